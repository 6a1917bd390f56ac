"""Real size: a 1B-8B geometry's decode step and prefill, fastpipe against the strongest baselines,
as fractions of the device's measured copy bandwidth and matmul rate.

    python bench/report_real_size.py --geometry llama-3.2-1b --tp 2 --batches 1,8 --device cpu
    python bench/report_real_size.py --checkpoint /data/l8b --tp 2 --batches 1,8,32 --prompt-lens 512,2048
    python bench/report_real_size.py --geometry llama-3.1-8b --tp 2 --fastpipe-only --check-against l.pt

The checkpoint is a folder (--checkpoint) or a random one of a named geometry written first
(bench/real_checkpoint.py; --layers keeps the geometry with fewer layers). Rows, in one process,
from the same checkpoint, on one device (cuda:0 or the CPU), in bf16:

  fastpipe                  build_hf(tp) of the serving engine's decode step (a static cache of M
                            positions written in place at cache_position), loaded with
                            processor="auto" (the region processor: every slot's steps as one graph,
                            shard matmuls merged), compiled; on a GPU replayed as one CUDA graph with
                            its outputs aliased, as the engine runs it. Prefill: the serving prefill
                            (the prompt's keys and values written into its cache row, the last
                            token's logits out).
  transformers static       the Hugging Face model on a StaticCache of M positions, forward compiled
                            (fullgraph, dynamic=False; mode="reduce-overhead" on a GPU), prefill
                            compiled too (logits_to_keep=1).
  gpt-fast style            bench/gptfast_llama.py: plain modules, the KV cache as buffers, one
                            compiled decode-one-token function (reduce-overhead on a GPU), prefill
                            compiled.

What each row reports: decode ms per step and tokens/s (batch x steps/s); bytes one step reads (the
weights each step reads: every weight but the embedding table, plus the batch's embedding rows, plus
the whole KV cache of M positions that each of these implementations reads) over the step's time,
as a % of the device's copy bandwidth measured in this run (a 1 GiB device copy, read + write bytes
over time, as STREAM's copy counts), timed in the same interleaved rounds as the case's rows. Prefill: time and tokens/s at each prompt length, and TFLOP/s
(2 x non-embedding parameters x tokens, plus the causal attention's 2 x layers x S^2 x heads x head_dim)
as a % of a large bf16 matmul timed in the same rounds.

Logits: every row's logits on the first --check-steps positions (each row's tokens fed one step at a
time from an empty cache) are checked against the unsplit model in float32: transformers' float32
model, when it fits in memory; else --check-against, the logits a run of this script saved with
--save-logits in another process; or, with --no-f32-check and the row "f32" in --rows, the float32
row of the same run. That row is the gpt-fast-style model's bf16 weights computed in float32, op by
op: the float32 model of the checkpoint in bf16's memory, sharing the gpt-fast row's weights (on a
GPU the check then loads no model of its own). A row passes when its largest error is within 2x the
bf16 unsplit models' own error (transformers' and gpt-fast's), or 3% of the largest |logit| when
neither ran.

Timing: after warm-up, the rows of a case are timed in interleaved rounds; a sample is the mean of
back-to-back calls of about --sample-ms, each followed by a device synchronize; the median of
--repeat samples is reported. Results go to --json with machine, date and versions.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gptfast_llama as gf  # noqa: E402
from bench.machine import machine_info  # noqa: E402

DTYPE = torch.bfloat16


# ------------------------------------------------------------------------------------- the device
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


COPY_BYTES = 2**30


def copy_row(dev: torch.device) -> "Row":
    """A row whose step copies COPY_BYTES on the device: timed with a case's rows, in the same rounds, it
    gives the copy bandwidth of the moments the rows ran (a shared machine's bandwidth drifts)."""
    a = torch.ones(COPY_BYTES // 2, dtype=DTYPE, device=dev)
    b = torch.empty_like(a)
    return Row("device copy", lambda tokens, pos: b.copy_(a))


GEMM_FLOOR = "the model's matmuls alone (F.linear on each weight, no other op)"


def gemm_floor_row(model, batch: int, dev: torch.device) -> "Row":
    """A row that runs only the decode step's GEMMs (F.linear of a [batch, in] activation with each linear
    weight of the gpt-fast-style model, the head included): what this device's GEMM kernels alone take to
    read the weights, the floor for every row built on them."""
    ws = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], device=dev).to(w.dtype) for w in ws}

    def step(tokens, pos):
        for w in ws:
            torch.nn.functional.linear(xs[w.shape[1]], w)
    return Row(GEMM_FLOOR, step)


