"""Same-run comparison of two revisions of fastpipe (for refactors: did dispatch or load get slower?).

    python bench/compare_revisions.py BASE [HEAD] [--rounds 2] [--runs 300]

Checks each revision out in a temporary git worktree and, alternating between them `--rounds`
times, measures in a fresh process per revision: the median run time and the mean load time of
every example in graphs/ with the reference and cpu processors (eager), and the dispatch row of
bench/report_foundation.py (1,000 tiny fx supertasks). Prints the best of the rounds per
revision and the ratio. CPU only; numbers on a busy 2-core machine move by +-20% per example,
so read the dispatch row (us per supertask) for small differences.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("tp_mlp", "seq_parallel", "moe_all_to_all", "two_stage_skip")
MEASURE = r"""
import json, statistics, sys, time
sys.path.insert(0, ".")
import fastpipe
from safetensors.torch import load_file
runs = int(sys.argv[1]); out = {}
for name in %r:
    ins = load_file(f"graphs/{name}/inputs.safetensors")
    for proc in ("reference", "cpu"):
        s = fastpipe.load(f"graphs/{name}/pipeline.json", processor=proc)
        for _ in range(20):
            s.run(ins)
        ts = []
        for _ in range(runs):
            t = time.perf_counter(); s.run(ins); ts.append(time.perf_counter() - t)
        out[f"{name} {proc} run"] = statistics.median(ts) * 1e3
        t = time.perf_counter()
        for _ in range(5):
            fastpipe.load(f"graphs/{name}/pipeline.json", processor=proc)
        out[f"{name} {proc} load"] = (time.perf_counter() - t) / 5 * 1e3
print(json.dumps(out))
""" % (EXAMPLES,)


def measure(tree: Path, runs: int) -> dict[str, float]:
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
    import os

    env = {**os.environ, **env}
    got = json.loads(subprocess.run([sys.executable, "-c", MEASURE, str(runs)], cwd=tree, env=env, check=True,
                                    capture_output=True, text=True).stdout.strip().splitlines()[-1])
    rep = subprocess.run([sys.executable, "bench/report_foundation.py", "--mb", "16", "--rounds", "5"], cwd=tree, env=env,
                         check=True, capture_output=True, text=True).stdout
    row = next(ln for ln in rep.splitlines() if ln.startswith("| dispatch"))
    got["dispatch us/supertask"] = float(row.split("|")[5].split("us")[0].strip().lstrip("+"))
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("head", nargs="?", default="HEAD")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for rev in (args.base, args.head):
            trees[rev] = Path(tmp) / rev.replace("/", "_")
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(trees[rev]), rev], check=True)
        try:
            best: dict[str, dict[str, float]] = {rev: {} for rev in trees}
            for _ in range(args.rounds):
                for rev, tree in trees.items():
                    for k, v in measure(tree, args.runs).items():
                        best[rev][k] = min(v, best[rev].get(k, v))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    b, h = best[args.base], best[args.head]
    print(f"| measure | {args.base} | {args.head} | ratio |")
    print("|---|---|---|---|")
    for k in b:
        print(f"| {k} | {b[k]:.3f} | {h[k]:.3f} | {h[k] / b[k]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
