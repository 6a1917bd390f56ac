"""Regenerate the example pipelines in graphs/ from small PyTorch modules.

    python graphs/make_examples.py            # rewrites graphs/<example>/

Each example folder holds pipeline.json, weights.safetensors (the *unsplit*
module's state_dict; every constant is a slice of it), inputs.safetensors and
expected.safetensors (computed by running the unsplit module, then sliced as
metadata.tensor_slices says). Together the examples use every comm kind,
both device spellings, FX/fx, param_files, blobs inline and as <blob-id>.fx
side files, and the producer spellings of reduce_op.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from fastpipe.builder.assemble import Assembler

HERE = Path(__file__).resolve().parent
F32 = "f32"


def _save(folder: Path, name: str, tensors: dict) -> None:
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(folder / name))


def _finish(folder: Path, a: Assembler, module: nn.Module, inputs: dict, expected: dict, side_blobs: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    _save(folder, "weights.safetensors", module.state_dict())
    doc = a.to_json()
    if side_blobs:  # saved-artifact form: null blobs, payload in <blob-id>.fx beside the pipeline
        for bid, data in doc["blobs"].items():
            (folder / f"{bid}.fx").write_text(data)
            doc["blobs"][bid] = None
    (folder / "pipeline.json").write_text(json.dumps(doc, indent=1) + "\n")
    _save(folder, "inputs.safetensors", inputs)
    _save(folder, "expected.safetensors", expected)


def _rows(n: int, parts: int, r: int) -> tuple[int, int]:
    return (n // parts * r, n // parts * (r + 1))


# ---------------------------------------------------------------- 1. tensor-parallel MLP
class TPMLP(nn.Module):
    """Two residual MLP blocks; split column-then-row over 2 slots (all_reduce, then reduce)."""

    def __init__(self, d=64, h=128):
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(d, h), nn.Linear(h, d), nn.LayerNorm(d)
        self.fc3, self.fc4 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):  # x: [B, D]
        h = self.ln(x + self.fc2(F.gelu(self.fc1(x))))
        return h + self.fc4(F.relu(self.fc3(h)))


def tp_mlp(folder: Path) -> None:
    torch.manual_seed(1)
    m, B, D, H, n = TPMLP(), 8, 64, 128, 2
    W = "weights.safetensors"
    a = Assembler("tp_mlp", version="0.1.0")
    a.input("x", (B, D), F32)
    a.original_input("x", (B, D), F32, 0)
    a.original_output("y", (B, D), F32, 0)
    partial, summed, block2 = [], [], []
    for r in range(n):
        s = str(r)
        a.slot(s, {"kind": "cpu", "idx": r})
        lo, hi = _rows(H, n, r)
        a.constant(f"w1_{r}", shape=(hi - lo, D), dtype=F32, path=W, name_in_file="fc1.weight", placements=[[lo, hi], [0, D]])
        a.constant(f"b1_{r}", shape=(hi - lo,), dtype=F32, path=W, name_in_file="fc1.bias", placements=[[lo, hi]])
        a.constant(f"w2_{r}", shape=(D, hi - lo), dtype=F32, path=W, name_in_file="fc2.weight", placements=[[0, D], [lo, hi]])
        a.constant(f"w3_{r}", shape=(hi - lo, D), dtype=F32, path=W, name_in_file="fc3.weight", placements=[[lo, hi], [0, D]])
        a.constant(f"b3_{r}", shape=(hi - lo,), dtype=F32, path=W, name_in_file="fc3.bias", placements=[[lo, hi]])
        a.constant(f"w4_{r}", shape=(D, hi - lo), dtype=F32, path=W, name_in_file="fc4.weight", placements=[[0, D], [lo, hi]])
        a.constant(f"lnw_{r}", shape=(D,), dtype=F32, path=W, name_in_file="ln.weight", placements=[[0, D]])
        a.constant(f"lnb_{r}", shape=(D,), dtype=F32, path=W, name_in_file="ln.bias", placements=[[0, D]])
        # identical column-then-row graph on both slots: stored once in blobs
        a.fx(s, lambda x, w1, b1, w2: F.gelu(F.linear(x, w1, b1)) @ w2.t(),
             ["x", f"w1_{r}", f"b1_{r}", f"w2_{r}"], [f"p_{r}"], blob="col_row")
        if r == 0:  # the row-parallel bias is added once, on one slot only
            a.constant("b2", shape=(D,), dtype=F32, path=W, name_in_file="fc2.bias", placements=[[0, D]])
            a.constant("b4", shape=(D,), dtype=F32, path=W, name_in_file="fc4.bias", placements=[[0, D]])
            a.fx(s, lambda p, b2: p + b2, ["p_0", "b2"], ["pb_0"])
        partial.append((s, [f"pb_{r}" if r == 0 else f"p_{r}"], [f"s_{r}"]))
    a.comm("all_reduce", "ar0", partial, reduce_op="sum")
    for r in range(n):
        s = str(r)
        ins = [f"s_{r}", "x", f"lnw_{r}", f"lnb_{r}", f"w3_{r}", f"b3_{r}", f"w4_{r}"]
        if r == 0:  # the residual and the bias join once, on slot 0
            a.fx(s, lambda s_, x, lw, lb, w3, b3, w4, b4: _block2(s_, x, lw, lb, w3, b3, w4, b4), ins + ["b4"], ["d_0"])
            block2.append((s, ["d_0"], ["y"]))
        else:
            a.fx(s, lambda s_, x, lw, lb, w3, b3, w4: _block2(s_, x, lw, lb, w3, b3, w4), ins, [f"c_{r}"])
            block2.append((s, [f"c_{r}"], []))
    a.comm("reduce", "red0", block2, out_shape=(B, D), reduce_op="RedOpType.SUM", dst="0")
    a.output(["y"])
    a.slice_of("inputs", "x", "x", [[0, B], [0, D]], "0")
    a.slice_of("outputs", "y", "y", [[0, B], [0, D]], "0")
    x = torch.randn(B, D)
    with torch.no_grad():
        y = m(x)
    _finish(folder, a, m, {"x": x}, {"y": y})


def _block2(s, x, lw, lb, w3, b3, w4, b4=None):
    h = F.layer_norm(x + s, (x.shape[-1],), lw, lb)
    c = F.relu(F.linear(h, w3, b3)) @ w4.t()
    return c if b4 is None else c + h + b4


# ---------------------------------------------------------------- 2. two stages with a skip connection
class TwoStage(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, scale):  # x: [B, D], scale: [B, 1]
        h1 = torch.tanh(self.l1(x))
        h2 = F.silu(self.l2(h1))
        return torch.softmax((self.l3(h2) + h1) * scale, dim=-1)   # h1: skip connection into stage 2


def two_stage(folder: Path) -> None:
    torch.manual_seed(2)
    m, B, D = TwoStage(), 4, 32
    W = "weights.safetensors"
    a = Assembler("two_stage_skip", version="0.1.0")
    a.slot("0", "npu:0")
    a.slot("1", "npu:1")
    a.input("x", (B, D), F32)
    a.input("scale", (B, 1), F32)
    for i, name in enumerate(("x", "scale")):
        a.original_input(name, a.doc["tensors"][name]["shape"], F32, i)
        a.slice_of("inputs", name, name, [[0, s] for s in a.doc["tensors"][name]["shape"]], "0" if name == "x" else "1")
    for l in ("l1", "l2", "l3"):
        a.constant(f"{l}.w", shape=(D, D), dtype=F32, path=W, name_in_file=f"{l}.weight", placements=[[0, D], [0, D]])
        a.constant(f"{l}.b", shape=(D,), dtype=F32, path=W, name_in_file=f"{l}.bias", placements=[[0, D]])
    a.fx("0", lambda x, w1, b1, w2, b2: _stage0(x, w1, b1, w2, b2), ["x", "l1.w", "l1.b", "l2.w", "l2.b"], ["h1", "h2"], kind="FX")
    a.send_recv("p2p_h2", "0", "h2", "1", "h2_r")
    a.send_recv("p2p_skip", "0", "h1", "1", "h1_r")
    a.fx("1", lambda h2, h1, s, w, b: torch.softmax((F.linear(h2, w, b) + h1) * s, dim=-1),
         ["h2_r", "h1_r", "scale", "l3.w", "l3.b"], ["y"], kind="FX")
    a.output(["y"])
    a.original_output("y", (B, D), F32, 0)
    a.slice_of("outputs", "y", "y", [[0, B], [0, D]], "1")
    x, scale = torch.randn(B, D), torch.rand(B, 1) + 0.5
    with torch.no_grad():
        y = m(x, scale)
    _finish(folder, a, m, {"x": x, "scale": scale}, {"y": y})


def _stage0(x, w1, b1, w2, b2):
    h1 = torch.tanh(F.linear(x, w1, b1))
    return h1, F.silu(F.linear(h1, w2, b2))


# ---------------------------------------------------------------- 3. sequence-parallel block
class SPBlock(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(d, h), nn.Linear(h, d), nn.LayerNorm(d)

    def forward(self, x):  # x: [S, D]
        return self.ln(x + self.fc2(F.gelu(self.fc1(x))))


def seq_parallel(folder: Path) -> None:
    torch.manual_seed(3)
    m, S, D, H, n = SPBlock(), 16, 32, 64, 2
    a = Assembler("seq_parallel_block", version="0.1.0")
    a.param_file("ckpt", "weights.safetensors")
    a.original_input("x", (S, D), F32, 0)
    a.original_output("y", (S, D), F32, 0)
    gathered, partial, ys = [], [], []
    for r in range(n):
        s = str(r)
        a.slot(s, f"cpu:{r}")
        lo, hi = _rows(S, n, r)
        a.input(f"x_{r}", (hi - lo, D), F32)
        a.slice_of("inputs", f"x_{r}", "x", [[lo, hi], [0, D]], s)
        hl, hh = _rows(H, n, r)
        a.constant(f"w1_{r}", shape=(hh - hl, D), dtype=F32, param_file="ckpt", name_in_file="fc1.weight", placements=[[hl, hh], [0, D]])
        a.constant(f"b1_{r}", shape=(hh - hl,), dtype=F32, param_file="ckpt", name_in_file="fc1.bias", placements=[[hl, hh]])
        a.constant(f"w2_{r}", shape=(D, hh - hl), dtype=F32, param_file="ckpt", name_in_file="fc2.weight", placements=[[0, D], [hl, hh]])
        a.constant(f"b2_{r}", shape=(D,), dtype=F32, param_file="ckpt", name_in_file="fc2.bias", placements=[[0, D]])
        a.constant(f"lnw_{r}", shape=(D,), dtype=F32, param_file="ckpt", name_in_file="ln.weight", placements=[[0, D]])
        a.constant(f"lnb_{r}", shape=(D,), dtype=F32, param_file="ckpt", name_in_file="ln.bias", placements=[[0, D]])
        gathered.append((s, [f"x_{r}"], [f"xf_{r}"]))
    a.comm("all_gather", "ag0", gathered, dim=0)
    for r in range(n):
        a.fx(str(r), lambda xf, w1, b1, w2: F.gelu(F.linear(xf, w1, b1)) @ w2.t(),
             [f"xf_{r}", f"w1_{r}", f"b1_{r}", f"w2_{r}"], [f"p_{r}"], blob="col_row")
        partial.append((str(r), [f"p_{r}"], [f"q_{r}"]))
    a.comm("reduce_scatter", "rs0", partial, reduce_op=0, dim=0)   # 0: a producer's integer spelling of sum
    for r in range(n):
        a.fx(str(r), lambda q, x, b2, lw, lb: F.layer_norm(x + q + b2, (x.shape[-1],), lw, lb),
             [f"q_{r}", f"x_{r}", f"b2_{r}", f"lnw_{r}", f"lnb_{r}"], [f"y_{r}"], blob="resid_ln")
        ys.append((str(r), [f"y_{r}"], ["y"] if r == 0 else []))
    a.comm("gather", "gather0", ys, out_shape=(S, D), dim=0, dst="0")
    a.output(["y"])
    a.slice_of("outputs", "y", "y", [[0, S], [0, D]], "0")
    x = torch.randn(S, D)
    with torch.no_grad():
        y = m(x)
    _finish(folder, a, m, {f"x_{r}": x[slice(*_rows(S, n, r))] for r in range(n)}, {"y": y}, side_blobs=True)


# ---------------------------------------------------------------- 4. MoE-style all_to_all exchange
class SoftMoE(nn.Module):
    """Dense mixture of experts: y = sum_e softmax(gate(x))_e * expert_e(x)."""

    def __init__(self, d=16, h=32, e=4):
        super().__init__()
        self.gate = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(e, h, d) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(e, d, h) / h ** 0.5)

    def forward(self, x):  # x: [T, D]
        g = torch.softmax(self.gate(x), dim=-1)                        # [T, E]
        ex = torch.stack([F.relu(x @ w1.t()) @ w2.t() for w1, w2 in zip(self.w1, self.w2)])  # [E, T, D]
        return (g.t().unsqueeze(-1) * ex).sum(0)


def moe_all_to_all(folder: Path) -> None:
    torch.manual_seed(4)
    T, D, H, E = 16, 16, 32, 4
    m = SoftMoE(D, H, E)
    W = "weights.safetensors"
    tl = T // E
    a = Assembler("moe_all_to_all", version="0.1.0")
    a.input("x", (T, D), F32)
    a.original_input("x", (T, D), F32, 0)
    a.original_output("y", (T, D), F32, 0)
    a.slice_of("inputs", "x", "x", [[0, T], [0, D]], "0")
    bcast, disp, back = [], [], []
    for r in range(E):
        s = str(r)
        a.slot(s, {"kind": "cpu", "idx": r})
        a.constant(f"gate_{r}", shape=(E, D), dtype=F32, path=W, name_in_file="gate.weight", placements=[[0, E], [0, D]])
        a.constant(f"w1_{r}", shape=(1, H, D), dtype=F32, path=W, name_in_file="w1", placements=[[r, r + 1], [0, H], [0, D]])
        a.constant(f"w2_{r}", shape=(1, D, H), dtype=F32, path=W, name_in_file="w2", placements=[[r, r + 1], [0, D], [0, H]])
        bcast.append((s, ["x"] if r == 0 else [], [f"xb_{r}"]))
    a.comm("broadcast", "bc0", bcast, out_shape=(T, D), src="0")   # replicated -> tiled: broadcast, then a local slice
    for r in range(E):
        a.fx(str(r), lambda xb, g, r=r: _dispatch(xb, g, r, tl, E), [f"xb_{r}", f"gate_{r}"], [f"d_{r}", f"g_{r}"])
        disp.append((str(r), [f"d_{r}"], [f"e_in_{r}"]))
    a.comm("all_to_all", "a2a_dispatch", disp, src_dim=0, dst_dim=1)
    for r in range(E):
        a.fx(str(r), lambda t, w1, w2: F.relu(t @ w1.transpose(1, 2)) @ w2.transpose(1, 2),
             [f"e_in_{r}", f"w1_{r}", f"w2_{r}"], [f"e_out_{r}"], blob="expert")
        back.append((str(r), [f"e_out_{r}"], [f"ret_{r}"]))
    a.comm("all_to_all", "a2a_combine", back, src_dim=1, dst_dim=0)
    outs = []
    for r in range(E):
        a.fx(str(r), lambda ret, g: (g.t().unsqueeze(-1) * ret).sum(0), [f"ret_{r}", f"g_{r}"], [f"y_{r}"], blob="combine")
        a.slice_of("outputs", f"y_{r}", "y", [[r * tl, (r + 1) * tl], [0, D]], str(r))
        outs.append(f"y_{r}")
    a.output(outs)
    x = torch.randn(T, D)
    with torch.no_grad():
        y = m(x)
    _finish(folder, a, m, {"x": x}, {f"y_{r}": y[r * tl:(r + 1) * tl] for r in range(E)})


def _dispatch(xb, gate_w, r, tl, e):
    t = xb[r * tl:(r + 1) * tl]                                  # this slot's tokens: [tl, D]
    g = torch.softmax(t @ gate_w.t(), dim=-1)                    # [tl, E]
    return t.unsqueeze(0).expand(e, tl, t.shape[-1]).contiguous(), g   # [E, tl, D]: a copy per expert


EXAMPLES = {"tp_mlp": tp_mlp, "two_stage_skip": two_stage, "seq_parallel": seq_parallel, "moe_all_to_all": moe_all_to_all}


def main(argv: list[str]) -> int:
    names = argv or list(EXAMPLES)
    for name in names:
        folder = HERE / name
        if folder.exists():
            shutil.rmtree(folder)
        EXAMPLES[name](folder)
        print(f"wrote {folder.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
