"""The fusion pass: matmul->reduce_scatter and all_gather->matmul replaced by the fused Triton kernels
(run under TRITON_INTERPRET=1 on CPU), with the same outputs as without it."""
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import fastpipe  # noqa: E402
from fastpipe.errors import InputError  # noqa: E402
from tests.examples import GRAPHS  # noqa: E402


def needs_cpu_kernels():
    """These tests launch the fused kernels on CPU tensors, through the Triton interpreter, which
    conftest turns on only where CUDA is absent (it must be set before triton is first imported).
    On a GPU machine the kernels were built for the GPU: tests/test_fusion_gpu.py runs the same
    fused steps there, against the same pipeline unfused."""
    from fastpipe.kernels.mm_reduce_scatter_kernel import interpreting

    if not interpreting():
        if torch.cuda.is_available():
            pytest.skip("the fused kernels run on CPU tensors only under TRITON_INTERPRET=1, set where CUDA is "
                        "absent (tests/test_fusion_gpu.py runs them on this GPU)")
        raise AssertionError("no CUDA, yet the Triton kernels are not interpreted: TRITON_INTERPRET=1 was not set "
                             "before triton was first imported")


def _inputs(sess, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(sess.pipeline.tensors[n].shape, generator=g) if sess.pipeline.tensors[n].dtype.startswith("f")
                else torch.randint(0, 50, sess.pipeline.tensors[n].shape, generator=g)) for n in sess.input_names}


def test_auto_on_cpu_fuses_nothing_and_says_why():
    sess = fastpipe.load(GRAPHS / "seq_parallel" / "pipeline.json", processor="reference")
    assert {d.group: d.fused for d in sess.fusion} == {"ag0": False, "rs0": False}
    assert all("fused kernels run on one CUDA device" in d.reason for d in sess.fusion)


@pytest.mark.parametrize("S, dtype, want", [
    (1024, "bf16", {"ag0": True, "rs0": True}),      # both measured faster at M 1024 (N = K 4096, n 2: nearest)
    (16, "bf16", {"ag0": True, "rs0": True}),        # ... and at M 16 (decode)
    (128, "bf16", {"ag0": True, "rs0": False}),      # at M 128 matmul+reduce_scatter tied the unfused path (1.00x)
    (1024, "f16", {"ag0": True, "rs0": True}),       # float16 takes bfloat16's measurement
    (1024, "f32", {"ag0": False, "rs0": False}),     # float32 was never measured: unfused
])
def test_auto_on_one_cuda_device_follows_the_measured_rule(tmp_path, S, dtype, want):
    """fuse="auto" with both members on one CUDA device asks fastpipe.kernels.fusion_rule at the group's
    shape, and the decision quotes the measurement (analysis only: no GPU needed to decide)."""
    from fastpipe import dtypes
    from fastpipe.kernels.fusion_rule import estimate, gpu_name
    from fastpipe.runtime.passes import fuse
    from tests.fusion_pipelines import sp_block

    D, H, n = 256, 512, 2
    sess = fastpipe.load(sp_block(tmp_path, S=S, D=D, H=H, n=n, dtype=dtype), fuse="off", processor="reference")
    cuda = {s: torch.device("cuda:0") for s in sess.slot_devices}
    got = {d.group: d for d in fuse.analyze(sess.checked, cuda, "auto")}
    assert {g: d.fused for g, d in got.items()} == want
    t, gpu = dtypes.to_torch(dtype), gpu_name("cuda:0")                        # no GPU here: None (any GPU)
    rules = {"ag0": estimate("all_gather_matmul", S, H, D, n, t, 0, gpu),     # [S, D] @ [D, H] (n x [D, H/n])
             "rs0": estimate("matmul_reduce_scatter", S, D, H, n, t, 0, gpu)}          # n x [S, H/n] @ [H/n, D]
    for g, d in got.items():
        assert d.reason.endswith(rules[g].reason) and "fastpipe.kernels.fusion_rule" in d.reason, d.line()
        assert d.reason.startswith("all members match, and the fused kernel is faster here" if d.fused
                                   else "the unfused path, faster here")


