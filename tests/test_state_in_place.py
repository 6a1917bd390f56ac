"""In-place state (fastpipe.runtime.binding.state): which outputs update which inputs, and run(...) with
state_in_place=True writing them into the caller's tensors on every processor.

The pipelines are static-cache decode steps of a tiny random Llama (GQA: with tp=2 each rank holds
one KV head), built by build_hf(..., max_len=M). The copying path (state_in_place off, the same
processor, eager) is the reference for values; tests/test_static_cache.py checks the steps
themselves against the unsplit Hugging Face model.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastpipe
from fastpipe.builder.hf.build import build_hf
from fastpipe.errors import InputError
from fastpipe.format import read_pipeline
from fastpipe.options import RunOptions
from fastpipe.runtime.binding.state import state_pairs
from tests.hf_models import make_checkpoint

B, M = 2, 16
LAYERS = 2
START = (3, 9)            # each row's first position
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("state_llama")
    make_checkpoint("llama", folder, seed=21)
    return folder


@pytest.fixture(scope="module")
def static(llama, tmp_path_factory):
    """tp -> path of the static decode pipeline (batch B, one token, max_len M)."""
    cache: dict = {}

    def get(tp):
        if tp not in cache:
            cache[tp] = build_hf(llama, tp=tp, batch=B, seq_len=1, max_len=M).save(tmp_path_factory.mktemp(f"tp{tp}"))
        return cache[tp]
    return get


def step_inputs(p, pos, seed, caches=None) -> dict:
    """Pipeline-level inputs: random ids, cache_position `pos`, random caches (or `caches`)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in p.input_names:
        origin, shape = p.metadata.slices_inputs[name].origin, p.tensors[name].shape
        if origin == "input_ids":
            out[name] = torch.randint(0, 100, shape, generator=g)
        elif origin == "cache_position":
            out[name] = torch.tensor(pos)
        else:
            out[name] = caches[name] if caches is not None else torch.randn(shape, generator=g)
    return out


def storages(ts) -> set:
    return {t.untyped_storage().data_ptr() for t in ts if t.numel()}


def clones(d: dict) -> dict:
    return {k: v.clone() for k, v in d.items()}


# ---- which outputs are state -----------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2])
def test_state_pairs_of_a_static_pipeline(static, tp):
    sess = fastpipe.load(static(tp), processor="reference")
    p = sess.pipeline
    pairs = state_pairs(p)
    assert sess.state == pairs
    caches = [n for n in p.input_names if p.metadata.slices_inputs[n].origin.startswith("past_key_values_")]
    assert len(caches) == 2 * LAYERS * tp and set(pairs) == set(caches)
    assert not {"input_ids", "cache_position"} & set(pairs)
    outs = p.metadata.slices_outputs
    assert len(set(pairs.values())) == len(pairs) and all(outs[o].origin != "logits" for o in pairs.values())
    for i, o in pairs.items():
        si, so = p.metadata.slices_inputs[i], outs[o]
        assert (si.origin, si.placements, si.device) == (so.origin, so.placements, so.device), (i, o)
        assert (p.tensors[i].shape, p.tensors[i].dtype) == (p.tensors[o].shape, p.tensors[o].dtype)
    if tp == 2:   # rank r's cache slice pairs with rank r's output: same KV head, same slot
        for dev in p.devices:
            mine = {i: o for i, o in pairs.items() if p.metadata.slices_inputs[i].device == dev}
            assert len(mine) == 2 * LAYERS and all(outs[o].device == dev for o in mine.values())


