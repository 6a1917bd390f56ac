"""The engine serves every layout the builder makes: tensor parallelism 1, 2 and 4 (wider than the KV heads
too: each rank holds its own copy of a replicated head), pipeline stages, tied and untied embeddings,
biases. Each layout's tokens equal transformers' greedy generate on the same checkpoint."""
import pytest
import torch

from fastpipe.serving.build import build_serving_set
from fastpipe.serving.engine import Engine

transformers = pytest.importorskip("transformers")
from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint  # noqa: E402

MAX_LEN, NEW = 24, 12


def _llama(heads=4, kv=2, tied=False):
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=heads,
                                    num_key_value_heads=kv, intermediate_size=128, vocab_size=96,
                                    tie_word_embeddings=tied)


def _qwen2(heads=4, kv=1, tied=True):         # q, k and v projections with biases
    return transformers.Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=heads,
                                    num_key_value_heads=kv, intermediate_size=128, vocab_size=96,
                                    tie_word_embeddings=tied)


LAYOUTS = {   # name: (config, tp, pp)
    "llama-tp1-untied": (lambda: _llama(), 1, 1),
    "llama-tp4": (lambda: _llama(heads=8, kv=4), 4, 1),
    "llama-pp2": (lambda: _llama(), 1, 2),
    "llama-tp2-pp2-tied": (lambda: _llama(tied=True), 2, 2),
    "qwen2-tp2-over-1-kv-head-tied-bias": (lambda: _qwen2(), 2, 1),
    "qwen2-tp4-over-2-kv-heads-untied-bias": (lambda: _qwen2(kv=2, tied=False), 4, 1),
    "gpt2-tp2-tied-bias": (lambda: transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=96,
                                                           n_positions=64), 2, 1),
}


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_serves_transformers_greedy_tokens(layout, tmp_path):
    make, tp, pp = LAYOUTS[layout]
    config = make()
    model = save_random_checkpoint(config, tmp_path / "m", seed=5).eval()
    build_serving_set(tmp_path / "m", tmp_path / "set", max_len=MAX_LEN, batches=(2,), prompt_lens=(8,), tp=tp, pp=pp)
    g = torch.Generator().manual_seed(len(layout))
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 8, 5)]
    with Engine(tmp_path / "set", eos_token_id=None, compile=False) as eng:
        got = eng.generate(prompts, max_new_tokens=NEW)
        caches = list(eng.kv.tensors.values())
        # every rank's cache is a tensor of its own, however many ranks hold the same KV head
        assert len({t.untyped_storage().data_ptr() for t in caches}) == len(caches)
    assert [r for r in got] == [_hf_greedy(model, p, NEW) for p in prompts]
