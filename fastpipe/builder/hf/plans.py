"""Tensor-parallel plans, as data (SPEC section 5).

A plan maps every parameter name of the unsplit model -- tied aliases
included, i.e. ``named_parameters(remove_duplicate=False)`` -- to a ``Rule``
(first regex that ``fullmatch``es wins), and names the attention modules
whose attributes a rank-local copy must change. The rules and attributes are
the family's (``FamilySpec.tp_rules`` / ``tp_attrs`` in
fastpipe.builder.hf.families: each family module states its own, with the
module attributes it changes and why); ``tp_plan`` sizes them from a config.

Rule kinds (``dim`` always counts dimensions of the *stored* tensor):
  column          output features sharded along ``dim``; no comm; the output is
                  sharded on its last dim. Shard boundaries are multiples of
                  ``unit`` (head_dim for per-head projections).
                  nn.Linear weight [out, in] -> dim 0; GPT-2 Conv1D weight
                  [in, out] -> dim 1; biases -> dim 0.
  column_packed   ``parts`` (sizes along ``dim``) packed in one tensor (GPT-2
                  c_attn = q|k|v, each hidden_size wide); every part is sharded
                  like ``column`` and the rank-local tensor is the
                  concatenation of the rank's share of each part, in order.
  kv_column       a GQA key/value projection: KV heads sharded along ``dim``
                  when tp <= n_kv; when tp > n_kv every rank holds the one KV
                  head its query heads use (``kv_heads_for_rank``), replicated
                  over tp / n_kv ranks, as serving systems do.
  row             input features sharded along ``dim`` (nn.Linear weight
                  [out, in] -> dim 1; Conv1D [in, out] -> dim 0); the partial
                  outputs are all-reduced (sum).
  row_bias        the bias of a row layer: whole, added once (rank 0 keeps
                  it, the others use zeros or no bias) -- after or before the
                  all-reduce, not on every rank.
  vocab_embedding rows (vocab) sharded in contiguous blocks of ceil(V/tp)
                  (``vocab_range``); ids outside a rank's block map to an extra
                  zero row; outputs all-reduced (sum). Works for any V.
  lm_head         vocab rows sharded like vocab_embedding; logits
                  all-gathered along the last dim. If V % tp != 0 the whole
                  head is kept on every rank (no comm), per SPEC.
  replicate       whole on every rank (norms, position embeddings, poolers,
                  rotary buffers).

Module attributes (``AttrUpdate``) on a rank-local copy: a value is a formula
in the rank's query heads ``q_local``, KV heads ``kv_local``, ``head_dim``,
``tp`` and the MLP width ``inner`` (``attribute_updates`` computes them);
``required`` says whether the forward reads it (False: set for consistency).
nn.Linear in_features/out_features and nn.Embedding num_embeddings are not
read by forward; nn.Embedding.padding_idx is a *global* id -- set it to None
on a vocab shard (it only affects gradients).
A tied embedding / LM head (GPT-2 always, Llama when tie_word_embeddings) must
be untied on each rank: the two names get different shards of one stored tensor.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from fastpipe.builder.hf.families import FamilySpec, get_family
from fastpipe.builder.markers import vocab_range  # the one formula, shared with the vocab_offset marker
from fastpipe.builder.hf.tp_rules import KINDS, REPLICATE, AttrUpdate, Rule
from fastpipe.errors import BuildError

__all__ = [
    "KINDS", "REPLICATE", "AttrUpdate", "Placements", "Rule", "TPPlan", "attribute_updates", "check_plan", "check_tp",
    "kv_head_for_rank", "kv_heads_for_rank", "lm_head_sharded", "local_heads", "q_heads_for_rank", "shard_pieces",
    "tp_plan", "vocab_range",
]

Placements = list[tuple[int, int]]


@dataclass(frozen=True)
class TPPlan:
    family: str
    rules: tuple[tuple[str, Rule], ...]
    attrs: tuple[AttrUpdate, ...]
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    inner_size: int                        # MLP width (n_inner / intermediate_size)
    notes: tuple[str, ...] = field(default=())

    def rule_for(self, name: str) -> Rule:
        for pattern, rule in self.rules:
            if re.fullmatch(pattern, name):
                return rule
        raise BuildError(f"tp plan ({self.family}): expected a rule for parameter {name!r}, found none")


def tp_plan(family: str | FamilySpec, config) -> TPPlan:
    """The tensor-parallel plan of ``family`` (a registered name or a spec) with sizes taken from ``config``."""
    spec = get_family(family)
    nq, nkv, hd = spec.dims(config)
    V, H = config.vocab_size, config.hidden_size
    inner = getattr(config, "n_inner", None) or getattr(config, "intermediate_size", None) or 4 * H
    return TPPlan(spec.name, tuple(spec.tp_rules(config)), tuple(spec.tp_attrs), nq, nkv, hd, V, inner,
                  tuple(spec.notes))


# ---- head and vocab arithmetic -------------------------------------------------------------

def check_tp(n_q_heads: int, n_kv_heads: int, tp: int) -> None:
    """Refuse a tp degree the head counts cannot be split by."""
    if tp < 1:
        raise BuildError(f"tp: expected >= 1, found {tp}")
    if n_q_heads % tp:
        raise BuildError(f"tp: expected a divisor of num_attention_heads={n_q_heads}, found {tp}")
    if tp <= n_kv_heads and n_kv_heads % tp:
        raise BuildError(f"tp: expected a divisor of num_key_value_heads={n_kv_heads} (tp <= kv heads), found {tp}")
    if tp > n_kv_heads and tp % n_kv_heads:
        raise BuildError(f"tp: expected a multiple of num_key_value_heads={n_kv_heads} (tp > kv heads), found {tp}")


def local_heads(n_q_heads: int, n_kv_heads: int, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) on each rank; KV heads are replicated (1 per rank) when tp > n_kv."""
    check_tp(n_q_heads, n_kv_heads, tp)
    return n_q_heads // tp, max(1, n_kv_heads // tp)


