"""Small Hugging Face models (random weights from a config; no network) and model-level runs."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastpipe.builder.hf.compat import cache_keyword  # noqa: E402
from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint  # noqa: E402
from tests.tensor_compare import assert_close  # noqa: E402

CONFIGS = {
    # vocab 99 does not divide by 2 or 4: the LM head stays whole on every rank
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=99, n_positions=64),
    # 4 query heads over 2 KV heads; vocab 100 divides by 2 and 4: the LM head is all-gathered
    "llama": lambda: transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                              num_key_value_heads=2, intermediate_size=128, vocab_size=100),
    "bert": lambda: transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                            intermediate_size=128, vocab_size=99),
}


def make_checkpoint(family: str, folder: Path, seed: int = 0):
    return save_random_checkpoint(CONFIGS[family](), folder, seed=seed).eval()


def skeleton_params(folder: Path, dtype=None):
    """(skeleton model, config, family, its parameters as empty tensors plus its non-persistent buffers):
    what trace_fake needs to trace a checkpoint folder's model without reading a weight."""
    from fastpipe.builder.hf.load import load_skeleton, skeleton_buffers

    model, config, family = load_skeleton(folder, dtype=dtype)
    params = {n: torch.empty(p.shape, dtype=p.dtype) for n, p in model.named_parameters()}
    params.update(skeleton_buffers(model))
    return model, config, family, params


def hf_reference(model, family: str, inputs: dict, past: list | None):
    """The unsplit Hugging Face model's own forward (and updated cache) for original-level inputs."""
    with torch.no_grad():
        if family == "bert":
            out = model(**inputs)
            res = {"last_hidden_state": out.last_hidden_state}
            if getattr(out, "pooler_output", None) is not None:
                res["pooler_output"] = out.pooler_output
            return res
        cache = transformers.DynamicCache()
        for layer, (k, v) in enumerate(past or []):
            cache.update(k, v, layer)
        out = model(input_ids=inputs["input_ids"], use_cache=True, **{cache_keyword(model): cache})
        res = {"logits": out.logits}
        if past is not None:
            for layer, lyr in enumerate(out.past_key_values.layers):
                res[f"past_key_values_{layer}_0"], res[f"past_key_values_{layer}_1"] = lyr.keys, lyr.values
        return res


def _slice(t, placements):
    return t[tuple(slice(a, b) for a, b in placements)]


def run_model_level(session, originals: dict) -> dict:
    """Slice original inputs onto the pipeline by metadata.tensor_slices; return pipeline outputs."""
    p = session.pipeline
    inputs = {name: _slice(originals[s.origin], s.placements).contiguous() for name, s in p.metadata.slices_inputs.items()}
    return session.run(inputs)


def assert_outputs_match(session, outs: dict, reference: dict, rtol: float = 1e-4) -> int:
    """Every pipeline output equals its slice of the reference (max |error| <= rtol * max |reference|);
    returns the count checked."""
    n = 0
    for name, s in session.pipeline.metadata.slices_outputs.items():
        want = _slice(reference[s.origin], s.placements)
        assert_close(outs[name], want, rtol=0.0, atol=rtol * max(want.abs().max().item(), 1e-12),
                     what=f"{name} ({s.origin})")
        n += 1
    return n


def build_producer_llama(folder: Path) -> Path:
    """`fastpipe build --style producer` of a one-layer random Llama (tp 2, seq 4) into folder/out: the
    pipeline.json path (one input per slot, `x` and `x_slot1`, as furiosa-llm writes them)."""
    from fastpipe.cli import main

    ckpt = folder / "ckpt"
    save_random_checkpoint(transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                    num_key_value_heads=1, intermediate_size=64, vocab_size=64), ckpt, seed=0)
    assert main(["build", str(ckpt), "--tp", "2", "--seq-len", "4", "-o", str(folder / "out"), "--style", "producer"]) == 0
    return folder / "out" / "pipeline.json"
