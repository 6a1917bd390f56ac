"""Print the foundation benchmarks side by side: load and dispatch, each against its baseline.

    python bench/report_foundation.py [--mb 256] [--chain 1000] [--rounds 5]

load:     fastpipe.load of a pipeline whose constants are slices covering a checkpoint, then one
          read of every constant, vs safetensors.torch.load_file of the whole checkpoint, then
          one read of every tensor (target <= 1.2x). Both are lazy (mmap), so both are made to
          touch every byte; the file is in the page cache for both (warm, same run).
dispatch: a chain of tiny fx supertasks vs the same ops in eager torch; the difference
          per supertask is fastpipe's dispatch overhead (target <= 30 us here).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import fastpipe  # noqa: E402
from bench.machine import machine_info  # noqa: E402
from bench.pipelines import (chain_reference, evict_from_page_cache, load_slices_only, session_constants,  # noqa: E402
                             touch_all, write_chain_pipeline, write_load_pipeline)
from fastpipe.weights import WeightStore  # noqa: E402


def median_time(fn, rounds: int) -> float:
    fn()  # warm (page cache, allocator)
    times = []
    for _ in range(rounds):
        gc.collect()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--chain", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pipeline, weights = write_load_pipeline(Path(tmp) / "load", total_mb=args.mb)
        def whole():
            return touch_all(load_file(str(weights)).values())

        def ours():
            return touch_all(session_constants(fastpipe.load(pipeline, store=WeightStore())))

        def slices():
            return touch_all(load_slices_only(pipeline))

        def cold(fn):
            def run():
                evict_from_page_cache(weights)
                return fn()
            return run

        for label, base_fn, our_fn, note in (
            ("load, cold file", cold(whole), cold(ours), "fastpipe.load (validate + decode + slices)"),
            ("load, warm file", whole, ours, "fastpipe.load (validate + decode + slices)"),
            ("weights only, warm", whole, slices, "weight store: every slice"),
        ):
            base = median_time(base_fn, args.rounds)
            t = median_time(our_fn, args.rounds)
            rows.append((label, f"{args.mb} MiB; {note}", f"{base * 1e3:.1f} ms", f"{t * 1e3:.1f} ms",
                         f"{t / base:.2f}x", "<= 1.2x", "yes" if t / base <= 1.2 else "NO"))
        chain = write_chain_pipeline(Path(tmp) / "chain", n=args.chain)
        sess = fastpipe.load(chain)
        y = torch.randn(4)
        base = median_time(lambda: chain_reference(y, args.chain), args.rounds * 4)
        ours = median_time(lambda: sess.run({"y0": y}), args.rounds * 4)
        per = (ours - base) / args.chain * 1e6
        rows.append(("dispatch", f"{args.chain} tiny fx supertasks", f"{base * 1e3:.2f} ms", f"{ours * 1e3:.2f} ms",
                     f"+{per:.1f} us/supertask", "<= 30 us", "yes" if per <= 30 else "NO"))
    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    header = ("benchmark", "size", "baseline", "fastpipe", "ratio / overhead", "target", "met")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths)] + rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
