"""Give back the resident pages of weights read from a file mapping once they are no longer read.

A slice of a safetensors file is a view of the file's private, read-only mmap (fastpipe.weights.store):
its pages become resident, and count in the process's RSS, when first touched. When a weight has been
copied elsewhere (the region processor's merged weights: the shards are concatenated into one new
tensor), its file pages stay mapped and resident for as long as the file is open, though nothing reads
them: an 8B model loaded on the CPU then shows its weights twice in RSS (the merged copy and the file's
pages). `release(tensors)` tells the kernel those pages are not needed (madvise MADV_DONTNEED): they
leave the process's RSS (the file's pages stay in the page cache), and a later read of the tensor
faults them in again from the file, with the same bytes.

Only whole pages inside a tensor's byte range, and only inside a mapping of a `.safetensors` file, are
released: anonymous memory (where MADV_DONTNEED would zero the pages) is never touched. Weights are
read-only (the store's contract), so no written page is discarded.

    n = release([shard0, shard1])       # bytes given back (0 where nothing is file-mapped, or off Linux)
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys

import torch

MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


def _file_mappings(suffix: str = ".safetensors") -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of files whose path ends with suffix."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n").endswith(suffix):
                    lo, hi = parts[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return out


@functools.lru_cache(maxsize=1)
def _libc_madvise():
    """libc's madvise, found once: ctypes.util.find_library runs a subprocess (ldconfig) each call."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi): the bytes a tensor's elements span (a strided view spans the rows between its own)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def release(tensors) -> int:
    """madvise(MADV_DONTNEED) the whole pages of each CPU tensor that lie in a .safetensors mapping;
    returns the bytes released."""
    if not sys.platform.startswith("linux"):
        return 0
    ranges = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            lo, hi = _extent(t)
            lo, hi = -(-lo // _PAGE) * _PAGE, hi // _PAGE * _PAGE
            if hi > lo:
                ranges.append((lo, hi))
    if not ranges:
        return 0
    maps = _file_mappings()
    madvise = _libc_madvise()
    done = 0
    for lo, hi in ranges:
        for mlo, mhi in maps:
            a, b = max(lo, mlo), min(hi, mhi)
            if b > a and madvise(a, b - a, MADV_DONTNEED) == 0:
                done += b - a
    return done