def matmul_row(dev: torch.device) -> tuple["Row", int]:
    """(a row whose step is a large bf16 matmul, n): n^3 at 8192 on a GPU, 2048 on the CPU; timed with a
    prefill case's rows, in the same rounds, it gives the matmul rate the rows are held to."""
    n = 8192 if dev.type == "cuda" else 2048
    a, b = torch.randn(n, n, device=dev).to(DTYPE), torch.randn(n, n, device=dev).to(DTYPE)
    return Row("bf16 matmul", lambda tokens, pos: a @ b), n


# ------------------------------------------------------------------------------------- the model
@dataclass
class Dims:
    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    vocab: int
    hidden: int
    weight_bytes: int          # every stored weight
    embed_bytes: int           # the embedding table (read by rows), 0 when tied (the head reads it whole)
    non_embed_params: int      # what a token's matmuls multiply with (the head included)

    @classmethod
    def of(cls, folder: Path) -> "Dims":
        cfg = json.loads((folder / "config.json").read_text())
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        from safetensors import safe_open

        total, embed = 0, 0
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                for k in h.keys():
                    s = h.get_slice(k)
                    n = 1
                    for d in s.get_shape():
                        n *= d
                    total += n
                    if k == "model.embed_tokens.weight":
                        embed = n
        tied = cfg.get("tie_word_embeddings", False)
        return cls(cfg["num_hidden_layers"], cfg["num_key_value_heads"], hd, cfg["num_attention_heads"],
                   cfg["vocab_size"], cfg["hidden_size"], total * 2, 0 if tied else embed * 2,
                   total - (0 if tied else embed))

    def step_bytes(self, batch: int, positions: int) -> int:
        """Bytes one decode step reads: the weights (the embedding by rows) and the whole KV cache."""
        kv = 2 * self.layers * batch * self.kv_heads * positions * self.head_dim * 2
        return self.weight_bytes - self.embed_bytes + batch * self.hidden * 2 + kv

    def prefill_flops(self, tokens: int) -> float:
        return 2.0 * self.non_embed_params * tokens + 2.0 * self.layers * tokens**2 * self.heads * self.head_dim


# ------------------------------------------------------------------------------------- the rows
@dataclass
class Row:
    label: str
    step: object = None                 # step(tokens [B, S], pos) -> logits [B, V] of the last position
    samples: list = field(default_factory=list)
    compile_s: float = 0.0
    check: str = ""
    err: float | None = None
    error: str = ""
    logits: torch.Tensor | None = None  # [B, n, V] of the check
    describe: str | None = None


def fastpipe_row(folder: Path, out: Path, batch: int, seq: int, max_len: int, dev: torch.device, tp: int,
                 prefill: bool, compile: bool = True) -> Row:
    import fastpipe
    from fastpipe.builder.hf.build import build_hf
    from fastpipe.format import read_pipeline
    from fastpipe.model_io import to_pipeline_inputs

    d = Dims.of(folder)
    kw = dict(last_logits=True, cache_rows=batch) if prefill else {}
    path = build_hf(folder, tp=tp, batch=batch, seq_len=seq, max_len=max_len, **kw).save(out)
    p = read_pipeline(path)
    caches = {f"past_key_values_{i}_{j}": torch.zeros(batch, d.kv_heads, max_len, d.head_dim, dtype=DTYPE)
              for i in range(d.layers) for j in (0, 1)}
    ins = {n: t.to(dev) for n, t in to_pipeline_inputs(p, caches, partial=True).items()}
    sess = fastpipe.load(path, processor="auto", compile=compile, state_in_place=True,
                         alias_outputs=dev.type == "cuda", device_map={s: str(dev) for s in p.devices})
    extra = {"cache_row": torch.arange(batch), "logits_index": torch.full((batch,), seq - 1)} if prefill else {}

    def step(tokens, pos):
        # a prefill writes its prompt from position 0 (cache_row, logits_index); a decode step at pos
        given = {"input_ids": tokens, **(extra or {"cache_position": torch.full((batch,), pos)})}
        ins.update({n: t.to(dev) for n, t in to_pipeline_inputs(p, given, partial=True).items()})
        return _logits(sess, p, ins)

    row = Row(f"fastpipe tp={tp}, {sess.processor} processor", step)
    t = time.perf_counter()
    step(torch.zeros(batch, seq, dtype=torch.long), 0)
    row.compile_s = time.perf_counter() - t
    row.describe = sess.describe()
    return row


