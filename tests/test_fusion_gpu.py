"""Fused steps through the runtime on a GPU: a sequence-parallel block (all_gather -> matmul ... matmul ->
reduce_scatter, tests/fusion_pipelines.py) with both slots on cuda:0, run fused (fuse="always" at a small
shape, fuse="auto" where the measured rule, fastpipe.kernels.fusion_rule, fuses one of the pair) and
compared to the same pipeline run unfused on the same GPU, in bfloat16 and float32. Marked `cuda`:
skipped cleanly without a GPU."""
import pytest
import torch

import fastpipe
from tests.fusion_pipelines import random_inputs, sp_block

pytestmark = pytest.mark.cuda

DM = {"0": "cuda:0", "1": "cuda:0"}
# max |fused - unfused| <= TOL * max |unfused|: the unfused path rounds the bf16 partial products
# (and the addmm's bias sum) once more than the fused kernels do; fp32 differs by summation order.
TOL = {"bf16": 3e-2, "f32": 1e-4}


def _cuda_tensors(gm):
    held = dict(gm.named_buffers())
    held.update(dict(gm.named_parameters()))
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            held[n.target] = getattr(gm, n.target)
    return held


def _auto_decisions(S, D, H, n, dtype) -> dict[str, bool]:
    """What fuse="auto" must decide for sp_block's groups: fastpipe.kernels.fusion_rule at their shapes
    (all_gather: [S, D] @ [D, H/n]; reduce_scatter: n x [S, H/n] @ [H/n, D])."""
    from fastpipe import dtypes
    from fastpipe.kernels import fused_is_faster
    from fastpipe.kernels.fusion_rule import gpu_name

    t, gpu = dtypes.to_torch(dtype), gpu_name("cuda:0")        # this GPU's measurements where it has them
    return {"ag0": fused_is_faster(S, H // n, D, n, t, kernel="all_gather_matmul", gpu=gpu),
            "rs0": fused_is_faster(S, D, H, n, t, kernel="matmul_reduce_scatter", gpu=gpu)}


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("processor", ["reference", "cuda", "region"])
@pytest.mark.parametrize("policy, S", [("always", 64), ("auto", 1024)])
def test_fused_step_on_gpu_equals_unfused(tmp_path, dtype, processor, policy, S):
    D, H, n = 256, 512, 2
    decided = {"ag0": True, "rs0": True}
    if policy == "auto":
        if processor == "region":
            pytest.skip("auto leaves the pair to the region processor's compiler (fuse='always' forces the kernels)")
        decided = _auto_decisions(S, D, H, n, dtype)
        if dtype == "bf16":  # the measured rule fuses at least one of the pair at M 1024 (which: this GPU's points)
            assert any(decided.values()), decided
        else:                # float32 was never measured: auto leaves it unfused
            assert decided == {"ag0": False, "rs0": False}, decided
    path = sp_block(tmp_path, S=S, D=D, H=H, n=n, dtype=dtype)
    fused = fastpipe.load(path, DM, fuse=policy, processor=processor)
    assert {d.group: d.fused for d in fused.fusion} == decided, [d.line() for d in fused.fusion]
    # each rank's block consumes the gather and feeds the reduce_scatter: its step is rewritten at both ends
    steps = [st for ss in fused.program.steps.values() for st in ss if st.kind == "compute"]
    assert len(steps) == n
    for st in steps:
        assert ("fused_matmul_out" in st.graph.code) == decided["ag0"]                  # the matmul left it
        assert any(w.endswith("#a") for w in st.writes) == decided["rs0"], st.writes   # it hands out the operands
    # the (rewritten) steps run on the GPU with their embedded constant there too
    for st in steps:
        held = _cuda_tensors(st.graph)
        assert held and all(t.device.type == "cuda" for t in held.values()), {k: t.device for k, t in held.items()}
    plain = fastpipe.load(path, DM, fuse="off", processor="reference")
    for seed in (1, 2):
        ins = random_inputs(plain, seed, device="cuda")
        want = plain.run(ins)
        got = fused.run(ins)
        torch.cuda.synchronize()
        assert want.keys() == got.keys()
        for k in want:
            assert got[k].device.type == "cuda" and got[k].dtype == want[k].dtype
            err = (got[k].float() - want[k].float()).abs().max().item()
            scale = want[k].float().abs().max().item()
            assert err <= TOL[dtype] * scale, f"{k}: max |fused - unfused| = {err:.3g}, {err / scale:.3g} of max |unfused|"


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_fused_step_on_gpu_refuses_a_view_that_does_not_map(tmp_path, dtype):
    """A [S, heads, hd] view split along hd is left unfused on the GPU too, and the results stay right."""
    S, D, H = 64, 256, 512
    path = sp_block(tmp_path, S=S, D=D, H=H, dtype=dtype, rs_view=(S, 4, 64), rs_dim=2)
    fused = fastpipe.load(path, DM, fuse="always", processor="reference")
    assert {d.group: d.fused for d in fused.fusion} == {"ag0": True, "rs0": False}
    plain = fastpipe.load(path, DM, fuse="off", processor="reference")
    ins = random_inputs(plain, 5, device="cuda")
    want, got = plain.run(ins), fused.run(ins)
    for k in want:
        err = (got[k].float() - want[k].float()).abs().max().item()
        assert err <= TOL[dtype] * want[k].float().abs().max().item()
