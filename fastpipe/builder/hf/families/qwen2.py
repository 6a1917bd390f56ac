"""Qwen2 (``model_type`` "qwen2"): Qwen2ForCausalLM, Llama's module layout (llama.py's rules,
dimensions and sequence-parallel points) with biases on the q, k and v projections (sharded like
their weights: ``column`` / ``kv_column`` on dim 0).

Sliding windows: Qwen2 applies ``sliding_window`` only on layers whose ``layer_types`` entry is
"sliding_attention" (with ``use_sliding_window``, the layers from ``max_window_layers`` on). A
config whose layers are all "full_attention" traces as plain causal attention, whatever
``sliding_window`` says; one with a sliding layer is refused, naming ``layer_types``. A dynamic
RoPE is refused as for Llama.
"""
from __future__ import annotations

import dataclasses

from fastpipe.builder.hf.families import llama
from fastpipe.builder.hf.families.registry import register_family


def check(config) -> None:
    llama.check_full_attention(config)
    llama.check_static_rope(config)


# llama's spec (layers, tensor-parallel rules, dims, sequence-parallel points), with its own name, class and checks
SPEC = register_family(dataclasses.replace(
    llama.SPEC, name="qwen2", model_types=("qwen2",), model_class="Qwen2ForCausalLM", check=check,
    notes=llama.NOTES + ("q/k/v biases, sharded like their weights (dim 0)",)))
