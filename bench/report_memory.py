"""Load time onto a device, peak GPU memory against the plan, and CUDA-graph pool memory of buckets.

    python bench/report_memory.py [--device auto|cpu|cuda] [--sections load,memory,pool] [--mb 1536]
                                  [--rounds 5] [--quick] [--json out.json]

Three sections, each printed as a markdown table; --json writes every row of every section run,
with bench.machine.machine_info(), after EACH section and, in memory and pool, after each row (tmp
file + os.replace; a section not yet finished has "partial": true), so a run cut off at a time
limit keeps the rows it finished.

load    A checkpoint of --mb MiB (16 matrices, --dtype) and a pipeline whose constants are row
        slices covering all of it over 2 slots (bench.pipelines.write_load_pipeline, as the
        Foundation benchmark). fastpipe.load(pipeline, device_map={every slot: device}) against
        safetensors.torch.load_file(path, device=device); on a GPU fastpipe twice: its default upload
        (upload="pinned": pinned staging buffers, reading the file while the copy engine copies) and
        upload="pageable" (.to(device) per tensor, as safetensors does), the columns "pageable ratio"
        (its time / safetensors') and "pinned / pageable" (what the staging buys), and the default
        upload again with torch's intra-op threads set to 1 for the load ("1 thread / pinned"): the
        staging's host copy faults the file's pages in on every intra-op thread at once, which may
        defeat the kernel's readahead on a cold file (pinned lost to pageable cold on the H200,
        2026-11-27). All end with every
        byte resident on the device: on a GPU both copy every tensor there and the timer stops after
        torch.cuda.synchronize(); on the CPU both are lazy mmap views, so both then read every byte
        (a sum, as report_foundation does). "cold" drops the file from the page cache
        (posix_fadvise DONTNEED) before each timed call, "warm" reads it from the page cache. Each
        side is loaded once untimed first (imports, CUDA context); then --rounds rounds, the
        sides alternating; medians, the ratio fastpipe / safetensors of the same run, and bytes/s
        (tensor bytes / median time). Between calls everything is freed (del, gc,
        torch.cuda.empty_cache). The file system of the folder is reported: on a tmpfs "cold" is
        not a disk read (--tmp picks the folder).

memory  A random Llama-family checkpoint (bench.generation_cases.make_model; --layers, --hidden,
        --vocab), built with tp=2 (build_hf) at a decode shape (batch 1, 1 token over --past=128
        cached: past_len=128), a prefill shape (batch 1, --seq=64 tokens, past_len=0: it also
        returns the KV cache) and the same prefill as a serving set builds it (last_logits: it takes
        logits_index and returns one position's logits, [1, 1, V] instead of [1, S, V]; cache_rows:
        it writes the prompt's keys/values into a row of a static cache of --seq + --past positions,
        the caller's, state_in_place, instead of returning them; a line after the table gives its
        plan activations, and on a GPU its run's own and peak reserved memory, over the full-logits
        prefill's). On a GPU, both slots on the one device, for the cuda processor with
        cuda_graph=True and False (fx steps eager) and the region processor (cuda_graph=True,
        compile per --compile): load, inputs placed on the GPU by the caller, Session.compile()
        (warm-up run; captures the graph where there is one), empty_cache, reset of the peak
        statistics, then ONE run. Columns (all bytes on that GPU, this process):
          plan peak / constants / activations: Session.memory_report()'s predicted_peak_bytes =
              constant_bytes (distinct constants of the slots) + activation_bytes (the most
              intermediates alive at once, one micro-batch; outputs counted, inputs not);
          constants (measured): memory_allocated growth over the load (weights moved there;
              the region processor's merged shard weights included);
          load peak: max_memory_allocated during the load, over what was allocated before it (the
              region processor merges shard weights on the device after they arrive, group by group,
              each group's shards going as it is merged: its weights plus the largest group);
          inputs: the caller's input tensors on the GPU (allocated before the run: in every
              "allocated" column below, not in the plan);
          allocated at start: memory_allocated right before the run: constants + inputs + what
              warm-up left alive (a graph's static input/output buffers, cuBLAS workspaces);
          peak allocated: torch.cuda.max_memory_allocated during the run (for the cuda processor
              also its memory_report()'s measured_peak_bytes, the same counter since
              reset_peak_memory()). A replayed graph's intermediates live in its private pool,
              reserved at capture and not allocated by the replay: they are NOT in this column;
          run's own: peak allocated - allocated at start;
          peak reserved: torch.cuda.max_memory_reserved during the run (graph pools included);
          graph pool: bytes of the allocator segments of the captured graph's pool
              (torch.cuda.memory_snapshot).
        On the CPU only the plan's rows are printed (cpu and region processors): the measured
        columns need a GPU.

pool    Three exact-size prefill pipelines (build_hf at batch 1, 2, 4, seq --seq, past_len=0, tp=2,
        one checkpoint), region processor, compile per --compile, cuda_graph=True: (a) the largest
        bucket alone, (b) the three sharing one GraphPool (the graph_pool load keyword: GraphReplay
        passes its handle to torch.cuda.graph(pool=...)), captured largest first, (c) the three with
        a pool each. Session.compile() runs the warm-up (torch.compile) and then captures; so each
        session is first warmed up with compile(capture=False), then empty_cache, and the baseline
        (memory_reserved / memory_allocated) is taken, then Session.capture() captures each, largest
        first: the growth is the captures' own (the graph's pool and its static input buffers). The
        capture stream's cuBLAS workspace (made once per process, at the first capture on it) is
        allocated before the baseline, so it is charged to no configuration. Printed: the growth,
        the pools' segment bytes, per-capture growth, and the ratios (3 shared / one, 3 separate /
        one). Each bucket is then run once (it must replay). On the CPU there is nothing to measure:
        the section says it needs a GPU.

Failures (a compile or capture that failed and ran eagerly: warnings, describe()) are in the rows;
an exception in a section is recorded as an error row and the next section still runs (the exit
status is then 1).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import fastpipe  # noqa: E402
from bench.machine import machine_info  # noqa: E402
from bench.pipelines import evict_from_page_cache, session_constants, touch_all, write_load_pipeline  # noqa: E402
from fastpipe.weights import WeightStore  # noqa: E402

SECTIONS = ("load", "memory", "pool")


# ---------------------------------------------------------------------------------- small helpers
def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def ratio(a, b) -> float | None:
    return None if a is None or not b else a / b


def fmt_ratio(r) -> str:
    return "-" if r is None else f"{r:.2f}x"


def print_table(title: str, header: tuple, rows: list[tuple]) -> None:
    print(f"\n### {title}\n")
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths)] + rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    sys.stdout.flush()


def write_json(path: str, doc: dict) -> None:
    from fastpipe.atomic import write_text

    write_text(path, json.dumps(doc, indent=1, default=str))


def fs_type(path: Path) -> str:
    """The file system type of the mount holding `path` (from /proc/mounts; "unknown" elsewhere)."""
    best, kind = "", "unknown"
    try:
        real = os.path.realpath(path)
        for line in open("/proc/mounts"):
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")):
                if len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def sync(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def prime_capture_stream(device: torch.device) -> None:
    """Make the cuBLAS workspace of the stream every fastpipe capture uses, outside any capture (as each
    capture does first: fastpipe.runtime.cuda.capture.prime_blas), so no graph's pool holds it."""
    from fastpipe.runtime.cuda.capture import capture_stream, prime_blas

    prime_blas(device, capture_stream(device))
    torch.cuda.synchronize(device)


