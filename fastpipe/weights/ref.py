"""ParamRef: one constant's reference into a parameter file (a checked ParamValue)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FORMATS = ("safetensors", "torch.save", "torch.export")


@dataclass(frozen=True)
class ParamRef:
    path: Path                     # already resolved (absolute, real): see resolve_param_path
    format: str                    # "safetensors" | "torch.save" | "torch.export"
    name: str                      # tensor name inside the file
    placements: tuple[tuple[int, int], ...] | None  # [start, end) per stored dim; None = whole tensor
