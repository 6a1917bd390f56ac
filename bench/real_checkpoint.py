"""Random checkpoints of real model geometries, written tensor by tensor.

    python -m bench.real_checkpoint llama-3.1-8b /data/llama8b          # config.json + sharded safetensors
    python -m bench.real_checkpoint llama-3.2-1b /tmp/l1b --layers 2    # the same geometry, 2 layers

    write_checkpoint("qwen2.5-7b", folder)                  # -> folder
    write_checkpoint(replace(GEOMETRIES["llama-3.2-1b"], layers=2, vocab=512), folder)

A real model's speed depends on its shapes, not on its trained values: these checkpoints have the
named models' shapes (head counts, GQA ratio, intermediate size, vocabulary, tied or untied
embeddings, Qwen2's q/k/v biases, Llama 3's rope scaling) and random bf16 weights, so a benchmark
runs at real size with no download. config.json is written as the models' own files spell it.

Memory: each tensor is generated and written in chunks of rows (64 MiB of f32 at a time), so the
writer's peak RSS grows by a few chunks over the imports (tests/test_real_checkpoint.py), whatever
the model's size; the safetensors header is computed first from the shapes alone. A shard is
written to `<name>.partial` and renamed when complete.

Values: the embedding and the linear weights are N(0, 0.02) (the models' own initializer range),
biases N(0, 0.02), layer norms 1. Two choices keep greedy decoding from collapsing onto one token,
as random weights otherwise do (values do not change what a step costs):
  * o_proj is N(0, 0.002): at 0.02 the attention output, a near-uniform average over the history,
    dominates the residual stream, so every step's state and its argmax are alike;
  * the final norm's weights are random signs (+-1): a tied head (Llama-3.2-1B) scores the state
    against the embedding it came from, and with weights 1 a token predicts itself.
Hidden states stay finite in bf16. Each tensor's values depend only on (seed, its name), not on
the sharding.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import torch

CHUNK_ELEMENTS = 16 * 2**20            # f32 elements generated at once (64 MiB)
STD = 0.02


@dataclass(frozen=True)
class Geometry:
    """A decoder's shapes. family: "llama" or "qwen2" (q/k/v biases)."""
    name: str
    family: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float
    rms_eps: float
    max_positions: int
    rope_scaling: dict | None = None   # Llama 3's "llama3" scaling, as its config.json writes it

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        return sum(math.prod(s) for _, s in tensor_shapes(self))


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}

GEOMETRIES = {g.name: g for g in (
    Geometry("llama-3.2-1b", "llama", hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8,
             vocab=128256, tied=True, rope_theta=500000.0, rms_eps=1e-5, max_positions=131072,
             rope_scaling={**LLAMA3_SCALING, "factor": 32.0}),
    Geometry("llama-3.1-8b", "llama", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
             vocab=128256, tied=False, rope_theta=500000.0, rms_eps=1e-5, max_positions=131072,
             rope_scaling=dict(LLAMA3_SCALING)),
    Geometry("qwen2.5-7b", "qwen2", hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4,
             vocab=152064, tied=False, rope_theta=1000000.0, rms_eps=1e-6, max_positions=32768),
)}


