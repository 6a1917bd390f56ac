"""Decode / extend steps on a static KV cache (build_hf(..., max_len=M)) against the unsplit Hugging Face model.

The caches of each row are filled from HF's own forward of that row's prompt (rows of different
lengths, random garbage everywhere past a row's length); the pipeline then runs S new tokens per row
at cache_position = the row's length. Its logits must equal HF's forward of the whole sequence
(prompt + new tokens) at the new positions, its returned caches must hold HF's keys/values at the
written positions and the input's values everywhere else (garbage included: never read, never
touched). Also: the flat signature with max_len and its refusals, the built file's metadata (what
fastpipe.runtime.binding.state pairs), the producer-style file, and the traced ops (ATEN_OPS).
"""
from __future__ import annotations

import json

import pytest
import torch

import fastpipe
from fastpipe.builder.hf.build import build_hf
from fastpipe.builder.hf.trace import (
    ATEN_OPS, attention_dims, call_targets, flat_signature, trace_fake, traced_forward,
)
from fastpipe.errors import BuildError
from fastpipe.runtime.binding.state import state_pairs
from tests.hf_models import CONFIGS, make_checkpoint, skeleton_params

B, M = 3, 12
FAMILIES = ("gpt2", "llama")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("static_hf")
    return {fam: (root / fam, make_checkpoint(fam, root / fam, seed=i + 5))
            for i, fam in enumerate(("gpt2", "llama", "bert"))}


@pytest.fixture(scope="module")
def built(checkpoints, tmp_path_factory):
    """(family, tp, seq_len) -> path of the saved static pipeline (built once per module)."""
    cache: dict = {}

    def get(family, tp, seq_len):
        key = (family, tp, seq_len)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{family}_tp{tp}_s{seq_len}")
            cache[key] = build_hf(checkpoints[family][0], tp=tp, batch=B, seq_len=seq_len, max_len=M).save(out)
        return cache[key]
    return get


def scenario(model, family: str, S: int, seed: int):
    """Model-level inputs of one step and HF's expected logits and new keys/values.

    Row 0 holds a prompt of 5 tokens, row 1 none (its step starts at position 0), row 2 fills the
    cache up to its last S positions. Every cache position is first random garbage (a value that
    would change the logits if any token saw it); HF's prompt keys/values overwrite 0..len-1."""
    cfg = model.config
    layers, _, hkv, hd = attention_dims(family, cfg)
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 0, M - S]
    new = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    caches = [torch.randn(B, hkv, M, hd, generator=g) * 3 for _ in range(2 * layers)]
    logits = torch.empty(B, S, cfg.vocab_size)
    written = [torch.zeros(B, hkv, M, hd, dtype=torch.bool) for _ in caches]
    want_kv = [torch.zeros(B, hkv, M, hd) for _ in caches]
    with torch.no_grad():
        for b, n in enumerate(lengths):
            prompt = torch.randint(0, cfg.vocab_size, (n,), generator=g)
            if n:
                out = model(input_ids=prompt[None], use_cache=True)
                for layer, lyr in enumerate(out.past_key_values.layers):
                    caches[2 * layer][b, :, :n] = lyr.keys[0]
                    caches[2 * layer + 1][b, :, :n] = lyr.values[0]
            full = model(input_ids=torch.cat([prompt, new[b]])[None], use_cache=True)
            logits[b] = full.logits[0, n:]
            for layer, lyr in enumerate(full.past_key_values.layers):
                for j, t in enumerate((lyr.keys, lyr.values)):
                    want_kv[2 * layer + j][b, :, n:n + S] = t[0, :, n:n + S]
                    written[2 * layer + j][b, :, n:n + S] = True
    inputs = {"input_ids": new, "cache_position": torch.tensor(lengths),
              "past_key_values": [[caches[2 * i], caches[2 * i + 1]] for i in range(layers)]}
    return inputs, caches, logits, want_kv, written


def close(got, want, what, rel=1e-4):
    torch.testing.assert_close(got, want, rtol=0, atol=rel * want.abs().max().item(), msg=lambda m: f"{what}: {m}")


