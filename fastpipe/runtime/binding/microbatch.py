"""Micro-batching (SPEC §4): inputs carrying k times the pipeline's batch along dim 0, split into k parts."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping

import torch

from fastpipe.errors import InputError


def _dim0_error(name: str, t: torch.Tensor, chunks: int, want: int) -> InputError:
    found = t.shape[0] if t.dim() else "a scalar"
    return InputError(f"inputs[\"{name}\"].shape[0]: expected {want * chunks} (chunks={chunks} x the pipeline's "
                      f"batch {want}), found {found}")


def check_chunked_inputs(p, inputs: Mapping[str, torch.Tensor], chunks: int,
                         allowed_devices: Mapping[str, set]) -> dict[str, int]:
    """check_inputs (fastpipe.runtime.binding.inputs) for a run with chunks > 1: each input must be the
    pipeline's input with chunks x its batch along dim 0. Every refusal is an InputError: a pipeline
    input or output with no dim 0 (shape []: nothing to split or concatenate), an input tensor whose
    dim 0 is not chunks x the batch (or that is 0-dim), then whatever check_inputs refuses (names,
    types, the other dims, dtype, device), against the whole chunked shape.

    Returns each pipeline input's batch (its dim 0), for split_chunks."""
    from fastpipe.runtime.binding.inputs import check_inputs

    for kind, names in (("input", p.input_names), ("output", p.output_names)):
        for name in names:
            if not p.tensors[name].shape:
                what = "split" if kind == "input" else "concatenate"
                raise InputError(f"chunks: expected 1 (the pipeline {kind} \"{name}\" has shape [], no dim 0 to "
                                 f"{what} micro-batches along), found {chunks}")
    batch = {n: p.tensors[n].shape[0] for n in p.input_names}
    for name in p.input_names:
        t = inputs.get(name)
        if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] != batch[name] * chunks):
            raise _dim0_error(name, t, chunks, batch[name])
    whole = {n: SimpleNamespace(shape=(batch[n] * chunks,) + tuple(p.tensors[n].shape[1:]), dtype=p.tensors[n].dtype)
             for n in p.input_names}
    check_inputs(SimpleNamespace(input_names=p.input_names, tensors=whole), inputs, allowed_devices)
    return batch


def split_chunks(inputs: Mapping[str, torch.Tensor], chunks: int, batch: Mapping[str, int]) -> list[dict]:
    """Split each input along dim 0 into `chunks` micro-batches of the pipeline's batch size."""
    out = [dict() for _ in range(chunks)]
    for name, t in inputs.items():
        want = batch[name]
        if t.dim() == 0 or t.shape[0] != want * chunks:
            raise _dim0_error(name, t, chunks, want)
        for c in range(chunks):          # slices, not t.split(want): a batch of 0 still gives `chunks` parts
            out[c][name] = t[c * want:(c + 1) * want]
    return out


def repeat_chunks(inputs: Mapping[str, torch.Tensor], chunks: int) -> dict[str, torch.Tensor]:
    """Each input repeated `chunks` times along dim 0 (the CLI's random inputs for --chunks); 0-dim
    tensors stay as they are, for the run to refuse them by name (check_chunked_inputs)."""
    return {k: torch.cat([v] * chunks, dim=0) if v.dim() else v for k, v in inputs.items()}
