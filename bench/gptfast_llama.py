"""A minimal gpt-fast-style Llama / Qwen2, used as a benchmark baseline.

Written from the architecture (not copied from gpt-fast or transformers): plain nn.Modules, a static KV
cache in registered buffers written with index_copy_ at `input_pos`, SDPA over the whole cache with a
boolean causal-mask row per position, fused wqkv / w13 projections, and plain `prefill` /
`decode_one_token` functions for the caller to wrap in torch.compile (as gpt-fast does).

    model = load(folder, torch.bfloat16, "cuda")         # HF config.json + safetensors (Llama, Qwen2)
    model.setup_caches(max_batch=1, max_seq_len=512)
    toks = generate_greedy(model, prompt, 128, compiled_prefill(model, "cuda"), compiled_decoder(model, "cuda"))

RoPE rotates the two halves of each head (the HF checkpoint layout: no weight permutation), default or
"llama3"-scaled (Llama-3.1/3.2). Not supported: sliding windows, other RoPE scalings, partial rotary.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # the "llama3" parameters, or None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        """From an HF config.json dict (transformers 5 `rope_parameters`, or older `rope_theta`/`rope_scaling`)."""
        if cfg.get("model_type", "llama") not in ("llama", "qwen2"):
            raise NotImplementedError(f"model_type {cfg.get('model_type')!r}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise NotImplementedError(f"rope_type {kind!r}")
        heads = cfg["num_attention_heads"]
        attn_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
            n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=rope if kind == "llama3" else None,
            qkv_bias=attn_bias or cfg.get("model_type") == "qwen2",  # Qwen2: q/k/v biases, none on o_proj
            o_bias=attn_bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def rope_tables(a: ModelArgs, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [seq_len, head_dim] float32; the frequencies repeated over both halves of a head."""
    inv_freq = 1.0 / a.rope_theta ** (torch.arange(0, a.head_dim, 2, device=device).float() / a.head_dim)  # [D/2]
    if a.rope_scaling is not None:  # llama3: keep high frequencies, divide low ones by factor, blend between
        s = a.rope_scaling
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        blend = ((old / wavelen - lo) / (hi - lo)).clamp(0, 1)  # 0 at wavelen >= old/lo, 1 at wavelen <= old/hi
        inv_freq = (1 - blend) * inv_freq / factor + blend * inv_freq
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, D]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, S, D]; cos, sin: [S, D]
    x1, x2 = x.chunk(2, dim=-1)  # [B, H, S, D/2] each
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., D]; normalized in float32, scaled in x's dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class KVCache(nn.Module):
    def __init__(self, max_batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (max_batch, n_kv_heads, max_seq_len, head_dim)  # [Bmax, Hkv, T, D]
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # input_pos: [S]; k, v: [B, Hkv, S, D] -> whole caches of the first B rows, [B, Hkv, T, D]
        kc, vc = self.k_cache[: k.shape[0]], self.v_cache[: k.shape[0]]
        kc.index_copy_(2, input_pos, k)
        vc.index_copy_(2, input_pos, v)
        return kc, vc


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.wqkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=a.qkv_bias)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=a.o_bias)
        self.kv_cache: KVCache | None = None

    def forward(self, x, cos, sin, mask, input_pos):
        # x: [B, S, dim]; cos, sin: [S, D]; mask: [1, 1, S, T] bool; input_pos: [S]
        B, S, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))  # q: [B, H, S, D]; k, v: [B, Hkv, S, D]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = self.kv_cache.update(input_pos, k, v)  # [B, Hkv, T, D]
        k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))  # GQA: [B, H, T, D] each
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, S, D]
        return self.wo(y.transpose(1, 2).reshape(B, S, H * D))  # [B, S, dim]


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.inter = a.intermediate_size
        self.w13 = nn.Linear(a.dim, 2 * a.intermediate_size, bias=a.mlp_bias)  # gate ; up
        self.w2 = nn.Linear(a.intermediate_size, a.dim, bias=a.mlp_bias)  # down

    def forward(self, x):
        # x: [B, S, dim] -> [B, S, dim]
        gate, up = self.w13(x).split(self.inter, dim=-1)  # [B, S, I] each
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(a.dim, a.norm_eps), Attention(a)
        self.ffn_norm, self.feed_forward = RMSNorm(a.dim, a.norm_eps), FeedForward(a)

    def forward(self, x, cos, sin, mask, input_pos):
        # x: [B, S, dim] -> [B, S, dim]
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        if a.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch = self.max_seq_len = -1

    def setup_caches(self, max_batch: int, max_seq_len: int, dtype=None, device=None):
        """KV caches [max_batch, Hkv, max_seq_len, D] per layer, RoPE tables and the causal mask, as buffers
        (dtype/device default to the weights')."""
        a, w = self.args, self.output.weight
        dtype, device = dtype or w.dtype, device or w.device
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch, a.n_kv_heads, max_seq_len, a.head_dim, dtype, device)
        cos, sin = rope_tables(a, max_seq_len, device)
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)  # [T, D]
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)  # [T, D]
        mask = torch.tril(torch.ones(max_seq_len, max_seq_len, dtype=torch.bool, device=device))
        self.register_buffer("causal_mask", mask, persistent=False)  # [T, T]

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        # idx: [B, S] long; input_pos: [S] long, the same positions for every row -> logits [B, S, V]
        mask = self.causal_mask[None, None, input_pos]  # [1, 1, S, T]
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [S, D]
        x = self.tok_embeddings(idx)  # [B, S, dim]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x))  # [B, S, V]