def check_step(session, model, family, S, seed):
    """One run_model step on `session` against HF (see scenario); the caller's caches stay as given."""
    inputs, caches, want_logits, want_kv, written = scenario(model, family, S, seed)
    given = [c.clone() for c in caches]
    res = session.run_model(**inputs)
    close(res["logits"], want_logits, "logits")
    layers = len(caches) // 2
    for i in range(2 * layers):
        name = f"past_key_values_{i // 2}_{i % 2}"
        got = res[name]
        assert got.shape == caches[i].shape and got.dtype == caches[i].dtype, name
        close(got[written[i]], want_kv[i][written[i]], f"{name} at the written positions")
        assert torch.equal(got[~written[i]], given[i][~written[i]]), f"{name}: a position not written changed"
        assert torch.equal(caches[i], given[i]), f"{name}: the caller's input changed (state_in_place is off)"
    return res


CASES = [(fam, tp, S) for fam in FAMILIES for tp in (1, 2) for S in (1, 3)]


@pytest.mark.parametrize("family, tp, S", CASES, ids=[f"{f}-tp{t}-s{s}" for f, t, s in CASES])
def test_static_step_equals_hf(checkpoints, built, family, tp, S):
    model = checkpoints[family][1]
    path = built(family, tp, S)
    sess = fastpipe.load(path)
    assert len(sess.pipeline.devices) == tp
    check_step(sess, model, family, S, seed=10 * tp + S)
    if tp == 2 and S > 1:   # the stitched region graph (one index_put per cache and rank) as well
        check_step(fastpipe.load(path, processor="region", compile="off"), model, family, S, seed=10 * tp + S + 1)


def test_flat_signature_with_max_len():
    llama, gpt2 = CONFIGS["llama"](), CONFIGS["gpt2"]()
    sig = flat_signature("llama", llama, 2, 3, max_len=10)
    caches = [f"past_key_values_{i}_{j}" for i in range(2) for j in (0, 1)]
    assert sig.input_names == ["input_ids", "cache_position", *caches]
    assert sig.output_names == ["logits", *caches]
    assert [t.idx for t in sig.inputs] == list(range(6)) and [t.idx for t in sig.outputs] == list(range(5))
    ins = {t.name: t for t in sig.inputs}
    assert ins["input_ids"].shape == (2, 3) and ins["input_ids"].dtype == torch.int64
    assert ins["cache_position"].shape == (2,) and ins["cache_position"].dtype == torch.int64
    assert sig.outputs[0].shape == (2, 3, 100) and sig.outputs[0].dtype == torch.float32
    for o in sig.outputs[1:]:
        assert o.shape == ins[o.name].shape == (2, 2, 10, 16) and o.dtype == ins[o.name].dtype == torch.float32
    assert sig.max_len == 10 and sig.past_len is None
    # past_len is ignored with max_len; num_kv_heads (a rank's) and dtype reach the caches
    assert flat_signature("llama", llama, 2, 3, past_len=5, max_len=10) == sig
    local = flat_signature("llama", llama, 2, 3, max_len=10, num_kv_heads=1, dtype=torch.bfloat16)
    assert local.inputs[2].shape == (2, 1, 10, 16) and local.inputs[2].dtype == torch.bfloat16
    assert local.outputs[0].dtype == torch.bfloat16
    g = flat_signature("gpt2", gpt2, 1, 1, max_len=64)          # exactly n_positions
    assert g.inputs[2].shape == (1, 4, 64, 16) and g.outputs[0].shape == (1, 1, 99)
    assert flat_signature("gpt2", gpt2, 4, 4, max_len=4).inputs[-1].shape == (4, 4, 4, 16)   # max_len == seq_len
    # bert has no cache: the signature has no max_len (build_hf refuses it, below)
    assert flat_signature("bert", CONFIGS["bert"](), 2, 3, past_len=None, max_len=8).max_len is None

    for bad in (2, 0, -1, True, 8.0, "8"):
        with pytest.raises(BuildError, match=r"^max_len: expected an integer >= seq_len \(3\)"):
            flat_signature("llama", llama, 2, 3, max_len=bad)
    with pytest.raises(BuildError, match="^max_len: expected at most the model's 64 positions, found 65$"):
        flat_signature("gpt2", gpt2, 2, 3, max_len=65)
    limit = llama.max_position_embeddings
    with pytest.raises(BuildError, match=f"^max_len: expected at most the model's {limit} positions"):
        flat_signature("llama", llama, 1, 1, max_len=limit + 1)