def test_auto_asks_about_the_gpu_the_members_share(tmp_path, monkeypatch):
    """fuse="auto" decides from the measurements of the GPU model the group runs on (fusion_rule.gpu_name
    of the members' device), and says where that GPU was not measured."""
    from fastpipe.kernels import fusion_rule
    from fastpipe.runtime.passes import fuse
    from tests.fusion_pipelines import sp_block

    asked = []
    monkeypatch.setattr(fusion_rule, "gpu_name", lambda device: asked.append(torch.device(device)) or "Some GPU")
    sess = fastpipe.load(sp_block(tmp_path, S=1024, D=256, H=512, n=2, dtype="bf16"), fuse="off", processor="reference")
    cuda = {s: torch.device("cuda:1") for s in sess.slot_devices}
    got = fuse.analyze(sess.checked, cuda, "auto")
    assert asked == [torch.device("cuda:1")] * 2 and len(got) == 2
    for d in got:
        assert d.reason.endswith("; this GPU (Some GPU) was not measured: another GPU's measurement decides "
                                 "until `scripts/gpu_check.sh fused` or `fastpipe tune` measures this one"), d.line()


def test_launch_problem_says_why_the_kernels_cannot_run(monkeypatch):
    from fastpipe.kernels import mm_reduce_scatter_kernel as k

    if k._mm_sum_kernel is None:
        assert k.launch_problem("cuda:0") == k.launch_problem("cpu") == "triton is not installed"
        return
    monkeypatch.setattr(k, "interpreting", lambda: False)                 # kernels built for a GPU
    assert k.launch_problem("cuda:0") is None
    assert k.launch_problem(torch.device("cpu")).startswith("the Triton kernels run on CUDA tensors, not on cpu")
    monkeypatch.setattr(k, "interpreting", lambda: True)                  # TRITON_INTERPRET=1: any device
    assert k.launch_problem("cpu") is None and k.launch_problem("cuda:0") is None
    monkeypatch.setattr(k, "_mm_sum_kernel", None)
    assert k.launch_problem("cuda:0") == k.launch_problem("cpu") == "triton is not installed"


def test_forced_fusion_is_refused_at_load_where_the_kernels_cannot_run(monkeypatch):
    """fuse="always" on CPU slots without the Triton interpreter: refused when loading, naming the
    group and why (not a KernelUnavailable at the first run)."""
    from fastpipe.errors import InputError
    from fastpipe.kernels import mm_reduce_scatter_kernel as k
    from fastpipe.runtime.passes import fuse

    monkeypatch.setattr(fuse, "_cannot_launch", k.launch_problem)   # the real check (conftest eases it on GPUs)
    monkeypatch.setattr(k, "_mm_sum_kernel", k._mm_sum_kernel or object())   # triton present
    monkeypatch.setattr(k, "interpreting", lambda: False)
    with pytest.raises(InputError, match=r'^fuse: "always" cannot fuse group "ag0" \(all_gather->matmul, supertasks '
                                         r'1, 2\) on cpu: the Triton kernels run on CUDA tensors, not on cpu \(unless '
                                         r'TRITON_INTERPRET=1 .*\(fuse="auto" or "off" runs it unfused\)$'):
        fastpipe.load(GRAPHS / "seq_parallel" / "pipeline.json", fuse="always", processor="reference")
    monkeypatch.setattr(k, "_mm_sum_kernel", None)
    with pytest.raises(InputError, match=r' on cpu: triton is not installed \(fuse="auto"'):
        fastpipe.load(GRAPHS / "seq_parallel" / "pipeline.json", fuse="always", processor="reference")


