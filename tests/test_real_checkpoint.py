"""bench/real_checkpoint.py: random checkpoints of real geometries, written tensor by tensor."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench.real_checkpoint import GEOMETRIES, tensor_shapes, write_checkpoint

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]

# the models' published parameter counts (their model cards / safetensors metadata)
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248, "qwen2.5-7b": 7_615_616_512}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_geometry_has_its_models_published_parameter_count(name):
    assert GEOMETRIES[name].parameters() == PUBLISHED[name]


def small(name: str):
    """The geometry's family, head ratio and tying at a size a test runs."""
    g = GEOMETRIES[name]
    return replace(g, hidden=g.heads * 8, intermediate=96, layers=3, vocab=32000)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_transformers_loads_it_with_every_tensor_and_greedy_decoding_moves(tmp_path, name):
    g = small(name)
    write_checkpoint(g, tmp_path, shard_bytes=40_000)                   # several shards and an index
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(n for n, _ in tensor_shapes(g))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (g.heads, g.kv_heads, g.tied)
    stored = dict(tensor_shapes(g))
    for n, p in model.state_dict().items():                           # every parameter came from the file
        if n == "lm_head.weight" and g.tied:
            n = "model.embed_tokens.weight"
        assert tuple(p.shape) == stored[n], n
        assert p.dtype == torch.float32
    want = model.model.layers[0].mlp.up_proj.weight
    assert 0.015 < want.std().item() < 0.025 and not torch.equal(want, model.model.layers[1].mlp.up_proj.weight)
    ids = torch.tensor([[5, 17, 42]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]
    assert torch.isfinite(hidden).all()
    new = out[0, 3:].tolist()
    assert len(set(new)) >= 4, f"greedy decoding collapsed: {new}"


def test_values_depend_on_the_seed_and_the_name_not_on_the_sharding(tmp_path):
    from safetensors.torch import load_file

    g = small("llama-3.1-8b")
    write_checkpoint(g, tmp_path / "one")
    write_checkpoint(g, tmp_path / "many", shard_bytes=30_000)
    write_checkpoint(g, tmp_path / "seed1", seed=1)
    one = load_file(tmp_path / "one" / "model.safetensors")
    many = {}
    for f in (tmp_path / "many").glob("model-*.safetensors"):
        many.update(load_file(f))
    other = load_file(tmp_path / "seed1" / "model.safetensors")
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    assert all(t.dtype == torch.bfloat16 for t in one.values())
    assert not torch.equal(one["model.layers.0.self_attn.q_proj.weight"], other["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(one["model.layers.0.input_layernorm.weight"], torch.ones_like(one["model.norm.weight"]))
    assert set(one["model.norm.weight"].tolist()) == {-1.0, 1.0}


def test_peak_memory_is_one_chunk_not_the_model(tmp_path):
    """A 656 MiB checkpoint (tensors up to 64 MiB) written with the process's peak RSS growing by far less
    (one 64 MiB f32 chunk, its bf16 copy, the allocator's slack)."""
    code = (
        "import sys\n"
        "from dataclasses import replace\n"
        "from bench.real_checkpoint import GEOMETRIES, write_checkpoint\n"
        "def hwm():\n"
        "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')) * 1024\n"
        "g = replace(GEOMETRIES['llama-3.1-8b'], layers=3, vocab=8192, intermediate=4096)\n"
        "before = hwm()\n"
        "write_checkpoint(g, sys.argv[1])\n"
        "print(before, hwm(), g.parameters() * 2)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT, check=True)
    before, after, size = map(int, r.stdout.split())
    assert size > 300 * 2**20
    assert after - before < 0.5 * size, f"peak grew {(after - before) / 2**20:.0f} MiB writing {size / 2**20:.0f} MiB"
