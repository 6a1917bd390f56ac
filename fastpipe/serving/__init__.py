"""Serving: serving sets and their buckets, the continuous-batching engine, requests, the KV state,
sampling, the tokenizer, exact-size buckets (ModelSet), and greedy generation over the producer's
LLM pipeline pair (ProducerLLM, with paged-cache blocks from a BlockAllocator).

    from fastpipe.serving import Engine, SamplingParams, Tokenizer

The names below are imported on first use: `import fastpipe.serving` imports neither torch nor
transformers, and a module of the package imports only what it needs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

# public name -> the module of this package that defines it
_EXPORTS = {
    "ModelSet": "model_set", "Bucket": "model_set",
    "Engine": "engine",
    "ServingBuckets": "buckets", "pipeline_paths": "buckets",
    "build_serving_set": "build",
    "KVState": "kv_state",
    "Request": "request",
    "SamplingParams": "sampling",
    "Tokenizer": "tokenizer", "TextStream": "tokenizer", "has_tokenizer": "tokenizer",
    "BlockAllocator": "blocks", "ProducerLLM": "producer_llm",
}
__all__ = ["BlockAllocator", "Bucket", "Engine", "KVState", "ModelSet", "ProducerLLM", "Request", "SamplingParams",
           "ServingBuckets", "TextStream", "Tokenizer", "build_serving_set", "has_tokenizer", "pipeline_paths"]

if TYPE_CHECKING:
    from fastpipe.serving.blocks import BlockAllocator
    from fastpipe.serving.buckets import ServingBuckets, pipeline_paths
    from fastpipe.serving.build import build_serving_set
    from fastpipe.serving.engine import Engine
    from fastpipe.serving.kv_state import KVState
    from fastpipe.serving.model_set import Bucket, ModelSet
    from fastpipe.serving.producer_llm import ProducerLLM
    from fastpipe.serving.request import Request
    from fastpipe.serving.sampling import SamplingParams
    from fastpipe.serving.tokenizer import TextStream, Tokenizer, has_tokenizer


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastpipe.serving' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"fastpipe.serving.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
