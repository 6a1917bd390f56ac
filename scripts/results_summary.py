"""Summarise a --results-jsonl file (tests/run_log.py): whether the run finished, its counts, its failures.

    python scripts/results_summary.py OUT/results.jsonl [--slowest 10] [--expect-cuda]

Prints: whether the run finished, and how many collected tests have no result (a run stopped at a
time limit: pytest-xdist interrupted may still write its 'finished' line with exit status 0); counts
by outcome for the whole suite and for the cuda-marked tests (what `pytest` and `pytest -m cuda` would
report, from one run); every failure and error with its one-line message; the reasons cuda-marked
tests were skipped; the slowest tests; and a rerun line of the failing node ids.
Exit status: 0 when the run finished with no failure or error (and, with --expect-cuda, as on the GPU
machine, no cuda-marked test was skipped for want of a GPU, and some passed where any ran), else 1; 2: unreadable.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def read(path: str) -> tuple[list[dict], list[dict]]:
    """(events, results); a torn last line (the writer killed mid-line) is dropped."""
    events, results = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            (events if "event" in rec else results).append(rec)
    return events, results


def counts(results: list[dict]) -> str:
    c = Counter(r["outcome"] for r in results)
    return ", ".join(f"{c[o]} {o}" for o in OUTCOMES if c[o] or o in ("passed", "failed"))


NO_GPU_SKIP = "needs a CUDA GPU"       # the reason conftest.py (and skipif guards) give where CUDA is absent


def summarise(path: str, slowest: int = 10, expect_cuda: bool = False) -> tuple[list[str], bool]:
    """(lines to print, whether the run is green: finished, and no failure or error)."""
    events, results = read(path)
    collected = max((e["n"] for e in events if e["event"] == "collected"), default=None)
    finished = next((e for e in events if e["event"] == "finished"), None)
    tests = {r["nodeid"] for r in results}
    head = (f"run finished in {finished['duration']} s, pytest exit status {finished['exitstatus']}"
            if finished is not None else "run CUT OFF (no 'finished' line)")
    # interrupted under xdist, pytest may still end with status 0 and a 'finished' line: count what is missing
    missing = collected - len(tests) if collected is not None else 0
    if missing > 0:
        head += f"; NO RESULT for {missing} of {collected} collected tests"
    cuda = [r for r in results if r["cuda"]]
    lines = [head, f"all:  {counts(results)}", f"cuda: {counts(cuda)}"]
    bad = [r for r in results if r["outcome"] in ("failed", "error", "xpassed")]
    if bad:
        lines.append(f"failed or errors ({len(bad)}):")
        lines += [f"  {r['nodeid']}{' [cuda]' if r['cuda'] else ''} ({r['when']}, {r['duration']:.1f} s): "
                  f"{r['outcome']}: {r['message']}" for r in bad]
    skips = Counter(r["message"] for r in results if r["cuda"] and r["outcome"] == "skipped")
    if skips:
        lines.append("cuda tests skipped, by reason:")
        lines += [f"  {n} x {reason}" for reason, n in skips.most_common()]
    if slowest:
        lines.append(f"slowest {slowest}:")
        lines += [f"  {r['duration']:7.1f} s  {r['nodeid']}"
                  for r in sorted(results, key=lambda r: -r["duration"])[:slowest]]
    if bad:
        ids = sorted({r["nodeid"] for r in bad})
        lines.append("rerun: bash scripts/gpu_check.sh tests " + " ".join(f"'{i}'" for i in ids))
    green = finished is not None and finished["exitstatus"] == 0 and not bad and missing <= 0
    if expect_cuda:
        no_gpu = sum(r["outcome"] == "skipped" and NO_GPU_SKIP in r["message"] for r in cuda)
        if no_gpu or (cuda and not any(r["outcome"] == "passed" for r in cuda)):
            lines.append(f"NOT A GPU RUN: {no_gpu} cuda-marked tests skipped for want of a GPU, "
                         f"{sum(r['outcome'] == 'passed' for r in cuda)} passed")
            green = False
    return lines, green


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--slowest", type=int, default=10, help="list the N slowest tests (0: none)")
    ap.add_argument("--expect-cuda", action="store_true",
                    help="a GPU machine's run: red unless cuda-marked tests ran (none skipped for want of a GPU)")
    args = ap.parse_args(argv)
    try:
        lines, green = summarise(args.jsonl, args.slowest, args.expect_cuda)
    except (OSError, KeyError, TypeError) as e:
        print(f"results_summary: {args.jsonl}: cannot read: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if green else 1


if __name__ == "__main__":
    sys.exit(main())