def test_no_pairs_without_updated_state(llama, tmp_path):
    # old-style decode: the caches come back longer (P + S positions) under the same names
    old = fastpipe.load(build_hf(llama, tp=2, batch=B, seq_len=1, past_len=4).save(tmp_path / "old"), processor="reference")
    meta = old.pipeline.metadata
    shared = set(meta.tensors_inputs) & set(meta.tensors_outputs)
    assert len(shared) == 2 * LAYERS                  # same names: only the shapes tell them apart
    assert all(meta.tensors_inputs[n].shape != meta.tensors_outputs[n].shape for n in shared)
    assert state_pairs(old.pipeline) == {} and old.state == {}
    # prefill (caches out, none in) and no cache at all
    for past_len in (0, None):
        p = fastpipe.load(build_hf(llama, batch=B, seq_len=2, past_len=past_len).save(tmp_path / f"p{past_len}"), processor="reference").pipeline
        assert state_pairs(p) == {}
    assert state_pairs(read_pipeline(ROOT / "graphs" / "tp_mlp" / "pipeline.json")) == {}

    # state_in_place on a pipeline without state: nothing is written, outputs are fresh
    sess = fastpipe.load(old.pipeline, state_in_place=True, processor="reference")
    ins = step_inputs(sess.pipeline, [4, 4], seed=1)
    before = clones(ins)
    out = sess.run(ins)
    want = old.run(before)
    assert all(torch.equal(ins[n], before[n]) for n in ins)
    assert not storages(out.values()) & storages(ins.values())
    assert all(torch.equal(out[n], want[n]) for n in want)


# ---- run(...) with state_in_place ------------------------------------------------------------------

RUNS = [("reference", False, 1), ("reference", False, 2), ("cpu", False, 1), ("cpu", False, 2), ("cpu", True, 2),
        ("region", False, 1), ("region", False, 2), ("region", True, 1)]


@pytest.mark.parametrize("processor, compile, tp", RUNS, ids=[f"{p}{'-compiled' if c else ''}-tp{t}" for p, c, t in RUNS])
def test_steps_in_place_equal_the_copying_path(static, processor, compile, tp):
    path = static(tp)
    sess = fastpipe.load(path, processor=processor, compile=compile, compile_policy="raise", state_in_place=True)
    copying = fastpipe.load(path, processor=processor)
    pairs = sess.state
    assert pairs and copying.state == pairs
    p = sess.pipeline
    state = {i: t for i, t in step_inputs(p, START, seed=0).items() if i in pairs}   # the caller's caches
    ptrs = {i: t.data_ptr() for i, t in state.items()}
    kept = clones(state)                                                           # the copying path's
    if compile:
        assert sess.compile().graphs and not sess.compile_report.eager
        if processor == "region":
            runs = [r for r in sess.runner.runs if r.compiled is not None]
            assert runs and all(r.compiled.compiled for r in runs)
            for r in runs:          # the compiled graph, even where warm-up timing preferred the eager one
                r.fn = r.compiled
    for step in range(3):
        pos = [s + step for s in START]
        ins = step_inputs(p, pos, seed=step + 1, caches=state)
        others = {n: t.clone() for n, t in ins.items() if n not in pairs}
        out = sess.run(ins)
        want = copying.run(step_inputs(p, pos, seed=step + 1, caches=kept))
        for i, o in pairs.items():
            assert out[o] is state[i] and out[o].data_ptr() == ptrs[i], f"step {step}: {o} is not inputs[{i!r}]"
            assert not torch.equal(state[i], kept[i]), f"step {step}: {i} not updated"
        for n, t in others.items():          # input_ids, cache_position: read, never written
            assert torch.equal(ins[n], t), f"step {step}: inputs[{n!r}] changed"
        fresh = [o for o in out if o not in pairs.values()]
        assert fresh and not storages(out[o] for o in fresh) & storages(ins.values())
        for n in want:
            if compile:
                torch.testing.assert_close(out[n], want[n], rtol=0, atol=1e-5 * want[n].abs().max().item())
            else:
                assert torch.equal(out[n], want[n]), f"step {step}: {n}"
        kept = {i: want[o] for i, o in pairs.items()}
    if processor in ("region", "cpu"):
        n = len(pairs)
        assert f"{n} state tensors updated in place ({n} by an in-place write)" in sess.describe()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_region_writes_the_caches_natively(static, family, tmp_path):
    """The region graph scatters into the caller's caches (index_put_, no copy_) and a step makes no
    cache-sized allocation by an index_put, a copy or a clone (where the copying path makes one per
    cache). GPT-2, with a longer cache, for the allocations: Llama's GQA repeats its keys and values
    (clones twice a rank's cache), and the caches dwarf every other tensor of the step."""
    from torch.profiler import ProfilerActivity, profile

    if family == "llama":
        path = static(2)
    else:
        make_checkpoint("gpt2", tmp_path / "gpt2", seed=22)
        path = build_hf(tmp_path / "gpt2", tp=2, batch=B, seq_len=1, max_len=64).save(tmp_path / "out")
    sess = fastpipe.load(path, processor="region", state_in_place=True, compile="off")
    pairs = sess.state
    assert len(pairs) == 2 * LAYERS * 2
    code = "\n".join(r.gm.code for r in sess.runner.runs if r.gm is not None)
    assert code.count("torch.ops.aten.index_put_.default(") == len(pairs)
    assert "torch.ops.aten.index_put.default(" not in code and "aten.copy_" not in code
    if family == "llama":
        return

    def big_writes(session):
        ins = step_inputs(session.pipeline, START, seed=3)
        nbytes = min(ins[i].nbytes for i in pairs)
        session.run(ins)                                    # warm
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            session.run(ins)
        events = prof.events()
        big = [e.name for e in events if any(k in e.name for k in ("index_put", "copy", "clone"))
               and e.cpu_memory_usage >= nbytes]
        return big, [e.name for e in events if e.name == "aten::index_put_"]

    big, in_place = big_writes(sess)
    assert big == [] and len(in_place) == len(pairs)
    control, _ = big_writes(fastpipe.load(path, processor="region", compile="off"))   # the profiler does see them
    assert sum("index_put" in n for n in control) >= len(pairs), control


