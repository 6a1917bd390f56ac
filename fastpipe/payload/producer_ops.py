"""The producer's own operators (furiosa-torch's `furiosa::*`), as foreign-op entries.

furiosa-llm's decode graphs read their paged KV cache through `furiosa::sparse_select_v1_5`
(furiosa-models' PagedAttention, when traced); furiosa-torch defines it, with `sparse_select` (v1.0)
and `gather_i32` beside it. Their meaning on a CPU, read from furiosa-torch 2026.3.0
(`furiosa/torch/_custom_ops/furiosa_internals.py`): the fake (meta) kernel of sparse_select is
`aten.index(x, indices)`, and furiosa-models' eager path reads the same blocks with `cache[blocks]`;
entries equal to `dummy_index` (0: the padding block) are positions the attention mask hides (the NPU
skips them; here they read the padding block). `index_group_size` (blocks per batch row) only tells
the NPU how the flat indices group; it does not change the result. gather_i32 is `torch.gather` with
an int32 index.

Not registered: furiosa-torch's `dequantize*` (their meaning depends on quantization formats the
producer's float pipelines do not use), its random-number ops and its NPU-graph ops (`dfg`,
`runnable`, `set_metadata`, `module_marker`); a payload calling one is refused by name.
"""
from __future__ import annotations

import torch

from fastpipe.payload.foreign_ops import ForeignOp, register_foreign_op

_INDEX_DTYPES = (torch.int32, torch.int64)


def sparse_select(x: torch.Tensor, indices: list, dummy_index: int, index_group_size: int) -> torch.Tensor:
    """x: [blocks, ...]; indices: one integer tensor [n] of block ids (dummy_index: padding) -> [n, ...]."""
    if len(indices) != 1:
        raise ValueError(f"sparse_select: expected one index tensor (block ids), found {len(indices)}")
    (idx,) = indices
    if idx.dtype not in _INDEX_DTYPES:
        raise ValueError(f"sparse_select: expected int32 or int64 block ids, found {idx.dtype}")
    if x.dim() < 1 or not 0 <= dummy_index < x.shape[0]:
        raise ValueError(f"sparse_select: expected 0 <= dummy_index < {x.shape[0] if x.dim() else 0} "
                         f"(a block of x: the padding block), found {dummy_index}")
    if index_group_size < 1:
        raise ValueError(f"sparse_select: expected index_group_size >= 1, found {index_group_size}")
    return torch.ops.aten.index.Tensor(x, [idx])


def gather_i32(x: torch.Tensor, dim: int, index: torch.Tensor, sparse_grad: bool) -> torch.Tensor:
    """torch.gather(x, dim, index) with an int32 (or int64) index."""
    if index.dtype not in _INDEX_DTYPES:
        raise ValueError(f"gather_i32: expected an int32 or int64 index, found {index.dtype}")
    return torch.ops.aten.gather.default(x, dim, index.to(torch.int64), sparse_grad=sparse_grad)


_SPARSE_SELECT = "(Tensor x, Tensor[] indices, SymInt dummy_index, SymInt index_group_size) -> Tensor"
ENTRIES = (
    ForeignOp("furiosa::sparse_select_v1_5", _SPARSE_SELECT, sparse_select,
              "furiosa-torch: paged-cache blocks read by id (aten.index), dummy_index the padding block"),
    ForeignOp("furiosa::sparse_select", _SPARSE_SELECT, sparse_select,
              "furiosa-torch (v1.0 of sparse_select_v1_5): the same meaning"),
    ForeignOp("furiosa::gather_i32", "(Tensor x, SymInt dim, Tensor index, bool sparse_grad) -> Tensor", gather_i32,
              "furiosa-torch: torch.gather with an int32 index"),
)


def register() -> None:
    for entry in ENTRIES:
        register_foreign_op(entry)
