"""Shared cases of the generation benchmarks (bench/report_generation.py, bench/test_bench_generation.py).

    root, model = make_model(tmp, layers=4, hidden=512)        # a random Llama-family checkpoint (dtype=: bf16)
    folder = make_set(root, tmp / "set", max_len=320, batches=(1, 8), tp=2)
    toks = hf_generate(model, prompt, n, compiled=True)        # transformers, static cache (compiled: torch.compile)
    prompts, news = load_requests(64, vocab)                    # the load test's requests

hf_generate runs on the model's device (model.to("cuda") first for a GPU run).
"""
from __future__ import annotations

import os
import time
import weakref
from pathlib import Path

import torch


def make_model(root: Path, *, layers: int = 4, hidden: int = 512, vocab: int = 8000, seed: int = 0,
               dtype: torch.dtype | None = None):
    """(folder, model): a random Llama-family checkpoint saved under root/model, and the model (CPU, eval).
    dtype (e.g. torch.bfloat16; default float32) goes into the config: save_random_checkpoint builds the
    model in the config's dtype and save_pretrained writes it to config.json, whence build_hf (and so
    build_serving_set) takes it when given no dtype (fastpipe.builder.hf.load.load_skeleton)."""
    import transformers

    from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint

    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=8,
                                   num_key_value_heads=4, intermediate_size=hidden * 11 // 4, vocab_size=vocab,
                                   bos_token_id=1, eos_token_id=2, max_position_embeddings=2048)
    if dtype is not None:
        cfg.dtype = dtype
    folder = root / "model"
    return folder, save_random_checkpoint(cfg, folder, seed=seed).eval()


def make_set(model_dir: Path, out: Path, *, max_len: int, batches=(1, 8), prompt_lens=(16, 64), tp: int = 2) -> Path:
    from fastpipe.serving.build import build_serving_set

    build_serving_set(model_dir, out, max_len=max_len, batches=batches, prompt_lens=prompt_lens, tp=tp)
    return out


_STATIC_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> {key: StaticCache}


def _static_cache(model, max_cache_len: int):
    """One StaticCache per (model, length, device, dtype), reset between calls (as transformers' own
    cache_implementation="static" does): its tensors keep their addresses, which transformers marks
    static, so a compiled forward under CUDA graphs (reduce-overhead) replays instead of re-recording
    on every generate() that a fresh cache would bring."""
    from transformers import StaticCache

    p = next(model.parameters())
    key = (max_cache_len, str(p.device), p.dtype)
    caches = _STATIC_CACHES.setdefault(model, {})
    cache = caches.get(key)
    if cache is None:
        cache = caches[key] = StaticCache(config=model.config, max_cache_len=max_cache_len)
    else:
        cache.reset()              # zeroes the keys, values and length in place
    return cache


def hf_generate(model, prompt: list[int], n: int, *, compiled: bool, max_cache_len: int | None = None,
                compile_mode: str | None = None) -> list[int]:
    """transformers' greedy generate with its static cache (of max_cache_len positions: the engine's
    max_len, so both attend over as many; default prompt + n), on the model's device; compiled: its
    forward under torch.compile (transformers compiles itself on GPUs; on a CPU only when asked, as
    here) in compile_mode (default: "reduce-overhead", transformers' own default, CUDA graphs, on a
    GPU; "default" on a CPU). Returns the new tokens (host ints: the call has synchronized)."""
    from transformers import CompileConfig

    from fastpipe.builder.hf.compat import cache_keyword

    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    kwargs = dict(disable_compile=not compiled)
    if max_cache_len is None:
        kwargs["cache_implementation"] = "static"
    else:
        kwargs[cache_keyword(model)] = _static_cache(model, max_cache_len)   # "cache" in transformers >= 5.2x
    if compiled:
        mode = compile_mode or ("reduce-overhead" if device.type == "cuda" else "default")
        cc = CompileConfig(fullgraph=True, dynamic=False, mode=mode)
        cc._compile_all_devices = True
        kwargs["compile_config"] = cc
    # No EOS: greedy argmax at every step, as the engine's ignore_eos=True (min_new_tokens alone would
    # mask the EOS logit, a different token whenever EOS is the argmax); min_new_tokens stays as a guard
    gc = model.generation_config
    saved = gc.eos_token_id
    gc.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, eos_token_id=None, **kwargs)
    finally:
        gc.eos_token_id = saved
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


def memory_per_token(engine, prompt, n: int, *, cuda: bool = False):
    """One request of n streamed tokens: (its tokens, RSS after each token, torch.cuda.memory_allocated()
    after each token (cuda; else None), seconds from submit to the last token)."""
    toks, rss, gpu = [], [], [] if cuda else None
    t0 = time.perf_counter()
    for tok in engine.submit(prompt, max_new_tokens=n, ignore_eos=True):
        toks.append(tok)
        rss.append(rss_bytes())
        if cuda:
            gpu.append(torch.cuda.memory_allocated())
    return toks, rss, gpu, time.perf_counter() - t0