def spy_write_back(monkeypatch) -> list:
    """Record, per run with state_in_place, whether each state output handed to write_back is its input
    tensor itself (written by the step: nothing to copy in); returns the list it appends to."""
    from fastpipe.runtime.binding import state as state_mod

    seen = []
    real = state_mod.write_back

    def spy(inputs, outputs, pairs):
        seen.append([outputs[o] is inputs[i] for i, o in pairs.items()])
        return real(inputs, outputs, pairs)

    monkeypatch.setattr(state_mod, "write_back", spy)
    return seen


def step_code(sess) -> str:
    return "\n".join(st.graph.code for ss in sess.program.steps.values() for st in ss if st.graph is not None)


@pytest.mark.parametrize("compile", [False, True])
def test_cpu_steps_write_the_caches_natively(static, compile, monkeypatch):
    """On the cpu processor (and the cuda processor: the same bound steps), the step that writes a
    layer's caches scatters into the caller's tensors (index_put_): what it returns is the input
    tensor itself, so the session copies nothing in; the plan counts no cache. The reference
    processor, the oracle, runs the graphs as the file has them."""
    path = static(2)
    seen = spy_write_back(monkeypatch)
    sess = fastpipe.load(path, processor="cpu", state_in_place=True, compile=compile, compile_policy="raise")
    pairs = sess.state
    code = step_code(sess)
    assert code.count("torch.ops.aten.index_put_.default(") == len(pairs)
    assert "torch.ops.aten.index_put.default(" not in code
    if compile:
        assert sess.compile().graphs and not sess.compile_report.eager
    ref = fastpipe.load(path, processor="reference")
    for step in range(2):
        pos = [s + step for s in START]
        ins = step_inputs(sess.pipeline, pos, seed=step)
        want = ref.run(clones(ins))
        seen.clear()
        out = sess.run(ins)
        assert seen == [[True] * len(pairs)], "a step's cache output was not its input tensor"
        for n in want:
            torch.testing.assert_close(out[n], want[n], rtol=0, atol=1e-5 * want[n].abs().max().item())

    copying = fastpipe.load(path, processor="cpu", compile="off")                   # without state_in_place: as the file
    oracle = fastpipe.load(path, processor="reference", state_in_place=True)
    for other in (copying, oracle):
        code = step_code(other)
        assert code.count("torch.ops.aten.index_put.default(") == len(pairs) and "aten.index_put_" not in code
    seen.clear()
    oracle.run(step_inputs(oracle.pipeline, START, seed=0))
    assert seen == [[False] * len(pairs)]
    region = fastpipe.load(path, processor="region", state_in_place=True, compile="off")

    def activations(s):
        return sum(r["activation_bytes"] for r in s.memory_report().values())
    cache_bytes = sum(t.numel() * t.element_size() for i, t in step_inputs(sess.pipeline, START, 0).items() if i in pairs)
    assert activations(sess) == activations(region)
    assert activations(copying) - activations(sess) >= cache_bytes // 2, (activations(copying), activations(sess))


