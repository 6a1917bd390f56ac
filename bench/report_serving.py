"""Serving benchmark, one run, printed as tables (ratios against baselines measured in the same run):

1. decode tokens/s at batch 1: the engine (serving set, tp=2 on one device, region processor) vs
   transformers' generate with its static cache, eager and under torch.compile; tokens compared;
2. continuous batching: 64 requests of random prompt lengths from 8 threads through a batch-8 engine
   vs the same requests one at a time through a batch-1 engine; every request's tokens compared;
3. memory: RSS after each token of one 256-token generation (flat after the first steps?);
4. 3 exact-size buckets (ModelSet) hold the weights of one.

    python bench/report_serving.py [--layers 4] [--hidden 512] [--tokens 128] [--requests 64] [--quick]
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


def table(rows, header) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths)] + rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens of the batch-1 decode rows")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rss-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a small model and few tokens (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.hidden, args.vocab, args.tokens, args.requests, args.rss_tokens, args.repeat = 2, 64, 100, 16, 16, 32, 1

    from bench.generation_cases import (hf_generate, load_requests, make_model, make_set, one_at_a_time,
                                        rss_per_token, serve)
    from bench.machine import machine_info
    from fastpipe.builder.hf.build import build_hf
    from fastpipe.generation.engine import Engine
    from fastpipe.serving import ModelSet

    torch.manual_seed(0)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine_info().items()))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        mdir, model = make_model(tmp, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
        max_len = max(args.prompt + args.tokens, 64 + 64, 16 + args.rss_tokens)
        t = time.perf_counter()
        folder = make_set(mdir, tmp / "set", max_len=max_len, batches=(1, 8), prompt_lens=(16, 64), tp=args.tp)
        build_s = time.perf_counter() - t
        print(f"model: Llama-family, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; serving set "
              f"tp={args.tp}, max_len {max_len}, batches 1 and 8, prompt buckets 16 and 64 (6 pipelines, built in "
              f"{build_s:.1f} s)")
        prompt = torch.randint(3, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
        n = args.tokens

        # 1. batch-1 decode tokens/s
        rows = []
        hf_generate(model, prompt, n, compiled=True, max_cache_len=max_len)     # compile outside the timing
        t_eager, ref = timed(lambda: hf_generate(model, prompt, n, compiled=False, max_cache_len=max_len), args.repeat)
        t_comp, ref_c = timed(lambda: hf_generate(model, prompt, n, compiled=True, max_cache_len=max_len), args.repeat)
        with Engine(folder, batch=1, eos_token_id=None) as eng:
            warm = eng.warmup_seconds
            t_ours, ours = timed(lambda: eng.generate([prompt], max_new_tokens=n, ignore_eos=True)[0], args.repeat)
            how = eng.decode.describe()
        one = make_set(mdir, tmp / "set_tp1", max_len=max_len, batches=(1,), prompt_lens=(16,), tp=1)
        with Engine(one, batch=1, eos_token_id=None) as eng:
            t_one, ours_one = timed(lambda: eng.generate([prompt], max_new_tokens=n, ignore_eos=True)[0], args.repeat)
        with Engine(folder, batch=1, eos_token_id=None, compile=False) as eng:
            t_ours_e, ours_e = timed(lambda: eng.generate([prompt], max_new_tokens=n, ignore_eos=True)[0], args.repeat)
        same = lambda toks: "identical" if toks == ref else "DIFFER"  # noqa: E731
        rows.append(("transformers generate, static cache, eager", f"{n / t_eager:.1f}", f"{t_comp / t_eager:.2f}x", "reference"))
        rows.append(("transformers generate, static cache, torch.compile", f"{n / t_comp:.1f}", "1.00x", same(ref_c)))
        rows.append((f"fastpipe engine, batch 1, tp={args.tp} set, region compiled", f"{n / t_ours:.1f}",
                     f"{t_comp / t_ours:.2f}x", same(ours)))
        rows.append((f"fastpipe engine, batch 1, tp={args.tp} set, region eager", f"{n / t_ours_e:.1f}",
                     f"{t_comp / t_ours_e:.2f}x", same(ours_e)))
        rows.append(("fastpipe engine, batch 1, tp=1 set, region compiled", f"{n / t_one:.1f}", f"{t_comp / t_one:.2f}x",
                     same(ours_one)))
        print(f"\n1. greedy decode, batch 1, prompt {args.prompt}, {n} new tokens, static caches of {max_len} positions "
              f"on both sides (median of {args.repeat}; "
              f"engine warm-up compile {warm:.1f} s, not timed; decode: {how})")
        table(rows, ("variant", "tokens/s", "vs compiled HF", "tokens"))

        # 2. continuous batching
        prompts, news = load_requests(args.requests, args.vocab, prompt=(8, 64), new=(16, 64))
        with Engine(folder, batch=8, eos_token_id=None) as eng:
            batched, t_b = serve(eng, prompts, news)
            steps = eng.steps
        with Engine(folder, batch=1, eos_token_id=None) as eng:
            solo, t_s = one_at_a_time(eng, prompts, news)
        total = sum(news)
        ok = sum(a == b for a, b in zip(batched, solo))
        print(f"\n2. {args.requests} requests (prompts 8-64 tokens, 16-64 new tokens each, {total} tokens), "
              f"greedy; batched from 8 threads: {steps} decode steps")
        table([("one at a time, batch-1 engine", f"{total / t_s:.1f}", "1.00x", ""),
               ("continuous batching, batch-8 engine, 8 threads", f"{total / t_b:.1f}", f"{t_s / t_b:.2f}x",
                f"{ok}/{len(prompts)} equal their solo run")], ("variant", "tokens/s", "speed-up", "tokens"))

        # 3. RSS over a long generation
        with Engine(folder, batch=1, eos_token_id=None) as eng:
            rss = rss_per_token(eng, prompt[:16], args.rss_tokens)
        base = rss[min(15, len(rss) - 1)]
        growth = (max(rss[16:] or rss) - base) / base
        print(f"\n3. RSS over one {args.rss_tokens}-token generation (batch 1): {base / 2**20:.1f} MiB after token 16, "
              f"max {max(rss) / 2**20:.1f} MiB, last {rss[-1] / 2**20:.1f} MiB: {growth * 100:+.2f}% after the first "
              "16 tokens (target within 5%)")

        # 4. exact-size buckets share weights
        b3 = [build_hf(mdir, tp=args.tp, batch=b, seq_len=args.prompt).save(tmp / f"b{b}") for b in (1, 2, 4)]
        with ModelSet(b3[:1]) as one, ModelSet(b3) as three:
            w1, w3 = one.weight_bytes(), three.weight_bytes()
        print(f"\n4. 3 exact-size buckets (batch 1, 2, 4) hold {w3 / 2**20:.2f} MiB of weights, one bucket "
              f"{w1 / 2**20:.2f} MiB: {w3 / w1:.2f}x (target <= 1.1x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