def test_build_refusals(checkpoints):
    with pytest.raises(BuildError, match="max_len: expected None for bert"):
        build_hf(checkpoints["bert"][0], batch=1, seq_len=4, max_len=8)
    with pytest.raises(BuildError, match="sequence_parallel: expected off with a static cache"):
        build_hf(checkpoints["gpt2"][0], tp=2, batch=1, seq_len=2, max_len=8, sequence_parallel=True)
    with pytest.raises(BuildError, match=r"max_len: expected an integer >= seq_len \(4\), found 3"):
        build_hf(checkpoints["llama"][0], batch=1, seq_len=4, max_len=3)
    with pytest.raises(BuildError, match="max_len: expected at most the model's 64 positions, found 65"):
        build_hf(checkpoints["gpt2"][0], batch=1, seq_len=1, max_len=65)


@pytest.mark.parametrize("tp", [1, 2])
def test_metadata_pairs_every_cache_slice(checkpoints, built, tp):
    family = "llama"
    model = checkpoints[family][1]
    layers, _, hkv, hd = attention_dims(family, model.config)
    p = fastpipe.load(built(family, tp, 1)).pipeline
    meta = p.metadata
    caches = [f"past_key_values_{i}_{j}" for i in range(layers) for j in (0, 1)]
    assert list(meta.tensors_outputs) == ["logits", *caches]
    assert set(meta.tensors_inputs) == {"input_ids", "cache_position", *caches}
    assert (meta.tensors_inputs["cache_position"].shape, meta.tensors_inputs["cache_position"].dtype) == ((B,), "i64")
    for c in caches:
        i, o = meta.tensors_inputs[c], meta.tensors_outputs[c]
        assert (i.shape, i.dtype) == (o.shape, o.dtype) == ((B, hkv, M, hd), "f32"), c
    pairs = state_pairs(p)
    cache_slices = {n for n, s in meta.slices_inputs.items() if s.origin in caches}
    assert len(cache_slices) == 2 * layers * tp and set(pairs) == cache_slices
    assert len(set(pairs.values())) == len(pairs)
    heads = set()
    for i, o in pairs.items():
        si, so = meta.slices_inputs[i], meta.slices_outputs[o]
        assert (si.origin, si.placements, si.device) == (so.origin, so.placements, so.device), (i, o)
        assert (p.tensors[i].shape, p.tensors[i].dtype) == (p.tensors[o].shape, p.tensors[o].dtype)
        assert p.tensors[i].shape == (B, hkv // tp, M, hd)
        heads.add((si.origin, si.placements[1], si.device))
    # with tp=2 each rank holds its own KV heads, on its own slot
    assert len(heads) == len(pairs) and {d for _, _, d in heads} == set(p.devices)


def test_producer_style_static_pipeline_runs_the_same(checkpoints, built, tmp_path):
    from tests.test_producer_style import check_layout

    family, tp, S = "gpt2", 2, 3
    folder, model = checkpoints[family]
    path = build_hf(folder, tp=tp, batch=B, seq_len=S, max_len=M).save(tmp_path / "producer", style="producer")
    check_layout(json.loads(path.read_text()), path.parent)
    prod, ours = fastpipe.load(path), fastpipe.load(built(family, tp, S))
    assert len(state_pairs(prod.pipeline)) == len(state_pairs(ours.pipeline)) == 2 * 2 * tp
    got = check_step(prod, model, family, S, seed=77)
    want = ours.run_model(**scenario(model, family, S, seed=77)[0])
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_static_trace_ops_are_documented(checkpoints, family, dtype):
    """As tests/test_hf_harness.py for the other forms: every traced target is in ATEN_OPS (and aten)."""
    model, config, fam, params = skeleton_params(checkpoints[family][0], dtype=dtype)
    seen: set[str] = set()
    for S in (1, 3):
        ff = traced_forward(model, fam, config, batch=2, seq_len=S, max_len=8)
        assert ff.signature.max_len == 8 and ff.signature.inputs[2].dtype == dtype
        for buffers in ("inputs", "constants"):
            gm = trace_fake(ff, params, buffers=buffers)
            targets = call_targets(gm)
            assert targets <= ATEN_OPS, sorted(targets - ATEN_OPS)
            for n in gm.graph.nodes:
                if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
                    assert n.target.namespace == "aten", n.target
            seen |= targets
            # the caches are written by index_put (functional), never concatenated onto
            puts = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == "aten.index_put.default"]
            assert len(puts) == 2 * config.num_hidden_layers
    assert {"aten.index_put.default", "aten.full.default"} <= seen
