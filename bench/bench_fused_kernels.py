"""Fused matmul + collective kernels vs the unfused path the runtime runs, all participants on one GPU.

    python bench/bench_fused_kernels.py                       # matmul_reduce_scatter, the default grid below
    python bench/bench_fused_kernels.py --kernel both --check --json fused.json     # what gpu_check runs
    python bench/bench_fused_kernels.py --threshold fused.json [more.json ...]      # results -> crossover
    python bench/bench_fused_kernels.py --kernel all_gather_matmul --dim 1
    python bench/bench_fused_kernels.py --kernel both --check --dim 0,1 --json fused.json    # both dims
    python bench/bench_fused_kernels.py --ms 16,8192 --nk 4096 --ns 2 --json fused.json
    python bench/bench_fused_kernels.py --smoke               # CPU, TRITON_INTERPRET=1, tiny: tests the script
    python bench/bench_fused_kernels.py --kernel both --check --profile --json fused.json   # + each variant's kernels
    python bench/bench_fused_kernels.py --kernel both --tune --check --ms 1024,8192 --json tune.json  # per shape
    python bench/bench_fused_kernels.py --write-tuned fastpipe/kernels/tuned_configs.json tune.json   # -> table

Default grid: M in {16, 128, 1024, 8192}, N = K in {4096, 8192}, n in {2, 4}, bf16, dim 0 (--dim 1: column
blocks; --dim 0,1: the whole grid at dim 0, then again at dim 1, what gpu_check's fused stage runs).

matmul_reduce_scatter (a[i]: [M, K], b[i] = w_i.t(): [K, N], as a row-parallel linear layer):
  fused    fastpipe.kernels.matmul_reduce_scatter: one launch, every tile written once
  unfused  what the runtime runs without fusion (the cuda processor, members on one GPU;
           fastpipe.runtime.tuning.unfused_path): each member's compute step, torch.mm, on its own
           stream (the slots' lanes, overlapping), then the group's callable,
           fastpipe.comm.reduce_scatter (float32 fold, one cast, a fresh chunk per member),
           after all of them
  torch.mm one mm of [M, n*K] x [n*K, N]: the same FLOPs in one cuBLAS call (the roofline
           the fused kernel should approach)
all_gather_matmul (a[i]: [M/n, K] (dim 0) or [M, K/n] (dim 1), b[j] = w_j.t(): [K, N/n]):
  fused    fastpipe.kernels.all_gather_matmul: one launch for every j, no cat(a)
  unfused  fastpipe.comm.all_gather (one gathered copy per member), then torch.mm per j, each on
           member j's stream
  torch.mm one mm of [M, K] x [K, N]: the same FLOPs

Each variant is timed as the runtime runs it by default: captured once as a CUDA graph (the
unfused members' matmuls forked onto their own streams inside it) and replayed, so no variant
pays host launch overhead the runtime does not (--eager: launched from Python on one stream
instead; a case whose capture fails is timed eagerly, and its row's "timing" says why). Each
time is triton.testing.do_bench's median (p20-p80 shown) after its warm-up, with L2 flushed
between repetitions; the fused kernel's first call (Triton compile) is reported apart.
TFLOP/s = 2*M*N*K_total / time, and its share of the GPU's dense bf16/fp16 peak (PEAK_TFLOPS_16BIT,
by device name; --peak-tflops overrides).
The targets, checked per row from M = 1024 on: fused >= 1.3x the unfused path, and fused
TFLOP/s >= 70% of torch.mm's.
The "rule" column is what ``fused_is_faster`` (fastpipe.kernels.fusion_rule, the runtime's
decision under fuse="auto") picked when the row was measured.

--check compares every variant's result (the replayed graph's, where timed so) with one float32
reference computed from the same inputs upcast, with tolerances for the dtype (``tolerance``
below): a mismatch exits 1.

Results are written to --json after every case (atomically), so a run cut off keeps what it
measured; a case that raises (out of memory, a launch error) becomes a row with its "error" and
the run goes on (exit 1 at the end). Cases go shape by shape (N = K, then n), both kernels and every
M at each, so a run cut short still has whole crossovers; --budget-s stops starting cases after that many seconds
(the rows not run are listed as "not_run").

--tune times the fused kernel under each of tune_candidates' launch configs (short runs of a replayed CUDA graph),
times the fastest again in full and checks it (--check); --write-tuned turns the rows where it beat
the heuristic by more than 3% into fastpipe.kernels.tuned's table, which pick_config consults first
on that GPU (the "fused" column of a later run then times the tuned kernel). Before the tuning, every
candidate's first call is made in --compile-workers spawned processes (fastpipe/kernels/compile_pool.py; on a GPU
by default the cores less two, at most 14), which fill Triton's on-disk cache, so the tuning's own first
calls read compiled kernels instead of compiling them one at a time on one core (each tuned row's
"first_calls_s" sums them; the JSON's "compile_warmup" says what the warm-up did).

--profile runs each variant's timed form 5 more times under torch.profiler (bench.kernel_profile):
per variant the kernels it launched, the time they were busy and the time they covered (below busy where
the unfused members' streams overlapped), beside its measured time, so a missed target comes with where the
time went (one fused kernel's own duration, or the unfused path's GEMMs and copies, their overlap and the
gaps between them). The row's "profile" holds them; a line per variant follows the row's.

--threshold reads result files and prints, per (GPU, kernel, N, K_total, n, dtype), the measured
crossover: the smallest M from which the fused kernel beat the unfused path (beyond the noise:
fusion_rule.fused_wins) at every measured M (``crossover``), and whether the shipped rule agrees
at every M (on that GPU); with --json it writes them. With --write-rule PATH it also writes the
runtime's rule table from those rows (fusion_rule.table_from_rows): ship it as
fastpipe/kernels/fusion_measured.json. Every row names its GPU (``device``; older files: their
machine.device), and the table keeps one point per GPU and shape: list every GPU's results, the
oldest first (on one GPU, a shape's newer kernel revision wins, and at the same revision the later
file's row). Without CUDA the script refuses to time, except --smoke
(tiny sizes, TRITON_INTERPRET=1 on CPU, timings meaningless).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # before triton is imported: the kernels then run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from fastpipe.atomic import write_text  # noqa: E402
from fastpipe.kernels import all_gather_matmul, fused_is_faster, matmul_reduce_scatter  # noqa: E402
from fastpipe.kernels.fusion_rule import (  # noqa: E402
    KERNEL_REVISIONS, dump_table, fused_wins, gpu_name, newest_rows, row_revision, rows_of, stale_revisions,
    table_from_rows)
from fastpipe.kernels import calls, compile_pool, pick_config, tuned  # noqa: E402
from fastpipe.kernels.autotune import candidates_for, tune_candidates  # noqa: E402,F401 (tune_candidates: scripts/)
from bench import kernel_profile  # noqa: E402
from fastpipe.runtime.tuning import unfused_path  # noqa: E402
from fastpipe.runtime.tuning.kernel_timing import capture_after_first_run as capture, replay_ms  # noqa: E402
from fastpipe.runtime.tuning.kernel_timing import timed as bench  # noqa: E402  (median, p20, p80) in ms
from tests.tensor_compare import error_ratio  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KERNELS = ("matmul_reduce_scatter", "all_gather_matmul")
VARIANTS = ("fused", "unfused", "torch.mm")

# dense (no sparsity) bf16/fp16 tensor-core peak, TFLOP/s, from the vendor's data sheets; the first
# name fragment found in torch.cuda.get_device_name() wins (so "H100 PCIe" before "H100")
PEAK_TFLOPS_16BIT = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.4), ("H200", 989.4),
                     ("H100", 989.4), ("H800", 989.4), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1),
                     ("L4", 121.0), ("B200", 2250.0))
TARGET_SPEEDUP, TARGET_OF_MM, TARGET_FROM_M = 1.3, 0.70, 1024      # the targets, from M = 1024 on


def peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """The GPU's dense 16-bit tensor-core peak (None: an unknown GPU, or float32, whose peak depends on TF32)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    return next((tf for frag, tf in PEAK_TFLOPS_16BIT if frag in device_name), None)


