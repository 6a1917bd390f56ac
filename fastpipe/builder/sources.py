"""Where each rank-local parameter comes from: a slice of an original parameter."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    param: str                                   # the parameter's name in the unsplit model
    placements: tuple[tuple[int, int], ...]      # [start, end) per dim of the original parameter

    @staticmethod
    def whole(param: str, shape) -> "Source":
        return Source(param, tuple((0, s) for s in shape))

    @staticmethod
    def slice(param: str, shape, dim: int, start: int, end: int) -> "Source":
        dim = dim % len(shape)
        return Source(param, tuple((start, end) if d == dim else (0, s) for d, s in enumerate(shape)))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in self.placements)
