"""Mistral (``model_type`` "mistral"): MistralForCausalLM, Llama's module layout (llama.py's rules,
dimensions and sequence-parallel points; ``head_dim`` may differ from hidden_size // heads).

Mistral applies ``sliding_window`` on every layer when it is set (Mistral-7B-v0.1: 4096): the mask
gains a window overlay, which this trace does not reproduce, so a config with a
``sliding_window`` other than null is refused, naming it (v0.2 and later have none). Mistral
ignores ``layer_types``. A dynamic RoPE is refused as for Llama.
"""
from __future__ import annotations

import dataclasses

from fastpipe.builder.hf.families import llama
from fastpipe.builder.hf.families.registry import register_family


def check(config) -> None:
    llama.check_no_sliding_window(config)
    llama.check_static_rope(config)


# llama's spec (layers, tensor-parallel rules, dims, sequence-parallel points), with its own name, class and checks
SPEC = register_family(dataclasses.replace(
    llama.SPEC, name="mistral", model_types=("mistral",), model_class="MistralForCausalLM", check=check))
