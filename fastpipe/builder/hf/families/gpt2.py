"""GPT-2 (``model_type`` "gpt2"): GPT2LMHeadModel.

Fused ``c_attn`` (q|k|v packed, each hidden_size wide) and MLP in transformers' Conv1D, whose
weights are [in, out]: column-parallel on dim 1, row-parallel on dim 0. The LM head is tied to
``wte`` (untied per rank: the two names get different shards of one stored tensor).

Module attributes on a rank-local copy (transformers 5.23 sources):
  GPT2Attention ``transformer.h.N.attn``:
    split_size = q_local * head_dim   REQUIRED (c_attn(x).split(split_size, dim=2))
    num_heads  = q_local              not read in forward; set for consistency
  Conv1D ``...attn.c_attn`` / ``...mlp.c_fc`` (column-sharded):
    nf = local output features        REQUIRED (Conv1D.forward views to (..., nf))
  (embed_dim stays hidden_size; head_dim, scaling and Conv1D.nx of row layers are not affected
  / not read)
Refused: ``add_cross_attention`` (a decoder with cross-attention is not a plain causal LM).
"""
from __future__ import annotations

from fastpipe.builder.hf.families.registry import FamilySpec, mha_dims, refuse, register_family
from fastpipe.builder.hf.tp_rules import REPLICATE, AttrUpdate, Rule


def tp_rules(config) -> tuple[tuple[str, Rule], ...]:
    H = config.hidden_size
    hd = mha_dims(config)[2]
    return (
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


def check(config) -> None:
    if getattr(config, "add_cross_attention", False):
        raise refuse("add_cross_attention", "false (no cross-attention)", True)


SPEC = register_family(FamilySpec(
    name="gpt2",
    model_types=("gpt2",),
    model_class="GPT2LMHeadModel",
    layers="transformer.h",
    tp_rules=tp_rules,
    tp_attrs=(
        AttrUpdate(r"transformer\.h\.\d+\.attn", "split_size", "q_local * head_dim", True),
        AttrUpdate(r"transformer\.h\.\d+\.attn", "num_heads", "q_local", False),
        AttrUpdate(r"transformer\.h\.\d+\.attn\.c_attn", "nf", "3 * q_local * head_dim", True),
        AttrUpdate(r"transformer\.h\.\d+\.mlp\.c_fc", "nf", "inner // tp", True),
    ),
    dims=mha_dims,
    check=check,
    # the embeddings' dropout is where the hidden states are first whole: slice its output
    sp_scatter=("post", "transformer.drop"),
    sp_gather=(r"transformer\.h\.\d+\.(attn|mlp)", r"transformer\.ln_f"),
    notes=("Conv1D weights are [in, out]: column dim 1, row dim 0",),
))
