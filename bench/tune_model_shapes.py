"""`fastpipe tune` at a real model's shapes: does fusing pay there, and did the bench grid's rule guess it?

    python bench/tune_model_shapes.py --json model_tune.json                 # on a GPU: Llama-3-8B's MLP, tp 2
    python bench/tune_model_shapes.py --d 8192 --h 28672 --n 4 --ms 16,1024   # Llama-3-70B's, tp 4
    python bench/tune_model_shapes.py --smoke                                # CPU, TRITON_INTERPRET=1, tiny
    python bench/tune_model_shapes.py --budget-s 240 --json t.json           # what gpu_check.sh shapes runs

For each M (a decode step's batch, a prefill's batch x length) it writes a sequence-parallel MLP block
split n ways (tests/fusion_pipelines.sp_block: all_gather -> [M, D] @ [D, H/n] -> gelu -> @ [H/n, D] ->
reduce_scatter, random weights, every slot on cuda:0) and runs ``fastpipe tune`` over all of them into one
table (--table, default a file beside the pipelines). So both fusable groups of each block get their launch
configs tuned and their fused kernel timed against the runtime's unfused path (fastpipe.runtime.
unfused_path), as replayed CUDA graphs.

Then, per point, the table it prints: the fused and unfused times, the speedup, the measured verdict, and
what fuse="auto" decides from the shipped bench grid alone (fastpipe.kernels.fusion_rule without this
table), so "agrees" says whether the grid's nearest point guessed this model's shape right. --json writes
the points, those verdicts and the machine. A run cut short (--budget-s, or interrupted) reports the calls
fastpipe tune finished (it writes its table after each) and exits non-zero.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.machine import machine_info  # noqa: E402
from fastpipe.atomic import write_text  # noqa: E402


def write_blocks(folder: Path, ms: list[int], D: int, H: int, n: int, dtype: str) -> list[Path]:
    """One sp_block pipeline per M under folder/m<M>/."""
    from tests.fusion_pipelines import sp_block

    return [sp_block(folder / f"m{M}", S=M, D=D, H=H, n=n, dtype=dtype) for M in ms]


def grid_verdicts(points: list[dict]) -> list[dict]:
    """Each point with what the shipped grid alone decides at its shape (``grid_fused``, ``grid_reason``)
    and whether that matches the measurement (``agrees``)."""
    from fastpipe.kernels.fusion_rule import estimate

    os.environ.pop("FASTPIPE_TUNED_CONFIGS", None)
    out = []
    for p in points:
        gpu = p["device"] if p["device"] != "cpu" else None
        e = estimate(p["kernel"], p["M"], p["N"], p["K_total"], p["n"], p["dtype"], p["dim"], gpu)
        out.append({**p, "grid_fused": e.fused, "grid_reason": e.reason, "agrees": e.fused == p["fused_wins"]})
    return out


def print_table(rows: list[dict]) -> None:
    header = ["kernel", "M", "N", "K_total", "n", "fused ms (p20-p80)", "unfused ms (p20-p80)", "speedup",
              "measured", "grid says", "agrees"]
    body = [[r["kernel"], str(r["M"]), str(r["N"]), str(r["K_total"]), str(r["n"]),
             f"{r['fused_ms']:.4f} ({r['fused_p20']:.4f}-{r['fused_p80']:.4f})",
             f"{r['unfused_ms']:.4f} ({r['unfused_p20']:.4f}-{r['unfused_p80']:.4f})", f"{r['speedup']:.2f}x",
             "fused" if r["fused_wins"] else "unfused", "fused" if r["grid_fused"] else "unfused",
             "yes" if r["agrees"] else "NO"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    for line in [header, ["-" * w for w in widths], *body]:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip())


def run_tune(cmd: list[str], env: dict) -> int:
    """fastpipe tune's exit status. Interrupted (Ctrl-C, or gpu_check's SIGINT at the stage's limit, which reaches
    the child too), it waits for fastpipe tune to stop: its table holds every call it finished, reported here."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        print("tune_model_shapes: interrupted: reporting the calls fastpipe tune finished", flush=True)
        try:
            return proc.wait(timeout=15)
        except KeyboardInterrupt:
            proc.kill()
            return proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="16,128,1024,8192", help="comma-separated M (rows) to build a block for")
    ap.add_argument("--d", type=int, default=4096, help="hidden size D (default 4096: Llama-3-8B)")
    ap.add_argument("--h", type=int, default=14336, help="MLP size H (default 14336: Llama-3-8B)")
    ap.add_argument("--n", type=int, default=2, help="tensor-parallel degree (default 2)")
    ap.add_argument("--dtype", default="bf16", help="the pipelines' dtype (default bf16)")
    ap.add_argument("--table", help="the tuned table to write (default: tuned.json beside the pipelines)")
    ap.add_argument("--json", help="write the points and the grid's verdicts here")
    ap.add_argument("--compile-workers", help="passed to fastpipe tune")
    ap.add_argument("--budget-s", type=float,
                    help="seconds for the whole run: fastpipe tune gets what writing the blocks left (its --budget-s), "
                         "and the points of the calls it reached are reported")
    ap.add_argument("--smoke", action="store_true", help="CPU under the Triton interpreter: D 16, H 32, M 8 and 16")
    args = ap.parse_args(argv)
    if args.smoke:
        args.ms, args.d, args.h, args.dtype = "8,16", 16, 32, "f32"
    ms = [int(x) for x in args.ms.split(",")]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fastpipe-model-tune-") as tmp:
        paths = write_blocks(Path(tmp), ms, args.d, args.h, args.n, args.dtype)
        table = args.table or str(Path(tmp) / "tuned.json")
        device = "cpu" if args.smoke else "cuda:0"
        cmd = [sys.executable, "-m", "fastpipe", "tune", *map(str, paths), "--out", table,
               "--device-map", ",".join(f"{r}={device}" for r in range(args.n))]
        if args.compile_workers is not None:
            cmd += ["--compile-workers", args.compile_workers]
        if args.budget_s is not None:
            cmd += ["--budget-s", f"{max(1.0, args.budget_s - (time.perf_counter() - t0)):.0f}"]
        env = {k: v for k, v in os.environ.items() if k != "FASTPIPE_TUNED_CONFIGS"}
        print("$ " + " ".join(cmd), flush=True)
        rc = run_tune(cmd, env)
        if not Path(table).exists():
            print(f"tune_model_shapes: fastpipe tune wrote no table (exit {rc})")
            return rc or 1
        doc = json.loads(Path(table).read_text())
    rows = grid_verdicts(doc.get("fusion", []))
    print()
    print_table(rows)
    print(f"\nthe grid's rule agrees with the measurement at {sum(r['agrees'] for r in rows)} of {len(rows)} shapes")
    if args.json:
        shape = {"D": args.d, "H": args.h, "n": args.n, "dtype": args.dtype, "ms": ms}
        write_text(args.json, json.dumps({"machine": machine_info(), "shape": shape, "exit": rc, "points": rows,
                                          "entries": doc.get("entries", [])}, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    from bench.sigint import stop_on_sigint

    stop_on_sigint()            # even where started with SIGINT ignored (gpu_check's stage limit)
    sys.exit(main())