def settle(device: torch.device) -> None:
    """Free what can be freed: gc, and on a GPU the cached blocks and the cuBLAS workspaces of streams
    gone (closed sessions' lanes); then the capture stream's workspace again (prime_capture_stream).
    Only called while no captured graph is alive."""
    gc.collect()
    if not is_cuda(device):
        return
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    prime_capture_stream(device)
    torch.cuda.empty_cache()


def allocated(device) -> int:
    return torch.cuda.memory_allocated(device)


def reserved(device) -> int:
    return torch.cuda.memory_reserved(device)


def pool_bytes(pool_ids) -> dict:
    """Bytes of the allocator's segments in these CUDA-graph pools: {"reserved": total segment size,
    "allocated": of which allocated (live blocks: static outputs), "pools": distinct pools}."""
    ids = {tuple(p) for p in pool_ids if p is not None}
    out = {"pools": len(ids), "reserved": 0, "allocated": 0}
    if not ids:
        return out
    try:
        snap = torch.cuda.memory_snapshot()
    except Exception as e:  # noqa: BLE001 - reported in the row
        return {"pools": len(ids), "reserved": None, "allocated": None, "error": f"{type(e).__name__}: {e}"}
    for seg in snap:
        if tuple(seg.get("segment_pool_id", ()) or ()) in ids:
            out["reserved"] += int(seg.get("total_size", 0))
            out["allocated"] += int(seg.get("allocated_size", 0))
    return out


def graph_pool_id(sess):
    """The pool id of the session's captured graph (None without one)."""
    r = sess.runner.replay if sess.processor in ("region", "cuda") else None
    g = getattr(r, "graph", None) if r is not None else None
    if g is None:
        return None
    try:
        return tuple(g.pool())
    except Exception:  # noqa: BLE001 - an older torch without CUDAGraph.pool()
        return None