def _logits(sess, p, ins):
    from fastpipe.model_io import assemble_outputs

    # logits [B, 1 or S, V] -> the last position's [B, V], on the device (as the engine keeps them)
    return assemble_outputs(p, sess.run(ins), only=("logits",), device=ins["input_ids"].device)["logits"][:, -1]


class HFStatic:
    """transformers on a StaticCache of max_len positions; forward compiled."""

    def __init__(self, folder: Path, batch: int, max_len: int, dev: torch.device, compile: bool = True):
        import transformers

        from bench.unsplit_calls import static_cache

        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE).to(dev).eval()
        self.cache = static_cache(self.model, batch, max_len, dev, DTYPE)
        mode = "reduce-overhead" if dev.type == "cuda" else None
        self.fn = torch.compile(self.model, fullgraph=True, dynamic=False, mode=mode) if compile else self.model
        self.dev = dev
        # transformers >= 5 counts each layer's filled length in a tensor: rewound to the step's position
        # before each call, so the same step can be timed again (bench/unsplit_calls.StaticStep does the same)
        self.lengths = [t for layer in getattr(self.cache, "layers", ())
                        if isinstance(t := getattr(layer, "cumulative_length", None), torch.Tensor)]

    def __call__(self, tokens, pos):
        with torch.inference_mode():
            s = tokens.shape[1]
            cp = torch.arange(pos, pos + s, device=self.dev)
            for t in self.lengths:
                t.fill_(pos)
            out = self.fn(input_ids=tokens.to(self.dev), cache_position=cp, past_key_values=self.cache,
                          use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]


class GptFast:
    def __init__(self, folder: Path, batch: int, max_len: int, dev: torch.device, compile: bool = True):
        self.model = gf.load(folder, DTYPE, dev)
        with torch.device(dev):
            self.model.setup_caches(batch, max_len)
        if compile:
            self.decode, self.prefill = gf.compiled_decoder(self.model, dev), gf.compiled_prefill(self.model, dev)
        else:
            self.decode = lambda t, p: gf.decode_one_token(self.model, t, p)
            self.prefill = lambda t, p: gf.prefill(self.model, t, p)
        self.dev = dev

    def __call__(self, tokens, pos):
        with torch.inference_mode():
            s = tokens.shape[1]
            ip = torch.arange(pos, pos + s, device=self.dev)
            fn = self.decode if s == 1 else self.prefill
            return fn(tokens.to(self.dev), ip)


class UpcastBf16(torch.overrides.TorchFunctionMode):
    """Every bf16 tensor argument of a torch call becomes float32 for that call: a bf16 checkpoint's model
    computed in float32 (its weights upcast one op at a time), which is exactly the float32 model of that
    checkpoint, in the memory of the bf16 one (a model too large to hold in float32: Llama-3.1-8B here)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        up = lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == DTYPE else t  # noqa: E731
        args = tuple(up(a) for a in args)
        kwargs = {k: up(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


class GptFastF32(GptFast):
    """The gpt-fast-style model's bf16 weights, computed in float32 (UpcastBf16; caches and rotary tables
    in float32): the float32 reference where transformers' float32 model does not fit beside the run.
    `share`: the bf16 row's GptFast, whose weights it uses (its own caches swapped in for each call)."""

    def __init__(self, folder: Path, batch: int, max_len: int, dev: torch.device, share: GptFast | None = None):
        self.model = share.model if share is not None else gf.load(folder, DTYPE, dev)
        self.dev, a = dev, self.model.args
        self.caches = [gf.KVCache(batch, a.n_kv_heads, max_len, a.head_dim, torch.float32, dev) for _ in self.model.layers]
        self.rope = gf.rope_tables(a, max_len, dev)           # float32 [T, D] each
        if share is None:
            with torch.device(dev):
                self.model.setup_caches(batch, max_len)

    def __call__(self, tokens, pos):
        m = self.model
        kept = [layer.attention.kv_cache for layer in m.layers], (m.rope_cos, m.rope_sin)
        for layer, c in zip(m.layers, self.caches):
            layer.attention.kv_cache = c
        m.rope_cos, m.rope_sin = self.rope
        try:
            with torch.inference_mode(), UpcastBf16():
                ip = torch.arange(pos, pos + tokens.shape[1], device=self.dev)
                fn = gf.decode_one_token if tokens.shape[1] == 1 else gf.prefill
                return fn(m, tokens.to(self.dev), ip).float()
        finally:
            for layer, c in zip(m.layers, kept[0]):
                layer.attention.kv_cache = c
            m.rope_cos, m.rope_sin = kept[1]