def test_auto_warns_where_the_measured_winner_cannot_run(tmp_path, monkeypatch):
    """fuse="auto" on a CUDA device where the rule fuses, but triton is missing: unfused, with a
    warning that says so (never a silent fallback, nor a failure at the first run)."""
    from fastpipe.kernels import mm_reduce_scatter_kernel as k
    from fastpipe.runtime.passes import fuse
    from tests.fusion_pipelines import sp_block

    monkeypatch.setattr(fuse, "_cannot_launch", k.launch_problem)   # the real check (conftest eases it on GPUs)
    monkeypatch.setattr(k, "_mm_sum_kernel", k._mm_sum_kernel or object())   # triton present
    sess = fastpipe.load(sp_block(tmp_path, S=128, D=256, H=512, n=2, dtype="bf16"), fuse="off", processor="reference")
    cuda = {s: torch.device("cuda:0") for s in sess.slot_devices}
    # at M 128 the rule fuses ag0 (all_gather+matmul 1.09x) and not rs0 (matmul+reduce_scatter 1.00x)
    assert {d.group: d.fused for d in fuse.analyze(sess.checked, cuda, "auto")} == {"ag0": True, "rs0": False}
    monkeypatch.setattr(k, "_mm_sum_kernel", None)
    with pytest.warns(RuntimeWarning, match=r'^fastpipe: fusion: group "ag0" .*: not fused: the fused kernel is '
                                            r'faster here \(fastpipe.kernels.fusion_rule\), but cannot run: triton '
                                            r'is not installed$'):
        got = {d.group: d for d in fuse.analyze(sess.checked, cuda, "auto")}
    assert not got["ag0"].fused and got["ag0"].reason.endswith("but cannot run: triton is not installed")
    assert not got["rs0"].fused and "but cannot run" not in got["rs0"].reason     # the rule keeps it unfused


def test_gpu_name_is_none_off_cuda():
    from fastpipe.kernels.fusion_rule import gpu_name

    assert gpu_name("cpu") is None and gpu_name(torch.device("meta")) is None
    assert gpu_name("cuda:0") == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)


@pytest.mark.parametrize("processor", ["reference", "cpu"])
def test_forced_fusion_equals_unfused_on_the_example(processor):
    needs_cpu_kernels()
    path = GRAPHS / "seq_parallel" / "pipeline.json"
    fused = fastpipe.load(path, fuse="always", processor=processor)
    assert {d.group: (d.fused, d.pattern) for d in fused.fusion} == {
        "ag0": (True, "all_gather->matmul"), "rs0": (True, "matmul->reduce_scatter")}
    plain = fastpipe.load(path, fuse="off", processor="reference")
    for seed in (1, 2):
        ins = _inputs(plain, seed)
        a, b = plain.run(ins), fused.run(ins)
        torch.testing.assert_close(b["y"], a["y"], rtol=1e-5, atol=1e-5)


def test_fuse_option_refused():
    with pytest.raises(InputError, match=r'fuse: expected auto, off or always, found "yes"'):
        fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", fuse="yes", processor="reference")


def test_show_plan_reports_fusion(capsys):
    from fastpipe.cli import main

    assert main(["show", "--plan", str(GRAPHS / "seq_parallel" / "pipeline.json")]) == 0
    out = capsys.readouterr().out
    # every slot on the CPU: auto runs the region processor, which leaves the pair to the compiler
    assert ('fusion: group "rs0" (matmul->reduce_scatter, supertasks 5, 6): not fused: the region processor compiles '
            "the matmul and the comm as one graph on one device (fuse='always' forces the kernels)") in out
    assert 'fusion: group "ag0" (all_gather->matmul' in out
    from fastpipe.runtime.passes import fuse

    sess = fastpipe.load(GRAPHS / "seq_parallel" / "pipeline.json", processor="cpu", compile="off")
    assert [d.reason for d in sess.fusion if d.group == "rs0"] == [
        "members on cpu: the fused kernels run on one CUDA device (fuse='always' forces them)"]
    del fuse


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_builder_sequence_parallel_pipeline(tmp_path, family):
    """A sequence-parallel pipeline from the builder: with the pass, the same outputs as without it."""
    needs_cpu_kernels()
    from tests.hf_models import make_checkpoint

    from fastpipe.builder.hf.build import build_hf

    folder = tmp_path / family
    make_checkpoint(family, folder)
    path = build_hf(folder, tp=2, batch=1, seq_len=8, sequence_parallel=True).save(tmp_path / "out")
    fused = fastpipe.load(path, fuse="always", processor="reference")
    kinds = {d.pattern for d in fused.fusion if d.fused}
    assert "matmul->reduce_scatter" in kinds          # every row-parallel linear's reduce_scatter
    plain = fastpipe.load(path, fuse="off", processor="reference")
    ins = _inputs(plain, 3)
    a, b = plain.run(ins), fused.run(ins)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-4)
    # batch 2: the sequence dim is not contiguous rows of the matmul: refused, with the reason
    path2 = build_hf(folder, tp=2, batch=2, seq_len=8, sequence_parallel=True).save(tmp_path / "out2")
    reasons = {d.reason for d in fastpipe.load(path2, fuse="always", processor="reference").fusion if not d.fused}
    assert any("neither the matmul's rows nor its" in r for r in reasons)


