"""The unsplit Hugging Face model's step, two ways, for the decode-step table (bench/report_runtime.py).

    logits = hf_call(model, ids, past)        # a DynamicCache of the past, built in the call
    logits = hf_call(model, ids, past, last_only=True)   # the last position's logits only [batch, 1, vocab]
    step = StaticStep(model, ids, past)       # a StaticCache of exactly past + seq positions, filled once
    logits = step(model)                      # (or step(torch.compile(model, ...)))

ids: [batch, seq] token ids; past: per layer [key, value], each [batch, kv_heads, past_len, head_dim]
(empty for a prefill); logits: [batch, seq, vocab].

hf_call is what a caller holding the past as tensors does (and what a fastpipe decode pipeline is
given): the cache is built, and the past copied into it by torch.cat, in every call. StaticStep is
how a server runs the unsplit model fast (transformers' cache_implementation="static"): the cache is
allocated and filled once, each step writes its seq new positions in place, and its tensors keep
their addresses, so torch.compile(mode="reduce-overhead") replays one CUDA graph. To time the same
step again and again, each call first rewinds the cache's length to the past (transformers >= 5
keeps it in a tensor per layer: one in-place fill per layer, in the timed call, a few microseconds;
older versions take the positions from cache_position alone and need nothing).
"""
from __future__ import annotations

import inspect

import torch

from fastpipe.builder.hf.compat import cache_keyword


def hf_call(model, ids, past, last_only: bool = False):
    """last_only: the logits of the last position only, [batch, 1, vocab] (logits_to_keep=1: the output
    projection runs on that position alone, as a server's prefill does)."""
    import transformers

    cache = transformers.DynamicCache()
    for i, (k, v) in enumerate(past or []):
        cache.update(k, v, i)
    keep = {"logits_to_keep": 1} if last_only else {}
    return model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache}, **keep).logits


def static_cache(model, batch: int, max_cache_len: int, device: torch.device, dtype: torch.dtype):
    """An empty transformers StaticCache of max_cache_len positions (the constructor of transformers >= 4.56
    sizes itself at the first update; older ones are told the batch, device and dtype)."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    if "max_batch_size" in params:
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_cache_len,
                           device=device, dtype=dtype)
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


class StaticStep:
    """One step of the unsplit model (seq tokens after past_len cached ones) on a StaticCache of exactly
    past_len + seq positions, so that attention spans as many positions as the pipeline's."""

    def __init__(self, model, ids: torch.Tensor, past):
        p, cfg = next(model.parameters()), model.config
        batch, seq = ids.shape
        if not past:         # a prefill: a past of no positions sizes the cache here, not in a compiled call
            hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            empty = torch.empty(batch, cfg.num_key_value_heads, 0, hd, dtype=p.dtype, device=ids.device)
            past = [[empty, empty] for _ in range(cfg.num_hidden_layers)]
        self.ids, self.past_len, self.keyword = ids, past[0][0].shape[2], cache_keyword(model)
        self.cache = static_cache(model, batch, self.past_len + seq, ids.device, p.dtype)
        fill = {"cache_position": torch.arange(self.past_len, device=ids.device)}
        for i, (k, v) in enumerate(past):
            self.cache.update(k, v, i, fill)
        # [seq]: where this step's tokens go (and their rotary positions)
        self.positions = torch.arange(self.past_len, self.past_len + seq, device=ids.device)
        self.lengths = [t for layer in getattr(self.cache, "layers", ())
                        if isinstance(t := getattr(layer, "cumulative_length", None), torch.Tensor)]

    def rewind(self) -> None:
        """The cache's length back to the past (its contents past it are overwritten by the step)."""
        for t in self.lengths:
            t.fill_(self.past_len)

    def __call__(self, model) -> torch.Tensor:
        self.rewind()
        return model(input_ids=self.ids, cache_position=self.positions, use_cache=True,
                     **{self.keyword: self.cache}).logits
