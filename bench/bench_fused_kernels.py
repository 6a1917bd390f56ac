"""Fused matmul + collective kernels vs the unfused path, all participants on one GPU.

    python bench/bench_fused_kernels.py                 # matmul_reduce_scatter, the default grid below
    python bench/bench_fused_kernels.py --check         # verify correctness at those sizes (exit 1 on mismatch)
    python bench/bench_fused_kernels.py --kernel all_gather_matmul --dim 0
    python bench/bench_fused_kernels.py --ms 16,8192 --nk 4096 --ns 2 --json fused.json

Default grid: M in {16, 128, 1024, 8192}, N = K in {4096, 8192}, n in {2, 4}, bf16, dim 0.

matmul_reduce_scatter (a[i]: [M, K], b[i] = w_i.t(): [K, N], as a row-parallel linear layer):
  fused    fastpipe.kernels.matmul_reduce_scatter: one launch, every tile written once
  unfused  torch.mm per participant, then the reduce_scatter of fastpipe.comm.reference
           semantics: float32 fold, one cast, n contiguous chunks
  torch.mm one mm of [M, n*K] x [n*K, N]: the same FLOPs in one cuBLAS call (the roofline
           the fused kernel should approach)
all_gather_matmul (a[i]: [M/n, K] (dim 0) or [M, K/n] (dim 1), b[j] = w_j.t(): [K, N/n]):
  fused    fastpipe.kernels.all_gather_matmul: one launch per j, no cat(a)
  unfused  torch.cat(a, dim), then torch.mm per j
  torch.mm one mm of [M, K] x [K, N]: the same FLOPs

Each time is triton.testing.do_bench's median (p20-p80 shown) after its warm-up; the fused
kernel's first call (Triton compile + autotune-free launch) is reported apart. TFLOP/s =
2*M*N*K_total / time. The last column is what ``fused_is_faster`` (the runtime's rule,
a placeholder until these numbers replace it) would pick. Without CUDA the script refuses,
except ``--smoke`` (tiny sizes, TRITON_INTERPRET=1 on CPU, timings meaningless): it only
checks that the script itself runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # before triton is imported: the kernels then run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from fastpipe.kernels import (  # noqa: E402
    all_gather_matmul,
    all_gather_matmul_reference,
    fused_is_faster,
    matmul_reduce_scatter,
    matmul_reduce_scatter_reference,
)
from tests.tensor_compare import error_ratio  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bench(fn, device) -> tuple[float, float, float]:
    """(median, p20, p80) in ms."""
    if device.type == "cuda":
        from triton.testing import do_bench

        med, p20, p80 = do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
        return med, p20, p80
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts), min(ts), max(ts)


def first_call_ms(fn, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t) * 1e3


def make_mrs(M, NK, n, dtype, device, seed=0):
    """a[i]: [M, K], b[i] = w_i.t() with w_i: [N, K] (a linear layer's weight), N = K = NK."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = [torch.randn(M, NK, generator=g, device=device, dtype=dtype) for _ in range(n)]
    w = [torch.randn(NK, NK, generator=g, device=device, dtype=dtype) / NK ** 0.5 for _ in range(n)]
    return a, [x.t() for x in w]


def make_agm(M, NK, n, dim, dtype, device, seed=0):
    """cat(a; dim) is [M, K]; b[j] = w_j.t(): [K, N/n]; N = K = NK."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (M // n, NK) if dim == 0 else (M, NK // n)
    a = [torch.randn(*shape, generator=g, device=device, dtype=dtype) for _ in range(n)]
    w = [torch.randn(NK // n, NK, generator=g, device=device, dtype=dtype) / NK ** 0.5 for _ in range(n)]
    return a, [x.t() for x in w]


def unfused_mrs(a, b, dim):
    n = len(a)
    parts = [torch.mm(x, y) for x, y in zip(a, b)]
    acc = parts[0].float()
    for p in parts[1:]:
        acc.add_(p)
    return [c.to(a[0].dtype, memory_format=torch.contiguous_format) for c in acc.chunk(n, dim)]


def unfused_agm(a, b, dim):
    full = torch.cat(a, dim=dim)
    return [torch.mm(full, bj) for bj in b]


def check_close(outs, refs, mags, rtol, atol) -> tuple[bool, float]:
    """|out - ref| <= rtol*|ref| + atol*mag everywhere (tests/tensor_compare.py's rule); returns
    (ok, worst ratio err/allowed)."""
    worst = max((error_ratio(o, r, m, rtol=rtol, atol=atol) for o, r, m in zip(outs, refs, mags)), default=0.0)
    return worst <= 1.0, worst


def run_case(kernel, M, NK, n, dim, dtype, device, check: bool) -> dict:
    if kernel == "matmul_reduce_scatter":
        if (M if dim == 0 else NK) % n:
            return {}
        a, b = make_mrs(M, NK, n, dtype, device)
        fused = lambda: matmul_reduce_scatter(a, b, dim=dim)  # noqa: E731
        unfused = lambda: unfused_mrs(a, b, dim)  # noqa: E731
        k_total, N = n * NK, NK
        a_cat = torch.cat(a, dim=1)
        b_cat = torch.cat([x.t() for x in b], dim=1).t()  # [n*K, N], the same w.t() layout
    else:
        if (M if dim == 0 else NK) % n or NK % n:
            return {}
        a, b = make_agm(M, NK, n, dim, dtype, device)
        fused = lambda: all_gather_matmul(a, b, dim=dim)  # noqa: E731
        unfused = lambda: unfused_agm(a, b, dim)  # noqa: E731
        k_total, N = NK, NK
        a_cat = torch.cat(a, dim=dim)
        b_cat = torch.cat([x.t() for x in b], dim=0).t()  # [K, N]
    row = {"kernel": kernel, "M": M, "N=K": NK, "n": n, "dim": dim, "dtype": str(dtype).replace("torch.", "")}
    row["first_call_ms"] = first_call_ms(fused, device)
    if check:
        outs = fused()
        if kernel == "matmul_reduce_scatter":
            refs = matmul_reduce_scatter_reference(a, b, dim)
            mags = torch.chunk(sum(x.float().abs() @ y.float().abs() for x, y in zip(a, b)), n, dim)
        else:
            refs = all_gather_matmul_reference(a, b, dim)
            full = torch.cat(a, dim=dim).float().abs()
            mags = [full @ bj.float().abs() for bj in b]
        rtol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
        if device.type == "cpu":
            rtol *= 4  # the interpreter truncates fp32 -> bf16 (one ulp, not half)
        ok, worst = check_close(outs, refs, mags, rtol, 1e-5)
        row.update(check="ok" if ok else "MISMATCH", worst_err_over_tol=worst)
        del outs, refs, mags
    flops = 2.0 * M * N * k_total
    for name, fn in (("fused", fused), ("unfused", unfused), ("torch.mm", lambda: torch.mm(a_cat, b_cat))):
        med, p20, p80 = bench(fn, device)
        row[f"{name}_ms"], row[f"{name}_p20"], row[f"{name}_p80"] = med, p20, p80
        row[f"{name}_tflops"] = flops / (med * 1e-3) / 1e12
    row["speedup"] = row["unfused_ms"] / row["fused_ms"]
    row["rule_says_fused"] = fused_is_faster(M, N, k_total, n, dtype)
    return row


def print_table(rows: list[dict], check: bool) -> None:
    header = ["M", "N=K", "n", "fused ms (p20-p80)", "unfused ms", "speedup", "fused TF/s", "unfused TF/s",
              "torch.mm TF/s", "first call ms", "rule: fused?"] + (["check"] if check else [])
    table = []
    for r in rows:
        table.append([str(r["M"]), str(r["N=K"]), str(r["n"]),
                      f"{r['fused_ms']:.3f} ({r['fused_p20']:.3f}-{r['fused_p80']:.3f})", f"{r['unfused_ms']:.3f}",
                      f"{r['speedup']:.2f}x", f"{r['fused_tflops']:.1f}", f"{r['unfused_tflops']:.1f}",
                      f"{r['torch.mm_tflops']:.1f}", f"{r['first_call_ms']:.0f}",
                      "yes" if r["rule_says_fused"] else "no"]
                     + ([f"{r['check']} ({r['worst_err_over_tol']:.2f} of tol)"] if check else []))
    widths = [max(len(x[i]) for x in table + [header]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths]] + table:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=["matmul_reduce_scatter", "all_gather_matmul"], default="matmul_reduce_scatter")
    ap.add_argument("--ms", default="16,128,1024,8192", help="comma-separated M values")
    ap.add_argument("--nk", default="4096,8192", help="comma-separated N = K values")
    ap.add_argument("--ns", default="2,4", help="comma-separated participant counts")
    ap.add_argument("--dim", type=int, default=0, choices=[0, 1])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--check", action="store_true", help="also verify the fused results (exit 1 on mismatch)")
    ap.add_argument("--json", help="write the rows and the machine info to this file")
    ap.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny sizes: tests the script")
    args = ap.parse_args()

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
    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(f"{args.kernel}, dtype {args.dtype}, dim {args.dim}, all participants on {device}"
          + (" (SMOKE RUN: interpreter, timings meaningless)" if args.smoke else ""))
    rows = []
    for nk in nks:
        for n in ns:
            for M in ms:
                row = run_case(args.kernel, M, nk, n, args.dim, dtype, device, args.check)
                if not row:
                    print(f"skipped M={M} N=K={nk} n={n}: the split dimension is not divisible by n")
                    continue
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print_table(rows, args.check)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    if args.check and any(r["check"] != "ok" for r in rows):
        print("MISMATCH: see the check column", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
