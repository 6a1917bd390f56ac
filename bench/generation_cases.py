"""Shared cases of the generation benchmarks (bench/report_generation.py, bench/test_bench_generation.py).

    root, model = make_model(tmp, layers=4, hidden=512)        # a random Llama-family checkpoint
    folder = make_set(root, tmp / "set", max_len=320, batches=(1, 8), tp=2)
    toks = hf_generate(model, prompt, n, compiled=True)        # transformers, static cache (compiled: torch.compile)
    prompts, news = load_requests(64, vocab)                    # the load test's requests
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch


def make_model(root: Path, *, layers: int = 4, hidden: int = 512, vocab: int = 8000, seed: int = 0):
    import transformers

    from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint

    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=8,
                                   num_key_value_heads=4, intermediate_size=hidden * 11 // 4, vocab_size=vocab,
                                   bos_token_id=1, eos_token_id=2, max_position_embeddings=2048)
    folder = root / "model"
    return folder, save_random_checkpoint(cfg, folder, seed=seed).eval()


def make_set(model_dir: Path, out: Path, *, max_len: int, batches=(1, 8), prompt_lens=(16, 64), tp: int = 2) -> Path:
    from fastpipe.generation.build import build_serving_set

    build_serving_set(model_dir, out, max_len=max_len, batches=batches, prompt_lens=prompt_lens, tp=tp)
    return out


def hf_generate(model, prompt: list[int], n: int, *, compiled: bool, max_cache_len: int | None = None) -> list[int]:
    """transformers' greedy generate with its static cache (of max_cache_len positions: the engine's
    max_len, so both attend over as many; default prompt + n); compiled: its forward under
    torch.compile (transformers compiles itself on GPUs; on a CPU only when asked, as here)."""
    from transformers import CompileConfig, StaticCache

    ids = torch.tensor([prompt])
    kwargs = dict(disable_compile=not compiled)
    if max_cache_len is None:
        kwargs["cache_implementation"] = "static"
    else:
        kwargs["past_key_values"] = StaticCache(config=model.config, max_cache_len=max_cache_len)
    if compiled:
        cc = CompileConfig(fullgraph=True, dynamic=False, mode="default")
        cc._compile_all_devices = True
        kwargs["compile_config"] = cc
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def load_requests(n: int, vocab: int, *, seed: int = 0, prompt=(8, 64), new=(16, 64)):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g).tolist()
    news = torch.randint(new[0], new[1] + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens], news


def serve(engine, prompts, news, threads: int = 8) -> tuple[list[list[int]], float]:
    """Every request submitted from `threads` threads at once; (tokens per request, seconds)."""
    import threading

    out: list = [None] * len(prompts)

    def worker(t):
        for i in range(t, len(prompts), threads):
            out[i] = engine.submit(prompts[i], max_new_tokens=news[i], ignore_eos=True).result()

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out, time.perf_counter() - t0


def one_at_a_time(engine, prompts, news) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    out = [engine.submit(p, max_new_tokens=n, ignore_eos=True).result() for p, n in zip(prompts, news)]
    return out, time.perf_counter() - t0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_per_token(engine, prompt, n: int) -> list[int]:
    """RSS after each of n streamed tokens of one request."""
    out = []
    for _ in engine.submit(prompt, max_new_tokens=n, ignore_eos=True):
        out.append(rss_bytes())
    return out
