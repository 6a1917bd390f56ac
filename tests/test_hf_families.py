"""Model families as registered specs (fastpipe.builder.hf.families).

(a) every registered family's spec is complete: its class builds from a tiny config, its layers,
    tensor-parallel rules and attributes, sequence-parallel points and encoder inputs name what
    the model has, and it traces;
(b) Qwen2 and Mistral, families of their own, built at tp=2 and pp=2 from tiny random checkpoints,
    run (the reference processor) to transformers' own fp32 logits and KV caches;
(c) an unknown model_type is refused in one line listing the supported ones;
(d) a family registered from this file, without editing the library (Qwen3: Llama's rules plus
    its per-head q/k norms), builds and runs, and is gone once unregistered.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import re

import pytest
import torch

import fastpipe
from tests.hf_models import assert_outputs_match, hf_reference, run_model_level

transformers = pytest.importorskip("transformers")

from fastpipe.builder.hf import plans  # noqa: E402
from fastpipe.builder.hf.build import build_hf  # noqa: E402
from fastpipe.builder.hf.families import (  # noqa: E402
    FamilySpec, family_for, get_family, llama, qwen2, register_family, registered, registered_families,
    supported_model_types, unregister_family,
)
from fastpipe.builder.hf.load import build_model, detect_family, load_skeleton, skeleton_buffers  # noqa: E402
from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint  # noqa: E402
from fastpipe.builder.hf.tp_rules import REPLICATE  # noqa: E402
from fastpipe.builder.hf.trace import attention_dims, trace_fake, traced_forward  # noqa: E402
from fastpipe.errors import BuildError, InvalidInput  # noqa: E402

B, S, P = 2, 8, 3
BUILT_IN = ["bert", "gpt2", "llama", "mistral", "qwen2"]
TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=100, max_position_embeddings=64, sliding_window=None,
            bos_token_id=0, eos_token_id=0)


def tiny_config(model_type: str):
    return transformers.AutoConfig.for_model(model_type, **TINY)


# ---- (a) every registered spec is complete -------------------------------------------------------

def test_the_built_in_families_are_registered():
    assert [f.name for f in registered_families()] == BUILT_IN
    assert supported_model_types() == BUILT_IN
    for name in BUILT_IN:
        assert get_family(name).model_types == (name,)


@pytest.mark.parametrize("spec", registered_families(), ids=lambda s: s.name)
def test_spec_is_complete(spec):
    assert isinstance(spec, FamilySpec) and get_family(spec.name) is spec
    for field in dataclasses.fields(FamilySpec):          # every field is set, none left to a wrong type
        assert getattr(spec, field.name) is not None or field.name == "sp_scatter", field.name
    config = tiny_config(spec.model_types[0])
    assert family_for(config) is spec
    cls = spec.resolve_model_class(config)
    assert issubclass(cls, torch.nn.Module)
    model = build_model(config, spec)
    assert type(model) is cls and all(p.device.type == "meta" for p in model.parameters())

    blocks = model.get_submodule(spec.layers)
    assert isinstance(blocks, torch.nn.ModuleList) and len(blocks) == config.num_hidden_layers
    nq, nkv, hd = spec.dims(config)
    assert nq == config.num_attention_heads and nq % nkv == 0 and hd > 0
    assert attention_dims(spec, config) == (config.num_hidden_layers, nq, nkv, hd)

    plan = plans.tp_plan(spec, config)
    assert plan.family == spec.name
    plans.check_plan(plan, model, 2)                      # every parameter has a rule that splits for tp=2
    modules = dict(model.named_modules())
    for update in spec.tp_attrs:
        matched = [m for name, m in modules.items() if re.fullmatch(update.module, name)]
        assert matched and all(hasattr(m, update.attr) for m in matched), update

    if spec.sp_scatter is not None:
        assert spec.sp_scatter[1] in modules
        for pattern in spec.sp_gather:
            assert any(re.fullmatch(pattern, name) for name in modules), pattern
    if spec.decoder:
        assert model.get_output_embeddings() is not None and not spec.encoder_inputs
    else:
        forward = inspect.signature(type(model).forward).parameters
        assert all(name in forward for name in spec.encoder_inputs)

    ff = traced_forward(model, spec, config, batch=1, seq_len=4, past_len=0 if spec.decoder else None)
    params = {n: torch.empty(p.shape, dtype=p.dtype) for n, p in model.named_parameters()}
    params.update(skeleton_buffers(model))
    gm = trace_fake(ff, params)
    outputs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert len(outputs) == len(ff.signature.outputs)
    assert ff.signature.family == spec.name


def test_spec_fields_are_checked():
    base = dict(name="x", model_types=("x",), model_class="LlamaForCausalLM", layers="model.layers",
                tp_rules=llama.tp_rules)
    FamilySpec(**base)
    for bad, what in [(dict(model_types=()), "model_types"), (dict(model_types="x"), "model_types"),
                      (dict(layers=""), "layers"), (dict(tp_rules=None), "tp_rules"),
                      (dict(encoder_inputs=("attention_mask",)), "encoder_inputs"),
                      (dict(sp_scatter=("middle", "model.layers.0"), sp_gather=("x",)), "sp_scatter"),
                      (dict(sp_scatter=("pre", "model.layers.0")), "sp_gather")]:
        with pytest.raises(BuildError, match=f"FamilySpec.{what}"):
            FamilySpec(**{**base, **bad})


def test_registering_a_taken_name_or_model_type_is_refused():
    spec = get_family("llama")
    with pytest.raises(BuildError, match="family 'llama': expected a name not registered yet"):
        register_family(spec)
    with pytest.raises(BuildError, match="found 'llama' built by 'llama'"):
        register_family(dataclasses.replace(spec, name="llama-again"))
    with pytest.raises(BuildError, match=r"family: expected one of \['bert', 'gpt2', 'llama', 'mistral', 'qwen2'\], "
                                         r"found 'nope'"):
        unregister_family("nope")
    assert supported_model_types() == BUILT_IN


# ---- (b) Qwen2 and Mistral build and run -------------------------------------------------------

CONFIGS = {
    # q/k/v biases; 4 query heads over 2 KV heads
    "qwen2": lambda: transformers.Qwen2Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=100, max_position_embeddings=64, bos_token_id=0, eos_token_id=0),
    # a sliding window that no layer uses (max_window_layers = the layer count: every layer full attention), tied
    "qwen2_unused_window": lambda: transformers.Qwen2Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=100, max_position_embeddings=64, use_sliding_window=True, sliding_window=4, max_window_layers=2,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0),
    # head_dim 32, not hidden_size // heads = 16
    "mistral": lambda: transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=96, vocab_size=100, max_position_embeddings=64, sliding_window=None,
        bos_token_id=0, eos_token_id=0),
}
CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen2_unused_window": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    made = {}

    def get(key):
        if key not in made:
            made[key] = (root / key, save_random_checkpoint(CONFIGS[key](), root / key, seed=len(made) + 3).eval())
        return made[key]
    return get


def originals(family, config, past_len, seed):
    """input_ids and, for a decode step, random past keys/values [B, Hkv, P, D] per layer."""
    g = torch.Generator().manual_seed(seed)
    ins = {"input_ids": torch.randint(0, config.vocab_size, (B, S), generator=g)}
    if past_len is None:
        return ins, None
    layers, _, kv, hd = attention_dims(family, config)
    past = [(torch.randn(B, kv, past_len, hd, generator=g), torch.randn(B, kv, past_len, hd, generator=g))
            for _ in range(layers)]
    for layer, (k, v) in enumerate(past):
        ins[f"past_key_values_{layer}_0"], ins[f"past_key_values_{layer}_1"] = k, v
    return ins, past


RUNS = [("qwen2", 2, 1, None), ("qwen2", 1, 2, 0), ("qwen2", 2, 2, P), ("qwen2_unused_window", 2, 2, P),
        ("mistral", 2, 1, None), ("mistral", 1, 2, 0), ("mistral", 2, 2, P)]


@pytest.mark.parametrize("key, tp, pp, past_len", RUNS, ids=[f"{k}-tp{t}-pp{p}-past{q}" for k, t, p, q in RUNS])
def test_llama_like_families_match_transformers(checkpoints, tmp_path, key, tp, pp, past_len):
    folder, model = checkpoints(key)
    assert type(model).__name__ == CLASSES[key]
    family = detect_family(model.config)
    assert family == key.split("_")[0]
    built = build_hf(folder, tp=tp, pp=pp, batch=B, seq_len=S, past_len=past_len)
    sess = fastpipe.load(built.save(tmp_path / "out"), processor="reference")
    assert len(sess.pipeline.devices) == tp * pp
    ins, past = originals(family, model.config, past_len, seed=tp * 10 + pp)
    ref = hf_reference(model, family, ins, past if past_len is not None else None)
    assert assert_outputs_match(sess, run_model_level(sess, ins), ref) >= (1 if past_len is None else 5)


@pytest.mark.parametrize("key", ["qwen2", "mistral"])
def test_llama_like_families_with_sequence_parallelism(checkpoints, tmp_path, key):
    folder, model = checkpoints(key)
    built = build_hf(folder, tp=2, batch=B, seq_len=S, sequence_parallel=True)
    sess = fastpipe.load(built.save(tmp_path / "out"), processor="reference")
    ins, _ = originals(key, model.config, None, seed=4)
    assert_outputs_match(sess, run_model_level(sess, ins), hf_reference(model, key, ins, None))


def test_what_the_trace_cannot_honour_is_refused_naming_the_field():
    with pytest.raises(BuildError, match=r"^config\.json\.sliding_window: expected null \(no sliding-window "
                                         r"attention\), found 4096$"):
        detect_family(transformers.MistralConfig(sliding_window=4096))
    # Qwen2 slides on the layers from max_window_layers on: one such layer is refused, none is not
    with pytest.raises(BuildError, match=r"^config\.json\.layer_types: expected only 'full_attention', found "
                                         r"\['full_attention', 'sliding_attention'\]$"):
        detect_family(transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=True, max_window_layers=1))
    assert detect_family(transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=True,
                                                  max_window_layers=2)) == "qwen2"
    for family, config in [("qwen2", transformers.Qwen2Config), ("mistral", transformers.MistralConfig)]:
        with pytest.raises(BuildError, match=r"config\.json\.rope_parameters\.rope_type: expected a static RoPE"):
            detect_family(config(sliding_window=None, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                       "rope_theta": 10000.0}))


# ---- (c) an unknown model_type -------------------------------------------------------------------

def test_unknown_model_type_is_refused_in_one_line(tmp_path):
    message = "config.json.model_type: expected one of ['bert', 'gpt2', 'llama', 'mistral', 'qwen2'], found 't5'"
    with pytest.raises(BuildError) as e:
        detect_family(transformers.T5Config())
    assert str(e.value) == message
    transformers.T5Config(num_layers=1, d_model=16, d_ff=32, num_heads=2, d_kv=8).save_pretrained(tmp_path)
    with pytest.raises(InvalidInput) as e:
        build_hf(tmp_path, batch=1, seq_len=4)
    assert str(e.value) == message


def test_cli_serve_refuses_an_unknown_model_type_and_an_encoder(tmp_path, capsys):
    from fastpipe.cli import main

    for model_type, says in [("t5", "build: config.json.model_type: expected one of ['bert', 'gpt2', 'llama', "
                                     "'mistral', 'qwen2'], found 't5'"),
                             ("bert", "--serve: expected a decoder checkpoint (generation needs a KV cache), found "
                                      "model_type 'bert'")]:
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert main(["build", str(folder), "--serve", "--max-len", "16", "-o", str(tmp_path / "out")]) == 2
        assert says in capsys.readouterr().err


# ---- (d) a family registered from outside the library ------------------------------------------

def qwen3_rules(config):
    """Llama's rules, plus Qwen3's RMSNorms over each head's queries and keys (head_dim wide: whole on every rank)."""
    return ((r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight", REPLICATE),) + llama.tp_rules(config)


QWEN3 = FamilySpec(
    name="qwen3", model_types=("qwen3",), model_class="Qwen3ForCausalLM", layers=llama.LAYERS,
    tp_rules=qwen3_rules, tp_attrs=llama.TP_ATTRS, dims=llama.dims, check=qwen2.check,
    sp_scatter=llama.SP_SCATTER, sp_gather=llama.SP_GATHER,
)


@pytest.mark.skipif(not hasattr(transformers, "Qwen3ForCausalLM"), reason="transformers without Qwen3")
def test_a_family_registered_from_outside_builds_and_runs(tmp_path):
    config = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, intermediate_size=96, vocab_size=100, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0)
    with pytest.raises(BuildError, match="config.json.model_type: expected one of .*, found 'qwen3'"):
        detect_family(config)
    with registered(QWEN3):
        assert supported_model_types() == sorted(BUILT_IN + ["qwen3"])
        model = save_random_checkpoint(config, tmp_path / "ckpt", seed=9).eval()
        assert type(model).__name__ == "Qwen3ForCausalLM"
        assert load_skeleton(tmp_path / "ckpt")[2] == "qwen3"
        for tp, pp, past_len in [(2, 1, None), (2, 2, P)]:
            built = build_hf(tmp_path / "ckpt", tp=tp, pp=pp, batch=B, seq_len=S, past_len=past_len)
            sess = fastpipe.load(built.save(tmp_path / f"out{tp}{pp}"), processor="reference")
            ins, past = originals("qwen3", config, past_len, seed=pp)
            assert_outputs_match(sess, run_model_level(sess, ins), hf_reference(model, "qwen3", ins, past))
    assert supported_model_types() == BUILT_IN
    with pytest.raises(InvalidInput, match="found 'qwen3'"):
        build_hf(tmp_path / "ckpt", batch=B, seq_len=S)
