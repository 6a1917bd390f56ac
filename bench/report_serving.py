"""Serving benchmark: greedy decode tokens/s vs Hugging Face generate (same run), and the memory of
3 loaded buckets vs the weight bytes of one.

    python bench/report_serving.py [--layers 4] [--hidden 256] [--tokens 32] [--tp 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import transformers

    from bench.machine import machine_info
    from fastpipe.builder.hf.build import build_hf
    from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint
    from fastpipe.generate import build_generation_set, greedy_generate
    from fastpipe.serving import ModelSet

    cfg = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                                   num_key_value_heads=4, intermediate_size=4 * args.hidden, vocab_size=8000,
                                   bos_token_id=1, eos_token_id=2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_checkpoint(cfg, Path(tmp) / "m", seed=0).eval()
        paths = build_generation_set(Path(tmp) / "m", Path(tmp) / "gen", batch=1, prompt_len=args.prompt,
                                     max_new_tokens=args.tokens, tp=args.tp)
        ids = torch.randint(3, 8000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
        with ModelSet(paths) as models:
            models.warmup()
            ours = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                toks = greedy_generate(models, ids, args.tokens)
                ours.append(time.perf_counter() - t)
        hf = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            ref = model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
            hf.append(time.perf_counter() - t)
        same = torch.equal(toks, ref[:, args.prompt:])
        t_hf, t_ours = statistics.median(hf), statistics.median(ours)
        rows.append(("HF generate (eager, one process)", f"{args.tokens / t_hf:.1f}", "1.00x", ""))
        rows.append((f"fastpipe greedy, tp={args.tp}, cpu reference processor", f"{args.tokens / t_ours:.1f}",
                     f"{t_hf / t_ours:.2f}x", "tokens identical" if same else "TOKENS DIFFER"))
        b3 = [build_hf(Path(tmp) / "m", tp=args.tp, batch=b, seq_len=args.prompt).save(Path(tmp) / f"b{b}") for b in (1, 2, 4)]
        with ModelSet(b3[:1]) as one, ModelSet(b3) as three:
            w1, w3 = one.weight_bytes(), three.weight_bytes()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine_info().items()))
    print(f"model: Llama-family, {args.layers} layers, hidden {args.hidden}, vocab 8000; prompt {args.prompt}, "
          f"{args.tokens} new tokens, batch 1")
    header = ("variant", "tokens/s", "vs HF", "")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    for r in [header, tuple("-" * w for w in widths)] + rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    print(f"memory: 3 buckets (batch 1, 2, 4) hold {w3 / 2**20:.2f} MiB of weights; one bucket {w1 / 2**20:.2f} MiB: "
          f"{w3 / w1:.2f}x (target <= 1.1x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
