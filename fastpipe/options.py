"""What the caller allows when loading a pipeline (all off by default)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadOptions:
    allow_outside_paths: bool = False
    """Allow param files / payload side files by absolute path or outside the pipeline's folder."""
    trust_export_archives: bool = False
    """Allow torch.export archives, whose loader can unpickle (i.e. run code from the file)."""
    check_payloads: bool = True
    """Decode every graph payload and propagate shapes with fake tensors during validation."""
