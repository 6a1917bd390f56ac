"""Llama (``model_type`` "llama"): LlamaForCausalLM. Its rules and checks are also those of the
Llama-like families (qwen2.py, mistral.py), which import them from here.

q/k/v/o_proj, gate/up/down_proj, RMSNorm, rotary positions, grouped-query attention: the KV
projections are ``kv_column`` (KV heads sharded when tp <= kv heads, replicated beyond). Biases
(``attention_bias``, ``mlp_bias``; Qwen2's q/k/v) are sharded like their weights. A tied LM head
(``tie_word_embeddings``) is untied per rank. ``rotary_emb.inv_freq`` / ``original_inv_freq``:
non-persistent buffers, replicated.

Module attributes on a rank-local copy (transformers 5.23 sources; projections reshape with
``view(..., -1, head_dim)`` and ``reshape(*input_shape, -1)``, so head counts follow the weight
shapes):
  LlamaAttention ``model.layers.N.self_attn``:
    num_key_value_groups = q_local // kv_local   REQUIRED (repeat_kv in eager and sdpa)
    (head_dim and scaling unchanged; do not edit the shared config's num_attention_heads /
    num_key_value_heads: forward never reads them)

Sequence parallelism: the rotary positions are derived from the embeddings' sequence length, so
the hidden states become sequence shards at the first decoder layer's input, not at the
embeddings' output.

Refused (the traced graph would not be plain causal attention with static RoPE): a sliding
window (``sliding_window``), layers other than full attention (``layer_types``), a dynamic RoPE
(``rope_parameters.rope_type`` dynamic / longrope: ``dynamic_rope_update`` reads
max(position_ids), data-dependent control flow).
"""
from __future__ import annotations

from fastpipe.builder.hf.families.registry import Dims, FamilySpec, refuse, register_family
from fastpipe.builder.hf.tp_rules import REPLICATE, AttrUpdate, Rule

LAYERS = "model.layers"
SP_SCATTER = ("pre", "model.layers.0")
SP_GATHER = (r"model\.layers\.\d+\.(self_attn|mlp)", r"model\.norm")
TP_ATTRS = (AttrUpdate(r"model\.layers\.\d+\.self_attn", "num_key_value_groups", "q_local // kv_local", True),)
NOTES = ("rotary_emb.inv_freq / original_inv_freq: non-persistent buffers, replicate",)


def dims(config) -> Dims:
    heads = config.num_attention_heads
    kv = config.num_key_value_heads or heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv, hd


def tp_rules(config) -> tuple[tuple[str, Rule], ...]:
    hd = dims(config)[2]
    return (
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


def check_no_sliding_window(config) -> None:
    """A sliding window gives the mask a window overlay and the cache sliding layers: not traced here."""
    if getattr(config, "sliding_window", None) is not None:
        raise refuse("sliding_window", "null (no sliding-window attention)", config.sliding_window)


def check_full_attention(config) -> None:
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        raise refuse("layer_types", "only 'full_attention'", sorted(set(types)))


def check_static_rope(config) -> None:
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type == "dynamic" or rope_type == "longrope" or "dynamic" in str(rope_type):
        # dynamic_rope_update reads max(position_ids) -> data-dependent control flow
        raise refuse("rope_parameters.rope_type", "a static RoPE (default, linear, llama3, yarn, ...)", rope_type)


def check(config) -> None:
    check_no_sliding_window(config)
    check_full_attention(config)
    check_static_rope(config)


SPEC = register_family(FamilySpec(
    name="llama",
    model_types=("llama",),
    model_class="LlamaForCausalLM",
    layers=LAYERS,
    tp_rules=tp_rules,
    tp_attrs=TP_ATTRS,
    dims=dims,
    check=check,
    sp_scatter=SP_SCATTER,
    sp_gather=SP_GATHER,
    notes=NOTES,
))