def test_a_state_input_read_by_two_steps_is_left_to_the_copy(static):
    """A step may write a state input in place only when no other step reads it (the other step could
    run after the write, on another thread or stream): bind's state_writers leaves such a pair out."""
    import dataclasses

    from fastpipe.runtime.binding.bind import state_writers

    sess = fastpipe.load(static(2), processor="cpu", state_in_place=True, compile="off")
    program, pairs = sess.program, sess.state
    writers = state_writers(program, pairs)
    assert sum(len(v) for v in writers.values()) == len(pairs)
    inp = next(iter(pairs))
    slot, ss = next((s, ss) for s, ss in program.steps.items() if any(inp in st.reads for st in ss))
    k = next(i for i, st in enumerate(ss) if st.kind == "compute" and inp not in st.reads)
    steps = list(ss)
    steps[k] = dataclasses.replace(steps[k], reads=steps[k].reads + (inp,))       # a second reader
    other = dataclasses.replace(program, steps={**program.steps, slot: tuple(steps)})
    again = state_writers(other, pairs)
    assert sum(len(v) for v in again.values()) == len(pairs) - 1
    assert inp not in {other.steps[sl][i].reads[r] for (sl, i), v in again.items() for r, _ in v}


@pytest.mark.parametrize("processor", ["reference", "cpu", "region"])
def test_non_contiguous_state_inputs(static, processor):
    path = static(1)
    sess = fastpipe.load(path, processor=processor, state_in_place=True)
    ref = fastpipe.load(path, processor="reference")
    pairs = sess.state
    p = sess.pipeline
    ins = step_inputs(p, START, seed=5)
    want = ref.run(clones(ins))
    a, b = "past_key_values_0_0", "past_key_values_1_1"
    big = torch.randn(*ins[a].shape[:2], M + 4, ins[a].shape[3])    # a slice of a bigger tensor
    big[:, :, :M] = ins[a]
    tail = big[:, :, M:].clone()
    ins[a] = big[:, :, :M]
    ins[b] = ins[b].transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values, transposed strides
    assert not ins[a].is_contiguous() and not ins[b].is_contiguous()
    given = {a: ins[a], b: ins[b]}
    out = sess.run(ins)

    def same(got, ref, what):     # the reference runs the file's batched linears, the others one mm
        if processor == "reference":
            assert torch.equal(got, ref), what
        else:
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * ref.abs().max().item(), msg=what)
    for n, t in given.items():
        assert out[pairs[n]] is t
        same(t, want[pairs[n]], n)
    assert torch.equal(big[:, :, M:], tail), "written outside the view"
    for o in pairs.values():
        same(out[o], want[o], o)
    same(out["logits"], want["logits"], "logits")


def test_refusals(static):
    path = static(1)
    sess = fastpipe.load(path, state_in_place=True, processor="reference")
    ins = step_inputs(sess.pipeline, START, seed=6)
    ins["past_key_values_1_0"] = ins["past_key_values_0_1"]
    with pytest.raises(InputError, match=r'inputs\["past_key_values_1_0"\].*inputs\["past_key_values_0_1"\]'):
        sess.run(ins)
    # overlapping views (different addresses, shared elements) would receive both updates too
    ins = step_inputs(sess.pipeline, START, seed=6)
    shape = ins["past_key_values_0_0"].shape
    big = torch.randn(shape[0], shape[1], M + 1, shape[3])
    ins["past_key_values_0_0"], ins["past_key_values_0_1"] = big[:, :, :M], big[:, :, 1:]
    with pytest.raises(InputError, match=r'inputs\["past_key_values_0_[01]"\].*inputs\["past_key_values_0_[01]"\]'):
        sess.run(ins)
    before = clones(ins)
    with pytest.raises(InputError, match="^chunks: expected 1 with state_in_place"):
        sess.run(ins, chunks=2)
    assert all(torch.equal(ins[n], before[n]) for n in ins)
    with pytest.raises(InputError, match='^state_in_place: .*found processor="dist"$'):
        fastpipe.load(path, processor="dist", state_in_place=True)
    with pytest.raises(InputError, match="^state_in_place: expected true or false"):
        RunOptions(state_in_place="yes")


