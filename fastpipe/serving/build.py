"""A serving set: the few pipelines that generate any prompt length and any number of tokens.

    paths = build_serving_set("hf_model_dir", "out/", max_len=256, batches=(1, 8), tp=2)

For each batch bucket B it writes
- `prefill_b{B}_s{S}/`: one per prompt-length bucket S (default: powers of two from 16 up to
  max_len, and max_len): input_ids [B, S], logits_index [B], cache_row [B],
  past_key_values_{l}_{0|1} [R, Hkv, max_len, D] -> logits [B, 1, V] and the caches with each
  prompt's keys/values written into its row cache_row[b] at positions 0..S-1 (the same names: in-place
  state). R = max(batches): the engine's one KV cache, whose first rows the decode step takes. Prompts
  are right-padded to S: causal attention keeps every real token from seeing the pads, so no mask
  input is needed; logits_index is each row's last real token, the one position whose logits the
  engine samples from, so the output projection runs on B rows, not B x S, and no [B, S, V] tensor is
  made (at a 128k vocabulary, 8 x 2048 positions of bf16 logits would be 4 GiB); and no [B, Hkv, S, D]
  caches are returned to be copied into the engine's (per layer, as large as the prompt's share of
  the KV cache);
- `decode_b{B}/`: ONE decode step on a static cache of max_len positions: input_ids [B, 1],
  cache_position [B], past_key_values_{l}_{0|1} [B, Hkv, max_len, D] -> logits [B, 1, V] and the
  caches updated at each row's position (the same names: in-place state, fastpipe.runtime.binding.state).
So the number of pipelines is len(batches) * (len(prompt_lens) + 1), whatever the number of
tokens generated. The checkpoint is hard-linked once per folder (no copy), and the model folder's
tokenizer and generation config are linked beside the pipelines, so `fastpipe generate out/`
can take text and knows the EOS token.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Sequence

from fastpipe.errors import BuildError

# files of a Hugging Face model folder that generation reads (the tokenizer, EOS, the config)
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
              "chat_template.jinja", "chat_template.json")        # where transformers saves a chat template


def default_prompt_lens(max_len: int) -> list[int]:
    out, s = [], 16
    while s < max_len:
        out.append(s)
        s *= 2
    return out + [max_len]


def _ints(name: str, values, low: int, high: int | None = None) -> list[int]:
    vals = list(values)
    bad = [v for v in vals if isinstance(v, bool) or not isinstance(v, int) or v < low or (high and v > high)]
    if not vals or bad:
        rng = f">= {low}" + (f" and <= {high}" if high else "")
        raise BuildError(f"{name}: expected a non-empty list of integers {rng}, found {vals!r}")
    return sorted(set(vals))


def build_serving_set(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, max_len: int,
                      batches: Sequence[int] = (1,), prompt_lens: Sequence[int] | None = None, tp: int = 1,
                      pp: int = 1, dtype=None, style: str = "fastpipe") -> list[Path]:
    """Write the serving set (module docstring) under out_dir; returns the pipeline.json paths."""
    from fastpipe.builder.hf.build import build_hf

    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise BuildError(f"max_len: expected an integer >= 2, found {max_len!r}")
    batches = _ints("batches", batches, 1)
    lens = _ints("prompt_lens", prompt_lens if prompt_lens is not None else default_prompt_lens(max_len), 1, max_len)
    model_dir, out = Path(model_dir), Path(out_dir)
    built = {}                  # every pipeline is built (and checked) before anything is written
    for b in batches:
        built[f"decode_b{b}"] = build_hf(model_dir, tp=tp, pp=pp, batch=b, seq_len=1, max_len=max_len, dtype=dtype)
        for s in lens:
            built[f"prefill_b{b}_s{s}"] = build_hf(model_dir, tp=tp, pp=pp, batch=b, seq_len=s, max_len=max_len,
                                                   cache_rows=batches[-1], dtype=dtype, last_logits=True)
    paths = [built[k].save(out / k, style=style) for k in sorted(built)]
    for name in SIDE_FILES:
        src, dst = model_dir / name, out / name
        if src.is_file():
            dst.unlink(missing_ok=True)               # a rebuild takes this model's tokenizer, not an old one
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)             # small text files: a copy is fine across filesystems
    return paths