def timed_row(label: str, make) -> Row:
    row = Row(label)
    try:
        t = time.perf_counter()
        row.step = make()
        row.compile_s = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        row.error = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return row


# ------------------------------------------------------------------------------------- checks
def check_rows(rows: list[Row], tokens: torch.Tensor, ref: torch.Tensor | None, own_err: float | None,
               whole: bool = False) -> None:
    """Feed each row tokens [B, n] one step at a time from position 0 (whole: all at once, a prefill);
    compare with ref [B, n, V] (f32; whole: [B, 1, V], the last position's)."""
    for r in rows:
        if r.step is None:
            continue
        try:
            t = time.perf_counter()
            first = r.step(tokens if whole else tokens[:, :1], 0).float().cpu()       # a baseline compiles here
            r.compile_s += time.perf_counter() - t
            r.logits = torch.stack([first] + [r.step(tokens[:, i:i + 1], i).float().cpu()
                                              for i in range(1, 0 if whole else tokens.shape[1])], 1)
        except Exception as e:  # noqa: BLE001
            r.error = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            r.step = None
    f32 = next((r for r in rows if r.label == F32_LABEL and r.logits is not None), None)
    if ref is None and f32 is not None:     # the float32 row of this run is the reference; the bf16
        ref = f32.logits                    # unsplit rows' own error against it, the tolerance's base
        own = [(r.logits - ref).abs().max().item() for r in rows if r.logits is not None
               and (r.label.startswith("transformers") or r.label.startswith("gpt-fast"))]
        own_err = max(own) if own else None
    if ref is None:
        return
    tol = 2 * own_err if own_err else 0.03 * ref.abs().max().item()
    for r in rows:
        if r.logits is not None:
            r.err = (r.logits - ref).abs().max().item()
            r.check = "ok" if r.err <= tol else f"MISMATCH (tolerance {tol:.3g})"