def caught_text(caught, limit: int = 20) -> list[str]:
    """The distinct warnings caught, deprecations apart (fastpipe's first: a failed compile or capture), at
    most `limit`."""
    texts = dict.fromkeys(f"{w.category.__name__}: {' '.join(str(w.message).split())[:300]}" for w in caught
                          if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning)))
    return sorted(texts, key=lambda t: "fastpipe" not in t)[:limit]


def print_warnings(rows: list[dict], key) -> None:
    """The warnings a row's sessions raised (a failed compile or capture, a recompile), after its table."""
    for r in rows:
        for w in r.get("warnings") or ():
            print(f"warning ({key(r)}): {w}")


def error_row(section: str, e: BaseException, **extra) -> dict:
    tb = traceback.format_exc()
    print(f"\n{section}: ERROR {type(e).__name__}: {e}\n{tb}", file=sys.stderr)
    return {"section": section, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}",
            "traceback": tb[-4000:], **extra}


def device_inputs(sess, device: torch.device) -> dict:
    """The seeded warm-up inputs (fastpipe.runtime.compiling.compile.warmup_inputs), placed on `device` where the
    pipeline's steps read them there (the caller's own tensors)."""
    from fastpipe.runtime.compiling.compile import warmup_inputs

    where = sess.program.input_devices()
    out = {}
    for n, t in warmup_inputs(sess.pipeline).items():
        out[n] = t.to(device) if device in where.get(n, set()) else t
    return out


def all_slots(path, device: torch.device) -> dict[str, str]:
    from fastpipe.format import read_pipeline

    return {s: str(device) for s in read_pipeline(Path(path)).devices}


# ---------------------------------------------------------------------------------- section: load
def one_intra_op_thread(fn):
    """fn, called with torch's intra-op threads set to 1 (restored after)."""
    def call():
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(n)
    return call


def section_load(args, device: torch.device, tmp: Path) -> list[dict]:
    pipeline, weights = write_load_pipeline(tmp / "load", total_mb=args.mb, dtype=args.dtype)
    dm = all_slots(pipeline, device)
    fs = fs_type(weights)
    cuda = is_cuda(device)

    def baseline():
        out = load_file(str(weights), device=str(device))
        if not cuda:
            touch_all(out.values())
        return out

    def ours(upload: str = "pinned"):
        sess = fastpipe.load(pipeline, device_map=dm, store=WeightStore(), upload=upload)
        if not cuda:
            touch_all(session_constants(sess))
        return sess

    def resident(side: str, out) -> tuple[int, bool]:
        """(bytes on the device, whether every tensor is there)."""
        ts = list(out.values()) if side == "baseline" else session_constants(out)
        return sum(t.nbytes for t in ts), all(t.device == device for t in ts)

    def release(side: str, out) -> None:
        if side != "baseline":
            out.close()

    def timed(side: str, fn, cold: bool) -> tuple[float, int, bool]:
        if cold:
            evict_from_page_cache(weights)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        dt = time.perf_counter() - t
        nbytes, there = resident(side, out)
        release(side, out)
        del out
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        return dt, nbytes, there

    # on a GPU fastpipe's two uploads (pinned staging, the default; pageable .to() per tensor, as safetensors
    # does) and the default with one intra-op thread; on the CPU there is no copy to make, so one fastpipe side
    sides = (("baseline", baseline), ("fastpipe", ours)) + (
        (("pageable", lambda: ours("pageable")), ("one_thread", one_intra_op_thread(ours))) if cuda else ())
    first = {side: timed(side, fn, cold=False) for side, fn in sides}     # untimed: imports, CUDA context
    rows = []
    for mode in ("cold", "warm"):
        times: dict[str, list[float]] = {side: [] for side, _ in sides}
        checks: dict[str, set] = {side: set() for side, _ in sides}
        for _ in range(args.rounds):
            for side, fn in sides:
                dt, nbytes, there = timed(side, fn, cold=mode == "cold")
                times[side].append(dt)
                checks[side].add((nbytes, there))
        b, f = statistics.median(times["baseline"]), statistics.median(times["fastpipe"])
        nbytes = first["baseline"][1]
        every = all(there and n == nbytes for side in checks for n, there in checks[side])
        row = {"section": "load", "mode": mode, "device": str(device), "mb": args.mb, "dtype": args.dtype,
               "bytes": nbytes, "rounds": args.rounds, "fs": fs,
               "baseline": "safetensors.torch.load_file(path, device=...)",
               "fastpipe": "fastpipe.load(pipeline, device_map={every slot: device})" + (" (upload pinned)" if cuda else ""),
               "baseline_s": b, "fastpipe_s": f, "ratio": f / b,
               "baseline_bytes_per_s": nbytes / b, "fastpipe_bytes_per_s": nbytes / f,
               "baseline_times_s": times["baseline"], "fastpipe_times_s": times["fastpipe"],
               "every_byte_on_device": every,
               "ends_with": ("torch.cuda.synchronize() after the copies" if cuda
                             else "one read of every byte (sum), both sides being mmap views")}
        if cuda:
            pg = statistics.median(times["pageable"])
            row.update({"pageable": "fastpipe.load(..., upload=\"pageable\")", "pageable_s": pg,
                        "pageable_ratio": pg / b, "pinned_vs_pageable": f / pg, "pageable_bytes_per_s": nbytes / pg,
                        "pageable_times_s": times["pageable"]})
            one = statistics.median(times["one_thread"])
            row.update({"one_thread": "fastpipe.load(...) with torch.set_num_threads(1)", "one_thread_s": one,
                        "one_thread_vs_pinned": one / f, "one_thread_times_s": times["one_thread"]})
        rows.append(row)
    head = ("mode", "safetensors load_file", "fastpipe.load", "ratio", "safetensors GB/s", "fastpipe GB/s")
    pageable = ("fastpipe pageable", "pageable ratio", "pinned / pageable", "1 thread / pinned") if cuda else ()
    print_table(f"load: {args.mb} MiB {args.dtype} checkpoint onto {device} (medians of {args.rounds}; "
                f"file on {fs}; ratio: time / safetensors' time)",
                head + pageable + ("every byte on device",),
                [(r["mode"], f"{r['baseline_s'] * 1e3:.1f} ms", f"{r['fastpipe_s'] * 1e3:.1f} ms", f"{r['ratio']:.2f}x",
                  f"{r['baseline_bytes_per_s'] / 1e9:.2f}", f"{r['fastpipe_bytes_per_s'] / 1e9:.2f}")
                 + ((f"{r['pageable_s'] * 1e3:.1f} ms", f"{r['pageable_ratio']:.2f}x", f"{r['pinned_vs_pageable']:.2f}x",
                     f"{r['one_thread_vs_pinned']:.2f}x") if cuda else ())
                 + ("yes" if r["every_byte_on_device"] else "NO",) for r in rows])
    if fs == "tmpfs":
        print("note: the file is on a tmpfs (RAM): cold rounds read memory, not a disk (use --tmp DIR on a disk)")
    return rows


