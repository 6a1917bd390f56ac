"""Multi-process (dist processor, gloo, N ranks) vs single-process (cpu processor) on one example.

    python bench/bench_distributed.py                       # graphs/tp_mlp, 2 ranks, 200 runs each
    python bench/bench_distributed.py --example seq_parallel --nproc 2 --repeat 500

single  fastpipe.load(..., processor="cpu"): one process, a thread per slot; comm groups are the
        plain-torch reference run in-process (a copy, a sum).
dist    fastpipe.load(..., processor="dist") in N processes launched by torch's elastic launcher
        (`python -m torch.distributed.run --standalone`), gloo over loopback TCP; one slot per rank.
Both run eagerly (no torch.compile) on the same inputs. Each run is timed on rank 0 from the call
to the outputs gathered on rank 0; before each dist run a barrier (not timed) lines the ranks up,
so the number is one run's latency, not a pipelined throughput. Threads: each rank gets
cores / N intra-op threads (what `fastpipe run --nproc` sets) and so does the single process,
which runs N slot threads at once (torch's default there, one intra-op thread per core on top of
the slot threads, oversubscribes the cores and measured several times slower on 2 cores).

overhead per comm group = (dist median - single median) / number of comm groups: what moving a
group's tensors between processes costs over doing it in memory (plus the output gather to
rank 0, which this attributes to the groups too). The same from the p20s is shown beside it:
on a small shared machine the medians swing with other load, the p20s much less.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _stats(ts: list[float]) -> dict:
    ts = sorted(ts)
    q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]  # noqa: E731
    return {"median_ms": statistics.median(ts), "p20_ms": q(0.2), "p80_ms": q(0.8), "runs": len(ts)}


def _inputs(example: str):
    from safetensors.torch import load_file

    return load_file(ROOT / "graphs" / example / "inputs.safetensors")


def single(example: str, repeat: int, warmup: int, threads: int) -> dict:
    import fastpipe

    import torch

    sess = fastpipe.load(ROOT / "graphs" / example / "pipeline.json", processor="cpu")
    torch.set_num_threads(threads)
    x = _inputs(example)
    for _ in range(warmup):
        sess.run(x)
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        sess.run(x)
        ts.append((time.perf_counter() - t) * 1e3)
    return {**_stats(ts), "groups": len(sess.checked.groups), "slots": len(sess.pipeline.devices)}


def worker(example: str, repeat: int, warmup: int, out: str) -> None:
    """One rank (run by the launcher)."""
    import torch.distributed as dist

    import fastpipe
    from fastpipe.runtime.processors.dist import shutdown

    sess = fastpipe.load(ROOT / "graphs" / example / "pipeline.json", processor="dist")
    x = _inputs(example)
    for _ in range(warmup):
        sess.run(x)
    ts = []
    for _ in range(repeat):
        dist.barrier()
        t = time.perf_counter()
        sess.run(x)
        ts.append((time.perf_counter() - t) * 1e3)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({**_stats(ts), "backend": sess.runner.plan.backend,
                                         "world": sess.runner.plan.world}))
    shutdown()          # lets go of the process groups (destroys the default group fastpipe created)


def multi(example: str, nproc: int, repeat: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               __file__, "--worker", "--example", example, "--repeat", str(repeat), "--warmup", str(warmup), "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"bench: the {nproc}-rank run failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--example", default="tp_mlp")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.example, args.repeat, args.warmup, args.out)
        return 0
    from bench.machine import machine_info

    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    s = single(args.example, args.repeat, args.warmup, threads)
    m = multi(args.example, args.nproc, args.repeat, args.warmup)
    per_group = (m["median_ms"] - s["median_ms"]) / s["groups"]
    per_group_p20 = (m["p20_ms"] - s["p20_ms"]) / s["groups"]
    info = machine_info()
    print(f"# {args.example}: {s['slots']} slots, {s['groups']} comm groups; {args.repeat} runs after {args.warmup} warm-up, "
          f"eager, {threads} intra-op thread(s) per slot")
    print(f"# {info['cpu']}, torch {info['torch']}, python {info['python']}, {info['date']}")
    print("| processor | processes | median ms | p20 ms | p80 ms | overhead per comm group (from median / from p20) |")
    print("|---|---|---|---|---|---|")
    print(f"| cpu (threads) | 1 | {s['median_ms']:.3f} | {s['p20_ms']:.3f} | {s['p80_ms']:.3f} | - |")
    print(f"| dist ({m['backend']}) | {m['world']} | {m['median_ms']:.3f} | {m['p20_ms']:.3f} | {m['p80_ms']:.3f} | "
          f"{per_group * 1e3:.0f} us / {per_group_p20 * 1e3:.0f} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
