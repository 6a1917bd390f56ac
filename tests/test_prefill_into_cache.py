"""A prefill written straight into rows of a static KV cache (build_hf(..., max_len=M, cache_rows=R)),
against the unsplit Hugging Face model.

The cache [R, Hkv, M, D] starts as random garbage. Batch rows 0, 1 and 3 are prompts of different
lengths (right-padded), going to cache rows 2, 0 and 9 (clamped: 3); row 2 is a pad row (other tokens)
pointing at row 0's cache row, as the serving engine's pad rows do. Expected: each prompt's cache row
holds, at positions 0..S-1, HF's keys/values of that row's padded tokens (row 0's, not the pad row's:
the first batch row naming a cache row is the one written); every other position and row is untouched;
the logits are HF's at each row's logits_index. Also: the signature and its refusals, the metadata's
state pairs (so state_in_place writes into the caller's cache), the region processor writing in place
with index_put_, and the traced ops (ATEN_OPS).
"""
from __future__ import annotations

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


def run_model_inputs(session, model_inputs: dict) -> dict:
    """The pipeline inputs of model-level inputs (the caches given as past_key_values [[k, v], ...])."""
    flat = {n: t for n, t in model_inputs.items() if n != "past_key_values"}
    for layer, (k, v) in enumerate(model_inputs["past_key_values"]):
        flat[f"past_key_values_{layer}_0"], flat[f"past_key_values_{layer}_1"] = k, v
    meta = session.pipeline.metadata
    return {n: flat[s.origin][tuple(slice(a, b) for a, b in s.placements)].contiguous()
            for n, s in meta.slices_inputs.items()}

B, S, M, R = 4, 6, 12, 4
LENGTHS = [6, 3, 2, 4]          # row 2 is the pad row
CACHE_ROW = [2, 0, 2, 9]        # row 3: out of range, clamped to R - 1
WRITTEN = {2: 0, 0: 1, 3: 3}    # cache row -> the batch row whose keys/values it holds


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows_hf")
    return {fam: (root / fam, make_checkpoint(fam, root / fam, seed=i + 11)) for i, fam in enumerate(("gpt2", "llama"))}


@pytest.fixture(scope="module")
def built(checkpoints, tmp_path_factory):
    cache: dict = {}

    def get(family, tp, last_logits=True):
        key = (family, tp, last_logits)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{family}_tp{tp}_rows")
            cache[key] = build_hf(checkpoints[family][0], tp=tp, batch=B, seq_len=S, max_len=M, cache_rows=R,
                                  last_logits=last_logits).save(out)
        return cache[key]
    return get


def scenario(model, family: str, seed: int, last_logits: bool = True):
    """(model-level inputs, the caches given, HF's logits, HF's keys/values per cache row [2L][Hkv, S, D])."""
    cfg = model.config
    layers, _, hkv, hd = attention_dims(family, cfg)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)       # pads: random tokens too (never read)
    caches = [torch.randn(R, hkv, M, hd, generator=g) * 3 for _ in range(2 * layers)]
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)                   # each row's padded prompt, causal
    index = torch.tensor([n - 1 for n in LENGTHS])
    logits = out.logits[torch.arange(B), index].unsqueeze(1) if last_logits else out.logits
    kv = [t for lyr in out.past_key_values.layers for t in (lyr.keys, lyr.values)]      # [B, Hkv, S, D] each
    inputs = {"input_ids": ids, "cache_row": torch.tensor(CACHE_ROW),
              "past_key_values": [[caches[2 * i], caches[2 * i + 1]] for i in range(layers)]}
    if last_logits:
        inputs["logits_index"] = index
    return inputs, caches, logits, kv


def close(got, want, what, rel=1e-4):
    torch.testing.assert_close(got, want, rtol=0, atol=rel * want.abs().max().item(), msg=lambda m: f"{what}: {m}")