# ---------------------------------------------------------------------------------- the model
class Models:
    """The random Llama checkpoint and the pipelines built from it (made once, when first needed)."""

    def __init__(self, args, tmp: Path):
        self.args, self.tmp = args, tmp
        self._dir = None
        self._built: dict[str, Path] = {}

    @property
    def model_dir(self) -> Path:
        if self._dir is None:
            from bench.generation_cases import make_model

            folder, model = make_model(self.tmp, layers=self.args.layers, hidden=self.args.hidden,
                                       vocab=self.args.vocab)
            del model
            self._dir = folder
        return self._dir

    def pipeline(self, name: str, **kw) -> Path:
        if name not in self._built:
            from fastpipe.builder.hf.build import build_hf

            self._built[name] = build_hf(self.model_dir, tp=2, **kw).save(self.tmp / name)
        return self._built[name]

    def shapes(self) -> list[tuple[str, str, Path]]:
        """(kind, label, pipeline) of the memory section's shapes."""
        a = self.args
        return [("decode", f"decode (batch 1, 1 token over {a.past} cached)",
                 self.pipeline("decode", batch=1, seq_len=1, past_len=a.past)),
                ("prefill", f"prefill (batch 1, seq {a.seq}), logits of every position",
                 self.pipeline("prefill", batch=1, seq_len=a.seq, past_len=0)),
                ("serving_prefill", f"serving prefill (batch 1, seq {a.seq}), logits of the last token, "
                                    f"caches written into a static cache of {a.seq + a.past} positions",
                 self.pipeline("serving_prefill", batch=1, seq_len=a.seq, max_len=a.seq + a.past, cache_rows=1,
                               last_logits=True))]


# ---------------------------------------------------------------------------------- section: memory
# load options a shape runs with, as the serving engine runs it: the prefill writes its caches into the
# engine's (the caller's) tensors
SHAPE_OPTIONS = {"serving_prefill": dict(state_in_place=True)}


def plan_of(report: dict, device: torch.device) -> dict:
    r = report.get(str(device))
    if r is None:                      # one entry per device: take the only one
        r = next(iter(report.values()))
    return {"slots": list(r["slots"]), "predicted_peak_bytes": r["predicted_peak_bytes"],
            "constant_bytes": r["constant_bytes"], "activation_bytes": r["activation_bytes"],
            "measured_peak_bytes": r.get("measured_peak_bytes")}


