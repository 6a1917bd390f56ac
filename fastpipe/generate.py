"""Greedy generation with prefill + decode pipelines (static shapes, exact KV-cache lengths).

    paths = build_generation_set("hf_model_dir", "out/", batch=2, prompt_len=8, max_new_tokens=32, tp=2)
    models = fastpipe.serving.ModelSet(paths)
    tokens = greedy_generate(models, input_ids, max_new_tokens=32)        # [batch, 32]

The prefill pipeline (seq = prompt_len, past_len = 0) returns the logits and the KV cache;
each decode step (seq = 1) has its own pipeline for its exact past length (prompt_len + i),
since the pipelines take no attention mask (see fastpipe.serving). All of them reference
one checkpoint, and a ModelSet loads each weight slice once for all of them.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from fastpipe.model_io import nest


def build_generation_set(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, batch: int, prompt_len: int,
                         max_new_tokens: int, tp: int = 1, pp: int = 1) -> list[Path]:
    from fastpipe.builder.hf.build import build_hf

    out = Path(out_dir)
    paths = [build_hf(model_dir, tp=tp, pp=pp, batch=batch, seq_len=prompt_len, past_len=0).save(out / "prefill")]
    for i in range(max_new_tokens - 1):
        past = prompt_len + i
        paths.append(build_hf(model_dir, tp=tp, pp=pp, batch=batch, seq_len=1, past_len=past).save(out / f"decode_p{past}"))
    return paths


def greedy_generate(models, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding: the argmax token at every step, fed back with the updated KV cache."""
    out = models.run_model(input_ids=input_ids)
    tokens = []
    for step in range(max_new_tokens):
        nxt = out["logits"][:, -1].argmax(-1)
        tokens.append(nxt)
        if step == max_new_tokens - 1:
            break
        cache = nest({k: v for k, v in out.items() if k.startswith("past_key_values_")}, "past_key_values")
        out = models.run_model(input_ids=nxt[:, None], past_key_values=cache)
    return torch.stack(tokens, dim=1)