def check_prefill(session, model, family, seed, *, last_logits=True):
    inputs, caches, want_logits, kv = scenario(model, family, seed, last_logits)
    given = [c.clone() for c in caches]
    res = session.run_model(**inputs)
    close(res["logits"], want_logits, "logits")
    for i in range(len(caches)):
        name = f"past_key_values_{i // 2}_{i % 2}"
        got = res[name]
        assert got.shape == caches[i].shape, name
        for row in range(R):
            if row in WRITTEN:
                close(got[row, :, :S], kv[i][WRITTEN[row]], f"{name}: cache row {row}")
                assert torch.equal(got[row, :, S:], given[i][row, :, S:]), f"{name}: row {row} past S changed"
            else:
                assert torch.equal(got[row], given[i][row]), f"{name}: cache row {row} (no prompt) changed"
        if not session.run_options.state_in_place:
            assert torch.equal(caches[i], given[i]), f"{name}: the caller's input changed (state_in_place is off)"
    return res


CASES = [("gpt2", 1), ("llama", 1), ("llama", 2), ("gpt2", 2)]


@pytest.mark.parametrize("family, tp", CASES, ids=[f"{f}-tp{t}" for f, t in CASES])
def test_prefill_into_cache_rows_equals_hf(checkpoints, built, family, tp):
    model = checkpoints[family][1]
    path = built(family, tp)
    sess = fastpipe.load(path, processor="reference")
    assert len(sess.pipeline.devices) == tp
    check_prefill(sess, model, family, seed=3 + tp)


def test_prefill_into_cache_rows_without_last_logits(checkpoints, built):
    model = checkpoints["llama"][1]
    check_prefill(fastpipe.load(built("llama", 2, last_logits=False), processor="reference"), model, "llama", seed=8, last_logits=False)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_region_processor_writes_the_prompts_into_the_callers_cache(checkpoints, built, compile):
    """state_in_place on the stitched region graph: every cache write is index_put_ on the caller's tensor."""
    model = checkpoints["llama"][1]
    sess = fastpipe.load(built("llama", 2), processor="region", compile=compile, compile_policy="raise",
                         state_in_place=True)
    layers = model.config.num_hidden_layers
    assert f"{4 * layers} state tensors updated in place ({4 * layers} by an in-place write)" in sess.describe()
    check_prefill(sess, model, "llama", seed=21)
    check_prefill(sess, model, "llama", seed=22)     # a second prompt set on the same session
    # pipeline-level: each rank's cache slice comes back as the very tensor given, its prompt rows written
    inputs = run_model_inputs(sess, scenario(model, "llama", seed=23)[0])
    before = {n: t.clone() for n, t in inputs.items()}
    outs = sess.run(inputs)
    for i, o in state_pairs(sess.pipeline).items():
        assert outs[o] is inputs[i], o
        assert not torch.equal(inputs[i][2, :, :S], before[i][2, :, :S]) and torch.equal(inputs[i][1], before[i][1]), i


def test_the_plan_counts_no_cache_the_region_processor_writes_in_place(built):
    """memory_report: with state_in_place the region processor writes the caches into the caller's tensors,
    so the plan's activations drop by up to their bytes; the processors that copy them in count them."""
    from fastpipe.lower import tensor_bytes

    path = built("llama", 2)

    def activations(**kw):
        with fastpipe.load(path, **kw) as s:
            return sum(r["activation_bytes"] for r in s.memory_report().values()), s

    plain, s = activations(processor="region")
    in_place, _ = activations(processor="region", state_in_place=True)
    state = sum(tensor_bytes(s.pipeline, o) for o in s.state.values())
    assert plain - state <= in_place < plain
    assert activations(processor="reference", state_in_place=True)[0] == activations(processor="reference")[0]


