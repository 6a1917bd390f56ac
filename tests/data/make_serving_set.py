"""Regenerate tests/data/serving/llama_tp2/: a tiny serving set with expected tokens, for tests that
must run where transformers is not installed (the GPU machine).

    python tests/data/make_serving_set.py

A random-init Llama (2 layers, hidden 64, 4 heads over 2 KV heads, vocab 100) is split tp=2 into
a serving set (batch 2, prompt bucket 8, max_len 24); expected.json holds prompts, their number
of new tokens, and transformers' greedy tokens for each (solo, no EOS).
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).resolve().parent / "serving" / "llama_tp2"
PROMPTS = [[5, 17, 3, 0, 42], [9], [60, 61, 62, 63, 64, 65, 66, 67], [1, 2, 3]]
NEW = [12, 16, 8, 15]


def main() -> int:
    import torch
    import transformers

    from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint
    from fastpipe.serving.build import build_serving_set

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=100)
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_checkpoint(cfg, Path(tmp) / "m", seed=21).eval()
        shutil.rmtree(OUT, ignore_errors=True)
        build_serving_set(Path(tmp) / "m", OUT, max_len=24, batches=(2,), prompt_lens=(8,), tp=2)
        tokens = []
        for p, n in zip(PROMPTS, NEW):
            ids = torch.tensor([p])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
            tokens.append(out[0, len(p):].tolist())
    (OUT / "expected.json").write_text(json.dumps({"prompts": PROMPTS, "max_new_tokens": NEW, "tokens": tokens}) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
