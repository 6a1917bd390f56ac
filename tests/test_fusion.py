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


def _inputs(sess, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(sess.pipeline.tensors[n].shape, generator=g) if sess.pipeline.tensors[n].dtype.startswith("f")
                else torch.randint(0, 50, sess.pipeline.tensors[n].shape, generator=g)) for n in sess.input_names}


def test_auto_on_cpu_fuses_nothing_and_says_why():
    sess = fastpipe.load(GRAPHS / "seq_parallel" / "pipeline.json")
    assert {d.group: d.fused for d in sess.fusion} == {"ag0": False, "rs0": False}
    assert all("fused kernels run on one CUDA device" in d.reason for d in sess.fusion)


@pytest.mark.parametrize("processor", ["reference", "cpu"])
def test_forced_fusion_equals_unfused_on_the_example(processor):
    path = GRAPHS / "seq_parallel" / "pipeline.json"
    fused = fastpipe.load(path, fuse="always", processor=processor)
    assert {d.group: (d.fused, d.pattern) for d in fused.fusion} == {
        "ag0": (True, "all_gather->matmul"), "rs0": (True, "matmul->reduce_scatter")}
    plain = fastpipe.load(path, fuse="off")
    for seed in (1, 2):
        ins = _inputs(plain, seed)
        a, b = plain.run(ins), fused.run(ins)
        torch.testing.assert_close(b["y"], a["y"], rtol=1e-5, atol=1e-5)


def test_fuse_option_refused():
    with pytest.raises(InputError, match=r'fuse: expected auto, off or always, found "yes"'):
        fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", fuse="yes")


def test_show_plan_reports_fusion(capsys):
    from fastpipe.cli import main

    assert main(["show", "--plan", str(GRAPHS / "seq_parallel" / "pipeline.json")]) == 0
    out = capsys.readouterr().out
    # every slot on the CPU: auto runs the region processor, which leaves the pair to the compiler
    assert ('fusion: group "rs0" (matmul->reduce_scatter, supertasks 5, 6): not fused: the region processor compiles '
            "the matmul and the comm as one graph on one device (fuse='always' forces the kernels)") in out
    assert 'fusion: group "ag0" (all_gather->matmul' in out
    from fastpipe.runtime import fuse

    sess = fastpipe.load(GRAPHS / "seq_parallel" / "pipeline.json", processor="cpu")
    assert [d.reason for d in sess.fusion if d.group == "rs0"] == [
        "members on cpu: the fused kernels run on one CUDA device (fuse='always' forces them)"]
    del fuse


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_builder_sequence_parallel_pipeline(tmp_path, family):
    """A sequence-parallel pipeline from the builder: with the pass, the same outputs as without it."""
    from tests.hf_models import make_checkpoint

    from fastpipe.builder.hf.build import build_hf

    folder = tmp_path / family
    make_checkpoint(family, folder)
    path = build_hf(folder, tp=2, batch=1, seq_len=8, sequence_parallel=True).save(tmp_path / "out")
    fused = fastpipe.load(path, fuse="always")
    kinds = {d.pattern for d in fused.fusion if d.fused}
    assert "matmul->reduce_scatter" in kinds          # every row-parallel linear's reduce_scatter
    plain = fastpipe.load(path, fuse="off")
    ins = _inputs(plain, 3)
    a, b = plain.run(ins), fused.run(ins)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-4)
    # batch 2: the sequence dim is not contiguous rows of the matmul: refused, with the reason
    path2 = build_hf(folder, tp=2, batch=2, seq_len=8, sequence_parallel=True).save(tmp_path / "out2")
    reasons = {d.reason for d in fastpipe.load(path2, fuse="always").fusion if not d.fused}
    assert any("neither the matmul's rows nor its" in r for r in reasons)