def test_metadata_pairs_the_caches(checkpoints, built):
    model = checkpoints["llama"][1]
    layers, _, hkv, hd = attention_dims("llama", model.config)
    p = fastpipe.load(built("llama", 2), processor="reference").pipeline
    meta = p.metadata
    caches = [f"past_key_values_{i}_{j}" for i in range(layers) for j in (0, 1)]
    assert set(meta.tensors_inputs) == {"input_ids", "logits_index", "cache_row", *caches}
    assert set(meta.tensors_outputs) == {"logits", *caches}
    assert (meta.tensors_inputs["cache_row"].shape, meta.tensors_inputs["cache_row"].dtype) == ((B,), "i64")
    assert meta.tensors_outputs["logits"].shape == (B, 1, model.config.vocab_size)
    for c in caches:
        assert meta.tensors_inputs[c].shape == meta.tensors_outputs[c].shape == (R, hkv, M, hd), c
    pairs = state_pairs(p)
    assert len(pairs) == 2 * layers * 2
    for i, o in pairs.items():
        assert p.tensors[i].shape == p.tensors[o].shape == (R, hkv // 2, M, hd)


def test_flat_signature_with_cache_rows():
    llama = CONFIGS["llama"]()
    sig = flat_signature("llama", llama, 2, 3, max_len=10, cache_rows=5, last_logits=True)
    caches = [f"past_key_values_{i}_{j}" for i in range(2) for j in (0, 1)]
    assert sig.input_names == ["input_ids", "logits_index", "cache_row", *caches]
    assert sig.output_names == ["logits", *caches]
    assert sig.cache_rows == 5 and sig.max_len == 10 and sig.last_logits
    assert sig.inputs[2].shape == (2,) and sig.inputs[2].dtype == torch.int64
    assert sig.outputs[0].shape == (2, 1, 100)
    for t in (*sig.inputs[3:], *sig.outputs[1:]):
        assert t.shape == (5, 2, 10, 16), t.name
    full = flat_signature("llama", llama, 2, 3, max_len=10, cache_rows=2)        # cache_rows == batch; every logit
    assert full.input_names == ["input_ids", "cache_row", *caches] and full.outputs[0].shape == (2, 3, 100)
    assert flat_signature("llama", llama, 2, 3, max_len=10).cache_rows is None

    with pytest.raises(BuildError, match=r"^cache_rows: expected with max_len"):
        flat_signature("llama", llama, 2, 3, cache_rows=4)
    for bad in (1, 0, True, 4.0):
        with pytest.raises(BuildError, match=r"^cache_rows: expected an integer >= batch \(2: a cache row per prompt\)"):
            flat_signature("llama", llama, 2, 3, max_len=10, cache_rows=bad)
    with pytest.raises(BuildError, match=r"^last_logits: expected off with a static-cache step"):
        flat_signature("llama", llama, 2, 3, max_len=10, last_logits=True)
    with pytest.raises(BuildError, match=r"^cache_rows: expected None for bert"):
        flat_signature("bert", CONFIGS["bert"](), 2, 3, past_len=None, cache_rows=4)


@pytest.mark.parametrize("family", ("gpt2", "llama"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_trace_ops_are_documented(checkpoints, family, dtype):
    model, config, fam, params = skeleton_params(checkpoints[family][0], dtype=dtype)
    seen: set[str] = set()
    for last in (False, True):
        ff = traced_forward(model, fam, config, batch=2, seq_len=3, max_len=8, cache_rows=3, last_logits=last)
        for buffers in ("inputs", "constants"):
            gm = trace_fake(ff, params, buffers=buffers)
            targets = call_targets(gm)
            assert targets <= ATEN_OPS, sorted(targets - ATEN_OPS)
            seen |= targets
            # the caches are only written (one index_put each), never read or concatenated onto
            puts = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == "aten.index_put.default"]
            assert len(puts) == 2 * config.num_hidden_layers
            caches = [n for n in gm.graph.nodes if n.op == "placeholder"][-2 * config.num_hidden_layers:]
            assert all([u.target for u in c.users] == [torch.ops.aten.index_put.default] for c in caches)
    assert {"aten.index_put.default", "aten.eq.Tensor", "aten.argmax.default"} <= seen


def test_build_refusals(checkpoints):
    with pytest.raises(BuildError, match=r"cache_rows: expected an integer >= batch \(4"):
        build_hf(checkpoints["llama"][0], batch=4, seq_len=2, max_len=8, cache_rows=2)
    with pytest.raises(BuildError, match="cache_rows: expected with max_len"):
        build_hf(checkpoints["llama"][0], batch=1, seq_len=2, cache_rows=2)
