"""Tiny Hugging Face checkpoints with seeded random weights, for tests, benchmarks and examples.

``save_random_checkpoint(config, model_dir, seed)`` builds the family's model from a config
(no network), perturbs every parameter and saves it with ``save_pretrained`` (safetensors).
It sits apart from checkpoint.py (reading checkpoints), since it needs load.py, which
reads checkpoints through checkpoint.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from fastpipe.builder.hf.load import build_model, detect_family


def _perturb(model, seed: int) -> None:
    """Give every floating parameter seeded noise, so biases and norm weights are not 0 / 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.is_floating_point():
                scale = 0.02 if p.dim() >= 2 else 0.1
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * scale)


def save_random_checkpoint(config, model_dir: Path, seed: int, *, model_cls=None,
                           max_shard_size: str | int | None = None):
    """A model from ``config`` with seeded random weights, saved with ``save_pretrained`` (safetensors).

    ``model_cls``: the class to save (default: the family's class, e.g.
    BertForMaskedLM to get a ``bert.``-prefixed checkpoint without a pooler).
    Every parameter gets seeded noise on top of transformers' init, so biases
    and LayerNorm/RMSNorm weights are not the trivial 0 / 1. ``max_shard_size``
    (e.g. "20KB") produces a sharded checkpoint with an index. Returns the
    model (CPU, eval mode) that was saved. In transformers 5 ``save_pretrained``
    writes safetensors only (it has no ``safe_serialization`` argument).
    """
    family = detect_family(config)
    torch.manual_seed(seed)
    if model_cls is None:
        model = build_model(config, family, device="cpu")
    else:
        model = model_cls._from_config(config, attn_implementation="eager").eval()
    _perturb(model, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(os.fspath(model_dir), **kwargs)
    return model
