"""Every GEMM that reads a weight reaches the backend as F.linear's mm (fastpipe.runtime.binding.gemm_layout).

A traced linear on a 3-d input decomposes into bmm(expand(x), expand(t(W))); on the CPU's bf16 bmm
that copies the whole transposed weight per call (60x the linear's time at hidden 2048). The check
is on what reaches the backend, not on time: a dispatch mode sees every mm/bmm/addmm of a run, and
an operand that shares storage with a constant must be the second operand of an mm/addmm, 2-d,
with the transposed row-major strides (1, K) of `t(W)`.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import fastpipe
from fastpipe.runtime.binding.gemm_layout import fold_batched_linears, folded_copy
from tests.hf_models import make_checkpoint

aten = torch.ops.aten
GEMMS = {aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm", aten.baddbmm.default: "baddbmm"}


class GemmLog(TorchDispatchMode):
    """Records (op, [(storage ptr, shape, stride)] per operand) of every GEMM dispatched."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            ops = [(a.untyped_storage().data_ptr(), tuple(a.shape), a.stride()) for a in args
                   if isinstance(a, torch.Tensor)]
            self.calls.append((GEMMS[func], ops))
        return func(*args, **(kwargs or {}))


def weight_layout_violations(calls, weight_ptrs) -> list[str]:
    bad = []
    for op, operands in calls:
        for i, (ptr, shape, stride) in enumerate(operands):
            if ptr not in weight_ptrs:
                continue
            is_b = (op == "mm" and i == 1) or (op == "addmm" and i == 2)
            if not (is_b and len(shape) == 2 and stride == (1, shape[0])):
                bad.append(f"{op} operand {i}: shape {shape} stride {stride}")
    return bad


def _linear_on_transposed(x, w):          # x: [B, K, M] -> transpose -> [B, M, K]: not foldable by a view
    return F.linear(x.transpose(1, 2), w) * 2


def test_a_traced_linear_on_a_3d_input_is_a_bmm_and_folds_into_mm_with_the_same_values():
    x, w = torch.randn(3, 16, 5), torch.randn(24, 16)
    gm = make_fx(_linear_on_transposed)(x, w)
    assert any(n.target == aten.bmm.default for n in gm.graph.nodes)     # what the trace gives
    want = _linear_on_transposed(x, w)
    assert fold_batched_linears(gm) == 1
    assert not any(n.target == aten.bmm.default for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x, w), want, rtol=1e-5, atol=1e-6)
    log = GemmLog()
    with log:
        gm(x, w)
    assert weight_layout_violations(log.calls, {w.untyped_storage().data_ptr()}) == []


def test_folded_copy_leaves_the_graph_it_copies_and_a_graph_without_the_pattern():
    x, w = torch.randn(2, 8, 4), torch.randn(6, 8)
    gm = make_fx(_linear_on_transposed)(x, w)
    out = folded_copy(gm)
    assert out is not gm
    assert any(n.target == aten.bmm.default for n in gm.graph.nodes)     # the original stays as it was
    torch.testing.assert_close(out(x, w), gm(x, w), rtol=1e-5, atol=1e-6)
    plain = make_fx(lambda a, b: torch.bmm(a, b))(torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    assert folded_copy(plain) is plain                                    # two activations: left as bmm


@pytest.fixture(scope="module")
def llama_decode(tmp_path_factory):
    """A builder-made Llama decode step (tp=2) and its unsplit model."""
    root = tmp_path_factory.mktemp("gemm_layout")
    model = make_checkpoint("llama", root / "ckpt", seed=3)
    built = fastpipe.build(str(root / "ckpt"), tp=2, batch=2, seq_len=1, max_len=8)
    return built.save(root / "out"), model


@pytest.mark.parametrize("processor", ["region", "cpu"])
def test_every_weight_gemm_of_a_decode_step_reaches_the_backend_as_mm_of_t_w(llama_decode, processor):
    path, model = llama_decode
    sess = fastpipe.load(path, processor=processor, compile=False, device_map=None)
    if processor == "region":
        weights = {b.untyped_storage().data_ptr() for run in sess._processor.runs for b in run.gm.buffers()}
        assert "batched linears folded into mm" in sess.describe()
    else:
        weights = {t.untyped_storage().data_ptr() for ss in sess.program.steps.values() for st in ss
                   for t in st.constants.values()}
    p = sess.pipeline
    cfg = model.config
    hkv, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    originals = {"input_ids": torch.randint(0, cfg.vocab_size, (2, 1), generator=g),
                 "cache_position": torch.tensor([3, 5])}
    for name in p.metadata.tensors_inputs:
        if name.startswith("past_key_values"):
            originals[name] = torch.randn(2, hkv, 8, hd, generator=g)
    run = sess.run
    if processor == "cpu":
        # its threads do not see this thread's dispatch mode: run its bound steps (the same callables)
        # one at a time in this thread
        from fastpipe.runtime.processors.reference import ReferenceProcessor

        run = lambda ins: ReferenceProcessor(sess.program).run([ins])[0]  # noqa: E731
    inputs = {name: originals[s.origin][tuple(slice(a, b) for a, b in s.placements)].contiguous()
              for name, s in p.metadata.slices_inputs.items()}
    log = GemmLog()
    with log:
        run(inputs)
    # q/k/v, o, gate/up and down of each layer and the head: merged on the region path, per rank on cpu
    assert sum(op in ("mm", "addmm") for op, _ in log.calls) >= 4 * cfg.num_hidden_layers + 1
    assert weight_layout_violations(log.calls, weights) == []


def test_a_broadcast_vector_folds_correctly_too():
    """bmm(x, expand(t(v), [B, K, N])) with v 1-d: every row of the matrix is v; the fold stays exact."""
    def f(x, v):
        return torch.bmm(x, v.t().expand(2, 3, 5))
    x, v = torch.randn(2, 4, 3), torch.randn(5)
    gm = make_fx(f)(x, v)
    assert fold_batched_linears(gm) == 1
    torch.testing.assert_close(gm(x, v), f(x, v), rtol=1e-6, atol=1e-6)
