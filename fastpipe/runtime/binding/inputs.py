"""Run-time inputs: checked by name, shape, dtype and device before anything runs."""
from __future__ import annotations

from functools import lru_cache
from typing import Mapping

import torch

from fastpipe import dtypes
from fastpipe.errors import InputError
from fastpipe.format.model import Pipeline


def check_inputs(p: Pipeline, inputs: Mapping[str, torch.Tensor], allowed_devices: Mapping[str, set]) -> None:
    """`allowed_devices[name]`: the devices the tensor may already be on (cpu is always fine)."""
    expected = p.input_names
    for name in inputs:
        if name not in expected:
            raise InputError(f"inputs[\"{name}\"]: expected one of the pipeline inputs ({', '.join(expected) or 'none'}), found an unknown name")
    for name in expected:
        if name not in inputs:
            raise InputError(f"inputs[\"{name}\"]: expected a tensor for this pipeline input, found none")
        t, info = inputs[name], p.tensors[name]
        if not isinstance(t, torch.Tensor):
            raise InputError(f"inputs[\"{name}\"]: expected a torch.Tensor, found {type(t).__name__}")
        if tuple(t.shape) != info.shape:
            raise InputError(f"inputs[\"{name}\"].shape: expected {list(info.shape)}, found {list(t.shape)}")
        want = dtypes.to_torch(info.dtype)
        if t.dtype != want:
            raise InputError(f"inputs[\"{name}\"].dtype: expected {info.dtype}, found {dtypes.TORCH_TO_NAME.get(t.dtype, str(t.dtype))}")
        if t.device.type != "cpu" and t.device not in allowed_devices.get(name, set()):
            ok = ", ".join(sorted({"cpu"} | {str(d) for d in allowed_devices.get(name, set())}))
            raise InputError(f"inputs[\"{name}\"].device: expected {ok}, found {t.device}")


@lru_cache(maxsize=4096)
def _dense_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return tuple(reversed(out))


def dense(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous, with the canonical strides even on its size-1 dims (`.contiguous()` keeps
    whatever stride a size-1 dim had, e.g. from slicing a bigger tensor, and a graph compiled with
    dynamic=False guards on every stride: a different one would recompile it)."""
    t = t.contiguous()
    want = _dense_strides(tuple(t.shape))
    return t if t.stride() == want else t.as_strided(t.shape, want)


def to_device(t: torch.Tensor, device, *, non_blocking: bool = False) -> torch.Tensor:
    """`t` on `device` (itself when there already). A copy made here is a normal tensor even under
    torch.inference_mode, as a caller's own device tensors are (an engine's KV caches): compiled graphs
    see one kind of tensor at warm-up, at capture and in runs. Dynamo guards on it, so an inference
    tensor where a normal one was seen (or the reverse) compiles the graph again, inside a CUDA-graph
    capture too, where compiling and first launches are not allowed. A caller handing in inference
    tensors of its own (made under inference_mode) costs one such recompile."""
    if t.device == device:
        return t
    with torch.inference_mode(False):
        return t.to(device, non_blocking=non_blocking)
