"""BERT (``model_type`` "bert"): BertModel, traced as an encoder.

In: input_ids, attention_mask, token_type_ids [B, S] int64 (mask 1 = keep); out:
last_hidden_state [B, S, H] and, if the model has a pooler, pooler_output [B, H]. The pooler
exists iff the checkpoint stores ``pooler.dense.weight`` (BertForMaskedLM checkpoints have
none); a checkpoint saved from a head model (``bert.`` prefix) is read too (checkpoint.py).

Module attributes on a rank-local copy (transformers 5.23 sources):
  BertSelfAttention ``encoder.layer.N.attention.self``:
    num_attention_heads = q_local, all_head_size = q_local * head_size
    neither is read in forward (nothing REQUIRED); set for consistency.
The LayerNorm after each row layer needs the all-reduced sum (+ bias once). No sequence
parallelism. Refused: ``is_decoder`` (BERT as a decoder).
"""
from __future__ import annotations

from pathlib import Path

from fastpipe.builder.hf.checkpoint import stored_tensors
from fastpipe.builder.hf.families.registry import FamilySpec, mha_dims, refuse, register_family
from fastpipe.builder.hf.tp_rules import REPLICATE, AttrUpdate, Rule
from fastpipe.errors import ParamError


def tp_rules(config) -> tuple[tuple[str, Rule], ...]:
    hd = mha_dims(config)[2]
    return (
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


def check(config) -> None:
    if getattr(config, "is_decoder", False):
        raise refuse("is_decoder", "false (BERT is traced as an encoder)", True)


def has_pooler(model_dir: Path | None) -> bool:
    """Whether the folder's checkpoint has a pooler (True without a folder or a checkpoint yet:
    BertModel's default; checkpoint_index then reports what is missing)."""
    if model_dir is None:
        return True
    try:
        names = stored_tensors(model_dir)
    except ParamError:
        return True
    return any(n == "pooler.dense.weight" or n.endswith(".pooler.dense.weight") for n in names)


def load_kwargs(model_dir: Path | None) -> dict:
    return {"add_pooling_layer": has_pooler(model_dir)}


SPEC = register_family(FamilySpec(
    name="bert",
    model_types=("bert",),
    model_class="BertModel",
    layers="encoder.layer",
    tp_rules=tp_rules,
    tp_attrs=(
        AttrUpdate(r"encoder\.layer\.\d+\.attention\.self", "num_attention_heads", "q_local", False),
        AttrUpdate(r"encoder\.layer\.\d+\.attention\.self", "all_head_size", "q_local * head_dim", False),
    ),
    dims=mha_dims,
    check=check,
    load_kwargs=load_kwargs,
    decoder=False,
    encoder_inputs=("attention_mask", "token_type_ids"),
    notes=("the LayerNorm after each row layer needs the all-reduced sum (+ bias once)",),
))
