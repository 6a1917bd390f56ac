"""Greedy generation with fastpipe pipelines built from a local Hugging Face checkpoint.

    python examples/generate.py build path/to/hf_model out/ --batch 1 --prompt-len 8 --max-new-tokens 32 --tp 2
    python examples/generate.py run out/ --prompt 5,7,9,11,2,3,4,8

`build` writes one prefill pipeline and one decode pipeline per step (their KV-cache lengths
are static); `run` loads them into one ModelSet (weights shared) and decodes greedily.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from fastpipe.generate import build_generation_set, greedy_generate
from fastpipe.serving import ModelSet


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("model")
    b.add_argument("out")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--prompt-len", type=int, default=8)
    b.add_argument("--max-new-tokens", type=int, default=32)
    b.add_argument("--tp", type=int, default=1)
    b.add_argument("--pp", type=int, default=1)
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("--prompt", required=True, help="comma-separated token ids (one sequence; repeated over the batch)")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        paths = build_generation_set(args.model, args.out, batch=args.batch, prompt_len=args.prompt_len,
                                     max_new_tokens=args.max_new_tokens, tp=args.tp, pp=args.pp)
        print(f"wrote {len(paths)} pipelines under {args.out}")
        return 0
    paths = sorted(Path(args.out).glob("*/pipeline.json"))
    models = ModelSet(paths)
    models.warmup()
    prompt = torch.tensor([[int(x) for x in args.prompt.split(",")]])
    n = sum(1 for p in paths if p.parent.name.startswith("decode")) + 1
    t = time.perf_counter()
    tokens = greedy_generate(models, prompt, n)
    dt = time.perf_counter() - t
    print(" ".join(str(int(x)) for x in tokens[0]))
    print(f"{n} tokens in {dt:.3f} s ({n / dt:.1f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
