"""bench/gptfast_llama.py (the gpt-fast-style baseline) against transformers' own Llama / Qwen2 forward:
tiny random checkpoints saved with save_pretrained (float32), loaded with gptfast_llama.load; prefill
and cached decode logits equal the full no-cache HF forward's at the same positions."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bench import gptfast_llama as gf  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, intermediate_size=96, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
ATOL = 1e-4


def make_hf(kind: str, folder, *, tie: bool = False, shard: bool = False, seed: int = 0, **extra):
    """A tiny random HF model (every parameter drawn, biases and norm weights included, so that all of
    them matter), saved to folder in float32; returns it in eval mode."""
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY, rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=tie, **extra)
        model_cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(**TINY, rope_theta=1000.0, tie_word_embeddings=tie, **extra)
        model_cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if "norm" in name else torch.randn_like(p) * 0.15)
    model.save_pretrained(folder, **({"max_shard_size": "40KB"} if shard else {}))
    return model


@torch.no_grad()
def check_against_hf(hf_model, folder, batch: int, prompt_len: int = 7, steps: int = 3):
    """Prefill prompt_len tokens, then decode `steps` given tokens one at a time; every logit row equals
    the HF full forward's (no cache) on the whole sequence at that position."""
    torch.manual_seed(1)
    seq = torch.randint(0, TINY["vocab_size"], (batch, prompt_len + steps))
    ref = hf_model(input_ids=seq, use_cache=False).logits  # [B, S + steps, V]
    assert ref.abs().max() > 1.0  # logits large enough that an atol of 1e-4 means something
    model = gf.load(folder, torch.float32)
    model.setup_caches(max_batch=batch, max_seq_len=32)
    got = gf.prefill(model, seq[:, :prompt_len], torch.arange(prompt_len))  # [B, V]
    torch.testing.assert_close(got, ref[:, prompt_len - 1], atol=ATOL, rtol=ATOL)
    for pos in range(prompt_len, prompt_len + steps):
        got = gf.decode_one_token(model, seq[:, pos:pos + 1], torch.tensor([pos]))
        torch.testing.assert_close(got, ref[:, pos], atol=ATOL, rtol=ATOL, msg=lambda m: f"pos {pos}: {m}")
    return model


def test_llama3_rope_scaling_prefill_and_decode_batch2(tmp_path):
    hf = make_hf("llama", tmp_path)
    cfg = (tmp_path / "config.json").read_text()
    assert '"rope_parameters"' in cfg and '"llama3"' in cfg  # transformers 5 writes rope_parameters
    model = check_against_hf(hf, tmp_path, batch=2)
    a = model.args
    assert (a.rope_scaling["rope_type"], a.n_kv_heads, a.head_dim, a.qkv_bias) == ("llama3", 2, 16, False)
    assert model.output.weight is not model.tok_embeddings.weight


def test_llama3_table_differs_from_unscaled():
    """The llama3 scaling changes the RoPE table within the test's 10 positions (so the test above sees it)."""
    a = gf.ModelArgs.from_hf({"model_type": "llama", **TINY, "rope_parameters": {"rope_theta": 1e4, **LLAMA3_ROPE}})
    plain = gf.ModelArgs.from_hf({"model_type": "llama", **TINY, "rope_theta": 1e4})
    assert (plain.rope_theta, plain.rope_scaling) == (1e4, None)
    assert (gf.rope_tables(a, 10)[0] - gf.rope_tables(plain, 10)[0]).abs().max() > 0.1


def test_llama_biases_and_old_rope_keys(tmp_path):
    """attention_bias / mlp_bias on a Llama; config.json rewritten with the pre-v5 rope_theta / rope_scaling keys."""
    import json

    hf = make_hf("llama", tmp_path, attention_bias=True, mlp_bias=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = check_against_hf(hf, tmp_path, batch=1)
    assert model.layers[0].attention.wo.bias is not None and model.layers[0].feed_forward.w2.bias is not None


def test_qwen2_qkv_bias_sharded(tmp_path):
    hf = make_hf("qwen2", tmp_path, shard=True)
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = check_against_hf(hf, tmp_path, batch=2)
    attn = model.layers[0].attention
    assert attn.wqkv.bias is not None and attn.wo.bias is None and model.args.rope_theta == 1000.0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tied_embeddings(tmp_path, kind):
    hf = make_hf(kind, tmp_path, tie=True)
    model = check_against_hf(hf, tmp_path, batch=1)
    assert model.output.weight is model.tok_embeddings.weight


@torch.no_grad()
def test_generate_greedy_matches_hf_argmax(tmp_path):
    """Each generated token is the argmax of HF's logits over the prompt plus the tokens before it."""
    hf = make_hf("llama", tmp_path)
    model = gf.load(tmp_path, torch.float32)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(2))
    toks = gf.generate_greedy(model, prompt, 4)
    assert toks.shape == (2, 4)
    ref = hf(input_ids=torch.cat([prompt, toks], 1), use_cache=False).logits[:, 4:-1].argmax(-1)
    assert torch.equal(toks, ref)


@torch.no_grad()
def test_compiled_decode_matches_eager(tmp_path):
    """torch.compile (default mode, fullgraph) of decode_one_token gives the eager logits (and HF's)."""
    hf = make_hf("llama", tmp_path)
    model = gf.load(tmp_path, torch.float32)
    seq = torch.randint(0, TINY["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(3))
    ref = hf(input_ids=seq, use_cache=False).logits
    torch._dynamo.reset()
    decode = gf.compiled_decoder(model, "cpu")
    model.setup_caches(1, 16)
    gf.prefill(model, seq[:, :4], torch.arange(4))
    for pos in (4, 5):
        # the same cache state for both: eager first, then the compiled call rewrites the same slot
        eager = gf.decode_one_token(model, seq[:, pos:pos + 1], torch.tensor([pos]))
        compiled = decode(seq[:, pos:pos + 1], torch.tensor([pos]))
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(compiled, ref[:, pos], atol=ATOL, rtol=ATOL)
