"""Token selection for generation: one row per request, each with its own parameters and seeded generator.

A request's tokens depend only on its own logits, parameters and generator, never on which other requests
share its batch: greedy rows take one vectorised argmax, each sampled row is warped and drawn on its own.
Warping follows transformers' order and rules (temperature, then top-k, then top-p, min_tokens_to_keep=1),
on scores shifted so that each row's largest is 0 (the distribution is the same): no temperature can
overflow them. A temperature is 0 (greedy) or at least MIN_TEMPERATURE; below it every draw would be the
argmax anyway, so the request is refused rather than silently made greedy.

A sampled token is drawn as torch.multinomial draws one: argmax(probs / E), E ~ Exp(1) from the row's
generator (the same tokens for the same generator state), without multinomial's host synchronisations.
`sample_rows` fails rows alone: a row whose logits hold nan or +inf, or whose draw raises, gets an
error of its own and the other rows their tokens (the engine fails that request alone).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from fastpipe.errors import InputError, RunError, at, described

_NEG_INF = float("-inf")
MIN_TEMPERATURE = 1e-5  # smallest temperature > 0 accepted (0 is greedy)


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax of the raw logits); >= MIN_TEMPERATURE: softmax(logits / temperature)
    top_k: int = 0  # 0: off; else keep the k most likely tokens (and any tied with the k-th)
    top_p: float = 1.0  # nucleus: keep the smallest set of most likely tokens whose probability sums to >= top_p
    seed: int | None = None  # seeds this request's torch.Generator (None: a nondeterministic seed)

    def check(self, where: str = "sampling") -> None:
        """Raise InputError (one line, naming ``{where}.{field}``) for the first invalid field."""
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if not (_real(t) and math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)):
            raise at(f"{where}.temperature", f"0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}", repr(t), InputError)
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
    """Scores to draw from: float32, filtered tokens -inf, same shape as ``logits`` ([V] or [R, V]), shifted
    so that each row's largest score is 0 (transformers' warped scores minus their row's max).

    Greedy params keep only the argmax (lowest index on ties), so softmax(warp(...)) is always the
    distribution ``sample`` draws from. As transformers' generate, top_k=0 and top_p=1 apply no filter.
    Where tied tokens straddle the top-p cut, transformers' (unstable) sort picks which stay; here the
    lowest indices stay, on every device; how many stay, and their probabilities, are the same.
    """
    params.check()
    scores = logits.float()  # [..., V]
    scores = scores - scores.amax(-1, keepdim=True)  # [..., V] <= 0, the max 0: no temperature overflows it
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


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index drawn from ``probs`` [V] (finite, >= 0, not all 0): argmax(probs / E), E ~ Exp(1), as
    torch.multinomial(probs, 1, generator=generator) draws it, without its checks' host synchronisations."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)  # [V]
    return (probs / q).argmax()


def _check_call(logits: torch.Tensor, params: Sequence[SamplingParams], generators) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise at("logits", "a float tensor [R, V]", f"{logits.dtype} {list(logits.shape)}", InputError)
    rows = logits.size(0)
    if len(params) != rows or len(generators) != rows:
        raise at("sample", f"{rows} params and generators (one per row)", f"{len(params)} and {len(generators)}", InputError)


def _check_row(r: int, p: SamplingParams, gen, device: torch.device) -> None:
    p.check(f"params[{r}]")
    if not p.greedy and gen is None:
        raise at(f"generators[{r}]", "a torch.Generator for a sampled row", "None", InputError)
    if gen is not None and gen.device.type != device.type:
        raise at(f"generators[{r}]", f"a generator on the logits' device ({device})", f"one on {gen.device}", InputError)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """One token per row of ``logits`` [R, V] (any float dtype) -> LongTensor [R] on the logits' device.

    Row r uses ``params[r]`` and ``generators[r]`` (from ``params[r].generator(device)``; None only for greedy
    rows). Bad parameters raise InputError naming the row; see sample_rows for failing rows alone.
    """
    _check_call(logits, params, generators)
    for r, p in enumerate(params):
        _check_row(r, p, generators[r], logits.device)
    out = logits.argmax(-1)  # [R]; argmax is exact in any float dtype; sampled rows are drawn below
    for r, p in enumerate(params):
        if not p.greedy:
            out[r] = draw(warp(logits[r], p).softmax(-1), generators[r])
    return out


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> tuple[list[int | None], dict[int, Exception]]:
    """sample(), failing rows alone: (each row's token, None for a failed row; {row: its one-line error}).
    A row fails when its parameters or generator are bad, its draw raises, or its logits hold nan or +inf,
    or are all -inf (a greedy row too: its argmax would mean nothing). One device-to-host transfer."""
    _check_call(logits, params, generators)
    out = logits.argmax(-1)  # [R]; argmax takes nan as the largest, so:
    top = logits.gather(-1, out[:, None])[:, 0]  # [R] each row's largest logit, nan if it holds one
    errors: dict[int, Exception] = {}
    for r, p in enumerate(params):
        try:
            _check_row(r, p, generators[r], logits.device)
            if not p.greedy:
                out[r] = draw(warp(logits[r], p).softmax(-1), generators[r])
        except Exception as e:  # noqa: BLE001 - this row fails, the others are drawn
            errors[r] = e if isinstance(e, InputError) else RunError(f"sampling: {described(e)}")
    broken = ~top.isfinite()  # [R] nan or +inf somewhere in the row (or every logit -inf: nothing to draw)
    tokens, broken = torch.stack([out, broken.long()]).tolist()  # the one transfer
    for r, b in enumerate(broken):
        if b and r not in errors:
            errors[r] = RunError("sampling: expected finite logits, found nan or +inf in this request's row")
    return [None if r in errors else t for r, t in enumerate(tokens)], errors
