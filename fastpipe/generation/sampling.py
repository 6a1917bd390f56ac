"""Token selection for generation: one row per request, each with its own parameters and seeded generator.

A request's tokens depend only on its own logits, parameters and generator, never on which other requests
share its batch: greedy rows take one vectorised argmax, each sampled row is warped and drawn on its own.
Warping follows transformers' order and rules (temperature, then top-k, then top-p, min_tokens_to_keep=1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from fastpipe.errors import InputError, at

_NEG_INF = float("-inf")


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax of the raw logits); > 0: sample from softmax(logits / temperature)
    top_k: int = 0  # 0: off; else keep the k most likely tokens (and any tied with the k-th)
    top_p: float = 1.0  # nucleus: keep the smallest set of most likely tokens whose probability sums to >= top_p
    seed: int | None = None  # seeds this request's torch.Generator (None: a nondeterministic seed)

    def check(self, where: str = "sampling") -> None:
        """Raise InputError (one line, naming ``{where}.{field}``) for the first invalid field."""
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if not (_real(t) and math.isfinite(t) and t >= 0):
            raise at(f"{where}.temperature", "a finite number >= 0", repr(t), InputError)
        if not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
            raise at(f"{where}.top_k", "an int >= 0 (0: off)", repr(k), InputError)
        if not (_real(p) and 0 < p <= 1):  # nan fails the comparison
            raise at(f"{where}.top_p", "0 < top_p <= 1", repr(p), InputError)
        if s is not None and not (isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**64):
            raise at(f"{where}.seed", "None or an int in [0, 2**64)", repr(s), InputError)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """This request's generator on ``device`` (the logits' device); None when greedy."""
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scores to draw from: float32, filtered tokens -inf, same shape as ``logits`` ([V] or [R, V]).

    Greedy params keep only the argmax (lowest index on ties), so softmax(warp(...)) is always the
    distribution ``sample`` draws from. As transformers' generate, top_k=0 and top_p=1 apply no filter.
    Where tied tokens straddle the top-p cut, transformers' (unstable) sort picks which stay; here the
    lowest indices stay, on every device; how many stay, and their probabilities, are the same.
    """
    params.check()
    scores = logits.float()  # [..., V]
    if params.greedy:
        keep = torch.nn.functional.one_hot(scores.argmax(-1), scores.size(-1)).bool()  # [..., V]
        return scores.masked_fill(~keep, _NEG_INF)
    scores = scores / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.size(-1))
        kth = torch.topk(scores, k).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, _NEG_INF)
    if params.top_p < 1:
        # ascending, ties in falling index order: a tie across the cut keeps its lowest indices, as argmax
        ordered, order = torch.sort(scores.flip(-1), stable=True)  # [..., V]
        order = scores.size(-1) - 1 - order  # [..., V] indices into scores
        remove = ordered.softmax(-1).cumsum(-1) <= (1 - params.top_p)  # [..., V] in sorted order
        remove[..., -1:] = False  # min_tokens_to_keep=1: the most likely token stays
        scores = scores.masked_fill(remove.scatter(-1, order, remove), _NEG_INF)
    return scores


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """One token per row of ``logits`` [R, V] (any float dtype) -> LongTensor [R] on the logits' device.

    Row r uses ``params[r]`` and ``generators[r]`` (from ``params[r].generator(device)``; None only for greedy rows).
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise at("logits", "a float tensor [R, V]", f"{logits.dtype} {list(logits.shape)}", InputError)
    rows = logits.size(0)
    if len(params) != rows or len(generators) != rows:
        raise at("sample", f"{rows} params and generators (one per row)", f"{len(params)} and {len(generators)}", InputError)
    for r, p in enumerate(params):
        p.check(f"params[{r}]")
        if not p.greedy and generators[r] is None:
            raise at(f"generators[{r}]", "a torch.Generator for a sampled row", "None", InputError)
        if generators[r] is not None and generators[r].device.type != logits.device.type:
            raise at(f"generators[{r}]", f"a generator on the logits' device ({logits.device})",
                     f"one on {generators[r].device}", InputError)
    greedy = [r for r, p in enumerate(params) if p.greedy]
    if len(greedy) == rows:
        return logits.argmax(-1)  # [R]; argmax is exact in any float dtype
    out = torch.empty(rows, dtype=torch.long, device=logits.device)  # [R]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)  # [G]
        out[idx] = logits[idx].argmax(-1)  # [G]
    for r, p in enumerate(params):
        if not p.greedy:
            probs = warp(logits[r], p).softmax(-1)  # [V]
            out[r] = torch.multinomial(probs, 1, generator=generators[r])[0]
    return out
