"""Run the benchmark suites that fit this machine and print them side by side.

    python bench/report.py [--suites examples,hf,comm,kernels,sampling] [--quick] [--out bench/results]

Writes <out>/results.json (pytest-benchmark), <out>/report.md (the tables) and
<out>/latency_vs_size.png (latency against message size for each comm kind; needs matplotlib:
`pip install -e '.[bench]'`). Every table row: variant, median and p10/p90 (ms), and the ratio
to the group's baseline (its first variant: the unsplit model eager, or the unfused kernel).
Suites needing a GPU are skipped (with the reason) on a CPU machine.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITES = {"examples": "bench/test_bench_examples.py", "hf": "bench/test_bench_hf.py",
          "comm": "bench/test_bench_comm.py", "kernels": "bench/test_bench_kernels.py",
          "foundation": "bench/test_bench_foundation.py", "sampling": "bench/test_bench_sampling.py"}


def run(suites: list[str], out: Path, quick: bool) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    js = out / "results.json"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:logging", "-p", "no:cacheprovider",
           f"--benchmark-json={js}", *[SUITES[s] for s in suites]]
    if quick:
        cmd += ["--benchmark-min-rounds=3", "--benchmark-max-time=0.2", "--benchmark-warmup=on"]
    r = subprocess.run(cmd, cwd=ROOT)
    if r.returncode not in (0, 5):
        raise SystemExit(f"report: the benchmark suites failed (exit {r.returncode})")
    return js


def tables(js: Path) -> tuple[str, dict]:
    data = json.loads(js.read_text())
    groups: dict[str, list] = defaultdict(list)
    for b in data["benchmarks"]:
        groups[b["group"]].append(b)
    lines, sizes = [], defaultdict(list)
    machine = data["benchmarks"][0]["extra_info"] if data["benchmarks"] else {}
    lines.append("machine: " + ", ".join(f"{k} {machine.get(k)}" for k in ("device", "cpu", "torch", "triton", "fastpipe", "date")))
    for g, rows in groups.items():
        if g.startswith("comm "):
            for b in rows:
                sizes[g[5:]].append((b["extra_info"]["size"], b["stats"]["median"] * 1e3))
            continue
        base = rows[0]["stats"]["median"]
        lines.append(f"\n### {g}\n")
        lines.append("| variant | median ms | p10 ms | p90 ms | vs baseline |")
        lines.append("|---|---|---|---|---|")
        for b in rows:
            e, st = b["extra_info"], b["stats"]
            lines.append(f"| {e.get('variant', b['name'])} | {st['median'] * 1e3:.3f} | {e.get('p10_s', st['min']) * 1e3:.3f} | "
                         f"{e.get('p90_s', st['max']) * 1e3:.3f} | {base / st['median']:.2f}x |")
    if sizes:
        lines.append("\n### comm kinds (reference), median ms by message size (float32 elements)\n")
        all_sizes = sorted({s for v in sizes.values() for s, _ in v})
        lines.append("| kind | " + " | ".join(str(s) for s in all_sizes) + " |")
        lines.append("|---" * (len(all_sizes) + 1) + "|")
        for kind, pts in sizes.items():
            d = dict(pts)
            lines.append(f"| {kind} | " + " | ".join(f"{d[s]:.4f}" if s in d else "-" for s in all_sizes) + " |")
    return "\n".join(lines) + "\n", sizes


def plot(sizes: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot: skipped: matplotlib is not installed (pip install -e '.[bench]')"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, pts in sorted(sizes.items()):
        pts = sorted(pts)
        ax.plot([s for s, _ in pts], [t for _, t in pts], marker="o", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (float32 elements)")
    ax.set_ylabel("median latency (ms)")
    ax.set_title("fastpipe comm reference: latency vs size")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot: wrote {path}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suites", default="examples,hf,comm,kernels")
    ap.add_argument("--quick", action="store_true", help="few rounds per benchmark (a smoke run)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--from-json", help="only tabulate an existing results.json")
    args = ap.parse_args()
    out = Path(args.out)
    js = Path(args.from_json) if args.from_json else run(args.suites.split(","), out, args.quick)
    text, sizes = tables(js)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    if sizes:
        print(plot(sizes, out / "latency_vs_size.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
