"""Acceptance: fastpipe build + run on CPU reproduce the unsplit Hugging Face model (fp32, rel err <= 1e-4),
logits / hidden states and updated KV caches, for GPT-2, Llama (GQA) and BERT with tp in {1, 2, 4} and pp in {1, 2}."""
import copy

import pytest
import torch

import fastpipe
from fastpipe.errors import InvalidInput
from tests.hf_models import assert_outputs_match, hf_reference, make_checkpoint, run_model_level

from fastpipe.builder.hf.build import build_hf  # noqa: E402  (after the transformers importorskip)

B, S, P = 2, 8, 5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {fam: (root / fam, make_checkpoint(fam, root / fam, seed=i)) for i, fam in enumerate(("gpt2", "llama", "bert"))}


def originals(family, cfg, past_len, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    if family == "bert":
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, -3:] = 0                                 # padding in the second sequence
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.randint(0, 2, (B, S), generator=g)}, None
    ins = {"input_ids": ids}
    past = None
    if past_len is not None:
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        hd = cfg.hidden_size // heads
        past = [(torch.randn(B, kv, past_len, hd, generator=g), torch.randn(B, kv, past_len, hd, generator=g))
                for _ in range(cfg.num_hidden_layers if hasattr(cfg, "num_hidden_layers") else cfg.n_layer)]
        for layer, (k, v) in enumerate(past):
            ins[f"past_key_values_{layer}_0"], ins[f"past_key_values_{layer}_1"] = k, v
    return ins, past


CASES = [(fam, tp, pp, past) for fam in ("gpt2", "llama", "bert") for tp in (1, 2, 4) for pp in (1, 2)
         for past in ((None,) if fam == "bert" else (None, 0, P))]


@pytest.mark.parametrize("family, tp, pp, past_len", CASES, ids=[f"{f}-tp{t}-pp{p}-past{q}" for f, t, p, q in CASES])
def test_build_run_equals_unsplit(checkpoints, tmp_path, family, tp, pp, past_len):
    folder, model = checkpoints[family]
    built = build_hf(folder, tp=tp, pp=pp, batch=B, seq_len=S, past_len=past_len)
    sess = fastpipe.load(built.save(tmp_path / "out"), processor="reference")
    assert len(sess.pipeline.devices) == tp * pp
    ins, past = originals(family, model.config, past_len, seed=tp * 10 + pp)
    outs = run_model_level(sess, ins)
    ref = hf_reference(model, family, ins, past if past_len is not None else None)
    checked = assert_outputs_match(sess, outs, ref)
    assert checked >= len(sess.pipeline.metadata.slices_outputs) > 0
    # the region processor (every slot on the CPU: one stitched graph, shard matmuls merged) runs it too
    region = fastpipe.load(sess.pipeline, processor="region", compile="off")
    assert_outputs_match(region, run_model_level(region, ins), ref)
    for k, v in run_model_level(region, ins).items():
        torch.testing.assert_close(v, outs[k], rtol=1e-5, atol=1e-5 * max(1.0, outs[k].abs().max().item()))
    if past_len is not None:   # every layer's keys and values come back, sharded by KV heads over the ranks
        names = {s.origin for s in sess.pipeline.metadata.slices_outputs.values()}
        assert {f"past_key_values_{l}_{j}" for l in range(2) for j in (0, 1)} <= names


COMPILED = [("llama", 2, 1, P), ("gpt2", 2, 2, None), ("bert", 4, 1, None), ("llama", 4, 2, 0)]


@pytest.mark.parametrize("family, tp, pp, past_len", COMPILED, ids=[f"{f}-tp{t}-pp{p}-past{q}" for f, t, p, q in COMPILED])
def test_region_compiled_equals_reference_with_and_without_chunks(checkpoints, tmp_path, family, tp, pp, past_len):
    """Prefill and decode steps, one compiled graph for all tp x pp slots, against the reference
    processor on the same pipeline (and the unsplit model), whole and as two micro-batches."""
    import warnings

    folder, model = checkpoints[family]
    built = build_hf(folder, tp=tp, pp=pp, batch=B, seq_len=S, past_len=past_len)
    path = built.save(tmp_path / "out")
    ref = fastpipe.load(path, processor="reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)            # compiled whole: no break, no recompile
        sess = fastpipe.load(path, processor="auto", compile=True)
        assert sess.processor == "region" and len(sess.program.regions) == 1
        assert sess.compile().eager == ()
        ins, past = originals(family, model.config, past_len, seed=7)
        pins = {name: ins[sl.origin][tuple(slice(a, b) for a, b in sl.placements)].contiguous()
                for name, sl in sess.pipeline.metadata.slices_inputs.items()}
        want = ref.run(pins)
        got = sess.run(pins)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4 * max(1.0, want[k].abs().max().item()))
        assert_outputs_match(sess, got, hf_reference(model, family, ins, past if past_len is not None else None))
        two = sess.run({k: torch.cat([v, v]) for k, v in pins.items()}, chunks=2)
        for k in want:
            b = want[k].shape[0]
            for c in range(2):
                torch.testing.assert_close(two[k][c * b:(c + 1) * b], got[k], rtol=1e-5, atol=1e-5)