def _layer_names(a: ModelArgs) -> dict:
    """Our per-layer module -> (the HF modules concatenated into it, whether it has a bias)."""
    return {"attention_norm": (["input_layernorm"], False), "ffn_norm": (["post_attention_layernorm"], False),
            "attention.wqkv": ([f"self_attn.{n}_proj" for n in "qkv"], a.qkv_bias),
            "attention.wo": (["self_attn.o_proj"], a.o_bias),
            "feed_forward.w13": (["mlp.gate_proj", "mlp.up_proj"], a.mlp_bias),
            "feed_forward.w2": (["mlp.down_proj"], a.mlp_bias)}


def load(folder, dtype: torch.dtype = torch.bfloat16, device="cpu") -> Transformer:
    """A Transformer from an HF Llama/Qwen2 checkpoint folder (config.json + model.safetensors, or shards
    listed in model.safetensors.index.json). Built on the meta device and filled with assign=True: the
    tensors read are used as they are (cast only where the dtype differs); q/k/v and gate/up are
    concatenated into wqkv and w13 (one copy of those)."""
    from safetensors import safe_open

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    hf = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt", device=str(device)) as f:
            for key in f.keys():
                hf[key] = f.get_tensor(key).to(dtype)
    if "lm_head.weight" not in hf:  # saved tied: no lm_head at all
        cfg = {**cfg, "tie_word_embeddings": True}
    a = ModelArgs.from_hf(cfg)

    def take(*keys):  # one tensor, or the concatenation of several along dim 0
        return hf.pop(keys[0]) if len(keys) == 1 else torch.cat([hf.pop(k) for k in keys])

    sd = {"tok_embeddings.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    sd["output.weight"] = sd["tok_embeddings.weight"] if a.tie_embeddings else take("lm_head.weight")
    hf.pop("lm_head.weight", None)  # tied in the config but saved anyway
    for i in range(a.n_layers):
        for ours, (theirs, bias) in _layer_names(a).items():
            for suffix in ("weight", "bias") if bias else ("weight",):
                sd[f"layers.{i}.{ours}.{suffix}"] = take(*(f"model.layers.{i}.{t}.{suffix}" for t in theirs))
    left = [k for k in hf if not k.endswith("rotary_emb.inv_freq")]
    if left:
        raise ValueError(f"unused checkpoint tensors: {left[:5]}")
    with torch.device("meta"):
        model = Transformer(a)
    model.load_state_dict(sd, strict=True, assign=True)
    if a.tie_embeddings:  # assign=True put two Parameters over one tensor: make them one again
        model.output.weight = model.tok_embeddings.weight
    return model.eval().requires_grad_(False)


def prefill(model: Transformer, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    # idx: [B, S]; input_pos: [S] -> logits of the last position [B, V]
    return model(idx, input_pos)[:, -1]


def decode_one_token(model: Transformer, cur: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    # cur: [B, 1]; input_pos: [1] -> logits [B, V]
    return model(cur, input_pos)[:, -1]


def _compiled(fn, model, device, mode):
    mode = mode or ("reduce-overhead" if torch.device(device).type == "cuda" else "default")
    compiled = torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)
    return lambda tokens, input_pos: compiled(model, tokens, input_pos)


def compiled_decoder(model: Transformer, device, mode: str | None = None):
    """decode(cur [B, 1], input_pos [1]) -> [B, V], compiled (fullgraph; "reduce-overhead" on CUDA, else default).
    Under CUDA graphs the next call overwrites the returned logits: use (or clone) them first."""
    return _compiled(decode_one_token, model, device, mode)


def compiled_prefill(model: Transformer, device, mode: str | None = "default"):
    """prefill(idx [B, S], input_pos [S]) -> [B, V], compiled (fullgraph, dynamic=False: a graph per shape)."""
    return _compiled(prefill, model, device, mode)


@torch.no_grad()
def generate_greedy(model: Transformer, prompt: torch.Tensor, n: int, prefill_fn=None, decode_fn=None):
    """Greedy tokens [B, n] after prompt [B, S]; prefill_fn / decode_fn default to the eager functions (or pass
    compiled_prefill(...) / compiled_decoder(...)). Sets up the caches if missing or too small."""
    B, S = prompt.shape
    if model.max_batch < B or model.max_seq_len < S + n:
        model.setup_caches(B, S + n)
    prefill_fn = prefill_fn or partial(prefill, model)
    decode_fn = decode_fn or partial(decode_one_token, model)
    cur = prefill_fn(prompt, torch.arange(S, device=prompt.device)).argmax(-1, keepdim=True)  # [B, 1]
    out = [cur]
    for i in range(n - 1):
        cur = decode_fn(cur, torch.tensor([S + i], device=prompt.device)).argmax(-1, keepdim=True)  # [B, 1]
        out.append(cur)
    return torch.cat(out, dim=1)  # [B, n]
