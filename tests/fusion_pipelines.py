"""Hand-made sequence-parallel pipelines for the fusion tests (tests/test_fusion.py, tests/test_fusion_gpu.py).

    path = sp_block(tmp_path, S=8, D=16, H=32)                   # the plain block, f32
    path = sp_block(tmp_path, rs_view=(8, 2, 8), rs_dim=2)       # the matmul's result viewed as [S, heads, hd]
    path = sp_block(tmp_path, state=True)                        # and a state (a cache) the block updates

Per rank r of n (slots "0".."n-1", "cpu:r" devices: map them with device_map):

    xf_r = all_gather(x_r; ag_dim)                 # [S, D], or the `ag_view` shape
    p_r  = (gelu(xf_r.reshape(S, D) @ w1_r.t() + b1_r) * c) @ w2_r.t()     # one fx supertask
    q_r  = reduce_scatter(p_r.reshape(rs_view); rs_dim)                    # the pipeline's outputs

With state=True each rank also reads `cache_r` [S, H/n] and `pos_r` [S] (int64) and returns the
cache's update, a functional scatter of the hidden rows h_r = gelu(..) * c at rows pos_r (as the
builder's static-cache write is), which the block reads before its last matmul:

    cache_new_r = cache_r.index_put((pos_r,), h_r)
    p_r = (h_r + cache_new_r.mean(0)) @ w2_r.t()

The metadata pairs `cache_new_r` with `cache_r` (both slices of the original `cache` [S, H], its
columns split by rank): a state (fastpipe.runtime.binding.state).

The fx graph starts with an addmm on the gathered activation (all_gather->matmul) and ends in an
mm feeding the reduce_scatter (matmul->reduce_scatter); `c` is a constant embedded in the payload
(a get_attr buffer of the decoded graph), which the fused step must carry to its device. Both
ranks share one payload (one blob). Weights are saved beside the pipeline (w.safetensors).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.fx.experimental.proxy_tensor import make_fx

from fastpipe import dtypes
from fastpipe.builder.assemble import Assembler
from fastpipe.payload import encode_payload


def _fx(a: Assembler, slot: str, fn, inputs, outputs, blob: str) -> None:
    """Assembler.fx, traced on real zeros so that tensors the function closes over become get_attr
    constants embedded in the payload."""
    example = [torch.zeros(a.doc["tensors"][n]["shape"], dtype=dtypes.to_torch(a.doc["tensors"][n]["dtype"]))
               for n in inputs]

    def flat(*xs):
        out = fn(*xs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    gm = make_fx(flat, tracing_mode="real")(*example)
    assert any(nd.op == "get_attr" for nd in gm.graph.nodes), "expected an embedded constant"
    results = flat(*example)
    for name, r in zip(outputs, results):
        a.doc["tensors"][name] = {"shape": list(r.shape), "dtype": dtypes.to_name(r.dtype)}
    data = encode_payload(gm, example)
    blobs = a.doc.setdefault("blobs", {})
    assert blobs.get(blob, data) == data
    blobs[blob] = data
    a.doc["supertasks"][a._id()] = {"kind": "fx", "inputs": list(inputs), "outputs": list(outputs), "device": slot,
                                    "data_blob": blob}


def sp_block(folder: Path, *, S: int = 8, D: int = 16, H: int = 32, n: int = 2, dtype: str = "f32",
             ag_view: tuple[int, ...] | None = None, ag_dim: int = 0,
             rs_view: tuple[int, ...] | None = None, rs_dim: int = 0, seed: int = 0, state: bool = False) -> Path:
    """Write the pipeline (see the module docstring) into `folder`; returns its pipeline.json."""
    folder.mkdir(parents=True, exist_ok=True)
    tdt = dtypes.to_torch(dtype)
    g = torch.Generator().manual_seed(seed)
    hn = H // n
    gathered = tuple(ag_view) if ag_view is not None else (S, D)
    shard = list(gathered)
    assert shard[ag_dim] % n == 0
    shard[ag_dim] //= n
    c = (1.0 + torch.rand(hn, generator=g)).to(tdt)          # embedded in the payload (get_attr)
    weights = {}
    a = Assembler(f"sp_block_{dtype}", version="0.1.0")
    for r in range(n):
        a.slot(str(r), f"cpu:{r}")
        a.input(f"x_{r}", shard, dtype)
        weights[f"w1_{r}"] = (torch.randn(hn, D, generator=g) / D ** 0.5).to(tdt)
        weights[f"b1_{r}"] = torch.randn(hn, generator=g).to(tdt)
        weights[f"w2_{r}"] = (torch.randn(D, hn, generator=g) / hn ** 0.5).to(tdt)
        for name in (f"w1_{r}", f"b1_{r}", f"w2_{r}"):
            a.constant(name, shape=tuple(weights[name].shape), dtype=dtype, path="w.safetensors", name_in_file=name)
    a.comm("all_gather", "ag0", [(str(r), [f"x_{r}"], [f"xf_{r}"]) for r in range(n)], dim=ag_dim)

    def block(xf, w1, b1, w2, *state):
        h = xf.reshape(S, D) if ag_view is not None else xf
        h = F.gelu(F.linear(h, w1, b1)) * c
        if state:
            cache, pos = state
            new = cache.index_put((pos,), h)                 # [S, H/n]: the state's update
            h = h + new.mean(0)
        p = h @ w2.t()
        p = p.reshape(rs_view) if rs_view is not None else p
        return (p, new) if state else p

    if state:
        a.original_input("cache", (S, H), dtype, 0)
        a.original_output("cache", (S, H), dtype, 0)
    for r in range(n):
        extra = [f"cache_{r}", f"pos_{r}"] if state else []
        if state:
            a.input(f"cache_{r}", [S, hn], dtype)
            a.input(f"pos_{r}", [S], "i64")
        _fx(a, str(r), block, [f"xf_{r}", f"w1_{r}", f"b1_{r}", f"w2_{r}"] + extra,
            [f"p_{r}"] + ([f"cache_new_{r}"] if state else []), blob="block")
        if state:
            for side, name in (("inputs", f"cache_{r}"), ("outputs", f"cache_new_{r}")):
                a.slice_of(side, name, "cache", [(0, S), (r * hn, (r + 1) * hn)], str(r))
    a.comm("reduce_scatter", "rs0", [(str(r), [f"p_{r}"], [f"q_{r}"]) for r in range(n)], reduce_op="sum", dim=rs_dim)
    a.output([f"q_{r}" for r in range(n)] + ([f"cache_new_{r}" for r in range(n)] if state else []))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "w.safetensors"))
    path = folder / "pipeline.json"
    path.write_text(json.dumps(a.to_json(), indent=1) + "\n")
    return path


def random_inputs(sess, seed: int, device=None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sess.input_names:
        t = sess.pipeline.tensors[name]
        dt = dtypes.to_torch(t.dtype)
        out[name] = (torch.randn(t.shape, generator=g).to(dt) if dt.is_floating_point        # indices: a permutation
                     else torch.randperm(t.shape[0], generator=g).to(dt))
        if device is not None:
            out[name] = out[name].to(device)
    return out