LAST = [("gpt2", 2, 2, 0, False), ("llama", 4, 1, 0, False), ("llama", 2, 2, P, False), ("llama", 2, 1, None, True),
        ("gpt2", 1, 1, 0, False)]


@pytest.mark.parametrize("family, tp, pp, past_len, sp", LAST, ids=[f"{f}-tp{t}-pp{p}-past{q}-sp{s}" for f, t, p, q, s in LAST])
def test_last_logits_equal_unsplit_logits_at_each_rows_position(checkpoints, tmp_path, family, tp, pp, past_len, sp):
    """A pipeline built with last_logits takes logits_index [B] and returns logits [B, 1, V]: the unsplit
    model's full logits read at each row's position (the caches unchanged by it), on the reference
    processor and the region one (compiled)."""
    folder, model = checkpoints[family]
    built = build_hf(folder, tp=tp, pp=pp, batch=B, seq_len=S, past_len=past_len, sequence_parallel=sp,
                     last_logits=True)
    sess = fastpipe.load(built.save(tmp_path / "out"), processor="reference")
    meta = sess.pipeline.metadata
    assert meta.tensors_inputs["logits_index"].shape == (B,) and meta.tensors_inputs["logits_index"].dtype == "i64"
    assert meta.tensors_outputs["logits"].shape == (B, 1, model.config.vocab_size)
    ins, past = originals(family, model.config, past_len, seed=5)
    ins["logits_index"] = torch.tensor([S - 1, 3])
    full = hf_reference(model, family, ins, past)
    ref = dict(full, logits=full["logits"][torch.arange(B), ins["logits_index"]].unsqueeze(1))    # [B, 1, V]
    assert assert_outputs_match(sess, run_model_level(sess, ins), ref) == len(meta.slices_outputs)
    region = fastpipe.load(sess.pipeline, processor="region", compile=True)
    assert_outputs_match(region, run_model_level(region, ins), ref)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel(checkpoints, tmp_path, family, tp):
    folder, model = checkpoints[family]
    built = build_hf(folder, tp=tp, pp=1, batch=B, seq_len=S, sequence_parallel=True)
    kinds = {st["kind"] for st in built.doc["supertasks"].values()}
    assert {"reduce_scatter", "all_gather"} <= kinds and "all_reduce" in kinds   # the embedding is still all-reduced
    sess = fastpipe.load(built.save(tmp_path / "out"), processor="reference")
    ins, _ = originals(family, model.config, None, seed=3)
    ref = hf_reference(model, family, ins, None)
    assert_outputs_match(sess, run_model_level(sess, ins), ref)
    region = fastpipe.load(sess.pipeline, processor="region", compile="off")      # reduce_scatter / all_gather as chunks and cats
    assert_outputs_match(region, run_model_level(region, ins), ref)


def test_lm_head_gathered_when_vocab_divides(checkpoints):
    built = build_hf(checkpoints["llama"][0], tp=2, batch=B, seq_len=S)   # vocab 100
    assert any(st["kind"] == "all_gather" for st in built.doc["supertasks"].values())
    built = build_hf(checkpoints["gpt2"][0], tp=2, batch=B, seq_len=S)    # vocab 99: whole head everywhere
    assert not any(st["kind"] == "all_gather" for st in built.doc["supertasks"].values())


def test_constants_are_slices_of_the_original_checkpoint(checkpoints, tmp_path):
    folder, _ = checkpoints["llama"]
    built = build_hf(folder, tp=2, pp=2, batch=B, seq_len=S)
    out = built.save(tmp_path / "out")
    consts = [t["value"] for t in built.doc["tensors"].values() if "value" in t]
    assert consts and {c["path"] for c in consts} == {"model.safetensors"}
    import os
    assert os.path.samefile(out.parent / "model.safetensors", folder / "model.safetensors")   # in place, not copied
    q = [c for c in consts if c["name"] == "model.layers.0.self_attn.q_proj.weight"]
    assert sorted(tuple(c["placements"][0]) for c in q) == [(0, 32), (32, 64)]


def test_identical_graphs_stored_once(checkpoints):
    built = build_hf(checkpoints["bert"][0], tp=4, batch=B, seq_len=S)
    refs = [st.get("data_blob") for st in built.doc["supertasks"].values() if st["kind"] == "fx"]
    assert built.doc.get("blobs") and sum(r is not None for r in refs) >= 4