def measure_plan(path: Path, shape: str, label: str, kw: dict) -> dict:
    """CPU: the plan's row only."""
    sess = fastpipe.load(path, device_map=all_slots(path, torch.device("cpu")), store=WeightStore(), **kw)
    try:
        plan = plan_of(sess.memory_report(), torch.device("cpu"))
        return {"section": "memory", "shape": shape, "processor": label, "device": "cpu", "options": dict(kw), **plan,
                "measured": None, "describe": sess.describe(),
                "note": "plan only (measuring needs a GPU)"}
    finally:
        sess.close()


def measure_run(path: Path, shape: str, label: str, kw: dict, device: torch.device) -> dict:
    """GPU: load, compile (warm-up + capture), then one run, measured."""
    settle(device)
    row = {"section": "memory", "shape": shape, "processor": label, "device": str(device),
           "options": {k: v for k, v in kw.items()}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a_pre = allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        from fastpipe.runtime.processors.cuda import CudaProcessor

        # the cuda processor resets the peak counter when it is made (its memory_report's "since the processor
        # was made"), which would hide the upload's peak: not during this load
        with mock.patch.object(CudaProcessor, "reset_peak_memory", lambda self: None):
            sess = fastpipe.load(path, device_map=all_slots(path, device), store=WeightStore(), compile_policy="warn",
                                 **kw)
        try:
            sync(device)
            a_load, load_peak = allocated(device), torch.cuda.max_memory_allocated(device)
            inputs = device_inputs(sess, device)
            sync(device)
            input_bytes = sum(t.nbytes for t in inputs.values() if t.device == device)
            t = time.perf_counter()
            sess.compile()
            compile_s = time.perf_counter() - t
            sync(device)
            gc.collect()
            torch.cuda.empty_cache()
            replay = sess.runner.replay if sess.processor in ("region", "cuda") else None
            replays_before = replay.replays if replay is not None else None
            if hasattr(sess.runner, "reset_peak_memory"):
                sess.runner.reset_peak_memory()              # the cuda processor's own reset (same counters)
            else:
                torch.cuda.reset_peak_memory_stats(device)
            a_start, r_start = allocated(device), reserved(device)
            out = sess.run(inputs)
            sync(device)
            peak_a, peak_r = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
            plan = plan_of(sess.memory_report(), device)
            pid = graph_pool_id(sess)
            pool = pool_bytes([pid]) if pid is not None else None
            row.update(plan)
            row.update({
                "measured": True,
                "allocated_before_load_bytes": a_pre,
                "constants_measured_bytes": a_load - a_pre,
                "load_peak_bytes": load_peak - a_pre,
                "load_peak_over_constants": ratio(load_peak - a_pre, a_load - a_pre),
                "input_bytes": input_bytes,
                "output_bytes": sum(t.nbytes for t in out.values() if t.device == device),
                "allocated_at_start_bytes": a_start,
                "reserved_at_start_bytes": r_start,
                "peak_allocated_bytes": peak_a,
                "run_own_bytes": peak_a - a_start,
                "peak_reserved_bytes": peak_r,
                "graph_pool_reserved_bytes": None if pool is None else pool["reserved"],
                "graph_pool_allocated_bytes": None if pool is None else pool["allocated"],
                "peak_allocated_over_plan": ratio(peak_a, plan["predicted_peak_bytes"]),
                "peak_reserved_over_plan": ratio(peak_r, plan["predicted_peak_bytes"]),
                "run_own_over_plan_activations": ratio(peak_a - a_start, plan["activation_bytes"]),
                "replayed": None if replay is None else (replay.replays or 0) > (replays_before or 0),
                "capture_failure": None if replay is None else replay.failure,
                "compile_s": compile_s,
                "describe": sess.describe(),
            })
            del out, inputs
        finally:
            sess.close()
            del sess
    row["warnings"] = caught_text(caught)
    return row


def section_memory(args, device: torch.device, models: Models, progress=lambda rows: None) -> list[dict]:
    cuda = is_cuda(device)
    if cuda:
        variants = [("cuda, cuda_graph=True", dict(processor="cuda", cuda_graph=True, compile=False)),
                    ("cuda, cuda_graph=False", dict(processor="cuda", cuda_graph=False, compile=False)),
                    (f"region, cuda_graph=True, compile={args.compile}",
                     dict(processor="region", cuda_graph=True, compile=args.compile == "on"))]
    else:
        variants = [("cpu", dict(processor="cpu")), ("region", dict(processor="region", compile=False))]
    rows = []
    for kind, shape, path in models.shapes():
        for label, kw in variants:
            kw = dict(kw, **SHAPE_OPTIONS.get(kind, {}))
            try:
                row = measure_run(path, shape, label, kw, device) if cuda else measure_plan(path, shape, label, kw)
            except Exception as e:  # noqa: BLE001 - recorded, the other rows still run
                row = error_row("memory", e, shape=shape, processor=label)
            rows.append(dict(row, kind=kind))
            progress(rows)
    model = f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, tp=2 on one device"
    ok = [r for r in rows if "error" not in r]
    if cuda:
        print_table(f"memory: one run on {device} vs the plan ({model})",
                    ("shape", "processor", "plan peak", "plan constants", "plan activations", "constants (measured)",
                     "load peak", "caller's inputs", "allocated at start", "peak allocated", "run's own", "peak reserved",
                     "graph pool", "peak alloc / plan", "peak reserved / plan", "replayed"),
                    [(r["shape"], r["processor"], mib(r["predicted_peak_bytes"]), mib(r["constant_bytes"]),
                      mib(r["activation_bytes"]), mib(r["constants_measured_bytes"]), mib(r["load_peak_bytes"]),
                      mib(r["input_bytes"]),
                      mib(r["allocated_at_start_bytes"]), mib(r["peak_allocated_bytes"]), mib(r["run_own_bytes"]),
                      mib(r["peak_reserved_bytes"]), mib(r["graph_pool_reserved_bytes"]),
                      fmt_ratio(r["peak_allocated_over_plan"]), fmt_ratio(r["peak_reserved_over_plan"]),
                      "-" if r["replayed"] is None else ("yes" if r["replayed"] else "NO")) for r in ok])
        print("plan = constants + activations (intermediates alive at once; outputs counted, inputs not). "
              "allocated columns count every tensor of this process on the GPU: constants, the caller's inputs, "
              "graph static buffers, cuBLAS workspaces. A replayed graph's intermediates are in its pool "
              "(graph pool, peak reserved), reserved at capture, not allocated by the run. The cuda processor's "
              "memory_report() measured_peak_bytes is the peak allocated counter (in the JSON rows).")
        print_warnings(ok, lambda r: f"{r['shape']}, {r['processor']}")
    else:
        print_table(f"memory: the plan on the CPU ({model})",
                    ("shape", "processor", "plan peak", "plan constants", "plan activations", "measured"),
                    [(r["shape"], r["processor"], mib(r["predicted_peak_bytes"]), mib(r["constant_bytes"]),
                      mib(r["activation_bytes"]), "needs a GPU") for r in ok])
        print("measured peak memory (torch.cuda.max_memory_allocated of one run) needs a GPU: plan rows only")
    print_last_logits_gain(ok, cuda)
    return rows


def last_logits_gain(rows: list[dict], cuda: bool) -> list[dict]:
    """Per processor, the serving prefill (logits_index in, the last token's logits out) against the
    prefill of every position's logits, same model and length: ratios of the plan's activations and,
    on a GPU, of the run's own peak allocation (ratio < 1: the serving prefill needs less)."""
    out = []
    for proc in dict.fromkeys(r["processor"] for r in rows):
        by = {r["kind"]: r for r in rows if r["processor"] == proc}
        full, last = by.get("prefill"), by.get("serving_prefill")
        if full is None or last is None:
            continue
        g = {"processor": proc, "plan_activations": ratio(last["activation_bytes"], full["activation_bytes"]),
             "plan_peak": ratio(last["predicted_peak_bytes"], full["predicted_peak_bytes"])}
        if cuda:
            g["run_own"] = ratio(last.get("run_own_bytes"), full.get("run_own_bytes"))
            g["peak_reserved"] = ratio(last.get("peak_reserved_bytes"), full.get("peak_reserved_bytes"))
        out.append(g)
    return out


def print_last_logits_gain(rows: list[dict], cuda: bool) -> None:
    for g in last_logits_gain(rows, cuda):
        extra = (f", run's own {fmt_ratio(g['run_own'])}, peak reserved {fmt_ratio(g['peak_reserved'])}"
                 if cuda else "")
        print(f"serving prefill / prefill of every position's logits ({g['processor']}): plan activations "
              f"{fmt_ratio(g['plan_activations'])}, plan peak {fmt_ratio(g['plan_peak'])}{extra}")


# ---------------------------------------------------------------------------------- section: pool
def measure_pool(config: str, paths: dict[int, Path], shared: bool, args, device: torch.device) -> dict:
    from fastpipe.runtime.cuda.graph_replay import GraphPool

    settle(device)
    order = sorted(paths, reverse=True)                       # largest first
    row = {"section": "pool", "config": config, "buckets": order, "shared_pool": shared, "compile": args.compile}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a_empty = allocated(device)
        pool = GraphPool() if shared else None
        store = WeightStore()
        sessions = []
        try:
            for b in order:
                sessions.append((b, fastpipe.load(paths[b], device_map=all_slots(paths[b], device), store=store,
                                                  processor="region", compile=args.compile == "on", cuda_graph=True,
                                                  compile_policy="warn", graph_pool=pool)))
            sync(device)
            row["weights_allocated_bytes"] = allocated(device) - a_empty
            t = time.perf_counter()
            for _, s in sessions:
                s.compile(capture=False)                      # warm-up run (torch.compile), no capture yet
            row["warmup_s"] = time.perf_counter() - t
            sync(device)
            gc.collect()
            torch.cuda.empty_cache()
            r0, a0 = reserved(device), allocated(device)
            caps = []
            for b, s in sessions:
                rb, ab = reserved(device), allocated(device)
                t = time.perf_counter()
                ok = s.capture()
                sync(device)
                torch.cuda.empty_cache()
                caps.append({"batch": b, "captured": bool(ok), "seconds": time.perf_counter() - t,
                             "reserved_growth_bytes": reserved(device) - rb,
                             "allocated_growth_bytes": allocated(device) - ab,
                             "pool_id": graph_pool_id(s), "failure": s.runner.replay.failure})
            r1, a1 = reserved(device), allocated(device)
            pools = pool_bytes([c["pool_id"] for c in caps])
            row.update({"captures": caps, "graphs_captured": sum(c["captured"] for c in caps),
                        "capture_reserved_bytes": r1 - r0, "capture_allocated_bytes": a1 - a0,
                        "pool_segments_reserved_bytes": pools["reserved"],
                        "pool_segments_allocated_bytes": pools["allocated"], "distinct_pools": pools["pools"],
                        "graph_pool_graphs": None if pool is None else pool.graphs})
            replayed = []
            for b, s in sessions:                             # each bucket runs once: a replay
                inputs = device_inputs(s, device)
                before = s.runner.replay.replays
                out = s.run(inputs)
                sync(device)
                replayed.append(s.runner.replay.replays > before)
                del out, inputs
            gc.collect()
            torch.cuda.empty_cache()
            row["every_run_replayed"] = all(replayed)
            row["reserved_growth_after_runs_bytes"] = reserved(device) - r1
            row["describe"] = [s.describe() for _, s in sessions]
        finally:
            for _, s in sessions:
                s.close()
            sessions.clear()
            pool = None
    row["warnings"] = caught_text(caught)
    settle(device)
    return row


def section_pool(args, device: torch.device, models: Models, progress=lambda rows: None) -> list[dict]:
    if not is_cuda(device):
        msg = "needs a GPU: CUDA-graph pools exist only on CUDA devices (nothing to measure on the CPU)"
        print(f"\n### pool: graph memory of 3 buckets vs one\n\n{msg}")
        return [{"section": "pool", "status": "needs a GPU", "device": str(device), "note": msg}]
    batches = sorted(args.batches, reverse=True)
    paths = {b: models.pipeline(f"pool_b{b}", batch=b, seq_len=args.seq, past_len=0) for b in batches}
    largest = batches[0]
    configs = [(f"one bucket (batch {largest}) alone", {largest: paths[largest]}, False),
               (f"{len(batches)} sharing one GraphPool", paths, True),
               (f"{len(batches)} with a pool each", paths, False)]
    rows = []
    for config, ps, shared in configs:
        try:
            rows.append(measure_pool(config, ps, shared, args, device))
        except Exception as e:  # noqa: BLE001 - recorded, the other configurations still run
            rows.append(error_row("pool", e, config=config))
        progress(rows)
    one = rows[0] if "error" not in rows[0] else None
    for r in rows:
        if "error" in r:
            continue
        r["capture_reserved_over_one"] = ratio(r["capture_reserved_bytes"], one and one["capture_reserved_bytes"])
        r["pool_segments_over_one"] = ratio(r["pool_segments_reserved_bytes"], one and one["pool_segments_reserved_bytes"])
    ok = [r for r in rows if "error" not in r]
    print_table(f"pool: CUDA-graph memory of {len(batches)} prefill buckets (batch {', '.join(map(str, batches))}, "
                f"seq {args.seq}) vs one, region processor, compile={args.compile}, {device}",
                ("configuration", "graphs", "pools", "weights on GPU", "reserved growth by captures",
                 "allocated growth", "pool segments", "per capture (reserved)", "reserved / one", "pool / one",
                 "runs replayed"),
                [(r["config"], r["graphs_captured"], r["distinct_pools"], mib(r["weights_allocated_bytes"]),
                  mib(r["capture_reserved_bytes"]), mib(r["capture_allocated_bytes"]),
                  mib(r["pool_segments_reserved_bytes"]),
                  ", ".join(f"b{c['batch']} {mib(c['reserved_growth_bytes'])}" for c in r["captures"]),
                  fmt_ratio(r["capture_reserved_over_one"]), fmt_ratio(r["pool_segments_over_one"]),
                  "yes" if r["every_run_replayed"] else "NO") for r in ok])
    print("reserved growth: memory_reserved after the captures minus before (after warm-up and empty_cache): the "
          "graphs' pools and their static input buffers. pool segments: the allocator segments of those pools.")
    print_warnings(ok, lambda r: r["config"])
    return rows


# ---------------------------------------------------------------------------------- main
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: load,memory,pool")
    ap.add_argument("--mb", type=int, default=None, help="load: checkpoint size in MiB (default 1536; --quick 16)")
    ap.add_argument("--dtype", default="f32", choices=("f32", "bf16", "f16"), help="load: the checkpoint's dtype")
    ap.add_argument("--rounds", type=int, default=None, help="load: timed rounds per side (default 5; --quick 2)")
    ap.add_argument("--layers", type=int, default=None, help="memory, pool: decoder layers (default 4; --quick 2)")
    ap.add_argument("--hidden", type=int, default=None, help="memory, pool: hidden size (default 1024; --quick 64)")
    ap.add_argument("--vocab", type=int, default=None, help="memory, pool: vocabulary (default 32000; --quick 512)")
    ap.add_argument("--past", type=int, default=128, help="memory: cached tokens of the decode shape")
    ap.add_argument("--seq", type=int, default=64, help="memory, pool: prefill length")
    ap.add_argument("--batches", default="1,2,4", help="pool: the buckets' batch sizes")
    ap.add_argument("--compile", default="on", choices=("on", "off"),
                    help="region processor sessions: torch.compile (memory, pool)")
    ap.add_argument("--tmp", default=None, help="folder for the checkpoints, made if absent (default: the system's "
                    "temp folder)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few rounds: a smoke run")
    ap.add_argument("--json", default=None, help="write every row here (after each row of memory and pool, and "
                    "after each section)")
    args = ap.parse_args(argv)
    q = args.quick
    for name, full, quick in (("mb", 1536, 16), ("rounds", 5, 2), ("layers", 4, 2), ("hidden", 1024, 64),
                              ("vocab", 32000, 512)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad or not args.sections:
        ap.error(f"--sections: expected some of {','.join(SECTIONS)}, found {args.sections}")
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.device == "auto":
        args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            ap.error(f"--device {args.device}: CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        ap.error(f"--device: expected auto, cpu or cuda[:N], found {args.device}")
    return args, device


def main(argv=None) -> int:
    args, device = parse_args(argv)
    if is_cuda(device):
        torch.cuda.set_device(device)
    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    doc = {"machine": info, "args": {k: v for k, v in vars(args).items()}, "device": str(device),
           "sections": {}, "rows": []}
    failed = False
    if args.json:
        write_json(args.json, doc)                     # the machine and the arguments, before any section
    if args.tmp:
        Path(args.tmp).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="report_memory_") as tmp:
        tmp = Path(tmp)
        models = Models(args, tmp)
        for name in SECTIONS:
            if name not in args.sections:
                continue
            t = time.perf_counter()

            def progress(rows, name=name, t=t):     # a section's rows so far, "partial" until it ends
                if args.json:
                    doc["sections"][name] = {"rows": list(rows), "seconds": time.perf_counter() - t, "partial": True}
                    write_json(args.json, {**doc, "rows": doc["rows"] + list(rows)})
            try:
                if name == "load":
                    rows = section_load(args, device, tmp)
                elif name == "memory":
                    rows = section_memory(args, device, models, progress)
                else:
                    rows = section_pool(args, device, models, progress)
            except Exception as e:  # noqa: BLE001 - recorded; the next section still runs
                rows = [error_row(name, e)]
            failed = failed or any("error" in r for r in rows)
            doc["sections"][name] = {"rows": rows, "seconds": time.perf_counter() - t}
            doc["rows"].extend(rows)
            print(f"({name}: {time.perf_counter() - t:.1f} s)")
            if args.json:
                write_json(args.json, doc)
    return 1 if failed else 0


if __name__ == "__main__":
    from bench.sigint import stop_on_sigint

    stop_on_sigint()            # even where started with SIGINT ignored (gpu_check's stage limit)
    sys.exit(main())
