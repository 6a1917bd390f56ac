"""One CUDA-graph capture, safe to fail: every capture of fastpipe.runtime.cuda.graph_replay goes through here.

    graph, out = capture(body, device, pool=None)    # body() issues the work; out is what it returned

`torch.cuda.graph`'s __exit__ ends the capture and only then restores the current stream, so a
capture that fails at its end (invalidated by a synchronizing call inside it, say) leaves the
thread on the capture stream; and up to torch 2.11 `capture_end` then also leaves the allocator
routing allocations into the dead capture's pool (fastpipe.torch_compat.end_pool_routing). A
failed capture is an expected event here (policy "warn" runs on eagerly after it), so capture():

- begins and ends the capture itself, inside a `torch.cuda.stream` context of its own, which
  restores the thread's stream whatever happens;
- always names the pool (a fresh `torch.cuda.graph_pool_handle()` for a private one), so the pool
  is known when the capture fails, and ends the allocator's routing into it then;
- first runs a few tiny matmuls in the capturing thread (prime_blas): cuBLAS/cuBLASLt handles are
  per thread, and a capture that is a thread's first matmul would create one inside the capture
  (a capture may happen in another thread than the warm-up: GraphReplay's second call);
- synchronizes and empties the cache first, as torch.cuda.graph does;
- holds Python's cyclic garbage collector off while it captures: a collection that the body's
  allocations trigger may free an unreachable CUDAGraph (an old session's, in a reference cycle),
  and its destructor's cudaGraphExecDestroy, called from the capturing thread, is refused and
  invalidates the capture ("operation not permitted when stream is capturing (function reset)").
  Such garbage goes at the next collection after the capture instead.

The capture stream is one per device (graphs sharing a pool want one stream), made from torch's
high-priority stream pool: torch.cuda.Stream() hands out 32 pooled streams per priority in turn,
so a lane made later could otherwise be the very stream a capture runs on, and its work, issued
from another thread, would be recorded into that capture.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator, TypeVar

import torch

from fastpipe.torch_compat import end_pool_routing

CAPTURE_ERROR_MODE = "thread_local"      # other threads' CUDA calls do not invalidate our capture
_CAPTURE_STREAMS: dict = {}              # str(device) -> the stream every capture on it uses

T = TypeVar("T")


def capture_stream(device: torch.device):
    key = str(device)
    s = _CAPTURE_STREAMS.get(key)
    if s is None:
        s = _CAPTURE_STREAMS[key] = torch.cuda.Stream(device=device, priority=-1)
    return s


def prime_blas(device: torch.device, stream) -> None:
    """Create this thread's cuBLAS and cuBLASLt handles (and the stream's workspace) outside any capture."""
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if torch.cuda.is_bf16_supported() else ())
    with torch.cuda.stream(stream):
        for dt in dtypes:
            a = torch.ones(16, 16, device=device, dtype=dt)
            torch.mm(a, a)
            torch.addmm(a[0], a, a)          # a 1-d bias: cuBLASLt's epilogue path


def capture(body: Callable[[], T], device: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture what body() issues on `device` into a new CUDA graph (in `pool`, a graph_pool_handle(),
    or a private pool). Returns (graph, body's result). Raises what failed, with the thread's current
    stream and the allocator as they were before (the failed capture's pool memory is left to torch)."""
    stream = capture_stream(device)
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(device):
        prime_blas(device, stream)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), no_collection():
            graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)
            try:
                out = body()
            except BaseException:
                _end(graph, index, pool, quiet=True)
                raise
            _end(graph, index, pool, quiet=False)
    return graph, out


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, back as it was after (it may already be off)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _end(graph, index: int, pool, *, quiet: bool) -> None:
    """End the capture; if that fails (an invalidated capture), end the allocator's routing too, then
    raise that failure, or (quiet: the body's own error is on its way up) let it go."""
    try:
        graph.capture_end()
    except BaseException:
        end_pool_routing(index, pool)
        if not quiet:
            raise