def reference_logits(folder: Path, tokens: torch.Tensor, dtype, dev: torch.device) -> torch.Tensor:
    """The unsplit transformers model's logits [B, n, V] (float32, on the CPU) on the whole sequence at
    once, computed on dev before any row is loaded (and its memory given back)."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(dev).eval()
    with torch.inference_mode():
        out = m(input_ids=tokens.to(dev)).logits.float().cpu()
    del m
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------- timing
def time_rows(rows: list[Row], tokens: torch.Tensor, pos: int, dev: torch.device, repeat: int, sample_ms: float,
              warmup: int = 2) -> None:
    live = [r for r in rows if r.step is not None]
    calls = {}
    for r in live:
        for _ in range(warmup):
            r.step(tokens, pos)
        sync(dev)
        t = time.perf_counter()
        r.step(tokens, pos)
        sync(dev)
        one = time.perf_counter() - t
        calls[r.label] = max(1, int(sample_ms / 1e3 / max(one, 1e-6)))
    for _ in range(repeat):
        for r in live:
            n = calls[r.label]
            sync(dev)
            t = time.perf_counter()
            for _ in range(n):
                r.step(tokens, pos)
            sync(dev)
            r.samples.append((time.perf_counter() - t) / n)


def row_doc(r: Row, **extra) -> dict:
    med = statistics.median(r.samples) if r.samples else None
    return {"label": r.label, "median_s": med, "samples_s": r.samples, "compile_s": r.compile_s,
            "logits_check": r.check or None, "max_abs_err": r.err, "error": r.error or None,
            "describe": r.describe, **extra}


# ------------------------------------------------------------------------------------- cases
def decode_case(args, folder: Path, dims: Dims, batch: int, dev, ref_all, own_err, tmp: Path) -> dict:
    m = args.max_len
    g = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, dims.vocab, (batch, args.check_steps), generator=g)
    rows = make_rows(args, folder, batch, 1, m, dev, tmp / f"decode_b{batch}", prefill=False)
    ref = None if ref_all is None else ref_all[:batch]
    check_rows(rows, tokens, ref, own_err)
    if args.save_logits:
        _save_logits(args.save_logits, batch, rows, tokens)
    cur = torch.randint(0, dims.vocab, (batch, 1), generator=g)
    copy = copy_row(dev)                    # the device copy, timed in the same rounds as the rows
    floor = [gemm_floor_row(r.step.model, batch, dev) for r in rows if isinstance(r.step, GptFast)
             and not isinstance(r.step, GptFastF32)][:1]
    time_rows([r for r in rows if r.label != F32_LABEL] + floor + [copy], cur, m - 1, dev, args.repeat, args.sample_ms)
    rows += floor
    bw = 2 * COPY_BYTES / statistics.median(copy.samples)
    del copy
    nbytes = dims.step_bytes(batch, m)
    docs = []
    for r in rows:
        med = statistics.median(r.samples) if r.samples else None
        docs.append(row_doc(r, ms_per_step=med and med * 1e3, tokens_per_s=med and batch / med,
                            bytes_per_step=nbytes, gb_per_s=med and nbytes / med / 1e9,
                            bandwidth_fraction=med and nbytes / med / bw))
    return {"case": "decode", "batch": batch, "positions": m, "copy_bandwidth_gb_s": bw / 1e9, "rows": docs,
            "verdicts": verdicts(docs, "decode")}


def prefill_case(args, folder: Path, dims: Dims, seq: int, dev, tmp: Path) -> dict:
    m = max(seq, args.max_len)
    g = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, dims.vocab, (1, seq), generator=g)
    ref = own = None
    if not args.no_f32_check:             # the last position's logits against the f32 model's (before any row)
        ref = reference_logits(folder, tokens, torch.float32, dev)[:, -1:]
        own = (reference_logits(folder, tokens, DTYPE, dev)[:, -1:] - ref).abs().max().item()
    rows = make_rows(args, folder, 1, seq, m, dev, tmp / f"prefill_s{seq}", prefill=True)
    check_rows(rows, tokens, ref, own, whole=True)
    mm, n = matmul_row(dev)                 # the large matmul, timed in the same rounds as the rows
    time_rows([r for r in rows if r.label != F32_LABEL] + [mm], tokens, 0, dev, args.repeat, args.sample_ms,
              warmup=1)
    rate = 2 * n**3 / statistics.median(mm.samples)
    flops = dims.prefill_flops(seq)
    docs = []
    for r in rows:
        med = statistics.median(r.samples) if r.samples else None
        docs.append(row_doc(r, ms=med and med * 1e3, tokens_per_s=med and seq / med, flops=flops,
                            tflop_per_s=med and flops / med / 1e12, matmul_fraction=med and flops / med / rate))
    return {"case": "prefill", "batch": 1, "prompt_len": seq, "matmul_tflop_s": rate / 1e12, "rows": docs,
            "verdicts": verdicts(docs, "prefill")}


def make_rows(args, folder: Path, batch: int, seq: int, m: int, dev, out: Path, prefill: bool) -> list[Row]:
    how = "eager" if args.eager else "compiled"
    rows = []
    for tp in args.tp if "fastpipe" in args.rows else ():
        rows.append(_safe(lambda: fastpipe_row(folder, out.with_name(f"{out.name}_tp{tp}"), batch, seq, m, dev, tp,
                                               prefill, not args.eager), f"fastpipe tp={tp}"))
    if "transformers" in args.rows:
        rows.append(timed_row(f"transformers static, {how}", lambda: HFStatic(folder, batch, m, dev, not args.eager)))
    if "gptfast" in args.rows:
        rows.append(timed_row(f"gpt-fast style, {how}", lambda: GptFast(folder, batch, m, dev, not args.eager)))
    if "f32" in args.rows:
        share = next((r.step for r in rows if isinstance(r.step, GptFast)), None)
        rows.append(timed_row(F32_LABEL, lambda: GptFastF32(folder, batch, m, dev, share)))
    return rows


F32_LABEL = "float32 reference (gpt-fast style, bf16 weights upcast per op)"


def _safe(make, label: str) -> Row:
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - a failed row is reported with its error
        return Row(label, error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")


def _save_logits(path: str, batch: int, rows: list[Row], tokens: torch.Tensor) -> None:
    """Each row's check logits [B, n, V] (f32), by batch, for --check-against in another process; the
    reference there is the gpt-fast row (else the first)."""
    doc = torch.load(path) if Path(path).exists() else {}
    got = {r.label: r.logits for r in rows if r.logits is not None}
    refs = [k for k in got if k == F32_LABEL] or [k for k in got if k.startswith("gpt-fast")] or list(got)
    bf16 = [k for k in got if k.startswith("gpt-fast")]
    own = (got[bf16[0]] - got[F32_LABEL]).abs().max().item() if F32_LABEL in got and bf16 else None
    doc[batch] = {"tokens": tokens, "rows": got, "reference": refs[0], "own_err": own}
    torch.save(doc, path)


def verdicts(docs: list[dict], case: str) -> dict:
    """Per fastpipe row: its time over the faster baseline's (target <= 1.05x) and its fraction of the
    device's copy bandwidth (decode, target >= 60 %) or bf16 matmul rate (prefill, target >= 60 %)."""
    timed = [d for d in docs if d["median_s"]]
    base = [d for d in timed if not d["label"].startswith("fastpipe") and d["label"] != GEMM_FLOOR]
    best = min(base, key=lambda d: d["median_s"]) if base else None
    v = {"logits_ok": all(d["logits_check"] in ("ok", None) and not d["error"] for d in docs), "rows": {}}
    for d in timed:
        if not d["label"].startswith("fastpipe"):
            continue
        mine = {}
        if best is not None:
            r = d["median_s"] / best["median_s"]
            mine["vs_faster_baseline"] = {"ratio": r, "baseline": best["label"], "target": 1.05, "met": r <= 1.05}
        key = "bandwidth_fraction" if case == "decode" else "matmul_fraction"
        mine[key] = {"value": d[key], "target": 0.60, "met": d[key] >= 0.60}
        v["rows"][d["label"]] = mine
    return v


