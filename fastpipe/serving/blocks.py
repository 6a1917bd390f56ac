"""Blocks of a paged KV cache handed out to sequences, and given back.

    pool = BlockAllocator(48, padding=0)     # blocks 1..47 to hand out; block 0 is the padding block
    table = pool.allocate(5)                 # [1, 2, 3, 4, 5]: a sequence's first five positions
    table += pool.allocate(1)                # one more as it grows
    pool.free(table)                         # at its end

Blocks go out lowest first and come back to the end of the free list, so sequences that grow in
turn hold interleaved, non-contiguous blocks (what a block table exists for). The padding block is
never handed out: padded positions write there and masked reads read it.
"""
from __future__ import annotations

from collections import deque

from fastpipe.errors import InputError


class BlockAllocator:
    def __init__(self, num_blocks: int, *, padding: int = 0):
        if not 0 <= padding < num_blocks:
            raise InputError(f"padding: expected a block of 0..{num_blocks - 1}, found {padding}")
        self.num_blocks, self.padding = num_blocks, padding
        self._free = deque(b for b in range(num_blocks) if b != padding)
        self._held: set[int] = set()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n blocks (InputError when fewer are free: nothing is taken then)."""
        if n > len(self._free):
            raise InputError(f"paged KV cache: expected {n} free blocks, found {len(self._free)} of {self.num_blocks - 1}")
        out = [self._free.popleft() for _ in range(n)]
        self._held.update(out)
        return out

    def free(self, blocks) -> None:
        for b in blocks:
            if b not in self._held:
                raise ValueError(f"block {b} is not held (freed twice, or never handed out)")
            self._held.discard(b)
            self._free.append(b)
