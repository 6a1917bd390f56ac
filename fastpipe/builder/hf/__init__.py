"""The Hugging Face side of building pipelines (transformers 5.x; the families registered in
fastpipe.builder.hf.families: GPT-2, Llama, Mistral, Qwen2, BERT).

    model, config, family = load_skeleton(model_dir)        # meta parameters, nothing read; family: its name
    index = checkpoint_index(model_dir, model)              # name -> StoredTensor (headers only)
    ff = traced_forward(model, family, config, batch=2, seq_len=8, past_len=5)
    gm = trace_fake(ff, params)                             # aten graph via make_fx(fake)
    plan = tp_plan(family, config)                          # tensor-parallel rules, as data

Importing this package does not import transformers; the functions do.
"""
from .families import (
    FamilySpec, family_for, get_family, register_family, registered, registered_families, supported_model_types,
    unregister_family,
)
from .checkpoint import StoredTensor, checkpoint_index, load_tensors, stored_tensors, tied_parameters
from .load import build_model, detect_family, load_skeleton, skeleton_buffers
from .plans import (
    Rule, TPPlan, attribute_updates, check_plan, kv_head_for_rank, kv_heads_for_rank, lm_head_sharded,
    local_heads, shard_pieces, tp_plan, vocab_range,
)
from .random_checkpoint import save_random_checkpoint
from .trace import ATEN_OPS, FlatForward, FlatSignature, FlatTensor, flat_signature, ordered, trace_fake, traced_forward

__all__ = [
    "ATEN_OPS", "FamilySpec", "FlatForward", "FlatSignature", "FlatTensor", "Rule", "StoredTensor", "TPPlan",
    "attribute_updates", "build_model", "check_plan", "checkpoint_index", "detect_family", "family_for",
    "flat_signature", "get_family", "register_family", "registered", "registered_families",
    "supported_model_types", "unregister_family",
    "kv_head_for_rank", "kv_heads_for_rank", "lm_head_sharded", "load_skeleton", "load_tensors", "local_heads",
    "ordered", "save_random_checkpoint", "shard_pieces", "skeleton_buffers", "stored_tensors", "tied_parameters",
    "tp_plan", "trace_fake", "traced_forward", "vocab_range",
]