# ------------------------------------------------------------------------------------- main
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path)
    src.add_argument("--geometry")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--keep", type=Path, help="with --geometry: write the checkpoint under this folder, and reuse "
                                              "one written there before")
    ap.add_argument("--budget-s", type=float, help="start no case that would end past this many seconds, "
                                                   "judged by the longest case so far")
    ap.add_argument("--tp", default="2", help="fastpipe rows' tensor-parallel degrees, e.g. 1,2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-lens", default="", help="prefill prompt lengths (batch 1), e.g. 512,2048")
    ap.add_argument("--max-len", type=int, default=256, help="KV cache positions of the decode step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--no-f32-check", action="store_true", help="skip the float32 transformers reference")
    ap.add_argument("--rows", default="fastpipe,transformers,gptfast",
                    help="which rows run (f32: a float32 reference computed on the bf16 weights, checked, not timed)")
    ap.add_argument("--eager", action="store_true", help="every row eager (a model too large to compile here)")
    ap.add_argument("--save-logits", help="torch.save each row's check logits here (by batch)")
    ap.add_argument("--check-against", help="check against the reference row of a --save-logits file")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--sample-ms", type=float, default=300.0)
    ap.add_argument("--json")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.tp = [int(x) for x in args.tp.split(",")]
    args.rows = set(args.rows.split(","))
    dev = torch.device(args.device if args.device != "cuda" else "cuda:0")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        folder = args.checkpoint
        if folder is None:
            from bench.real_checkpoint import write_checkpoint

            name = args.geometry + (f"-{args.layers}l" if args.layers else "")
            folder = (args.keep or tmp) / name
            if not (folder / "config.json").is_file():      # written last: a folder without it is partial
                write_checkpoint(args.geometry, folder, layers=args.layers)
        dims = Dims.of(folder)
        doc = {"machine": machine_info(), "checkpoint": str(args.checkpoint or args.geometry), "geometry": folder.name,
               "layers": dims.layers, "weight_bytes": dims.weight_bytes, "tp": args.tp, "dtype": "bf16", "cases": []}
        # the device's copy bandwidth and matmul rate are timed in each case's rounds (copy_row, matmul_row)
        print(f"{dev}: weights {dims.weight_bytes / 2**30:.2f} GiB, {dims.layers} layers")
        batches = [int(b) for b in args.batches.split(",") if b]
        ref = own_err = None
        saved = torch.load(args.check_against) if args.check_against else None
        t0, longest = time.perf_counter(), 0.0

        def fits(what: str) -> bool:
            if args.budget_s is None or time.perf_counter() - t0 + longest <= args.budget_s:
                return True
            doc.setdefault("not_started", []).append(what)
            print(f"\n{what}: not started (budget {args.budget_s:.0f} s; the longest case took {longest:.0f} s)")
            return False

        def record(case: dict, started: float) -> None:    # kept, printed and written as each case ends
            nonlocal longest
            doc["cases"].append(case)
            print_case(case)
            if args.json:
                Path(args.json).write_text(json.dumps(doc, indent=1))
            gc.collect()
            longest = max(longest, time.perf_counter() - started)

        for b in batches:
            if not fits(f"decode, batch {b}"):
                continue
            tc = time.perf_counter()
            g = torch.Generator().manual_seed(b)
            tokens = torch.randint(0, dims.vocab, (b, args.check_steps), generator=g)
            if saved is not None:                  # another process's row (a model that does not fit twice)
                assert torch.equal(saved[b]["tokens"], tokens), "--check-against: other tokens"
                ref, own_err = saved[b]["rows"][saved[b]["reference"]], saved[b].get("own_err")
            elif not args.no_f32_check:
                ref = reference_logits(folder, tokens, torch.float32, dev)
                own_err = (reference_logits(folder, tokens, DTYPE, dev) - ref).abs().max().item()
            record(decode_case(args, folder, dims, b, dev, ref, own_err, tmp), tc)
        for s in [int(x) for x in args.prompt_lens.split(",") if x]:
            if not fits(f"prefill, prompt {s}"):
                continue
            tc = time.perf_counter()
            record(prefill_case(args, folder, dims, s, dev, tmp), tc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    ok = all(c["verdicts"]["logits_ok"] for c in doc["cases"])
    return 0 if ok else 1


def print_case(case: dict) -> None:
    what = (f"decode, batch {case['batch']}, {case['positions']} cache positions" if case["case"] == "decode"
            else f"prefill, batch 1, prompt {case['prompt_len']}")
    hw = (f"device copy {case['copy_bandwidth_gb_s']:.1f} GB/s" if case["case"] == "decode"
          else f"bf16 matmul {case['matmul_tflop_s']:.2f} TFLOP/s")
    print(f"\n{what} ({hw}, in the same rounds)")
    for d in case["rows"]:
        if d["error"]:
            print(f"  {d['label']}: FAILED {d['error']}")
            continue
        if d["median_s"] is None:
            print(f"  {d['label']}: not timed; logits {d['logits_check'] or 'not checked'} (err {d['max_abs_err']})")
            continue
        if case["case"] == "decode":
            print(f"  {d['label']}: {d['ms_per_step']:.2f} ms/step, {d['tokens_per_s']:.1f} tok/s, "
                  f"{d['gb_per_s']:.1f} GB/s ({100 * d['bandwidth_fraction']:.0f}% of copy), compile {d['compile_s']:.0f} s, "
                  f"logits {d['logits_check'] or 'not checked'} (err {d['max_abs_err']})")
        else:
            print(f"  {d['label']}: {d['ms']:.1f} ms, {d['tokens_per_s']:.0f} tok/s, {d['tflop_per_s']:.2f} TFLOP/s "
                  f"({100 * d['matmul_fraction']:.0f}% of matmul), compile {d['compile_s']:.0f} s")
    print(f"  verdicts: {json.dumps(case['verdicts'])}")


if __name__ == "__main__":
    sys.exit(main())