def tensor_shapes(g: Geometry) -> list[tuple[str, tuple[int, ...]]]:
    """Every stored tensor, in the order the models' files hold them."""
    d, kv = g.head_dim, g.kv_heads * g.head_dim
    out = [("model.embed_tokens.weight", (g.vocab, g.hidden))]
    for i in range(g.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (g.hidden,)),
                (p + "self_attn.q_proj.weight", (g.heads * d, g.hidden)),
                (p + "self_attn.k_proj.weight", (kv, g.hidden)),
                (p + "self_attn.v_proj.weight", (kv, g.hidden))]
        if g.family == "qwen2":
            out += [(p + "self_attn.q_proj.bias", (g.heads * d,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        out += [(p + "self_attn.o_proj.weight", (g.hidden, g.heads * d)),
                (p + "post_attention_layernorm.weight", (g.hidden,)),
                (p + "mlp.gate_proj.weight", (g.intermediate, g.hidden)),
                (p + "mlp.up_proj.weight", (g.intermediate, g.hidden)),
                (p + "mlp.down_proj.weight", (g.hidden, g.intermediate))]
    out.append(("model.norm.weight", (g.hidden,)))
    if not g.tied:
        out.append(("lm_head.weight", (g.vocab, g.hidden)))
    return out


def config_json(g: Geometry) -> dict:
    """config.json as the model's own file spells it (the keys transformers 4 and 5 both read)."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[g.family]
    cfg = {"architectures": [arch], "model_type": g.family, "hidden_size": g.hidden,
           "intermediate_size": g.intermediate, "num_hidden_layers": g.layers, "num_attention_heads": g.heads,
           "num_key_value_heads": g.kv_heads, "vocab_size": g.vocab, "tie_word_embeddings": g.tied,
           "rope_theta": g.rope_theta, "rms_norm_eps": g.rms_eps, "max_position_embeddings": g.max_positions,
           "hidden_act": "silu", "initializer_range": STD, "torch_dtype": "bfloat16", "use_cache": True,
           "bos_token_id": 0, "eos_token_id": 1, "attention_dropout": 0.0}
    if g.family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, head_dim=g.head_dim, rope_scaling=g.rope_scaling,
                   pretraining_tp=1)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=g.layers)
    return cfg


def write_checkpoint(geometry: str | Geometry, folder: str | Path, *, layers: int | None = None, seed: int = 0,
                     shard_bytes: int = 5 * 2**30) -> Path:
    """Write config.json and model[-0000k-of-0000n].safetensors (+ the index when sharded) into folder."""
    g = GEOMETRIES[geometry] if isinstance(geometry, str) else geometry
    if layers is not None:
        g = replace(g, layers=layers)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(g):
        n = math.prod(shape) * 2
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, tensors in zip(files, shards):
        _write_shard(folder / file, tensors, seed)
    if len(shards) > 1:
        weight_map = {name: file for file, tensors in zip(files, shards) for name, _ in tensors}
        total = sum(math.prod(s) * 2 for _, s in tensor_shapes(g))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps(config_json(g), indent=2))
    return folder


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape in tensors:
            _write_tensor(f, name, shape, seed)
    tmp.replace(path)


def _write_tensor(f, name: str, shape: tuple[int, ...], seed: int) -> None:
    gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little"))
    if name == "model.norm.weight":
        f.write(memoryview((torch.randint(0, 2, shape, generator=gen) * 2 - 1).to(torch.bfloat16).view(torch.uint8).numpy()))
        return
    if name.endswith("norm.weight"):
        f.write(memoryview(torch.ones(shape, dtype=torch.bfloat16).view(torch.uint8).numpy()))
        return
    std = STD / 10 if name.endswith("o_proj.weight") else STD
    cols = shape[-1]
    rows = math.prod(shape) // cols
    step = max(1, CHUNK_ELEMENTS // cols)
    for r in range(0, rows, step):
        chunk = torch.empty(min(step, rows - r), cols).normal_(0.0, std, generator=gen)   # [rows, cols] f32
        f.write(memoryview(chunk.to(torch.bfloat16).view(torch.uint8).numpy()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("geometry", choices=sorted(GEOMETRIES))
    ap.add_argument("folder")
    ap.add_argument("--layers", type=int, help="keep the geometry, with this many layers")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out = write_checkpoint(a.geometry, a.folder, layers=a.layers, seed=a.seed)
    g = replace(GEOMETRIES[a.geometry], layers=a.layers or GEOMETRIES[a.geometry].layers)
    print(f"wrote {out}: {a.geometry}, {g.layers} layers, {g.parameters() / 1e9:.2f}B parameters, bf16")


if __name__ == "__main__":
    main()
