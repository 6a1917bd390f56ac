"""State a pipeline updates: outputs that are the new version of an input (a KV cache).

    pairs = state_pairs(pipeline)     # {"past_key_values_0_0": "past_key_values_0_0_new", ...}

The pairing is read from the pipeline's metadata, in the format's existing fields (no new key,
so files stay valid for the producer's loader): an original output whose name, shape and dtype
equal an original input's is that input's updated version (transformers' convention:
`past_key_values` in, `past_key_values` out). Each pipeline output slice of such an origin is
paired with the input slice of the same origin, placements and device slot, when the two
pipeline tensors have one shape and dtype. A pipeline without such outputs has no state: its
outputs are new tensors, and a caller keeping state copies them back.

With `state_in_place=True` (fastpipe.options.RunOptions) a session writes each paired output
into the tensor the caller gave as its input and returns that very tensor: no allocation per
step and stable addresses (what one compiled graph and one captured CUDA graph need). The region
processor writes it in the graph itself (fastpipe.runtime.passes.region_state); the cpu and cuda
processors in the step that updates it, where that step alone reads the input and updates it by a
scatter (fastpipe.runtime.binding.bind); otherwise (and on the reference processor) the output is computed
and copied into the input (`write_back`).
"""
from __future__ import annotations

from typing import Mapping

import torch

from fastpipe.errors import InputError
from fastpipe.format.model import Pipeline


def state_pairs(p: Pipeline) -> dict[str, str]:
    """Pipeline input name -> the pipeline output that is its updated version (see the module docstring)."""
    meta = p.metadata
    updated = {n for n, o in meta.tensors_outputs.items()
               if (i := meta.tensors_inputs.get(n)) is not None and (i.shape, i.dtype) == (o.shape, o.dtype)}
    if not updated:
        return {}
    by_slice = {(s.origin, s.placements, s.device): n for n, s in meta.slices_inputs.items() if s.origin in updated}
    pairs = {}
    for out, s in meta.slices_outputs.items():
        inp = by_slice.get((s.origin, s.placements, s.device))
        if inp is None or inp in pairs or inp not in p.tensors or out not in p.tensors:
            continue
        a, b = p.tensors[inp], p.tensors[out]
        if (a.shape, a.dtype) == (b.shape, b.dtype):
            pairs[inp] = out
    return pairs


def _span(t: torch.Tensor) -> tuple:
    """(device, storage, first byte, byte after the last) of the memory t's elements lie in."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    start = t.storage_offset() * t.element_size()
    return t.device, t.untyped_storage().data_ptr(), start, start + (last + 1) * t.element_size()


def check_state_inputs(inputs: Mapping[str, torch.Tensor], pairs: Mapping[str, str]) -> None:
    """State inputs must not overlap: memory given for two would receive both updates. Disjoint views
    of one allocation (one buffer holding every cache) are fine; views whose spans overlap are refused
    (interleaved strided views too: telling those apart is not worth the cost)."""
    spans = []
    for name in pairs:
        t = inputs.get(name)
        if not isinstance(t, torch.Tensor) or not t.numel():
            continue
        dev, base, lo, hi = _span(t)
        for other, (d2, b2, lo2, hi2) in spans:
            if (dev, base) == (d2, b2) and lo < hi2 and lo2 < hi:
                raise InputError(f"inputs[\"{name}\"]: expected its own memory (its output is written into it in "
                                 f"place), found memory shared with inputs[\"{other}\"]")
        spans.append((name, (dev, base, lo, hi)))


def working_inputs(inputs: Mapping[str, torch.Tensor], written: Mapping[str, str],
                   reader_devices: Mapping[str, set], chunks: int = 1) -> tuple[Mapping, list]:
    """Inputs a graph writes in place (fastpipe.validate.written), made what the graph will write: the
    caller's tensor itself where it is dense on the device its reader runs on, else a dense copy there.
    Returns (the inputs with those copies, [(caller's tensor, its copy)]): after the run each copy is
    written back into the caller's tensor, so the update never stays in a copy that is then dropped.
    Names in `written` but not in `inputs` (another rank's) are left alone; chunks must be 1."""
    from fastpipe.runtime.binding.inputs import dense, to_device

    if chunks != 1:
        raise InputError(f"chunks: expected 1 (inputs written in place hold one batch: "
                         f"{', '.join(sorted(written))}), found {chunks}")
    out, back = None, []
    for name in written:
        t = inputs.get(name)
        if t is None:
            continue
        devices = reader_devices.get(name) or {t.device}
        dev = next(iter(devices))
        if t.device == dev and dense(t) is t:
            continue
        out = dict(inputs) if out is None else out
        out[name] = work = dense(to_device(t, dev))
        back.append((t, work))
    return (inputs if out is None else out), back


def write_back(inputs: Mapping[str, torch.Tensor], outputs: dict, pairs: Mapping[str, str]) -> dict:
    """Each paired output written into its input tensor (unless the processor already did), and that
    input tensor returned in its place."""
    for i, o in pairs.items():
        t, new = inputs[i], outputs[o]
        if new is not t:
            if new.data_ptr() != t.data_ptr() or new.stride() != t.stride() or new.device != t.device:
                t.copy_(new)
            outputs[o] = t
    return outputs
