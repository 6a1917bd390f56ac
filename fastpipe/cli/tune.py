"""`fastpipe tune`: launch configs for this pipeline's fused-kernel calls, and whether fusing them pays, measured
on this GPU.

Loads the pipeline with every fusable group fused (fuse="always", eager, no CUDA graph), runs it once on
seeded random inputs while recording the fused-kernel calls (fastpipe.kernels.calls), compiles every
(call, config) it will time in --compile-workers processes (fastpipe.kernels.compile_pool), then, call by
call, tunes it (fastpipe.kernels.autotune.tune) and times its fused kernel under the config the new table
gives it against the runtime's unfused path (fastpipe.runtime.tuning.kernel_timing.fusion_point). After each call
it writes the table pick_config reads (fastpipe.kernels.tuned) and fuse="auto" consults
(fastpipe.kernels.fusion_rule: its "fusion" points) to --out, merged with what that file held (or, for a
new file, with the table in use now): a run interrupted (Ctrl-C, a time limit's SIGINT) keeps every call it
finished. --budget-s S starts no call S seconds after the command began (the compile pool stops by S/2)
and names the calls it did not reach. Several pipelines (a folder stands for every */pipeline.json in it:
a serving set's buckets) are recorded in turn, and their distinct calls tuned into one table. Exit 0 when
every call was tuned and measured, 1 when one could not be or was not reached (the others are written), 2
on bad input (no GPU, an unreadable --out table; pipelines with nothing to fuse are not an error: nothing
is written).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from fastpipe.cli.common import EXIT_FAILED, check_writable, device_map_of, load_options
from fastpipe.errors import InputError, RunError


def cmd_tune(args) -> int:
    import torch

    from fastpipe.atomic import write_text
    from fastpipe.kernels import autotune, compile_pool, tuned
    from fastpipe.kernels.mm_reduce_scatter_kernel import interpreting
    from fastpipe.runtime.tuning import kernel_timing

    out = args.out or os.environ.get("FASTPIPE_TUNED_CONFIGS")
    if not out:
        raise InputError("--out: expected the file to write the tuned configs to (or FASTPIPE_TUNED_CONFIGS set), "
                         "found neither")
    if not 0 <= args.min_gain < 1:
        raise InputError(f"--min-gain: expected 0 <= gain < 1 (0.03: 3% faster than the heuristic), "
                         f"found {args.min_gain}")
    if args.budget_s is not None and not args.budget_s > 0:
        raise InputError(f"--budget-s: expected seconds > 0, found {args.budget_s:g}")
    check_writable(out, "--out")
    budget = _Budget(args.budget_s)                    # from here: recording the pipelines counts too
    base = _base_table(Path(out), tuned.table_path())
    if not torch.cuda.is_available() and not interpreting():
        raise InputError("fastpipe tune: expected a CUDA GPU (launch configs are measured per GPU model), found none")
    made = []                                          # the distinct calls of every pipeline, in first-call order
    for path in _pipeline_paths(args.pipeline):
        name, got = _record(path, args)
        new = [c for c in got if c not in made]
        made += new
        if got:
            print(f"{name}: {len(got)} distinct fused-kernel calls" + (
                f", {len(got) - len(new)} of them also an earlier pipeline's" if len(new) < len(got) else "") + (
                " (Triton interpreter: timings meaningless)" if interpreting() else ""))
    if not made:
        print("wrote nothing: no pipeline has a group to fuse")
        return 0
    workers = args.compile_workers if args.compile_workers is not None else \
        compile_pool.default_workers(torch.device(made[0].device))
    if workers > 0:
        tasks = [compile_pool.task(c, cfg) for c in made for cfg in autotune.configs_for(c)]
        warm = compile_pool.warm(tasks, workers, timeout_s=budget.pool_s())
        print(f"compiled {warm['tasks']} first calls ({warm['units']} kernels) on {warm['workers']} processes in "
              f"{warm['s']:.1f} s" + (f"; ENDED EARLY: {warm['error']}" if "error" in warm else ""))
    results, points, failed, unreached, doc = [], [], 0, [], None
    for i, call in enumerate(made):
        if budget.spent():
            unreached = made[i:]
            break
        try:
            r = autotune.tune(call, kernel_timing.time_config)
        except ValueError as e:
            r = None
            failed += 1
            print(f"  not tuned: {call.kernel} dim {call.dim}: {e}")
        if r is not None:
            results.append(r)
            print(f"  {r.line(args.min_gain)}")
            for s in r.skipped:
                print(f"    could not run: {s}")
        # the call's fused kernel against the unfused path, under the config the table now gives it; the table
        # written after every call, so that an interrupted run (Ctrl-C, a stage's time limit) keeps the calls done
        doc, kept = autotune.merged_table(base, results, args.min_gain)
        point = _fusion_point(call, tuned.parse_table(doc, out))
        if point is None:
            failed += 1
        else:
            points.append(point)
        doc = autotune.with_fusion_points(doc, points)
        write_text(out, json.dumps(doc, indent=1) + "\n")
    if unreached:
        print(f"budget: --budget-s {args.budget_s:g} s spent after {len(made) - len(unreached)} of {len(made)} calls; "
              f"not tuned or measured: " + "; ".join(c.text() for c in unreached))
    if doc is None:
        print("wrote nothing: no call was reached")
        return EXIT_FAILED
    print(f"wrote {out}: {kept} of {len(results)} tuned calls beat the heuristic by more than {args.min_gain:.0%}; "
          f"{len(doc['entries'])} entries in all; {len(points)} fused-vs-unfused points "
          f"({sum(p['fused_wins'] for p in points)} fused faster)")
    if tuned.table_path().resolve() != Path(out).resolve():
        print(f"pick_config reads it where FASTPIPE_TUNED_CONFIGS={out}")
    return EXIT_FAILED if failed or unreached else 0


class _Budget:
    """--budget-s: no call is tuned once that many seconds have passed since the command began (the call under way
    finishes); the compile pool stops when half of them have passed, at the latest (a stuck pool must leave the
    tuning its time)."""

    def __init__(self, seconds: float | None):
        self.seconds, self.t0 = seconds, _now()

    def pool_s(self) -> float:
        return 600.0 if self.seconds is None else max(1.0, min(600.0, self.seconds / 2 - (_now() - self.t0)))

    def spent(self) -> bool:
        return self.seconds is not None and _now() - self.t0 >= self.seconds


def _now() -> float:
    return time.perf_counter()


def _record(path, args) -> tuple[str, list]:
    """(the pipeline's name, the distinct fused-kernel calls of one run): loaded with every fusable group fused
    and run once on seeded random inputs; no calls where no group fuses (said, with each group's reason)."""
    from fastpipe.format import read_pipeline
    from fastpipe.kernels import calls
    from fastpipe.runtime.processors.registry import with_fields
    from fastpipe.random_inputs import random_inputs
    from fastpipe.session import Session

    p = read_pipeline(str(path))
    sess = Session(p, device_map=device_map_of(args), load_options=load_options(args),
                   run_options=with_fields(None, processor="auto", fuse="always", cuda_graph=False))
    try:
        if not any(d.fused for d in sess.fusion):
            for d in sess.fusion:
                print("fusion: " + d.line())
            print(f"{p.name}: nothing to tune: no group fuses ({len(sess.fusion)} candidate groups)")
            return p.name, []
        with calls.recording() as got:
            sess.run(random_inputs(p, args.seed))
    finally:
        sess.close()
    if not got:
        raise RunError(f"fastpipe tune: expected the fused run of {path} to call the fused kernels, found no call "
                       f"({sum(d.fused for d in sess.fusion)} groups fused); wrote nothing")
    return p.name, got


def _pipeline_paths(given: list[str]) -> list[Path]:
    """The pipeline.json files named, a folder standing for every */pipeline.json in it (a serving set)."""
    from fastpipe.serving.buckets import pipeline_paths

    out = []
    for g in given:
        for path in pipeline_paths(g) if Path(g).is_dir() else [Path(g)]:
            if path not in out:
                out.append(path)
    return out


def _fusion_point(call, table: dict) -> dict | None:
    """The call's fastpipe.kernels.fusion_rule point (printed), or None where it could not be measured (said): its
    fused kernel under the config pick_config will take from the table being written, against the runtime's
    unfused path, so that fuse="auto" decides from this pipeline's own shapes on this GPU."""
    import datetime

    from fastpipe.kernels import autotune
    from fastpipe.runtime.tuning import kernel_timing

    config = autotune.config_in(table, call)
    try:
        p = kernel_timing.fusion_point(call, config, datetime.date.today().isoformat())
    except Exception as e:  # noqa: BLE001 - reported with the call; the others are still measured
        print(f"  fusion not measured: {call.text()}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
        return None
    print(f"  {_point_line(p)}")
    return p


def _point_line(p: dict) -> str:
    verdict = ('fuse="auto" fuses it' if p["fused_wins"] else
               'fuse="auto" runs it unfused (the fused kernel is not faster beyond the noise: its p80 is not below '
               "the unfused path's p20)")
    return (f"fusion: {p['kernel']} dim {p['dim']} M={p['M']} N={p['N']} K_total={p['K_total']} n={p['n']} "
            f"{p['dtype']}: fused ({p['config']}) {p['fused_ms']:.4f} ms ({p['fused_p20']:.4f}-{p['fused_p80']:.4f}) "
            f"vs unfused {p['unfused_ms']:.4f} ms ({p['unfused_p20']:.4f}-{p['unfused_p80']:.4f}), {p['speedup']:.2f}x "
            f"({p['timing']}): {verdict}")


def _base_table(out: Path, in_use: Path) -> dict | None:
    """What the new table starts from: --out's own entries where it exists (refused if it is not a valid table:
    it is not overwritten), else the table in use now (the packaged one or $FASTPIPE_TUNED_CONFIGS), if any."""
    from fastpipe.kernels.fusion_rule import parse_tuned_points
    from fastpipe.kernels.tuned import parse_table

    path = out if out.exists() else in_use
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        parse_table(doc, str(path))
        parse_tuned_points(doc, str(path))
    except (OSError, ValueError) as e:
        what = "--out" if path == out else "the tuned-config table in use"
        raise InputError(f"{what}: expected a tuned-config table (fastpipe.kernels.tuned) to merge into, found "
                         f"{' '.join(str(e).split())[:300]}") from None
    return doc
