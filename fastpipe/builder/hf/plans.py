"""Tensor-parallel plans for the three families, as data (SPEC section 5).

A plan maps every parameter name of the unsplit model -- tied aliases
included, i.e. ``named_parameters(remove_duplicate=False)`` -- to a ``Rule``
(first regex that ``fullmatch``es wins), and names the attention modules
whose attributes a rank-local copy must change.

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

Module attributes on a rank-local copy (read from the transformers 5.23
sources; projections reshape with ``view(..., -1, head_dim)`` and
``reshape(*input_shape, -1)``, so head counts follow the weight shapes except
where listed as REQUIRED; ``attribute_updates`` computes the values):
  gpt2  GPT2Attention ``transformer.h.N.attn``:
          split_size = q_local * head_dim   REQUIRED (c_attn(x).split(split_size, dim=2))
          num_heads  = q_local              not read in forward; set for consistency
        Conv1D ``...attn.c_attn`` / ``...mlp.c_fc`` (column-sharded):
          nf = local output features        REQUIRED (Conv1D.forward views to (..., nf))
        (embed_dim stays hidden_size; head_dim, scaling and Conv1D.nx of row
        layers are not affected / not read)
  llama LlamaAttention ``model.layers.N.self_attn``:
          num_key_value_groups = q_local // kv_local   REQUIRED (repeat_kv in eager and sdpa)
          (head_dim and scaling unchanged; do not edit the shared config's
          num_attention_heads / num_key_value_heads: forward never reads them)
  bert  BertSelfAttention ``encoder.layer.N.attention.self``:
          num_attention_heads = q_local, all_head_size = q_local * head_size
          neither is read in forward (nothing REQUIRED); set for consistency.
  nn.Linear in_features/out_features and nn.Embedding num_embeddings are not
  read by forward; nn.Embedding.padding_idx is a *global* id -- set it to None
  on a vocab shard (it only affects gradients).
A tied embedding / LM head (GPT-2 always, Llama when tie_word_embeddings) must
be untied on each rank: the two names get different shards of one stored tensor.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from fastpipe.errors import BuildError

KINDS = ("column", "column_packed", "kv_column", "row", "row_bias", "vocab_embedding", "lm_head", "replicate")

Placements = list[tuple[int, int]]


@dataclass(frozen=True)
class Rule:
    kind: str
    dim: int | None = None
    parts: tuple[int, ...] | None = None   # column_packed: sizes of the packed parts along dim
    unit: int = 1                          # shard boundaries are multiples of this (per part)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise BuildError(f"Rule.kind: expected one of {KINDS}, found {self.kind!r}")


@dataclass(frozen=True)
class AttrUpdate:
    module: str        # regex over module names (fullmatch)
    attr: str
    value: str         # formula in q_local, kv_local, head_dim, tp and config fields (see attribute_updates)
    required: bool     # False: forward does not read it (set for consistency only)


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


REPLICATE = Rule("replicate")


def _dims(family: str, config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    if family == "llama":
        kv = config.num_key_value_heads or heads
        hd = getattr(config, "head_dim", None) or config.hidden_size // heads
        return heads, kv, hd
    return heads, heads, config.hidden_size // heads


def tp_plan(family: str, config) -> TPPlan:
    """The tensor-parallel plan of ``family`` with sizes taken from ``config``."""
    nq, nkv, hd = _dims(family, config)
    V, H = config.vocab_size, config.hidden_size
    if family == "gpt2":
        rules = (
            (r"transformer\.wte\.weight", Rule("vocab_embedding", 0)),
            (r"lm_head\.weight", Rule("lm_head", 0)),                 # tied to wte: untie per rank
            (r"transformer\.wpe\.weight", REPLICATE),
            (r"transformer\.h\.\d+\.attn\.c_attn\.weight", Rule("column_packed", 1, (H, H, H), hd)),
            (r"transformer\.h\.\d+\.attn\.c_attn\.bias", Rule("column_packed", 0, (H, H, H), hd)),
            (r"transformer\.h\.\d+\.attn\.c_proj\.weight", Rule("row", 0, unit=hd)),
            (r"transformer\.h\.\d+\.attn\.c_proj\.bias", Rule("row_bias")),
            (r"transformer\.h\.\d+\.mlp\.c_fc\.weight", Rule("column", 1)),
            (r"transformer\.h\.\d+\.mlp\.c_fc\.bias", Rule("column", 0)),
            (r"transformer\.h\.\d+\.mlp\.c_proj\.weight", Rule("row", 0)),
            (r"transformer\.h\.\d+\.mlp\.c_proj\.bias", Rule("row_bias")),
            (r"transformer\.(h\.\d+\.ln_[12]|ln_f)\.(weight|bias)", REPLICATE),
        )
        attn = (
            AttrUpdate(r"transformer\.h\.\d+\.attn", "split_size", "q_local * head_dim", True),
            AttrUpdate(r"transformer\.h\.\d+\.attn", "num_heads", "q_local", False),
            AttrUpdate(r"transformer\.h\.\d+\.attn\.c_attn", "nf", "3 * q_local * head_dim", True),
            AttrUpdate(r"transformer\.h\.\d+\.mlp\.c_fc", "nf", "inner // tp", True),
        )
        notes = ("Conv1D weights are [in, out]: column dim 1, row dim 0",)
    elif family == "llama":
        rules = (
            (r"model\.embed_tokens\.weight", Rule("vocab_embedding", 0)),
            (r"lm_head\.weight", Rule("lm_head", 0)),
            (r"model\.layers\.\d+\.self_attn\.q_proj\.(weight|bias)", Rule("column", 0, unit=hd)),
            (r"model\.layers\.\d+\.self_attn\.[kv]_proj\.(weight|bias)", Rule("kv_column", 0, unit=hd)),
            (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", Rule("row", 1, unit=hd)),
            (r"model\.layers\.\d+\.self_attn\.o_proj\.bias", Rule("row_bias")),
            (r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.(weight|bias)", Rule("column", 0)),
            (r"model\.layers\.\d+\.mlp\.down_proj\.weight", Rule("row", 1)),
            (r"model\.layers\.\d+\.mlp\.down_proj\.bias", Rule("row_bias")),
            (r"model\.(layers\.\d+\.(input|post_attention)_layernorm|norm)\.weight", REPLICATE),
        )
        attn = (AttrUpdate(r"model\.layers\.\d+\.self_attn", "num_key_value_groups", "q_local // kv_local", True),)
        notes = ("rotary_emb.inv_freq / original_inv_freq: non-persistent buffers, replicate",
                 "qwen2 has q/k/v biases (sharded like their weights, dim 0)")
    elif family == "bert":
        rules = (
            (r"embeddings\.word_embeddings\.weight", Rule("vocab_embedding", 0)),
            (r"embeddings\.(position|token_type)_embeddings\.weight", REPLICATE),
            (r"embeddings\.LayerNorm\.(weight|bias)", REPLICATE),
            (r"encoder\.layer\.\d+\.attention\.self\.(query|key|value)\.(weight|bias)", Rule("column", 0, unit=hd)),
            (r"encoder\.layer\.\d+\.attention\.output\.dense\.weight", Rule("row", 1, unit=hd)),
            (r"encoder\.layer\.\d+\.attention\.output\.dense\.bias", Rule("row_bias")),
            (r"encoder\.layer\.\d+\.intermediate\.dense\.(weight|bias)", Rule("column", 0)),
            (r"encoder\.layer\.\d+\.output\.dense\.weight", Rule("row", 1)),
            (r"encoder\.layer\.\d+\.output\.dense\.bias", Rule("row_bias")),
            (r"encoder\.layer\.\d+\.(attention\.output|output)\.LayerNorm\.(weight|bias)", REPLICATE),
            (r"pooler\.dense\.(weight|bias)", REPLICATE),
        )
        attn = (
            AttrUpdate(r"encoder\.layer\.\d+\.attention\.self", "num_attention_heads", "q_local", False),
            AttrUpdate(r"encoder\.layer\.\d+\.attention\.self", "all_head_size", "q_local * head_dim", False),
        )
        notes = ("the LayerNorm after each row layer needs the all-reduced sum (+ bias once)",)
    else:
        raise BuildError(f"family: expected gpt2, llama or bert, found {family!r}")
    inner = getattr(config, "n_inner", None) or getattr(config, "intermediate_size", None) or 4 * H
    return TPPlan(family, rules, attn, nq, nkv, hd, V, inner, notes)


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


def vocab_range(rank: int, tp: int, vocab: int) -> tuple[int, int]:
    """[start, end) of the vocab rows rank ``rank`` holds: blocks of ceil(V/tp) (the last may be short or empty)."""
    block = math.ceil(vocab / tp)
    return min(rank * block, vocab), min((rank + 1) * block, vocab)


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