# ---------------------------------------------------------------------------- hand-made pipelines
from tests.fusion_pipelines import random_inputs, sp_block  # noqa: E402


def _equal_to_unfused(path, fused, seeds=(1, 2), **load):
    plain = fastpipe.load(path, fuse="off", **load)
    for seed in seeds:
        ins = random_inputs(plain, seed)
        a, b = plain.run(ins), fused.run(ins)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5)


def _forced_decision(tmp_path, group: str, **block):
    """(path, session loaded with fuse="always", the fusion decision for `group`) of an sp_block."""
    path = sp_block(tmp_path, **block)
    sess = fastpipe.load(path, fuse="always", processor="reference")
    return path, sess, {d.group: d for d in sess.fusion}[group]


@pytest.mark.parametrize("view, dim, fused", [
    (None, 0, True),                 # [S, D]: row chunks
    ((8, 2, 8), 1, True),            # [S, heads, hd] split along heads: whole column blocks
    ((16, 8), 0, True),              # [2S, D/2] split along rows: whole row blocks
    ((8, 2, 8), 2, False),           # split along hd with 2 heads: the chunks interleave the heads
    ((2, 4, 16), 1, False),          # split inside the rows, with a leading dim > 1
])
def test_reduce_scatter_view_is_fused_only_where_it_maps_onto_the_matmul(tmp_path, view, dim, fused):
    needs_cpu_kernels()
    path, sess, d = _forced_decision(tmp_path, "rs0", rs_view=view, rs_dim=dim)
    assert d.fused is fused, d.reason
    if not fused:
        assert d.reason.startswith(f"the scatter dim {dim} of {list(view)} is neither the matmul's rows nor its columns")
        assert "[8, 16] matmul result" in d.reason
    _equal_to_unfused(path, sess)


@pytest.mark.parametrize("view, dim, fused", [
    (None, 0, True),                 # [S, D] gathered along rows
    ((8, 2, 8), 1, True),            # [S, heads, hd] gathered along heads: K-slices of the operand
    ((8, 2, 8), 2, False),           # gathered along hd with 2 heads: not K-slices
    ((2, 4, 16), 1, False),          # gathered inside the rows, with a leading dim > 1
])
def test_all_gather_view_is_fused_only_where_it_maps_onto_the_matmul(tmp_path, view, dim, fused):
    needs_cpu_kernels()
    path, sess, d = _forced_decision(tmp_path, "ag0", ag_view=view, ag_dim=dim)
    assert d.fused is fused, d.reason
    if not fused:
        assert d.reason.startswith(f"the gather dim {dim} of {list(view)} is neither the matmul's rows nor its K")
    _equal_to_unfused(path, sess)


@pytest.mark.parametrize("policy", ["auto", "always", "off"])
@pytest.mark.parametrize("side_blob", [False, True])
def test_fusion_without_checked_payloads(tmp_path, policy, side_blob):
    """check_payloads=False leaves the decoded graphs out of the checked pipeline: the pass decodes
    the payloads it needs itself (safely: decode_payload), with the same decisions and results."""
    if policy == "always":
        needs_cpu_kernels()
    import json

    from fastpipe.options import LoadOptions

    path = sp_block(tmp_path)
    if side_blob:          # the saved-artifact form: the payload in block.fx beside pipeline.json
        doc = json.loads(path.read_text())
        (tmp_path / "block.fx").write_text(doc["blobs"]["block"])
        doc["blobs"]["block"] = None
        path.write_text(json.dumps(doc))
    unchecked = fastpipe.load(path, fuse=policy, load_options=LoadOptions(check_payloads=False), processor="reference")
    checked = fastpipe.load(path, fuse=policy, processor="reference")
    assert [(d.group, d.fused, d.reason) for d in unchecked.fusion] == [
        (d.group, d.fused, d.reason) for d in checked.fusion]
    assert {d.group for d in unchecked.fusion} == {"ag0", "rs0"}
    assert all(d.fused for d in unchecked.fusion) is (policy == "always")
    _equal_to_unfused(path, unchecked, seeds=(3,))


