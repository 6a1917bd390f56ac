"""Rank-local tensor-parallel layers (SPEC §5, as in text-generation-inference).

Each layer holds this rank's parameters (meta tensors of local shape while
building) and records their `Source` (slice of an original parameter). Where
ranks must communicate it leaves `layout`/`require` markers; the sharding pass
turns each mismatch into a comm supertask.

    ColumnLinear   weight rows (output features) sharded, per part for packed weights
                   (fused QKV / gate-up); output sharded on the last dim, or gathered.
    RowLinear      weight columns (input features) sharded; partial outputs reduced
                   (all_reduce, or reduce_scatter on the sequence dim with sequence
                   parallelism); the bias is added once, after the reduction.
    VocabEmbedding each rank holds a contiguous block of ceil(V/n) rows; ids outside
                   the block give zeros; outputs reduced like RowLinear.
Linear weights are stored [out, in] (nn.Linear) or [in, out] (GPT-2's Conv1D,
`transposed=True`).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fastpipe.builder import markers
from fastpipe.builder.sources import Source
from fastpipe.errors import BuildError


def _meta_param(shape, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device="meta", dtype=dtype), requires_grad=False)


def even_range(size: int, rank: int, tp: int) -> tuple[int, int]:
    if size % tp:
        raise BuildError(f"cannot split {size} evenly over {tp} ranks")
    step = size // tp
    return rank * step, (rank + 1) * step


class ColumnLinear(nn.Module):
    """y = x @ W_local^T + b_local; `parts` splits a packed weight (e.g. [q, k, v] sizes) per part."""

    def __init__(self, name: str, weight_shape, has_bias: bool, rank: int, tp: int, *, transposed: bool = False,
                 parts: Sequence[int] | None = None, part_ranges: Sequence[tuple[int, int]] | None = None,
                 gather: bool = False, input_layout: str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.transposed, self.gather, self.input_layout, self.tp = transposed, gather, input_layout, tp
        out_dim = 1 if transposed else 0
        out_features = weight_shape[out_dim]
        parts = list(parts) if parts else [out_features]
        if sum(parts) != out_features:
            raise BuildError(f"{name}: parts {parts} do not add up to {out_features} output features")
        offsets = [sum(parts[:i]) for i in range(len(parts))]
        ranges = list(part_ranges) if part_ranges else [even_range(p, rank, tp) for p in parts]
        self.sources: dict[str, Source] = {}
        self.n_parts = len(parts)
        for i, (off, (a, b)) in enumerate(zip(offsets, ranges)):
            src = Source.slice(f"{name}.weight", weight_shape, out_dim, off + a, off + b)
            self.register_parameter(f"weight_{i}", _meta_param(src.shape, dtype))
            self.sources[f"weight_{i}"] = src
            if has_bias:
                bsrc = Source.slice(f"{name}.bias", (out_features,), 0, off + a, off + b)
                self.register_parameter(f"bias_{i}", _meta_param(bsrc.shape, dtype))
                self.sources[f"bias_{i}"] = bsrc
        self.has_bias = has_bias

    def forward(self, x):  # x: [..., in] -> [..., out_local]
        if self.input_layout is not None:   # sequence parallel: gather the sequence shards first
            x = markers.transition(x, self.input_layout, "replicate", self.tp)
        dim = 1 if self.transposed else 0
        ws = [getattr(self, f"weight_{i}") for i in range(self.n_parts)]
        w = ws[0] if len(ws) == 1 else torch.cat(ws, dim=dim)
        b = None
        if self.has_bias:
            bs = [getattr(self, f"bias_{i}") for i in range(self.n_parts)]
            b = bs[0] if len(bs) == 1 else torch.cat(bs)
        y = x @ w + b if self.transposed and b is not None else (x @ w if self.transposed else F.linear(x, w, b))
        if self.gather:
            y = markers.transition(y, f"shard:{y.dim() - 1}", "replicate", self.tp)
        return y


class RowLinear(nn.Module):
    """y = reduce(x_local @ W_local^T) + b; `reduce_to` is "replicate" or "shard:D" (sequence parallel)."""

    def __init__(self, name: str, weight_shape, has_bias: bool, rank: int, tp: int, *, transposed: bool = False,
                 reduce_to: str = "replicate", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.transposed, self.reduce_to, self.tp = transposed, reduce_to, tp
        in_dim = 0 if transposed else 1
        a, b = even_range(weight_shape[in_dim], rank, tp)
        src = Source.slice(f"{name}.weight", weight_shape, in_dim, a, b)
        self.weight = _meta_param(src.shape, dtype)
        self.sources = {"weight": src}
        self.bias = None
        if has_bias:
            out = weight_shape[1 if transposed else 0]
            self.bias = _meta_param((out,), dtype)
            self.sources["bias"] = Source.whole(f"{name}.bias", (out,))

    def forward(self, x):  # x: [..., in_local] -> [..., out]
        y = x @ self.weight if self.transposed else F.linear(x, self.weight)
        y = markers.transition(y, "partial:sum", self.reduce_to, self.tp)
        return y + self.bias if self.bias is not None else y


class VocabEmbedding(nn.Module):
    """Rows [r*ceil(V/n), min(V, (r+1)*ceil(V/n))) on rank r; other ids give zeros; partial sums reduced."""

    RANK_FIELDS = ("start", "stop")     # reach the graph through the vocab_offset marker only

    def __init__(self, name: str, weight_shape, rank: int, tp: int, *, reduce_to: str = "replicate",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        vocab, dim = weight_shape
        self.start, self.stop = markers.vocab_range(rank, tp, vocab)
        self.rows, self.dim, self.reduce_to, self.tp, self.dtype = self.stop - self.start, dim, reduce_to, tp, dtype
        self.vocab = vocab
        self.sources = {}
        if self.rows:
            src = Source.slice(f"{name}.weight", weight_shape, 0, self.start, self.stop)
            self.weight = _meta_param(src.shape, dtype)
            self.sources["weight"] = src

    def forward(self, ids):  # ids: [...] int -> [..., D]
        if self.rows == 0:
            y = torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)
        else:
            local = markers.vocab_offset(ids, self.vocab, self.tp)     # ids - self.start, written in per rank
            inside = (local >= 0) & (local < self.rows)
            y = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return markers.transition(y, "partial:sum", self.reduce_to, self.tp)


class Replicated(nn.Module):
    """Marks a module whose parameters every rank holds whole (e.g. an LM head whose vocab does not divide)."""