def q_heads_for_rank(rank: int, tp: int, n_q_heads: int) -> range:
    per = n_q_heads // tp
    return range(rank * per, (rank + 1) * per)


def kv_heads_for_rank(rank: int, tp: int, n_q_heads: int, n_kv_heads: int) -> range:
    """The KV heads rank ``rank`` holds: a block of n_kv/tp, or the single head its query heads use."""
    check_tp(n_q_heads, n_kv_heads, tp)
    if not 0 <= rank < tp:
        raise BuildError(f"rank: expected 0 <= rank < {tp}, found {rank}")
    if tp <= n_kv_heads:
        per = n_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank * n_kv_heads // tp   # = first local q head // (n_q / n_kv)
    return range(head, head + 1)


def kv_head_for_rank(rank: int, tp: int, n_q_heads: int, n_kv_heads: int) -> int:
    """The one KV head of ``rank`` when tp >= n_kv (each rank holds exactly one)."""
    heads = kv_heads_for_rank(rank, tp, n_q_heads, n_kv_heads)
    if len(heads) != 1:
        raise BuildError(f"tp: expected >= num_key_value_heads={n_kv_heads} for one KV head per rank, found {tp}")
    return heads.start


def lm_head_sharded(vocab: int, tp: int) -> bool:
    """Whether the LM head is sharded (V divisible by tp) or kept whole on every rank."""
    return tp > 1 and vocab % tp == 0


def attribute_updates(plan: TPPlan, tp: int) -> list[tuple[str, dict[str, int]]]:
    """(module regex, {attr: value}) to set on the matching modules of a rank-local copy, in plan order."""
    q, kv = local_heads(plan.n_q_heads, plan.n_kv_heads, tp)
    values = {
        "q_local * head_dim": q * plan.head_dim,
        "q_local": q,
        "3 * q_local * head_dim": 3 * q * plan.head_dim,
        "inner // tp": plan.inner_size // tp,
        "q_local // kv_local": q // kv,
    }
    out: dict[str, dict[str, int]] = {}
    for u in plan.attrs:
        if u.value not in values:
            raise AssertionError(f"AttrUpdate.value: unknown formula {u.value!r}")
        out.setdefault(u.module, {})[u.attr] = values[u.value]
    return list(out.items())


# ---- which part of a stored tensor a rank holds -----------------------------------------------

def _even(size: int, tp: int, rank: int, unit: int, what: str) -> tuple[int, int]:
    if size % (tp * unit):
        raise BuildError(f"{what}: expected a size divisible by tp*unit={tp}*{unit}, found {size}")
    per = size // tp
    return rank * per, (rank + 1) * per


def shard_pieces(plan: TPPlan, name: str, shape: tuple[int, ...], rank: int, tp: int) -> list[Placements]:
    """The placements (one [start, end) per stored dim) rank ``rank`` needs for parameter ``name``.

    One piece for every kind but column_packed, whose pieces (one per part,
    in order) are concatenated along ``rule.dim``. ``row_bias`` gives the
    whole bias on every rank: adding it once is the caller's job (rank 0).
    ``vocab_embedding`` gives the rank's rows (possibly fewer than
    ceil(V/tp), possibly none); the caller appends the zero row.
    """
    rule = plan.rule_for(name)
    full = [(0, s) for s in shape]

    def at(dim: int, start: int, end: int) -> Placements:
        p = list(full)
        p[dim] = (start, end)
        return p

    k = rule.kind
    if tp == 1 or k in ("replicate", "row_bias"):
        return [full]
    if k == "column" or k == "row":
        return [at(rule.dim, *_even(shape[rule.dim], tp, rank, rule.unit, name))]
    if k == "column_packed":
        if sum(rule.parts) != shape[rule.dim]:
            raise BuildError(f"{name}: expected packed parts {list(rule.parts)} to cover dim {rule.dim} "
                               f"of size {shape[rule.dim]}, found sum {sum(rule.parts)}")
        pieces, offset = [], 0
        for size in rule.parts:
            s, e = _even(size, tp, rank, rule.unit, name)
            pieces.append(at(rule.dim, offset + s, offset + e))
            offset += size
        return pieces
    if k == "kv_column":
        heads = kv_heads_for_rank(rank, tp, plan.n_q_heads, plan.n_kv_heads)
        return [at(rule.dim, heads.start * plan.head_dim, heads.stop * plan.head_dim)]
    if k == "vocab_embedding":
        return [at(rule.dim, *vocab_range(rank, tp, shape[rule.dim]))]
    if k == "lm_head":
        if not lm_head_sharded(shape[rule.dim], tp):
            return [full]
        return [at(rule.dim, *vocab_range(rank, tp, shape[rule.dim]))]
    raise AssertionError(k)


def check_plan(plan: TPPlan, model, tp: int) -> None:
    """Every parameter name (tied aliases too) has a rule, and every shard splits evenly for ``tp``."""
    check_tp(plan.n_q_heads, plan.n_kv_heads, tp)
    for name, p in model.named_parameters(remove_duplicate=False):
        for rank in range(tp):
            shard_pieces(plan, name, tuple(p.shape), rank, tp)