def test_unchecked_payloads_are_decoded_once_for_bind_and_fusion(tmp_path, monkeypatch):
    """check_payloads=False: binding and the fusion pass share one lazily decoded graph per distinct
    payload (they decoded each payload separately, and binding once per supertask)."""
    import fastpipe.payload as payload
    from fastpipe.options import LoadOptions
    from fastpipe.validate.sources import payload_text

    path = sp_block(tmp_path)
    calls = []
    real = payload.decode_payload
    monkeypatch.setattr(payload, "decode_payload", lambda text, **kw: calls.append(text) or real(text, **kw))
    sess = fastpipe.load(path, fuse="always", load_options=LoadOptions(check_payloads=False), processor="reference")
    fx = [sid for sid, st in sess.pipeline.supertasks.items() if st.kind == "fx"]
    texts = {payload_text(sess.pipeline, sid, sess.options)[0] for sid in fx}
    assert len(fx) > len(texts) >= 1                       # replicas share a payload
    assert sorted(calls) == sorted(texts)                  # each decoded once, by whoever asked first
    assert all(sess.checked.graphs[sid] is sess.checked.graphs[fx[0]] for sid in fx
               if payload_text(sess.pipeline, sid, sess.options)[0] == payload_text(sess.pipeline, fx[0], sess.options)[0])


def _tensors_of(gm):
    """Every tensor a graph module holds (its buffers, parameters and plain tensor attributes)."""
    out = dict(gm.named_buffers())
    out.update(dict(gm.named_parameters()))
    out.update({k: v for k, v in vars(gm).items() if isinstance(v, torch.Tensor)})
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            out[n.target] = getattr(gm, n.target)
    return out


def test_fused_steps_keep_their_constants_on_the_step_device(tmp_path):
    """bind puts each compute step's graph (its get_attr buffers) on the slot's device; the graphs the
    fusion pass rewrites must be there too, and so must the all_gather->matmul weights the fused
    group uses. The "meta" device stands in for a GPU here; the decoded graphs stay on the CPU."""
    from fastpipe.lower import lower
    from fastpipe.runtime.passes import fuse
    from fastpipe.runtime.binding.bind import Binder, bind

    path = sp_block(tmp_path)
    sess = fastpipe.load(path, fuse="off", processor="reference")
    meta = {s: torch.device("meta") for s in sess.slot_devices}
    binder = Binder(sess.pipeline, sess.options, sess.store, meta)
    program = bind(lower(sess.checked), sess.checked, binder)
    decisions = fuse.analyze(sess.checked, meta, "always")
    assert all(d.fused for d in decisions)
    program = fuse.apply(program, decisions, sess.checked, binder)
    fx_steps = [st for ss in program.steps.values() for st in ss if st.kind == "compute"]
    assert len(fx_steps) == 2
    for st in fx_steps:
        held = _tensors_of(st.graph)
        assert held, "expected the embedded constant as a buffer of the rewritten graph"
        assert {k: v.device.type for k, v in held.items()} == {k: "meta" for k in held}
        assert "fused_matmul_out" in st.graph.code          # it is the rewritten graph
        decoded = sess.checked.graphs[st.supertask].gm
        assert {v.device.type for v in _tensors_of(decoded).values()} == {"cpu"}   # not moved in place
    weights = program.group_fns["ag0"].weights
    assert len(weights) == 2 and {w.device.type for w in weights} == {"meta"}