def test_disjoint_views_of_one_buffer_are_accepted(static):
    path = static(1)
    sess = fastpipe.load(path, state_in_place=True, processor="reference")
    ins = step_inputs(sess.pipeline, START, seed=8)
    want = fastpipe.load(path, processor="reference").run(clones(ins))
    names = sorted(sess.state)
    buf = torch.stack([ins[n] for n in names])          # every cache a view of one allocation
    for k, n in enumerate(names):
        ins[n] = buf[k]
    out = sess.run(ins)
    for k, n in enumerate(names):
        assert out[sess.state[n]] is ins[n] and torch.equal(buf[k], want[sess.state[n]])


# ---- the graph rewrite (fastpipe.runtime.passes.region_state) ----------------------------------------------

def _scatter_graph(read_view_after: bool, single: bool):
    """fx graph of (cache [4, 3], pos [1], v [1, 3]) -> cache.index_put((pos,), v) (and, unless single,
    a read of the cache: a view of it taken before the scatter and read after it, or a plain sum before)."""
    import torch.fx as fx

    aten = torch.ops.aten
    g = fx.Graph()
    cache, pos, v = g.placeholder("cache"), g.placeholder("pos"), g.placeholder("v")
    view = g.call_function(aten.slice.Tensor, (cache, 0, 0, 2))      # aliases the cache
    early = None if read_view_after else g.call_function(aten.sum.default, (view,))
    new = g.call_function(aten.index_put.default, (cache, [pos], v))
    late = g.call_function(aten.sum.default, (view,)) if read_view_after else early
    g.output(new if single else (late, new))
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("read_view_after, single", [(False, False), (True, False), (False, True)],
                         ids=["read-before", "view-read-after", "one-output"])
def test_write_in_place_only_where_every_read_of_the_state_comes_first(read_view_after, single):
    """The scatter becomes index_put_ on the input only if nothing reads the input (or a view of it)
    after it: a view taken before and read after would see the new rows. Otherwise copy_rest=False leaves
    the graph as it was; copy_rest=True (the region processor) copies the update in at the end."""
    from fastpipe.runtime.passes.region_state import write_in_place, writes_in_place

    out_idx = 0 if single else 1
    cache, pos, v = torch.zeros(4, 3), torch.tensor([2]), torch.ones(1, 3)
    want = _scatter_graph(read_view_after, single)(cache.clone(), pos, v)
    gm = _scatter_graph(read_view_after, single)
    done = write_in_place(gm, [(0, out_idx)], copy_rest=False)
    given = cache.clone()
    got = gm(given, pos, v)
    got_new = got if single else got[out_idx]
    want_new = want if single else want[out_idx]
    assert torch.equal(got_new, want_new) and (single or torch.equal(got[0], want[0]))
    if read_view_after:
        assert done == [] and not writes_in_place(gm, 0, out_idx) and "aten.index_put_." not in gm.code
        assert torch.equal(given, cache), "the input was written"
        gm = _scatter_graph(read_view_after, single)
        assert write_in_place(gm, [(0, out_idx)]) == []                 # copy_rest: a copy_ at the end
        given = cache.clone()
        got = gm(given, pos, v)
        assert "aten.copy_" in gm.code and torch.equal(given, want_new) and torch.equal(got[0], want[0])
    else:
        assert done == [(0, out_idx)] and writes_in_place(gm, 0, out_idx)
        assert got_new is given and torch.equal(given, want_new)