def targets(row: dict) -> dict:
    """The targets for one row with M >= 1024: fused >= 1.3x the unfused path, and fused
    TFLOP/s >= 70% of one torch.mm's of the same work; {} below that M."""
    if row["M"] < TARGET_FROM_M:
        return {}
    of_mm = row["fused_tflops"] / row["torch.mm_tflops"]
    return {"speedup_met": row["speedup"] >= TARGET_SPEEDUP, "of_torch_mm": of_mm, "of_torch_mm_met": of_mm >= TARGET_OF_MM}

# ---------------------------------------------------------------------------------------- tolerances
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
ACC = 1e-4  # float32 accumulation: the kernel's, cuBLAS's and the reference's summation orders differ


def tolerance(variant: str, kernel: str, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """(rtol, atol) of ``|out - ref| <= rtol*|ref| + atol*mag`` (tests/tensor_compare.py's rule), ref the
    float32 result from the same inputs upcast, mag = sum_i |a_i| @ |b_i| (the accumulation's scale).

    Every variant accumulates in float32 and rounds its result to the dtype once: at most u|ref|
    (u the unit roundoff: bf16 2^-8, fp16 2^-11), rtol = 2u; the summation orders differ by at most
    ACC*mag. cuBLAS (torch.mm: the unfused variant and the torch.mm one) may also reduce split-K
    partials in the 16-bit dtype (torch.backends.cuda.matmul.allow_bf16/fp16_reduced_precision_reduction,
    on by default, as the runtime runs): at most about u*mag more, atol + 2u. The unfused
    matmul_reduce_scatter also rounds each participant's partial product (torch.mm's output) to the
    dtype before the float32 sum, at most u * |a_i| @ |b_i| each, so u*mag in all: 2u more again.
    Under the CPU interpreter the fused kernel's final cast truncates (one ulp, not half): rtol doubles.
    """
    u = UNIT_ROUNDOFF[dtype]
    rtol = 2 * u * (2 if variant == "fused" and device.type == "cpu" else 1)
    atol = ACC
    if variant != "fused" and dtype != torch.float32:
        atol += 2 * u
        if variant == "unfused" and kernel == "matmul_reduce_scatter":
            atol += 2 * u
    return rtol, atol


# ---------------------------------------------------------------------------------------- the cases
@contextlib.contextmanager
def timed_forms(fns: dict, device, eager: bool):
    """Yields ({variant: a call that runs it and returns its outputs}, how it is timed): on a GPU,
    graph replays unless eager; a failed capture times the whole case eagerly (saying why). The
    graphs are released on leaving."""
    graphs, forms, timing = [], {}, "graph"
    try:
        if device.type != "cuda" or eager:
            forms, timing = fns, "eager"
        else:
            try:
                for v, fn in fns.items():
                    g, out = capture(fn, device)
                    graphs.append(g)
                    forms[v] = lambda g=g, out=out: (g.replay(), out)[1]
            except Exception as e:  # noqa: BLE001 - said in the row and printed, never silent
                torch.cuda.synchronize(device)
                forms, timing = fns, f"eager: capture of {v} failed: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
                print(f"  {timing}", flush=True)
        yield forms, timing
    finally:
        for g in graphs:
            g.reset()


def first_call_ms(fn, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t) * 1e3


def _randn(device, seed):
    """randn(*shape, dtype=) from a seeded generator on device; on the meta device (shapes and strides only,
    case_call) empty tensors."""
    if torch.device(device).type == "meta":
        return lambda *shape, dtype: torch.empty(*shape, device="meta", dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    return lambda *shape, dtype: torch.randn(*shape, generator=g, device=device, dtype=dtype)


def make_mrs(M, NK, n, dtype, device, seed=0):
    """a[i]: [M, K], b[i] = w_i.t() with w_i: [N, K] (a linear layer's weight), N = K = NK."""
    randn = _randn(device, seed)
    a = [randn(M, NK, dtype=dtype) for _ in range(n)]
    w = [randn(NK, NK, dtype=dtype) / NK ** 0.5 for _ in range(n)]
    return a, [x.t() for x in w]


def make_agm(M, NK, n, dim, dtype, device, seed=0):
    """cat(a; dim) is [M, K]; b[j] = w_j.t(): [K, N/n]; N = K = NK."""
    randn = _randn(device, seed)
    shape = (M // n, NK) if dim == 0 else (M, NK // n)
    a = [randn(*shape, dtype=dtype) for _ in range(n)]
    w = [randn(NK // n, NK, dtype=dtype) / NK ** 0.5 for _ in range(n)]
    return a, [x.t() for x in w]


def case_call(kernel, M, NK, n, dim, dtype, device) -> calls.KernelCall:
    """The fused call a case makes, as fastpipe.kernels.calls describes it: its operands' shapes and strides
    (make_mrs / make_agm's, made on the meta device), on ``device``."""
    meta = torch.device("meta")
    a, b = make_mrs(M, NK, n, dtype, meta) if kernel == "matmul_reduce_scatter" else \
        make_agm(M, NK, n, dim, dtype, meta)
    call = calls.KernelCall.of(kernel, a, b, dim, "sum" if kernel == "matmul_reduce_scatter" else "")
    return dataclasses.replace(call, device=str(device))


def reference_f32(kernel, a, b, dim) -> tuple[list, list]:
    """(float32 results, mags) from the same inputs upcast: what every variant is checked against."""
    n = len(a)
    if kernel == "matmul_reduce_scatter":
        ref = sum(x.float() @ y.float() for x, y in zip(a, b))
        mag = sum(x.float().abs() @ y.float().abs() for x, y in zip(a, b))
        return list(torch.chunk(ref, n, dim)), list(torch.chunk(mag, n, dim))
    full = torch.cat(a, dim=dim).float()
    return [full @ bj.float() for bj in b], [full.abs() @ bj.float().abs() for bj in b]


def check_variant(kernel, variant, outs, refs, mags, dtype, device) -> float:
    """Worst err/allowed over the outputs (<= 1 passes); see ``tolerance``."""
    rtol, atol = tolerance(variant, kernel, dtype, device)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert tuple(o.shape) == tuple(r.shape) and o.dtype == dtype, (variant, tuple(o.shape), o.dtype)
    return max(error_ratio(o, r, m, rtol=rtol, atol=atol) for o, r, m in zip(outs, refs, mags))


def variants(kernel, M, NK, n, dim, dtype, device, lanes=None):
    """(a, b, fns by variant, split, K_total, N) for one case, or None where the split is not
    divisible by n; lanes: the unfused members' streams (fastpipe.runtime.tuning.unfused_path.on_lanes)."""
    if not splits_evenly(kernel, M, NK, n, dim):
        return None
    if kernel == "matmul_reduce_scatter":
        a, b = make_mrs(M, NK, n, dtype, device)
        a_cat = torch.cat(a, dim=1)
        b_cat = torch.cat([x.t() for x in b], dim=1).t()  # [n*K, N], the same w.t() layout
        fns = {"fused": lambda: matmul_reduce_scatter(a, b, dim=dim),
               "unfused": lambda: unfused_path.matmul_then_reduce_scatter(a, b, dim, "sum", lanes),
               "torch.mm": lambda: torch.mm(a_cat, b_cat)}
        split = lambda out: list(torch.chunk(out, n, dim))  # noqa: E731
        return a, b, fns, split, n * NK, NK
    a, b = make_agm(M, NK, n, dim, dtype, device)
    a_cat = torch.cat(a, dim=dim)
    b_cat = torch.cat([x.t() for x in b], dim=0).t()  # [K, N]
    fns = {"fused": lambda: all_gather_matmul(a, b, dim=dim),
           "unfused": lambda: unfused_path.all_gather_then_matmul(a, b, dim, lanes),
           "torch.mm": lambda: torch.mm(a_cat, b_cat)}
    split = lambda out: list(torch.split(out, [bj.shape[1] for bj in b], dim=1))  # noqa: E731
    return a, b, fns, split, NK, NK


def splits_evenly(kernel, M, NK, n, dim) -> bool:
    """Whether the case's split dimension (and all_gather_matmul's N) divides by n: else it is skipped."""
    return not ((M if dim == 0 else NK) % n or (kernel == "all_gather_matmul" and NK % n))


def case_key(kernel, M, NK, n, dim, dtype) -> dict:
    return {"kernel": kernel, "M": M, "N=K": NK, "n": n, "dim": dim, "dtype": str(dtype).replace("torch.", "")}


def run_case(kernel, M, NK, n, dim, dtype, device, check: bool, peak: float | None = None, eager: bool = False,
             lanes=None, profile: bool = False) -> dict:
    """One row: every variant timed (graph replays unless eager), checked with --check, its kernels profiled
    with ``profile`` (``profile_variants``); {} where the split is not divisible by n. lanes: n streams for the
    unfused members (on a GPU, unless eager)."""
    made = variants(kernel, M, NK, n, dim, dtype, device, None if eager else lanes)
    if made is None:
        return {}
    a, b, fns, split, k_total, N = made
    row = {**case_key(kernel, M, NK, n, dim, dtype), "N": N, "K_total": k_total,
           "kernel_revision": KERNEL_REVISIONS[kernel]}
    row["fused_config"], row["fused_config_from"] = fused_config(kernel, M, NK, n, dim, dtype, device)
    row["first_call_ms"] = first_call_ms(fns["fused"], device)
    with timed_forms(fns, device, eager) as (forms, row["timing"]):
        if check:
            refs, mags = reference_f32(kernel, a, b, dim)
            worst = {}
            for v, fn in forms.items():
                outs = fn()
                worst[v] = check_variant(kernel, v, split(outs) if v == "torch.mm" else outs, refs, mags, dtype,
                                         device)
                del outs
            row["worst_err_over_tol"] = worst
            row["check"] = "ok" if all(w <= 1.0 for w in worst.values()) else "MISMATCH"
            del refs, mags
        flops = 2.0 * M * N * k_total
        for name, fn in forms.items():
            med, p20, p80 = bench(fn, device)
            row[f"{name}_ms"], row[f"{name}_p20"], row[f"{name}_p80"] = med, p20, p80
            row[f"{name}_tflops"] = flops / (med * 1e-3) / 1e12
            row[f"{name}_of_peak"] = row[f"{name}_tflops"] / peak if peak else None
        if profile:
            row["profile"] = profile_variants(forms, device)
    row["peak_tflops"] = peak
    row["speedup"] = row["unfused_ms"] / row["fused_ms"]
    row["rule_says_fused"] = fused_is_faster(M, N, k_total, n, dtype, kernel=kernel, dim=dim, gpu=gpu_name(device))
    row["targets"] = targets(row)
    return row


def profile_variants(forms: dict, device) -> dict:
    """--profile: per variant, the kernels a few runs of its timed form launch (bench.kernel_profile:
    time busy, time covered, the top kernels); a variant the profiler fails on gets its "error", and the row
    stands."""
    out = {}
    for name, fn in forms.items():
        try:
            out[name] = kernel_profile.profile(fn, device)
        except Exception as e:  # noqa: BLE001 - said in the row and its line; the timings stand
            out[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
    return out


def fused_config(kernel, M, NK, n, dim, dtype, device) -> tuple[str, str]:
    """The launch config the fused kernel runs in this case (pick_config's answer to the launcher) and where
    it comes from: "tuned" (the table of configs measured on this GPU, fastpipe.kernels.tuned) or "heuristic".
    A row's time is that config's: after a tuned table ships, the fused rows time its configs."""
    launcher, lm, ln, lk = launcher_shape(kernel, M, NK, n, dim)
    cfg = pick_config(lm, ln, lk, dtype, device, launcher=launcher, n=n)
    measured = tuned.lookup(launcher, lm, ln, lk, n, dtype, gpu_name(device) or "") if device.type == "cuda" else None
    return cfg.text(), "tuned" if measured is not None and measured == cfg else "heuristic"


# ---------------------------------------------------------------------------------------- tuning
def launcher_shape(kernel: str, M: int, NK: int, n: int, dim: int) -> tuple[str, int, int, int]:
    """(launcher, M, N, K) as pick_config sees them for one fused call (fastpipe.kernels.tuned)."""
    return case_call(kernel, M, NK, n, dim, torch.bfloat16, "meta").launch()[:4]


def tune_case(kernel, M, NK, n, dim, dtype, device, row: dict, check: bool, smoke: bool, eager: bool = False) -> dict:
    """Time the fused kernel under every candidate config (short runs of a replayed CUDA graph, as the
    runtime runs it, to rank them: fastpipe.kernels.autotune.replay_ms; eager runs with --eager); the fastest,
    timed as the row's fused kernel was (a graph replay unless eager) and checked, vs the heuristic's time."""
    made = variants(kernel, M, NK, n, dim, dtype, device)
    a, b, _, _, _, _ = made
    fused = (lambda cfg: matmul_reduce_scatter(a, b, dim=dim, config=cfg)) if kernel == "matmul_reduce_scatter" \
        else (lambda cfg: all_gather_matmul(a, b, dim=dim, config=cfg))
    call = case_call(kernel, M, NK, n, dim, dtype, device)
    launcher, lm, ln, lk, _ = call.launch()
    timed, first_calls_s = [], 0.0
    rank = (lambda fn: bench(fn, device, quick=True)[0]) if eager or device.type != "cuda" else \
        (lambda fn: replay_ms(fn, device, quick=True)[0])
    for cfg in candidates_for(call, smoke):
        try:
            t0 = time.perf_counter()
            try:
                fused(cfg)                                   # compiles, unless the warm-up did (compile_pool)
            finally:
                first_calls_s += time.perf_counter() - t0
            timed.append((rank(lambda cfg=cfg: fused(cfg)), cfg))
        except Exception as e:  # noqa: BLE001 - a config the GPU cannot run (resources) is skipped, and counted
            row.setdefault("tune_skipped", []).append(f"{cfg}: {type(e).__name__}: {' '.join(str(e).split())[:120]}")
    if not timed:
        return {}
    best_ms, best = min(timed, key=lambda t: t[0])
    with timed_forms({"fused": lambda: fused(best)}, device, eager or row["timing"] != "graph") as (forms, timing):
        best_ms = bench(forms["fused"], device)[0]           # the winner, timed like the row's fused kernel
        out = {"launcher": launcher, "M": lm, "N": ln, "K": lk, "n": n, "config": dataclasses.asdict(best),
               "ms": best_ms, "heuristic_ms": row["fused_ms"], "candidates": len(timed), "timing": timing,
               "first_calls_s": round(first_calls_s, 3)}
        if check:
            refs, mags = reference_f32(kernel, a, b, dim)
            out["check"] = "ok" if check_variant(kernel, "fused", forms["fused"](), refs, mags, dtype, device) <= 1.0 \
                else "MISMATCH"
    return out


def warmup_tasks(cases, dtype, device, smoke: bool) -> list[compile_pool.Task]:
    """Every (case, candidate config) first call that --tune will make (fastpipe.kernels.compile_pool); cases as
    ``case_order`` gives them."""
    tasks = []
    for kernel, nk, n, M, dim in cases:
        if not splits_evenly(kernel, M, nk, n, dim):
            continue
        call = case_call(kernel, M, nk, n, dim, dtype, device)
        tasks += [compile_pool.task(call, cfg) for cfg in candidates_for(call, smoke)]
    return tasks


def tuned_table(paths, min_gain: float = 0.03) -> dict:
    """fastpipe.kernels.tuned's table from --tune result files: one entry per tuned row whose best
    config beat the heuristic's by more than min_gain (elsewhere the heuristic stays)."""
    entries = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        device = doc["machine"]["device"]
        for r in doc["rows"]:
            t = r.get("tuned")
            if not t or "error" in t or t.get("check", "ok") != "ok" or t["ms"] >= (1 - min_gain) * t["heuristic_ms"] \
                    or (t.get("timing", "graph") == "graph") != (r.get("timing", "graph") == "graph"):
                continue
            entries.append({"launcher": t["launcher"], "device": device, "dtype": r["dtype"], "M": t["M"],
                            "N": t["N"], "K": t["K"], "n": t["n"], "config": t["config"], "ms": t["ms"],
                            "heuristic_ms": t["heuristic_ms"]})
    return {"format": 1, "entries": entries}


def print_table(rows: list[dict], check: bool) -> None:
    header = ["kernel", "dim", "M", "N=K", "n", "fused ms (p20-p80)", "unfused ms", "torch.mm ms", "speedup",
              "fused TF/s", "unfused TF/s", "torch.mm TF/s", "fused % peak", "torch.mm % peak", "fused / torch.mm", "first call ms",
              "rule: fused?", "targets (M >= 1024)"] + (["check"] if check else [])
    table = []
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    for r in measured(rows):
        t = r.get("targets") or {}
        verdict = "-" if not t else (f"{'met' if t['speedup_met'] else 'MISSED'} >= {TARGET_SPEEDUP}x, "
                                     f"{'met' if t['of_torch_mm_met'] else 'MISSED'} >= {TARGET_OF_MM:.0%} of torch.mm")
        table.append([r["kernel"], str(r["dim"]), str(r["M"]), str(r["N=K"]), str(r["n"]),
                      f"{r['fused_ms']:.3f} ({r['fused_p20']:.3f}-{r['fused_p80']:.3f})", f"{r['unfused_ms']:.3f}",
                      f"{r['torch.mm_ms']:.3f}", f"{r['speedup']:.2f}x", f"{r['fused_tflops']:.1f}",
                      f"{r['unfused_tflops']:.1f}", f"{r['torch.mm_tflops']:.1f}", pct(r.get("fused_of_peak")),
                      pct(r.get("torch.mm_of_peak")), f"{r['fused_tflops'] / r['torch.mm_tflops']:.2f}",
                      f"{r['first_call_ms']:.0f}", "yes" if r["rule_says_fused"] else "no", verdict]
                     + ([r["check"] + " (" + ", ".join(f"{k} {v:.2f}" for k, v in r["worst_err_over_tol"].items())
                         + " of tol)"] if check else []))
    widths = [max(len(x[i]) for x in table + [header]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths]] + table:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


# ---------------------------------------------------------------------------------------- thresholds
def measured(rows: list[dict]) -> list[dict]:
    """The rows that were timed (not those that failed with an "error")."""
    return [r for r in rows if "error" not in r]


def shipped_rule(r: dict) -> bool:
    return fused_is_faster(r["M"], r["N"], r["K_total"], r["n"], r["dtype"], kernel=r["kernel"], dim=r["dim"],
                           gpu=r.get("device"))


def crossover(rows: list[dict], rule=shipped_rule) -> list[dict]:
    """The measured crossover per (GPU, kernel, dim, dtype, N, K_total, n): ``min_M``, the smallest
    measured M from which the fused kernel was faster than the unfused path at EVERY larger measured
    M too (beyond the noise: ``fused_wins``), None where it never was at the largest M; with the
    speedups behind it and whether ``rule(row)`` (default: the shipped fused_is_faster) agrees at
    every M measured."""
    groups: dict[tuple, list[dict]] = {}
    for r in measured(rows):
        key = (r.get("device") or "?", r["kernel"], r["dim"], r["dtype"], r["N"], r["K_total"], r["n"])
        groups.setdefault(key, []).append(r)
    out = []
    for (device, kernel, dim, dtype, N, k_total, n), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["M"])
        wins = [fused_wins(r) for r in rs]
        min_m = None
        for i in range(len(rs) - 1, -1, -1):
            if not wins[i]:
                break
            min_m = rs[i]["M"]
        out.append({"device": device, "kernel": kernel, "dim": dim, "dtype": dtype, "N": N, "K_total": k_total, "n": n,
                    "min_M": min_m,
                    "speedup_by_M": {r["M"]: round(r["speedup"], 3) for r in rs},
                    "fused_vs_torch_mm_by_M": {r["M"]: round(r["torch.mm_ms"] / r["fused_ms"], 3) for r in rs},
                    "rule_agrees": all(rule(r) == w for r, w in zip(rs, wins)),
                    "revisions": sorted({row_revision(r) for r in rs})})
    return out


def _stale(t: dict) -> str:
    old = stale_revisions(t["kernel"], t["dim"], t.get("revisions", ()))
    return f"  [stale: revision {', '.join(map(str, old))} of the kernel, now {KERNEL_REVISIONS[t['kernel']]}]" \
        if old else ""


def print_thresholds(ts: list[dict]) -> None:
    print("measured crossover: fused beats the runtime's unfused path from min_M on (None: never, at the sizes run)")
    for t in ts:
        sp = ", ".join(f"M={m}: {s:.2f}x" for m, s in t["speedup_by_M"].items())
        agrees = "agrees" if t["rule_agrees"] else "DISAGREES"
        print(f"  {t['device']}: {t['kernel']} dim {t['dim']} {t['dtype']} N={t['N']} K_total={t['K_total']} "
              f"n={t['n']}: min_M={t['min_M']}  ({sp}; the shipped rule {agrees})" + _stale(t))
    for device, kernel, dim in sorted({(t["device"], t["kernel"], t["dim"]) for t in ts}):
        ks = [t for t in ts if (t["device"], t["kernel"], t["dim"]) == (device, kernel, dim)]
        found = [t["min_M"] for t in ks if t["min_M"] is not None]
        never = [t for t in ks if t["min_M"] is None]
        line = f"{device}: {kernel} dim {dim}: "
        line += f"the largest crossover is M={max(found)}" if found else "the fused kernel never won"
        if never:
            line += "; never faster at: " + ", ".join(f"N={t['N']} K_total={t['K_total']} n={t['n']}" for t in never)
        print(line)


def read_results(paths) -> tuple[list[dict], list[dict | None]]:
    """(every row, each naming its GPU: ``rows_of``; each file's "machine") of these result files in
    their order, each read once (a bare list of rows has no machine: None)."""
    rows, machines = [], []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        rows += rows_of(doc)
        machines.append(doc.get("machine") if isinstance(doc, dict) else None)
    return rows, machines


# ---------------------------------------------------------------------------------------- main
def case_order(kernels, nks, ns, ms, dims=(0,)) -> list[tuple[str, int, int, int, int]]:
    """(kernel, N=K, n, M, dim): dim by dim (in the order given), then shape by shape, each kernel over every M at
    a shape: a run cut short by --budget-s has whole crossovers (where fused starts to win) for both kernels at
    the shapes it reached, the first dim's grid first."""
    return [(kernel, nk, n, M, dim) for dim in dims for nk in nks for n in ns for kernel in kernels for M in ms]


def parse_dims(text: str) -> tuple[int, ...] | None:
    """--dim's value: "0", "1", "0,1" or "1,0" -> the dims in that order; None where it is not such a list."""
    parts = [x.strip() for x in str(text).split(",")]
    if not parts or any(x not in ("0", "1") for x in parts) or len(set(parts)) != len(parts):
        return None
    return tuple(int(x) for x in parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=[*KERNELS, "both"], default="matmul_reduce_scatter")
    ap.add_argument("--ms", default="16,128,1024,8192", help="comma-separated M values")
    ap.add_argument("--nk", default="4096,8192", help="comma-separated N = K values")
    ap.add_argument("--ns", default="2,4", help="comma-separated participant counts")
    ap.add_argument("--dim", default="0", help="the split dim: 0 (row blocks), 1 (column blocks), or 0,1 (the whole "
                                                "grid at dim 0, then at dim 1)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--check", action="store_true",
                    help="also check every variant against a float32 reference (exit 1 on mismatch)")
    ap.add_argument("--json", help="write the rows (or, with --threshold, the crossovers) and the machine info here")
    ap.add_argument("--threshold", nargs="+", metavar="RESULTS_JSON",
                    help="no timing: read these result files and print (--json: write) the measured crossovers")
    ap.add_argument("--write-rule", metavar="TABLE_JSON",
                    help="with --threshold: write fastpipe.kernels.fusion_rule's table from those result files "
                         "(ship it as fastpipe/kernels/fusion_measured.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny sizes: tests the script")
    ap.add_argument("--tune", action="store_true",
                    help="also time the fused kernel under each candidate launch config (tune_candidates): the "
                         "fastest goes to the row's 'tuned' (slow: minutes on a GPU; narrow it with --ms/--nk/--ns)")
    ap.add_argument("--write-tuned", nargs="+", metavar=("TABLE_JSON", "RESULTS_JSON"),
                    help="no timing: write fastpipe.kernels.tuned's table (TABLE_JSON) from --tune result files")
    ap.add_argument("--peak-tflops", type=float,
                    help="the GPU's dense 16-bit peak TFLOP/s (default: PEAK_TFLOPS_16BIT by the device's name)")
    ap.add_argument("--eager", action="store_true",
                    help="time launches from Python on one stream, not CUDA-graph replays (host overhead included)")
    ap.add_argument("--compile-workers", type=int,
                    help="with --tune: first compile every candidate kernel in this many processes (compile_pool; "
                         "default: on a GPU, the cores less two, at most 14; 0: off)")
    ap.add_argument("--budget-s", type=float,
                    help="start no case after this many seconds (the rest are listed as not_run in --json)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile each variant's kernels (torch.profiler over 5 runs of its timed form): the "
                         "row's 'profile' and a line per variant (bench/kernel_profile.py)")
    args = ap.parse_args(argv)

    if args.write_tuned:
        if len(args.write_tuned) < 2:
            ap.error("--write-tuned: expected TABLE_JSON and at least one RESULTS_JSON")
        table = tuned_table(args.write_tuned[1:])
        out = Path(args.write_tuned[0])
        write_text(out, json.dumps(table, indent=1))
        print(f"wrote {out}: {len(table['entries'])} tuned configs (rows whose best config beat the heuristic's "
              "by more than 3%); ship it as fastpipe/kernels/tuned_configs.json or point FASTPIPE_TUNED_CONFIGS at it")
        return 0

    if args.write_rule and not args.threshold:
        ap.error("--write-rule: needs --threshold RESULTS_JSON ...")
    if args.threshold:
        rows, machines = read_results(args.threshold)
        if args.write_rule:
            table = table_from_rows(rows, [m for m in machines if m], [Path(p).name for p in args.threshold])
            write_text(Path(args.write_rule), dump_table(table))
            print(f"wrote {args.write_rule}: {len(table['points'])} measured points "
                  f"({sum(p['fused_wins'] for p in table['points'])} where the fused kernel won); ship it as "
                  "fastpipe/kernels/fusion_measured.json")
        ts = crossover(newest_rows(measured(rows)))
        print_thresholds(ts)
        if args.json:
            write_results(args.json, {"machines": machines, "crossovers": ts})
            print(f"wrote {args.json}")
        return 0

    if args.smoke:
        device = torch.device("cpu")
        ms, nks, ns = [16, 48], [64], [2]
    else:
        if not torch.cuda.is_available():
            print("bench_fused_kernels: needs a CUDA GPU (or --smoke for a CPU interpreter run of the script)",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda")
        ms, nks, ns = ([int(x) for x in s.split(",")] for s in (args.ms, args.nk, args.ns))
    dtype = DTYPES[args.dtype]
    kernels = KERNELS if args.kernel == "both" else (args.kernel,)
    dims = parse_dims(args.dim)
    if dims is None:
        ap.error(f"--dim: expected 0, 1 or 0,1, found {args.dim!r}")
    info = machine_info()
    peak = args.peak_tflops or (peak_tflops(info["device"], dtype) if device.type == "cuda" else None)
    info["peak_tflops"] = peak
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    if device.type == "cuda" and peak is None:
        print(f"no {args.dtype} peak known for {info['device']}: the % peak columns are empty (--peak-tflops sets it)")
    print(f"{', '.join(kernels)}, dtype {args.dtype}, dim {', then '.join(map(str, dims))}, all participants on {device}"
          + (" (SMOKE RUN: interpreter, timings meaningless)" if args.smoke else ""))
    cases = case_order(kernels, nks, ns, ms, dims)
    lanes = unfused_path.lanes_for(device, max(ns))
    rows, not_run, t0 = [], [], time.perf_counter()
    warmup = None
    workers = args.compile_workers if args.compile_workers is not None else compile_pool.default_workers(device)
    if args.tune and workers > 0:
        # half the budget at most: a stuck pool must leave the tuning its time
        warmup = compile_pool.warm(warmup_tasks(cases, dtype, device, args.smoke), workers,
                                   timeout_s=args.budget_s / 2 if args.budget_s is not None else 600)
        print(f"compile warm-up: {warmup['tasks']} first calls ({warmup['units']} kernels' configs) on "
              f"{warmup['workers']} processes in {warmup['s']:.1f} s"
              + (f"; {len(warmup['failed'])} failed (the tuning records them): " + "; ".join(warmup["failed"][:3])
                 if warmup["failed"] else "")
              + (f"; ENDED EARLY: {warmup['error']}" if "error" in warmup else ""), flush=True)
    for i, (kernel, nk, n, M, dim) in enumerate(cases):
        if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
            not_run = [case_key(k, m, x, y, d, dtype) for k, x, y, m, d in cases[i:]]
            print(f"budget: {args.budget_s:.0f} s spent; {len(not_run)} cases not run", flush=True)
            break
        try:
            row = run_case(kernel, M, nk, n, dim, dtype, device, args.check, peak, args.eager, lanes,
                           args.profile)
            if not row:
                print(f"skipped {kernel} dim {dim} M={M} N=K={nk} n={n}: the split dimension is not divisible by n")
                continue
            if args.tune:
                try:
                    row["tuned"] = tune_case(kernel, M, nk, n, dim, dtype, device, row, args.check, args.smoke,
                                             args.eager)
                except Exception as e:  # noqa: BLE001 - the row's own timings stand; the tuning failed
                    row["tuned"] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
                    print(f"  tuning {kernel} dim {dim} M={M} N=K={nk} n={n} FAILED: {row['tuned']['error']}",
                          flush=True)
                t = row["tuned"] if "error" not in row["tuned"] else {}
                if t:
                    print(f"  tuned {kernel} dim {dim} M={M} N=K={nk} n={n}: {t['ms']:.3f} ms with {t['config']} "
                          f"vs the heuristic's {t['heuristic_ms']:.3f} ms ({t['candidates']} configs"
                          + (f", check {t['check']}" if "check" in t else "") + ")", flush=True)
            print(f"  {kernel} dim {dim} M={M} N=K={nk} n={n}: fused {row['fused_ms']:.3f} ms ({row['fused_config']}, "
                  f"{row['fused_config_from']}), unfused "
                  f"{row['unfused_ms']:.3f} ms, torch.mm {row['torch.mm_ms']:.3f} ms ({row['timing']})"
                  + (f", check {row['check']}" if args.check else ""), flush=True)
            for v, prof in row.get("profile", {}).items():
                print(f"    {kernel_profile.line(v, prof, row[f'{v}_ms'])}", flush=True)
        except Exception as e:  # noqa: BLE001 - one case failing (out of memory, say) fails its row, not the run
            row = {**case_key(kernel, M, nk, n, dim, dtype),
                   "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
            print(f"  {kernel} dim {dim} M={M} N=K={nk} n={n}: FAILED: {row['error']}", flush=True)
        row["device"] = info["device"]
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.json:
            write_results(args.json, {"machine": info, "args": vars(args), "compile_warmup": warmup, "rows": rows,
                                       "not_run": not_run})
    if args.json:
        write_results(args.json, {"machine": info, "args": vars(args), "compile_warmup": warmup, "rows": rows,
                                  "not_run": not_run})
    print_table(rows, args.check)
    done = measured(rows)
    failed = [r for r in rows if "error" in r or "error" in (r.get("tuned") or {})]
    missed = [r for r in done if r["targets"] and not (r["targets"]["speedup_met"] and r["targets"]["of_torch_mm_met"])]
    print(f"\ntargets at M >= {TARGET_FROM_M}: {sum(1 for r in done if r['targets']) - len(missed)} rows met both, "
          f"{len(missed)} missed one" + ("" if not missed else ": " + "; ".join(
              f"{r['kernel']} dim {r['dim']} M={r['M']} N=K={r['N=K']} n={r['n']}" for r in missed)))
    print()
    print_thresholds(crossover(rows))
    if args.json:
        print(f"wrote {args.json}")
    rc = 0
    if failed:
        print(f"FAILED: {len(failed)} cases raised: " + "; ".join(
            f"{r['kernel']} dim {r['dim']} M={r['M']} N=K={r['N=K']} n={r['n']}: "
            f"{r.get('error') or 'tuning: ' + r['tuned']['error']}"
            for r in failed), file=sys.stderr)
        rc = 1
    if args.check and any(r["check"] != "ok" or (r.get("tuned") or {}).get("check", "ok") != "ok" for r in done):
        print("MISMATCH: see the check column", file=sys.stderr)
        rc = 1
    return rc


def write_results(path, doc: dict) -> None:
    """--json, rewritten whole after every case, atomically (never half-written)."""
    write_text(path, json.dumps(doc, indent=1))


if __name__ == "__main__":
    from bench.sigint import stop_on_sigint

    stop_on_sigint()            # even where started with SIGINT ignored (gpu_check's stage limit)
    sys.exit(main())