def test_members_on_several_devices_are_not_fused_even_when_forced(tmp_path):
    """The fused kernels take every participant's tensors on one device: 'always' leaves a group whose
    members sit on two devices unfused, with the reason, instead of failing at run time."""
    from fastpipe.runtime.passes import fuse

    sess = fastpipe.load(sp_block(tmp_path), fuse="off", processor="reference")
    devices = {"0": torch.device("cpu"), "1": torch.device("meta")}
    reasons = {d.group: (d.fused, d.reason) for d in fuse.analyze(sess.checked, devices, "always")}
    assert reasons == {g: (False, "members on cpu, meta: the fused kernels run on one device") for g in ("ag0", "rs0")}


def test_placing_a_rewritten_graph_moves_a_copy(tmp_path):
    """The fallback of the placement: a graph still holding CPU tensors is moved on a deep copy, so the
    decoded graph it shares them with stays where it was."""
    import torch.fx as fx

    from fastpipe.runtime.passes.fuse import _placed_graph

    root = torch.nn.Module()
    root.register_buffer("c", torch.ones(3))
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (x, g.get_attr("c"))))
    gm = fx.GraphModule(root, g)
    moved = _placed_graph(gm, torch.device("meta"))
    assert moved is not gm and moved.c.device.type == "meta"
    assert gm.c.device.type == "cpu" and root.c.device.type == "cpu"
    assert _placed_graph(gm, torch.device("cpu")) is gm


def test_shapes_of_a_graph_with_unbound_external_constants():
    """A payload decoded by the pass itself (check_payloads=False) still has its external constants as
    meta placeholders: the shape annotation fakes them from their shape and dtype."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import base64
    import json

    import safetensors.torch

    from fastpipe.payload import decode_payload, encode_payload, unbound_external
    from fastpipe.runtime.passes.fuse import _annotate

    c = torch.arange(8.0)
    gm = make_fx(lambda x: (x * c) @ torch.ones(8, 4))(torch.zeros(2, 8))
    attr = next(n.target for n in gm.graph.nodes if n.op == "get_attr")
    doc = json.loads(base64.b64decode(encode_payload(gm, [torch.zeros(2, 8)])))
    info = doc["metadata"]["constant_saved_info"]          # the constant moves to a file of its own
    blob = safetensors.torch.load(base64.b64decode(info["blob"]))
    del blob[attr]
    info["blob"] = base64.b64encode(safetensors.torch.save(blob)).decode()
    info["param_files"]["owned"] = {"path": "/m/c.safetensors", "format": "safetensors"}
    info["tensor_to_saved_file_id_and_saved_name"][attr] = ["owned", "saved." + attr]
    decoded = decode_payload(base64.b64encode(json.dumps(doc).encode()).decode(), where="test")
    assert unbound_external(decoded) == [attr]
    _annotate(decoded)
    mm = next(n for n in decoded.gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert tuple(mm.meta["val"].shape) == (2, 4)


@pytest.mark.parametrize("processor", ["cpu", "region"])
def test_fused_steps_keep_their_state_written_in_place(tmp_path, processor):
    """A step that writes a state (a KV cache) and ends in the fused matmul keeps the in-place write
    (fastpipe.runtime.binding.bind; the fused rest graph is rewritten as the unfused step was): the session
    hands back the caller's cache tensor, updated, and equals the unfused copying path."""
    needs_cpu_kernels()
    path = sp_block(tmp_path, state=True)
    sess = fastpipe.load(path, processor=processor, fuse="always", state_in_place=True)
    assert [d.fused for d in sess.fusion] == [True, True]
    assert sess.state == {"cache_0": "cache_new_0", "cache_1": "cache_new_1"}
    assert "2 state tensors updated in place (2 by an in-place write)" in sess.describe()
    plain = fastpipe.load(path, fuse="off", processor="reference")
    for seed in (1, 2):
        ins = random_inputs(sess, seed)
        want = plain.run({k: v.clone() for k, v in ins.items()})
        got = sess.run(ins)
        assert got.keys() == want.keys()
        for r in range(2):
            assert got[f"cache_new_{r}"] is ins[f"cache_{r}"]
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