HALF = [(fam, dt) for fam in ("gpt2", "llama", "bert") for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("family, dtype", HALF, ids=[f"{f}-{str(d)[6:]}" for f, d in HALF])
def test_half_precision_checkpoint(checkpoints, tmp_path, family, dtype):
    """A bf16/f16 checkpoint (what real ones are) builds at tp=2 with every weight in its dtype (the
    shards were once made float32: the build then failed on the logits' dtype), and runs like the
    unsplit model in that dtype, within its rounding."""
    _, model = checkpoints[family]
    folder = tmp_path / "ckpt"
    model = copy.deepcopy(model).to(dtype)
    model.save_pretrained(str(folder))
    past_len = None if family == "bert" else P
    sess = fastpipe.load(build_hf(folder, tp=2, batch=B, seq_len=S, past_len=past_len).save(tmp_path / "out"), processor="reference")
    name = "bf16" if dtype == torch.bfloat16 else "f16"
    assert {t.dtype for t in sess.pipeline.tensors.values() if t.is_constant and t.dtype != "i64"} == {name}
    ins, past = originals(family, model.config, past_len, seed=3)
    if past is not None:
        past = [(k.to(dtype), v.to(dtype)) for k, v in past]
        ins.update({n: v.to(dtype) for n, v in ins.items() if n.startswith("past_key_values_")})
    outs = run_model_level(sess, ins)
    assert_outputs_match(sess, outs, hf_reference(model, family, ins, past), rtol=3e-2)


def test_build_dtype_must_match_the_checkpoint(checkpoints):
    """Weights are slices of the checkpoint: a build dtype other than the stored one is refused at
    build time, naming the tensor (not later, at load)."""
    with pytest.raises(InvalidInput, match=r"\['model.embed_tokens.weight'\]: expected dtype bf16 for "
                                           r"model.embed_tokens.weight \(the build's dtype\), found F32"):
        build_hf(checkpoints["llama"][0], tp=2, batch=B, seq_len=S, dtype=torch.bfloat16)


def test_refusals(checkpoints):
    with pytest.raises(InvalidInput, match="tp: expected a divisor of num_attention_heads=4, found 3"):
        build_hf(checkpoints["gpt2"][0], tp=3, batch=B, seq_len=S)
    with pytest.raises(InvalidInput, match=r"pp: expected at most the number of layers \(2\), found 3"):
        build_hf(checkpoints["gpt2"][0], pp=3, batch=B, seq_len=S)
    with pytest.raises(InvalidInput, match="sequence_parallel: expected seq_len divisible by tp=4, found 6"):
        build_hf(checkpoints["gpt2"][0], tp=4, batch=B, seq_len=6, sequence_parallel=True)


def test_cli_build_then_run_check(checkpoints, tmp_path, capsys):
    from safetensors.torch import save_file

    from fastpipe.cli import main

    folder, model = checkpoints["llama"]
    out = tmp_path / "out"
    assert main(["build", str(folder), "--tp", "2", "--pp", "2", "--batch", str(B), "--seq-len", str(S), "-o", str(out)]) == 0
    assert "4 slots" in capsys.readouterr().out
    ins, _ = originals("llama", model.config, None, seed=9)
    ref = hf_reference(model, "llama", ins, None)["logits"]
    save_file(ins, str(tmp_path / "in.safetensors"))
    save_file({"logits": ref, "logits_rank1": ref.clone()}, str(tmp_path / "expected.safetensors"))
    assert main(["run", str(out / "pipeline.json"), "--inputs", str(tmp_path / "in.safetensors"),
                 "--check", str(tmp_path / "expected.safetensors")]) == 0
    assert "check: 2 outputs match" in capsys.readouterr().out


def test_cli_build_last_logits_then_run_check(checkpoints, tmp_path, capsys):
    """`fastpipe build --past-len 0 --last-logits`: a prefill taking logits_index; `fastpipe run` checks it
    against the unsplit model's logits at those positions, and runs it on random inputs too."""
    from safetensors.torch import save_file

    from fastpipe.cli import main

    folder, model = checkpoints["gpt2"]
    out = tmp_path / "out"
    assert main(["build", str(folder), "--tp", "2", "--batch", str(B), "--seq-len", str(S), "--past-len", "0",
                 "--last-logits", "-o", str(out)]) == 0
    capsys.readouterr()
    ins, _ = originals("gpt2", model.config, None, seed=4)
    ins["logits_index"] = torch.tensor([2, S - 1])
    full = hf_reference(model, "gpt2", ins, [])
    want = {"logits": full["logits"][torch.arange(B), ins["logits_index"]].unsqueeze(1)}      # [B, 1, V]
    save_file(ins, str(tmp_path / "in.safetensors"))
    save_file(want, str(tmp_path / "expected.safetensors"))
    assert main(["run", str(out / "pipeline.json"), "--inputs", str(tmp_path / "in.safetensors"),
                 "--check", str(tmp_path / "expected.safetensors")]) == 0
    assert "check: 1 outputs match" in capsys.readouterr().out
    assert main(["run", str(out / "pipeline.json")]) == 0                   # seeded random inputs


def test_cli_build_errors(checkpoints, tmp_path, capsys):
    from fastpipe.cli import main

    assert main(["build", str(tmp_path), "-o", str(tmp_path / "o")]) == 2
    assert "model: expected a Hugging Face checkpoint folder with config.json" in capsys.readouterr().err
    assert main(["build", str(checkpoints["gpt2"][0]), "--tp", "3", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tp: expected a divisor of num_attention_heads=4, found 3" in err
