"""Weights onto a GPU through a few pinned staging buffers, reading the file while the copy engine copies.

    outs = upload(srcs, torch.device("cuda:0"))        # srcs: host tensors (an iterable, read lazily);
                                                       # outs: their copies there, every copy done on return

Why. ``t.to("cuda")`` of a host tensor that is not pinned (the weight store's slices are views of a
safetensors file's mmap) is a synchronous copy: the driver faults the file's pages in and stages them
through its own pinned buffer on the calling thread, tensor after tensor, and the copy engine waits
while it does. Here the bytes go through ``buffers`` pinned buffers of ``chunk_bytes`` each:

    for each piece of each source (a piece never crosses a buffer's end; small sources share one):
        buffer k full?  record an event behind its copies, move to buffer k+1 and, before writing
                        into it, wait for the event recorded behind ITS last copies
        buf_k[used:used+n].copy_(src bytes)      host copy: torch's CPU copy runs on the intra-op
                                                 threads, so the file's pages fault in in parallel
        dst bytes.copy_(buf_k[...], non_blocking=True)   queued on the device's current stream
    wait for the last event (every copy done: the tensors are ready for any stream, as after .to())

so the host fills buffer k+1 while the copy engine drains buffer k. A source is dropped once its
bytes are in a buffer, so host memory holds one source at a time plus the buffers (2 x 32 MiB by
default), never the whole checkpoint.

The destinations are allocated on the device's current stream and copied on it, so they are ordered
after everything already queued there, as ``.to()`` copies are. ``staged_copy`` is the algorithm over
any ``queue`` (staging buffers, an async copy, a mark to wait on): the CPU tests run it against a
queue that defers every copy until its mark is waited on, which is what makes a buffer reused too
early show up as wrong bytes.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch

CHUNK_BYTES = 32 << 20        # one staging buffer
BUFFERS = 2                   # staging buffers in turn (double buffering)


class PinnedStagingUnavailable(RuntimeError):
    """Pinned host memory for the staging buffers could not be allocated (the reason is the message)."""


class CudaCopies:
    """The queue for a CUDA device: pinned staging buffers, copies on the device's current stream,
    a mark is an event recorded behind the copies queued so far (its wait: event.synchronize)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.current_stream(device)

    def staging(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:
            raise PinnedStagingUnavailable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e

    def empty(self, src: torch.Tensor) -> torch.Tensor:
        return torch.empty(src.shape, dtype=src.dtype, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def mark(self) -> Callable[[], None]:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event.synchronize


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The dense tensor's bytes as a 1-d uint8 view (a 0-d tensor too)."""
    return t.reshape(-1).view(torch.uint8)


def staged_copy(srcs: Iterable[torch.Tensor], queue, *, chunk_bytes: int = CHUNK_BYTES,
                buffers: int = BUFFERS, total_bytes: int | None = None) -> tuple[list[torch.Tensor], int]:
    """(the copies of `srcs` that `queue.empty` made, bytes staged): every source's bytes through `buffers`
    staging buffers of `chunk_bytes` (smaller when `total_bytes`, the sources' sum, is smaller), as the module
    docstring says. Returns after the last copy's mark was waited on."""
    if chunk_bytes < 1 or buffers < 1:
        raise ValueError(f"chunk_bytes >= 1 and buffers >= 1 expected, found {chunk_bytes}, {buffers}")
    size = chunk_bytes if not total_bytes else min(chunk_bytes, total_bytes)
    bufs: list[torch.Tensor] = []

    def allocate() -> list[torch.Tensor]:
        need = buffers if total_bytes is None else min(buffers, -(-total_bytes // size))
        return [queue.staging(size) for _ in range(need)]

    if total_bytes:                                      # before any source is read
        bufs = allocate()
    waits: list[Callable[[], None] | None] = [None] * buffers        # per buffer: its last copies' mark
    outs: list[torch.Tensor] = []
    k, used, staged = 0, 0, 0
    for src in srcs:
        src = src.contiguous()
        dst = queue.empty(src)
        outs.append(dst)
        s8, d8 = _bytes(src), _bytes(dst)
        off, n_src = 0, s8.numel()
        while off < n_src:
            if used >= size:                             # buffer k is full: its copies are queued
                waits[k] = queue.mark()
                k, used = (k + 1) % len(bufs), 0
                if waits[k] is not None:                 # buffer k's earlier copies must be done
                    waits[k]()
                    waits[k] = None
            if not bufs:                                 # all at once, before the first copy is queued
                bufs = allocate()
            n = min(n_src - off, size - used)
            piece = bufs[k][used:used + n]
            piece.copy_(s8[off:off + n])                 # host: file pages -> pinned
            queue.copy(d8[off:off + n], piece)           # device: pinned -> GPU, asynchronous
            off, staged, used = off + n, staged + n, used + n
        del src, s8                                      # the source is in a buffer now: let it go
    if staged:
        queue.mark()()                                   # marks complete in order: the last covers all
    return outs, staged


def queue_for(device: torch.device):
    """The queue that stages copies to `device` (CUDA: CudaCopies), or None where there is none."""
    return CudaCopies(device) if device.type == "cuda" else None


def upload(srcs: Iterable[torch.Tensor], device: torch.device, *, queue=None, chunk_bytes: int = CHUNK_BYTES,
           buffers: int = BUFFERS, total_bytes: int | None = None) -> tuple[list[torch.Tensor], int]:
    """(copies of the host tensors `srcs` on `device`, bytes staged) through pinned staging buffers; every copy
    is done on return (`queue`: queue_for(device) unless given). With `total_bytes` (> 0) the buffers are
    allocated before the first source is read, so PinnedStagingUnavailable (pinned memory cannot be had)
    leaves `srcs` untouched."""
    device = torch.device(device)
    queue = queue or queue_for(device)
    if queue is None:
        raise ValueError(f"upload: expected a CUDA device, found {device}")
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return staged_copy(srcs, queue, chunk_bytes=chunk_bytes, buffers=buffers, total_bytes=total_bytes)
