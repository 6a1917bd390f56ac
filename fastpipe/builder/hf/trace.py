"""A Hugging Face model as a flat function of tensors, ready for make_fx.

    ff = traced_forward(model, family, config, batch=2, seq_len=8, past_len=5)
    gm = trace_fake(ff, params)              # make_fx(ff.fn, tracing_mode="fake")
    outs = gm(*ordered(params), *inputs)     # placeholders: ff.param_names, then ff.signature.inputs

``ff.fn(params: dict[str, Tensor], *flat_inputs) -> tuple[Tensor, ...]`` calls
``torch.func.functional_call(model, params, ...)``, so every weight is an
explicit input. ``params`` holds the model's parameters under their
deduplicated names (``model.named_parameters()``: a tied ``lm_head.weight``
appears once, as ``transformer.wte.weight``), its persistent buffers (none in
the built-in families) and, optionally, the non-persistent buffers (Llama
``rotary_emb.inv_freq``, BERT ``embeddings.position_ids`` ...): given, they are
graph inputs like weights; left out, the module's real CPU values are used and
make_fx records them as ``get_attr`` constants (which the payload encoder lifts
into the embedded-constants blob) -- that needs ``_allow_non_fake_inputs``,
see ``trace_fake(..., buffers="constants")``.

Flat inputs/outputs (SPEC naming; ``idx`` = position among the flat model
inputs, resp. outputs, weights not counted):
  decoders (a family spec's ``decoder``: gpt2, llama, mistral, qwen2), ``past_len`` =
    None  no KV cache:  in  input_ids[B,S]                    out logits[B,S,V]
    0     prefill:      in  input_ids[B,S]                    out logits, past_key_values_{l}_{0|1}[B,Hkv,S,D]
    P>0   decode step:  in  input_ids[B,S], past_key_values_{l}_{0|1}[B,Hkv,P,D]
                                                              out logits, past_key_values_{l}_{0|1}[B,Hkv,P+S,D]
    ({l} the block, 0 = keys, 1 = values; inputs and outputs are ordered
    l0k, l0v, l1k, ...). Positions are P..P+S-1: the model derives them from the
    cache length (a static shape), no position_ids input. No attention_mask:
    every token attends causally to the whole past (no padding).
  ``last_logits=True`` (any of the three above): one more input after input_ids,
    logits_index[B] int64, the position in each row whose logits are wanted, and logits[B,1,V]
    at that position only: a serving prefill on right-padded prompts needs each row's last real
    token's, not [B,S,V] (at Llama-3's 128k vocabulary, 8 x 2048 tokens of bf16 logits are 4 GiB).
    The hidden states [B,S,H] are gathered at the (clamped: never an out-of-range read) positions
    before the output projection, which so runs on B rows instead of B x S.
  decoders with a static cache, ``max_len=M`` (``past_len`` ignored):
                  in  input_ids[B,S], cache_position[B] int64, past_key_values_{l}_{0|1}[B,Hkv,M,D]
                  out logits[B,S,V], past_key_values_{l}_{0|1}[B,Hkv,M,D]   (the same names: updated caches)
    Row b's tokens sit at positions cache_position[b] + 0..S-1: their keys/values are written
    there (``aten.index_put``) and they attend to cache positions <= their own (an additive
    mask built in the graph from cache_position); what lies beyond is never read, so rows may
    be at different positions and a cache may hold stale entries past a row's position.
  a prefill into a static cache of R rows, ``max_len=M, cache_rows=R`` (R >= B; with or without
    ``last_logits``):
                  in  input_ids[B,S], [logits_index[B],] cache_row[B] int64, past_key_values_{l}_{0|1}[R,Hkv,M,D]
                  out logits[B,S|1,V], past_key_values_{l}_{0|1}[R,Hkv,M,D]   (updated)
    Row b's prompt is at positions 0..S-1 and attends causally to itself only (a prefill: the
    cache is written, never read); its keys/values go into cache row cache_row[b] (clamped to
    [0, R)), positions 0..S-1. Rows of the batch naming the same cache row all write the FIRST
    such row's keys/values (identical values, so the duplicate write is deterministic): a server
    points its pad rows at a real row's cache row. A serving engine so prefills straight into
    the KV cache its decode step updates: no [B,Hkv,S,D] caches are returned and copied.
  encoders (``decoder=False``): in input_ids and the spec's ``encoder_inputs``, each [B,S] int64
        (bert: attention_mask (1 = keep), token_type_ids);
        out last_hidden_state[B,S,H] and, if the model has a pooler, pooler_output[B,H].

The KV cache inside ``fn`` is a transformers ``DynamicCache`` whose layers are
``_FlatLayer``s holding the flat tensors: ``update`` concatenates the new
keys/values (``aten.cat`` on dim -2), and with no past takes them as they are
(``DynamicLayer`` would instead cat onto a ``torch.tensor([])`` constant). A
decoder without a cache still runs with an empty cache: with
``past_key_values=None`` transformers adds packed-sequence detection ops
(diff/cumsum on position ids) to the mask; with an empty cache the mask is
the plain causal one, which is what the HF model computes for unpadded input.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import torch

from fastpipe.builder.hf.compat import cache_keyword
from fastpipe.builder.hf.families import FamilySpec, get_family
from fastpipe.errors import BuildError

# Union of call_function targets seen when tracing the built-in families (gpt2, llama, qwen2, bert) with
# attn_implementation="eager", fp32 and bf16, with and without a KV cache
# (torch 2.13, transformers 5.23; tests/test_hf_harness.py checks every trace
# against it). aten.detach appears only when the traced params require grad
# (nn.Parameters passed as they are: Llama's rotary runs under no_grad).
# A static cache (max_len) adds aten.index_put (the cache write) and aten.full
# (the mask's minimum); tests/test_static_cache.py checks those traces. last_logits adds aten.clamp
# (the positions' bounds; the gather is aten.index.Tensor). cache_rows adds aten.eq and aten.argmax
# (each batch row's first row with the same cache row).
# transformers 5.17 (the GPU machine's) builds the eager mask with
# torch.where(mask, torch.tensor(0.0), min): a constant, read through aten.lift_fresh_copy
# (VERSION_DEPENDENT_OPS: 5.23 and 5.24 trace no such op).
VERSION_DEPENDENT_OPS = frozenset({"aten.lift_fresh_copy.default"})
ATEN_OPS = frozenset({
    "aten._softmax.default", "aten._to_copy.default", "aten._unsafe_view.default", "aten.add.Tensor",
    "aten.addmm.default", "aten.alias.default", "aten.arange.default", "aten.bitwise_and.Tensor",
    "aten.argmax.default", "aten.bmm.default", "aten.cat.default", "aten.clamp.default", "aten.clone.default",
    "aten.cos.default", "aten.detach.default", "aten.embedding.default", "aten.eq.Tensor", "aten.expand.default",
    "aten.full.default", "aten.ge.Scalar",
    "aten.gelu.default", "aten.index.Tensor", "aten.index_put.default", "aten.le.Tensor",
    "aten.lift_fresh_copy.default", "aten.mean.dim",
    "aten.mm.default", "aten.mul.Tensor", "aten.native_layer_norm.default", "aten.neg.default",
    "aten.new_ones.default", "aten.pow.Tensor_Scalar", "aten.rsqrt.default", "aten.scalar_tensor.default",
    "aten.select.int", "aten.silu.default", "aten.sin.default", "aten.slice.Tensor", "aten.split.Tensor",
    "aten.t.default", "aten.tanh.default", "aten.transpose.int", "aten.unsqueeze.default",
    "aten.view.default", "aten.where.self", "aten.zeros.default", "operator.getitem",
})


@dataclass(frozen=True)
class FlatTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    idx: int


@dataclass(frozen=True)
class FlatSignature:
    family: str
    batch: int
    seq_len: int
    past_len: int | None      # None: no KV cache
    inputs: tuple[FlatTensor, ...]
    outputs: tuple[FlatTensor, ...]
    max_len: int | None = None  # a static KV cache of max_len positions (module docstring)
    last_logits: bool = False   # logits_index [B] in, logits [B, 1, V] out (module docstring)
    cache_rows: int | None = None  # a prefill into a static cache of this many rows (module docstring)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def example_inputs(self, *, seed: int = 0, vocab_size: int, device="cpu") -> list[torch.Tensor]:
        """Real random inputs matching the signature (ids < vocab_size, masks of ones, 0/1 token types)."""
        g = torch.Generator().manual_seed(seed)
        out = []
        for t in self.inputs:
            if t.name == "input_ids":
                x = torch.randint(0, vocab_size, t.shape, generator=g)
            elif t.name == "attention_mask":
                x = torch.ones(t.shape, dtype=t.dtype)
            elif t.name == "token_type_ids":
                x = torch.randint(0, 2, t.shape, generator=g)
            elif t.name == "logits_index":
                x = torch.randint(0, self.seq_len, t.shape, generator=g)
            else:
                x = torch.randn(t.shape, generator=g)
            out.append(x.to(device=device, dtype=t.dtype))
        return out


def kv_name(layer: int, which: int) -> str:
    """``past_key_values_{layer}_{0 keys | 1 values}``."""
    return f"past_key_values_{layer}_{which}"


def _dtype(config, dtype):
    if dtype is not None:
        return dtype
    d = getattr(config, "dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else torch.float32


def attention_dims(family: str | FamilySpec, config) -> tuple[int, int, int, int]:
    """(num_layers, num_q_heads, num_kv_heads, head_dim) of the unsplit model (the family's ``dims``)."""
    return (config.num_hidden_layers, *get_family(family).dims(config))


def flat_signature(family: str | FamilySpec, config, batch: int, seq_len: int, past_len: int | None = 0, *,
                   dtype: torch.dtype | None = None, num_kv_heads: int | None = None,
                   pooler: bool = True, max_len: int | None = None, last_logits: bool = False,
                   cache_rows: int | None = None) -> FlatSignature:
    """Names, shapes, dtypes and idx of the flat inputs/outputs (see module docstring).

    ``max_len``: a static KV cache of that many positions (decoders; see the module docstring).
    ``last_logits``: logits_index [B] in, the logits at those positions [B, 1, V] out (decoders
    without a static cache, or a prefill into one).
    ``cache_rows``: with ``max_len``, a prefill into a static cache of that many rows.

    ``dtype``: of the cache and the float outputs (default: config.dtype or
    float32). ``num_kv_heads`` overrides the KV head count (a rank-local
    module's). ``pooler``: encoders only, whether pooler_output exists.
    """
    spec = get_family(family)
    if batch < 1 or seq_len < 1:
        raise BuildError(f"batch, seq_len: expected >= 1, found {batch}, {seq_len}")
    dt = _dtype(config, dtype)
    i64 = torch.int64
    ins: list[tuple] = [("input_ids", (batch, seq_len), i64)]
    outs: list[tuple] = []
    if not spec.decoder:
        if past_len not in (None, 0):
            raise BuildError(f"past_len: expected None or 0 for {spec.name} (no KV cache), found {past_len}")
        ins += [(name, (batch, seq_len), i64) for name in spec.encoder_inputs]
        outs.append(("last_hidden_state", (batch, seq_len, config.hidden_size), dt))
        if pooler:
            outs.append(("pooler_output", (batch, config.hidden_size), dt))
        past_len = None
    else:
        if cache_rows is not None:
            if max_len is None:
                raise BuildError("cache_rows: expected with max_len (a prefill into a static cache of cache_rows x "
                                 "max_len positions), found without")
            if isinstance(cache_rows, bool) or not isinstance(cache_rows, int) or cache_rows < batch:
                raise BuildError(f"cache_rows: expected an integer >= batch ({batch}: a cache row per prompt), "
                                 f"found {cache_rows!r}")
        if last_logits:
            if max_len is not None and cache_rows is None:
                raise BuildError("last_logits: expected off with a static-cache step (max_len: a decode step's "
                                 "logits are already one per row; a prefill into the cache takes cache_rows), found on")
            ins.append(("logits_index", (batch,), i64))
        outs.append(("logits", (batch, 1 if last_logits else seq_len, config.vocab_size), dt))
        if max_len is not None:
            if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < seq_len:
                raise BuildError(f"max_len: expected an integer >= seq_len ({seq_len}), found {max_len!r}")
            limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
            if limit and max_len > limit:
                raise BuildError(f"max_len: expected at most the model's {limit} positions, found {max_len}")
            ins.append(("cache_row" if cache_rows is not None else "cache_position", (batch,), i64))
            layers, _, kv, head_dim = attention_dims(spec, config)
            kv = num_kv_heads or kv
            for layer in range(layers):
                for which in (0, 1):
                    shape = (cache_rows or batch, kv, max_len, head_dim)
                    ins.append((kv_name(layer, which), shape, dt))
                    outs.append((kv_name(layer, which), shape, dt))
            past_len = None
        elif past_len is not None:
            if past_len < 0:
                raise BuildError(f"past_len: expected None or >= 0, found {past_len}")
            layers, _, kv, head_dim = attention_dims(spec, config)
            kv = num_kv_heads or kv
            for layer in range(layers):
                for which in (0, 1):
                    if past_len > 0:
                        ins.append((kv_name(layer, which), (batch, kv, past_len, head_dim), dt))
                    outs.append((kv_name(layer, which), (batch, kv, past_len + seq_len, head_dim), dt))
    if last_logits and not spec.decoder:
        raise BuildError(f"last_logits: expected off for {spec.name} (an encoder: no logits), found on")
    if cache_rows is not None and not spec.decoder:
        raise BuildError(f"cache_rows: expected None for {spec.name} (no KV cache), found {cache_rows!r}")
    return FlatSignature(
        spec.name, batch, seq_len, past_len,
        tuple(FlatTensor(n, s, d, i) for i, (n, s, d) in enumerate(ins)),
        tuple(FlatTensor(n, s, d, i) for i, (n, s, d) in enumerate(outs)),
        max_len if spec.decoder else None, bool(last_logits),
        cache_rows if spec.decoder and max_len is not None else None,
    )


@functools.cache
def _cache_classes():
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class _FlatLayer(DynamicLayer):
        """A full-attention cache layer over given tensors; no empty-tensor constant, no lazy init."""

        def __init__(self, keys=None, values=None):
            super().__init__()
            if keys is not None:
                self._take(keys, values)

        def _take(self, keys, values):
            self.keys, self.values = keys, values
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states):
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if self.keys is None:
                self._take(key_states, value_states)
            else:
                self.keys = torch.cat([self.keys, key_states], dim=-2)
                self.values = torch.cat([self.values, value_states], dim=-2)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return 0 if self.keys is None else self.keys.shape[-2]

    class _StaticLayer(_FlatLayer):
        """A static cache layer: full [B, Hkv, M, D] tensors; update writes the new keys/values at each
        row's positions (``aten.index_put``, functional: the result is the updated cache)."""

        def __init__(self, keys, values, positions):
            super().__init__(keys, values)
            self.positions = positions                       # [B, S] absolute positions of the new tokens

        def update(self, key_states, value_states, *args, **kwargs):
            b, h, s, _ = key_states.shape                    # [B, Hkv, S, D]
            rows = torch.arange(b, device=key_states.device).view(b, 1, 1)
            heads = torch.arange(h, device=key_states.device).view(1, h, 1)
            where = (rows, heads, self.positions.view(b, 1, s))   # broadcast to [B, Hkv, S]
            self.keys = self.keys.index_put(where, key_states)
            self.values = self.values.index_put(where, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return 0      # positions come from cache_position, never from the cache's size

    class _RowsLayer(_FlatLayer):
        """A prefill's layer writing into a static cache [R, Hkv, M, D]: the prompt's keys/values
        [B, Hkv, S, D] go to cache rows `rows` [B], positions 0..S-1 (``aten.index_put``, functional:
        ``cache_keys``/``cache_values`` are the updated caches), row b writing row `first[b]`'s; attention
        reads the prompt's own keys/values (the layer holds them as a past-less DynamicLayer would)."""

        def __init__(self, keys, values, rows, first):
            super().__init__()
            self.cache_keys, self.cache_values = keys, values
            self.rows, self.first = rows, first              # [B] each

        def update(self, key_states, value_states, *args, **kwargs):
            b, h, s, _ = key_states.shape                    # [B, Hkv, S, D]
            heads = torch.arange(h, device=key_states.device).view(1, h, 1)
            steps = torch.arange(s, device=key_states.device).view(1, 1, s)
            where = (self.rows.view(b, 1, 1), heads, steps)  # broadcast to [B, Hkv, S]
            self.cache_keys = self.cache_keys.index_put(where, key_states[self.first])
            self.cache_values = self.cache_values.index_put(where, value_states[self.first])
            return super().update(key_states, value_states)

    return DynamicCache, _FlatLayer, _StaticLayer, _RowsLayer


def _check_past(num_layers: int, past) -> None:
    if len(past) != 2 * num_layers:
        raise BuildError(f"past_key_values: expected {2 * num_layers} tensors, found {len(past)}")


def flat_cache(num_layers: int, past: tuple[torch.Tensor, ...] | list[torch.Tensor]):
    """A transformers DynamicCache over flat tensors [l0 keys, l0 values, l1 keys, ...] (empty if none)."""
    DynamicCache, FlatLayer, *_ = _cache_classes()
    if past:
        _check_past(num_layers, past)
    cache = DynamicCache()
    cache.layer_class_to_replicate = None
    cache.layers = [FlatLayer(past[2 * l], past[2 * l + 1]) if past else FlatLayer() for l in range(num_layers)]
    return cache


def static_cache(num_layers: int, past, positions: torch.Tensor):
    """A DynamicCache of static layers over flat tensors [l0 keys, l0 values, ...], each [B, Hkv, M, D];
    `positions` [B, S]: where each row's new tokens go."""
    DynamicCache, _, StaticLayer, _ = _cache_classes()
    _check_past(num_layers, past)
    cache = DynamicCache()
    cache.layer_class_to_replicate = None
    cache.layers = [StaticLayer(past[2 * l], past[2 * l + 1], positions) for l in range(num_layers)]
    return cache


def rows_cache(num_layers: int, past, cache_row: torch.Tensor):
    """A DynamicCache of layers that write a prefill into rows of static caches [l0 keys, l0 values, ...],
    each [R, Hkv, M, D]: batch row b into cache row cache_row[b] (clamped to [0, R)); batch rows naming
    one cache row write the first one's keys/values."""
    DynamicCache, *_, RowsLayer = _cache_classes()
    _check_past(num_layers, past)
    b = cache_row.shape[0]
    rows = cache_row.clamp(0, past[0].shape[0] - 1)                            # [B]
    same = rows.view(b, 1) == rows.view(1, b)                                   # [B, B]
    first = same.to(torch.int64).argmax(dim=1)                                  # [B]: the first equal row
    cache = DynamicCache()
    cache.layer_class_to_replicate = None
    cache.layers = [RowsLayer(past[2 * l], past[2 * l + 1], rows, first) for l in range(num_layers)]
    return cache


def static_mask(positions: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask [B, 1, S, M] of a static cache: a token at position p sees cache
    positions <= p (0), nothing else (the dtype's min, as transformers' eager masks)."""
    keys = torch.arange(max_len, device=positions.device)              # [M]
    seen = keys.view(1, 1, -1) <= positions.unsqueeze(-1)               # [B, S, M]
    zero = torch.zeros((), dtype=dtype, device=positions.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=positions.device)
    return torch.where(seen, zero, low).unsqueeze(1)                    # [B, 1, S, M]


@dataclass(frozen=True)
class FlatForward:
    fn: Callable                       # fn(params: dict, *flat_inputs) -> tuple of flat outputs
    signature: FlatSignature
    param_names: tuple[str, ...]       # required: deduplicated parameters + persistent buffers
    buffer_names: tuple[str, ...]      # optional: non-persistent buffers (real values on the skeleton)

    @property
    def all_names(self) -> tuple[str, ...]:
        return self.param_names + self.buffer_names


def traced_forward(model, family: str | FamilySpec, config, *, batch: int, seq_len: int,
                   past_len: int | None = 0, num_kv_heads: int | None = None,
                   max_len: int | None = None, last_logits: bool = False,
                   cache_rows: int | None = None) -> FlatForward:
    """The flat function of ``model`` for one static shape (see module docstring).

    ``num_kv_heads``: the KV heads the module holds when it is a rank-local
    copy (``plans.local_heads``); only the signature's cache shapes use it.
    """
    spec = get_family(family)
    non_persistent = tuple(n for n, _ in model.named_non_persistent_buffers())
    params = tuple(n for n, _ in model.named_parameters())
    params += tuple(n for n, _ in model.named_buffers() if n not in non_persistent)
    pooler = getattr(model, "pooler", None) is not None
    if model.training:
        raise BuildError("model: expected eval mode (dropout off), found training mode")
    dtype = next(iter(model.parameters())).dtype
    layers = attention_dims(spec, config)[0]
    sig = flat_signature(spec, config, batch, seq_len, past_len, dtype=dtype, pooler=pooler,
                         num_kv_heads=num_kv_heads, max_len=max_len, last_logits=last_logits,
                         cache_rows=cache_rows)
    n_in = len(sig.inputs)

    def check(ps: Mapping[str, torch.Tensor], flat: tuple) -> None:
        if len(flat) != n_in:
            raise BuildError(f"flat inputs: expected {n_in} ({', '.join(sig.input_names)}), found {len(flat)}")
        missing = [n for n in params if n not in ps]
        if missing:
            raise BuildError(f"params[{missing[0]!r}]: expected a tensor, found none ({len(missing)} missing)")

    rows_model = _RowLogits(model) if sig.last_logits else None

    def logits_of(ps, input_ids, cache, logits_index=None) -> torch.Tensor:
        """The LM's logits over a DynamicCache-like `cache`: [B, S, V], or with last_logits [B, 1, V] at
        logits_index (_RowLogits)."""
        if rows_model is not None:
            return torch.func.functional_call(rows_model, {f"lm.{n}": t for n, t in ps.items()}, (), {
                "input_ids": input_ids, "logits_index": logits_index, "cache": cache})
        return torch.func.functional_call(model, dict(ps), (), {
            "input_ids": input_ids, cache_keyword(model): cache, "use_cache": True}).logits

    if not spec.decoder:
        def fn(ps, input_ids, *extra):
            check(ps, (input_ids, *extra))
            out = torch.func.functional_call(model, dict(ps), (), {
                "input_ids": input_ids, **dict(zip(spec.encoder_inputs, extra))})
            res = (out.last_hidden_state,)
            return res + (out.pooler_output,) if pooler else res
    elif sig.cache_rows is not None:
        def fn(ps, input_ids, *rest):
            check(ps, (input_ids, *rest))
            logits_index, cache_row, *past = rest if sig.last_logits else (None, *rest)
            cache = rows_cache(layers, past, cache_row)
            res = [logits_of(ps, input_ids, cache, logits_index)]
            for layer in cache.layers:
                res += [layer.cache_keys, layer.cache_values]
            return tuple(res)
    elif sig.max_len is not None:
        def fn(ps, input_ids, cache_position, *past):
            check(ps, (input_ids, cache_position, *past))
            steps = torch.arange(input_ids.shape[1], device=input_ids.device)
            positions = cache_position.unsqueeze(1) + steps                   # [B, S]
            cache = static_cache(layers, past, positions)
            out = torch.func.functional_call(model, dict(ps), (), {
                "input_ids": input_ids, "position_ids": positions, cache_keyword(model): cache, "use_cache": True,
                "attention_mask": static_mask(positions, sig.max_len, dtype)})
            res = [out.logits]
            for layer in cache.layers:
                res += [layer.keys, layer.values]
            return tuple(res)
    else:
        def fn(ps, input_ids, *rest):
            check(ps, (input_ids, *rest))
            logits_index, *past = rest if sig.last_logits else (None, *rest)
            cache = flat_cache(layers, past)
            return (logits_of(ps, input_ids, cache, logits_index), *_cache_outputs(cache, past_len))

    return FlatForward(fn, sig, params, non_persistent)


def _cache_outputs(cache, past_len: int | None) -> list[torch.Tensor]:
    """The updated flat caches [l0 keys, l0 values, ...] of a dynamic cache (none without a KV cache)."""
    res = []
    if past_len is not None:
        for layer in cache.layers:
            res += [layer.keys.contiguous(), layer.values.contiguous()]
    return res


class _RowLogits(torch.nn.Module):
    """A causal LM's logits at one position per row: its base model (``lm.base_model``, which is what
    the LM's own forward calls), the last hidden states gathered at ``logits_index``, then the LM's
    output projection -- what the LM's forward computes with ``logits_to_keep`` selecting a position
    per row instead of one for all rows."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, logits_index, cache):
        base = self.lm.base_model
        out = base(input_ids=input_ids, use_cache=True, **{cache_keyword(base): cache})
        hidden = out.last_hidden_state                                      # [B, S, H]
        b, s = hidden.shape[0], hidden.shape[1]
        at = logits_index.clamp(0, s - 1)                                   # [B], never out of range
        picked = hidden[torch.arange(b, device=hidden.device), at]          # [B, H]
        return self.lm.get_output_embeddings()(picked.unsqueeze(1))         # [B, 1, V]


def ordered(ff: FlatForward, params: Mapping[str, torch.Tensor], *, buffers: bool = True) -> dict[str, torch.Tensor]:
    """``params`` as the dict ``ff.fn`` takes, in ``ff.param_names`` (+ ``ff.buffer_names``) order.

    make_fx flattens the dict in this order, so the GraphModule's first
    placeholders are these names, then the flat inputs.
    """
    names = ff.all_names if buffers else ff.param_names
    missing = [n for n in names if n not in params]
    if missing:
        raise BuildError(f"params[{missing[0]!r}]: expected a tensor, found none ({len(missing)} missing)")
    return {n: params[n] for n in names}


def trace_fake(ff: FlatForward, params: Mapping[str, torch.Tensor], *, device="cpu",
               buffers: str = "inputs", inputs: list[torch.Tensor] | None = None) -> torch.fx.GraphModule:
    """make_fx(ff.fn, tracing_mode="fake") with fake tensors built from ``params``' shapes/dtypes on ``device``.

    ``params`` may be meta, fake or real (only metadata is used).
    ``buffers="inputs"``: the non-persistent buffers are placeholders too
    (values: ``skeleton_buffers(model)``); ``"constants"``: they become
    ``get_attr`` constants of the GraphModule (their real CPU values).
    ``inputs``: fake/real tensors to trace with instead of the signature's.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    from fastpipe.torch_compat import FakeTensor, FakeTensorMode, fx_tracing_lock

    if buffers not in ("inputs", "constants"):
        raise BuildError(f"buffers: expected 'inputs' or 'constants', found {buffers!r}")
    as_inputs = buffers == "inputs"
    ps = ordered(ff, params, buffers=as_inputs)
    mode = FakeTensorMode(allow_non_fake_inputs=not as_inputs)
    with mode:
        fparams = {n: torch.empty(t.shape, dtype=t.dtype, device=device) for n, t in ps.items()}
        if inputs is None:
            finputs = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in ff.signature.inputs]
        else:
            finputs = [mode.from_tensor(x) if not isinstance(x, FakeTensor) else x
                       for x in inputs]
    with fx_tracing_lock():              # FX's tracing state is global: never beside a background compile
        return make_fx(ff.fn, tracing_mode="fake", _allow_non_fake_inputs=not as_inputs)(fparams, *finputs)


def call_targets(gm: torch.fx.GraphModule) -> set[str]:
    """The call_function targets of a traced graph, as strings ("aten.mm.default", "operator.getitem")."""
    out = set()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            t = n.target
            out.add(f"operator.{t.__name__}" if getattr(t, "__module__", None) == "_operator" else str(t))
    return out
