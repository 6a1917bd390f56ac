"""Runtime benchmark: decode-step and prefill pipelines of a Llama-family model (tp=2, a few blocks),
each fastpipe path side by side with the unsplit Hugging Face model, in one run.

    python bench/report_runtime.py                                 # GPU: decode and prefill, batch 1, 8, 32
    python bench/report_runtime.py --budget-s 300 --json r.json   # about what scripts/gpu_check.sh runtime runs
    python bench/report_runtime.py --device cpu --quick            # CPU: a check that it runs

Cases: a decode step (1 new token over --past cached tokens) and a prefill step (--prefill-len
tokens), at each batch of --batches, built with build_hf(tp=2) from one random checkpoint. All slots
go to one device (cuda:0, or the CPU).

Variants on a GPU:
  fastpipe cuda, graph replay            the cuda processor (a stream per slot), compiled, the whole
                                         run captured as one CUDA graph and replayed
  fastpipe cuda, compiled streams        the same compiled steps issued from Python, no graph (what
                                         replay saves over launching them; shares the compiled code)
  fastpipe cuda, eager streams           the cuda processor, eager, no graph: the baseline of replay
  fastpipe region compiled               the whole-device path: every slot's steps as one graph,
                                         compiled (shard matmuls merged), no CUDA graph
  fastpipe region compiled + replay      the same, captured and replayed (what processor="auto" runs)
  ..., a copy per tensor                 the same replay copying its inputs in and outputs out one tensor
                                         at a time, not one launch per dtype group (GraphReplay's
                                         grouped_copies): what the grouping saves per call
  ..., outputs aliased                   the same replay returning its output buffers, not clones
                                         (alias_outputs=True: valid until the next run, as the serving
                                         engine's buckets and reduce-overhead's outputs are)
  fastpipe static cache (the engine's    decode only: the serving set's decode step (a static cache of
  decode step), region compiled + replay past + 1 positions, written in place at cache_position), as
                                         the engine runs it (state in place, outputs aliased): the
                                         fastpipe side of the unsplit static-cache rows
  fastpipe serving prefill (last token's prefill only: the serving set's prefill bucket (logits_index in,
  logits), region compiled + replay      the last token's logits [B, 1, V] out, each prompt's keys and
                                         values written into its row of a static cache, cache_row, state
                                         in place), as the engine runs it (outputs aliased): against the best full-logits
                                         fastpipe row (what skipping [B, S, V] saves) and the unsplit
                                         rows with logits_to_keep=1 (the same work)
  unsplit compiled, last token's logits  prefill only: the unsplit model (DynamicCache) with
  (+ reduce-overhead on a GPU)           logits_to_keep=1, as a server's prefill runs it
  unsplit eager / unsplit compiled /     the HF model on the same device: eager, torch.compile
  unsplit compiled, reduce-overhead      (dynamic=False), and torch.compile(mode="reduce-overhead"),
                                         on a DynamicCache of the past built in each call
  unsplit static cache eager / ...       the same three on a StaticCache of past + seq positions,
                                         filled once (how a server runs the unsplit model: the step
                                         writes in place, addresses fixed for CUDA graphs)
On a CPU: the region processor compiled and eager, the cpu processor eager, the static-cache decode
step compiled, the serving prefill compiled, the unsplit model eager and compiled on either cache
(and, for the prefill, compiled with logits_to_keep=1).

What is timed: a fastpipe row times `session.run(inputs)` on the pipeline's own inputs, already
sliced per slot and on the device (as a server holds them); a replayed run includes what a caller
of run() gets: the inputs copied into the graph's buffers and the outputs cloned out of them. The
unsplit rows time the HF model on input ids and the same past, on the device: a DynamicCache
built in the timed call (what a caller holding the past as tensors does, as a fastpipe pipeline is
given it), or a StaticCache filled before timing, whose length each call rewinds to the past
(bench/unsplit_calls.py). Each call is followed by a device synchronize (the
latency a caller sees when it needs the result). Every session compiles (and captures) before it
is timed: Session.compile(); compile seconds get a column of their own ("shared": it compiled
nothing new, reusing a row above's compiled code; its own warm-up and capture seconds are in
--json). A reduce-overhead row that inductor ran without CUDA graphs says so (torch reports that
only in its log).

Every row's logits are checked against the unsplit model run in float32 on the same inputs: a row
passes when its largest error is at most 1e-4 x the largest |logit| plus twice the unsplit model's
own error in the run's dtype (bf16 rounding alone puts the unsplit bf16 model ~3% of the largest
logit from float32 at this size). A fastpipe mismatch or failure makes the exit status 1.

Timing: after --warmup calls each, the variants of one case are timed in interleaved rounds (round
r times every variant once); a sample is the mean of back-to-back calls lasting about --sample-ms;
the table gives the median and p10/p90 of --repeat samples.

Targets: at batch 1, graph replay >= 3x faster than eager streams; the best fastpipe path
within 1.1x of the best unsplit compiled model (default or reduce-overhead, either cache); the
last-token rows are held against each other only (their own verdict lines). Each case's verdicts
are printed under its table and written to --json, rewritten after every case and after each row's
set-up (compile, capture, check) within one (that case marked "partial": "set-up"), so a run stopped at
a time limit keeps what it did. Interrupted (SIGINT, as scripts/gpu_check.sh stops a stage at its
limit), it writes the case in progress with the samples each row has so far ("partial":
"interrupted", and "interrupted" says where) and exits with 130. Cases run batch by batch (decode 1,
prefill 1, decode 8, ...), so a cut-off run has the batch-1 targets first. --budget-s starts no case
that would end past that many seconds, judged by the longest case so far, and says which cases it
left.
The script installs its own SIGINT handler (bench.sigint: a process started with SIGINT ignored, as a
background job without job control is, still stops), which remembers the signal: the sample loop and the row set-up stop
at their next step even where torch swallowed the KeyboardInterrupt itself.
"""
from __future__ import annotations

import argparse
import copy
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_region import Row, first_call, measure, pct  # noqa: E402   (every timed fn here syncs)
from bench.report_region import table as region_table  # noqa: E402
from bench.sigint import interrupted, stop_on_sigint  # noqa: E402
from bench.unsplit_calls import hf_call  # noqa: E402

CUDA_VARIANTS = [
    ("fastpipe cuda, graph replay", dict(processor="cuda", compile=True, cuda_graph=True)),
    ("fastpipe cuda, compiled streams", dict(processor="cuda", compile=True, cuda_graph=False)),
    ("fastpipe cuda, eager streams", dict(processor="cuda", compile=False, cuda_graph=False)),
    ("fastpipe region compiled", dict(processor="region", compile=True, cuda_graph=False)),
    ("fastpipe region compiled + replay", dict(processor="region", compile=True, cuda_graph=True)),
    ("fastpipe region compiled + replay, a copy per tensor", dict(processor="region", compile=True, cuda_graph=True)),
    ("fastpipe region compiled + replay, outputs aliased", dict(processor="region", compile=True, cuda_graph=True,
                                                                 alias_outputs=True)),
]
# rows whose replay copies its inputs in and outputs out one tensor at a time (GraphReplay.grouped_copies=False),
# against the grouped copies every other replay makes (one launch per dtype group): what grouping saves per call
PER_TENSOR_COPIES = {"fastpipe region compiled + replay, a copy per tensor": "fastpipe region compiled + replay"}
# the replay handing out its output buffers (RunOptions.alias_outputs, as the serving engine runs its buckets, and as
# torch.compile's reduce-overhead hands out its outputs) against its clones of them: what the copy out costs per call
ALIASED = {"fastpipe region compiled + replay, outputs aliased": "fastpipe region compiled + replay"}
CPU_VARIANTS = [
    ("fastpipe region compiled", dict(processor="region", compile=True)),
    ("fastpipe region eager", dict(processor="region")),
    ("fastpipe cpu processor eager", dict(processor="cpu")),
]
REPLAY, STREAMS = "fastpipe cuda, graph replay", "fastpipe cuda, eager streams"
STATIC_STEP_GPU = "fastpipe static cache (the engine's decode step), region compiled + replay"
STATIC_STEP_CPU = "fastpipe static cache (the engine's decode step), region compiled"
# the same step on the processor of slots on several GPUs (a stream per slot; here both on one GPU) and on the
# cpu processor (a thread per slot): each writes its caches in place too, in the step (fastpipe.runtime.binding.bind)
STATIC_STREAMS_GPU = "fastpipe static cache (the engine's decode step), cuda compiled + replay"
STATIC_STREAMS_CPU = "fastpipe static cache (the engine's decode step), cpu processor eager"
STATIC_STREAMS = {STATIC_STREAMS_GPU: STATIC_STEP_GPU, STATIC_STREAMS_CPU: STATIC_STEP_CPU}
SERVING_PREFILL_GPU = "fastpipe serving prefill (last token's logits), region compiled + replay"
SERVING_PREFILL_CPU = "fastpipe serving prefill (last token's logits), region compiled"
SERVING_PREFILL = (SERVING_PREFILL_GPU, SERVING_PREFILL_CPU)
UNSPLIT_LAST = ("unsplit compiled, last token's logits", "unsplit compiled, reduce-overhead, last token's logits")
COMPILED_STREAMS = "fastpipe cuda, compiled streams"
UNSPLIT_COMPILED = ("unsplit compiled", "unsplit compiled, reduce-overhead",
                    "unsplit static cache compiled", "unsplit static cache compiled, reduce-overhead")
DTYPES = ("bfloat16", "float16", "float32")
TARGET_REPLAY_VS_STREAMS = 3.0  # at batch 1: graph replay at least this many times faster than eager streams
TARGET_VS_UNSPLIT = 1.1         # the best fastpipe row's time over the best unsplit compiled row's, at most
F32_TOLERANCE = 1e-4    # times the largest |logit|: float32 vs float32, summation orders apart
DEFAULTS = {"cuda": dict(layers=4, hidden=1024, heads=16, kv_heads=8, vocab=32000, dtype="bfloat16"),
            "cpu": dict(layers=4, hidden=512, heads=8, kv_heads=4, vocab=8000, dtype="float32")}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when available")
    ap.add_argument("--cases", default="decode,prefill", help="decode and/or prefill (comma-separated)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--past", type=int, default=128, help="cached tokens of the decode step")
    ap.add_argument("--prefill-len", type=int, default=128, help="tokens of the prefill step")
    for k in ("layers", "hidden", "heads", "kv_heads", "vocab"):
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, help="model size (default: per device, see DEFAULTS)")
    ap.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--repeat", type=int, default=30, help="timed samples per variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per variant before timing")
    ap.add_argument("--sample-ms", type=float, default=5.0)
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no case that would end past this many seconds, by the longest so far (0: no limit)")
    ap.add_argument("--json", help="write every case's rows and verdicts here")
    ap.add_argument("--quick", action="store_true", help="a tiny model, batch 1, few samples: a check that it runs")
    args = ap.parse_args(argv)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available on this machine")
    for k, v in DEFAULTS[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.quick:
        args.layers, args.hidden, args.heads, args.kv_heads, args.vocab = 1, 64, 4, 2, 256
        args.batches, args.past, args.prefill_len, args.repeat, args.warmup = "1", 16, 16, 3, 1
    args.case_list = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not args.case_list or set(args.case_list) - {"decode", "prefill"}:
        ap.error(f"--cases: expected decode and/or prefill, found {args.cases!r}")
    try:
        args.batch_list = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batches: expected comma-separated integers, found {args.batches!r}")
    if not args.batch_list or min(args.batch_list) < 1 or args.repeat < 1 or args.warmup < 0:
        ap.error("--batches must be >= 1, --repeat >= 1, --warmup >= 0")
    return args


def make_checkpoint(args, folder: Path):
    """A random Llama-family checkpoint in args.dtype; returns the unsplit model (CPU, eval)."""
    import torch
    import transformers

    from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint

    cfg = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                   num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                   intermediate_size=args.hidden * 11 // 4, vocab_size=args.vocab,
                                   max_position_embeddings=max(2048, args.past + args.prefill_len))
    model = save_random_checkpoint(cfg, folder, seed=0).eval()
    if args.dtype != "float32":             # the checkpoint itself in that dtype: the pipeline's weights are too
        model = model.to(getattr(torch, args.dtype))
        model.save_pretrained(os.fspath(folder))
    return model


def model_inputs(model, batch: int, seq: int, past_len: int | None, seed: int):
    import torch

    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    if not past_len:
        return {"input_ids": ids}
    hd = cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    past = [[torch.randn(batch, cfg.num_key_value_heads, past_len, hd, generator=g).to(dtype) for _ in range(2)]
            for _ in range(cfg.num_hidden_layers)]
    return {"input_ids": ids, "past_key_values": past}


def tolerance(ref, own_err: float) -> float:
    """The largest error a row may have against the float32 reference `ref`: float32 summation
    noise plus twice the unsplit model's own error in the run's dtype (0 in float32)."""
    return F32_TOLERANCE * ref.abs().max().item() + 2 * own_err


def run_case(args, step: str, batch: int, folder: Path, model, store, out: Path, model32=None,
             rows: list[Row] | None = None, progress=lambda: None) -> list[Row]:
    """One case's rows; model32: the unsplit model in float32 (the reference; None: model is float32). rows:
    the list to fill (the caller's, so an interrupted case keeps the rows it set up); progress(): after each
    row's set-up."""
    import torch

    from fastpipe.builder.hf.build import build_hf

    dev = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    seq, past_len = (1, args.past) if step == "decode" else (args.prefill_len, None)
    path = build_hf(folder, tp=2, batch=batch, seq_len=seq, past_len=past_len).save(out)
    host = model_inputs(model, batch, seq, past_len, seed=batch)
    ids = host["input_ids"].to(dev)
    past = [[t.to(dev) for t in kv] for kv in host.get("past_key_values", [])]
    torch._dynamo.reset()                 # each case compiles afresh: no recompile limit across cases

    def timed(fn):
        def call():
            r = fn()
            sync()
            return r
        return call

    with torch.inference_mode():
        if model32 is None:
            ref, own = hf_call(model, ids, past).float().cpu(), 0.0
        else:                              # the same (already rounded) weights and past, in float32
            ref = hf_call(model32, ids, [[t.float() for t in kv] for kv in past]).float().cpu()
            own = (hf_call(model, ids, past).float().cpu() - ref).abs().max().item()
    tol = tolerance(ref, own)       # also bounds the last position's error: a part of the whole

    def check(logits, ref=ref) -> str:
        err = (logits.float().cpu() - ref).abs().max().item()
        return f"{'ok' if err <= tol else 'MISMATCH'} (max err {err:.1e}, tol {tol:.1e})"

    def check_last(logits) -> str:                       # [B, 1, V] against the last position's
        return check(logits, ref[:, -1:])

    _, pipeline, inputs = on_device(path, host, dev)     # its slots, and its inputs: sliced per slot, on the device
    rows = [] if rows is None else rows
    for label, kw in (CUDA_VARIANTS if dev.type == "cuda" else CPU_VARIANTS):
        fastpipe_row(label, lambda: (path, pipeline, inputs), kw, dev, store, check, timed, rows)
        progress()
    if step == "decode":
        built: dict = {}                  # one build for both rows; each row its own caches
        gpu = dev.type == "cuda"
        region = (STATIC_STEP_GPU if gpu else STATIC_STEP_CPU,
                  dict(processor="region", compile=True, state_in_place=True, alias_outputs=True))
        apart = ((STATIC_STREAMS_GPU, dict(processor="cuda", compile=True, state_in_place=True, alias_outputs=True))
                 if gpu else (STATIC_STREAMS_CPU, dict(processor="cpu", state_in_place=True)))
        for label, kw in (region, apart):
            fastpipe_row(label, lambda: static_step(folder, out.parent / f"{out.name}_static", host, dev, built),
                         kw, dev, store, check, timed, rows,
                         note="the serving set's decode step, state in place"
                              + (", outputs aliased" if kw.get("alias_outputs") else ""))
            progress()
    if step == "prefill":
        fastpipe_row(SERVING_PREFILL_GPU if dev.type == "cuda" else SERVING_PREFILL_CPU,
                     lambda: serving_prefill(folder, out.parent / f"{out.name}_last", host, dev),
                     dict(processor="region", compile=True, state_in_place=True, alias_outputs=True),
                     dev, store, check_last, timed, rows,
                     note="the serving set's prefill: logits_index in, the last token's logits out, the prompts "
                          "written into their cache rows in place, outputs aliased")
        progress()
    unsplit_rows(args, model, ids, past, check, timed, dev, rows, progress)
    if step == "prefill":
        unsplit_last_rows(model, ids, check_last, timed, dev, rows, progress)
    return rows


def fastpipe_row(label: str, make, kw: dict, dev, store, check, timed, rows: list[Row], note: str = "") -> None:
    """One fastpipe row, appended to rows: make() -> (pipeline.json path, its Pipeline, its inputs on dev); the
    session loaded with every slot on dev and `kw`, compiled (and captured) on those inputs, its first call
    watched for a recompile, its logits checked. A failure is the row's error, not the end of the run."""
    import fastpipe
    from fastpipe.model_io import assemble_outputs
    from fastpipe.torch_compat import unique_graphs

    row = Row(label)
    rows.append(row)
    try:
        path, pipeline, inputs = make()
        sess = fastpipe.load(path, device_map={s: str(dev) for s in pipeline.devices}, store=store, **kw)
        if label in PER_TENSOR_COPIES:
            sess.runner.replay.grouped_copies = False
        before = unique_graphs()
        rep = sess.compile(inputs)
        if kw.get("compile"):
            row.compile_s = rep.seconds
            row.shared = unique_graphs() == before and bool(rows[:-1]) and not rep.eager   # a row above's
            if rep.eager:
                row.notes.append(f"left eager by a failed compile: {', '.join(map(str, rep.eager))}")
        row.notes.append(sess.describe() + (f"; {note}" if note else ""))
        fn = timed(lambda: sess.run(inputs))
        dt, warned = first_call(fn)
        if warned:
            row.recompile_s = dt
            row.notes.append(f"the first call after warm-up took {dt * 1e3:.0f} ms: " + " | ".join(sorted(set(warned))))
        row.check = check(assemble_outputs(sess.pipeline, fn(), only=("logits",))["logits"])
        row.fn, row.session = fn, sess
    except Exception as e:  # noqa: BLE001 - a failing variant is a row of the table, not the end of the run
        row.error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        traceback.print_exc()


def static_step(folder: Path, out: Path, host: dict, dev, built: dict | None = None):
    """The serving engine's decode step (fastpipe.serving.build: a static cache of exactly past + 1
    positions, written in place at cache_position), to run as the engine runs its buckets (region compiled,
    + replay on a GPU, state in place, outputs aliased): the fastpipe row to hold against the unsplit
    static-cache rows. Its caches hold the past; every call writes the new token's keys and values at the
    same position. `built`: a dict kept across calls, so that the pipeline is built once (each call makes
    its own caches). Returns (path, Pipeline, inputs on dev)."""
    import torch

    from fastpipe.builder.hf.build import build_hf

    past = host["past_key_values"]
    batch, past_len = host["input_ids"].shape[0], past[0][0].shape[2]
    built = {} if built is None else built
    if "path" not in built:
        built["path"] = build_hf(folder, tp=2, batch=batch, seq_len=1, max_len=past_len + 1).save(out)
    path = built["path"]
    caches = [[torch.cat([t, torch.zeros_like(t[:, :, :1])], dim=2) for t in kv]   # [B, Hkv, past + 1, D]
              for kv in past]
    return on_device(path, {"input_ids": host["input_ids"], "cache_position": torch.full((batch,), past_len),
                            "past_key_values": caches}, dev)


def on_device(path: Path, model_inputs: dict, dev):
    """(path, its Pipeline, its inputs made from the model-level `model_inputs`: sliced per slot, on dev)."""
    from fastpipe.format import read_pipeline
    from fastpipe.model_io import flatten_args, to_pipeline_inputs

    pipeline = read_pipeline(path)
    return path, pipeline, {n: t.to(dev) for n, t in to_pipeline_inputs(pipeline, flatten_args(model_inputs)).items()}


def serving_prefill(folder: Path, out: Path, host: dict, dev):
    """The serving set's prefill bucket (fastpipe.serving.build: last_logits, cache_rows: logits_index [B]
    in, the logits there [B, 1, V] out, each prompt's keys/values written into its row cache_row[b] of a
    static cache, here of B rows x S positions, in place) on the case's prompts, which fill the bucket:
    each row's index is its last token, row b goes to cache row b. Returns (path, Pipeline, inputs on dev)."""
    import torch

    from fastpipe.builder.hf.build import build_hf
    from fastpipe.dtypes import to_torch
    from fastpipe.format import read_pipeline

    batch, seq = host["input_ids"].shape
    path = build_hf(folder, tp=2, batch=batch, seq_len=seq, max_len=seq, cache_rows=batch, last_logits=True).save(out)
    meta = read_pipeline(path).metadata.tensors_inputs
    caches = {n: torch.zeros(t.shape, dtype=to_torch(t.dtype)) for n, t in meta.items() if n.startswith("past_key_values_")}
    return on_device(path, {"input_ids": host["input_ids"], "logits_index": torch.full((batch,), seq - 1),
                            "cache_row": torch.arange(batch), **caches}, dev)


def unsplit_last_rows(model, ids, check, timed, dev, rows: list[Row], progress=lambda: None) -> None:
    """The unsplit prefill as a server runs it, the last position's logits only (logits_to_keep=1):
    compiled and (on a GPU) reduce-overhead, appended to rows: the serving prefill's baseline."""
    modes = [{}] + ([{"mode": "reduce-overhead"}] if dev.type == "cuda" else [])
    for label, kw in zip(UNSPLIT_LAST, modes):
        unsplit_row(label, lambda: (lambda m: hf_call(m, ids, [], last_only=True)), model, kw, check, timed, rows)
        progress()


def unsplit_rows(args, model, ids, past, check, timed, dev, rows: list[Row], progress=lambda: None) -> None:
    """The unsplit model's rows, appended to rows (progress() after each): eager, compiled and (on a GPU)
    compiled with mode="reduce-overhead", each on a DynamicCache built per call ("unsplit ...") and on a
    StaticCache filled once ("unsplit static cache ...", bench/unsplit_calls.py)."""
    from bench.unsplit_calls import StaticStep

    modes = [("compiled", {})] + ([("compiled, reduce-overhead", {"mode": "reduce-overhead"})]
                                  if dev.type == "cuda" else [])
    for prefix, make_step in (("unsplit", lambda: (lambda m: hf_call(m, ids, past))),
                              ("unsplit static cache", lambda: StaticStep(model, ids, past))):
        for mode, kw in [("eager", None)] + modes:
            unsplit_row(f"{prefix} {mode}", make_step, model, kw, check, timed, rows)
            progress()


def unsplit_row(label: str, make_step, model, kw: dict | None, check, timed, rows: list[Row]) -> None:
    """One unsplit row, appended to rows: make_step() -> step(model) -> logits, run on the model as it is (kw
    None) or under torch.compile(dynamic=False, **kw), compiled before timing, its logits checked. A failure
    is the row's error, not the end of the run."""
    import torch

    row = Row(label)
    rows.append(row)
    try:
        step = make_step()
        target = model if kw is None else torch.compile(model, dynamic=False, **kw)
        fn = timed(_inference(lambda: step(target)))
        if kw is not None:
            _compile_unsplit(row, fn, kw)
        row.check = check(fn())
        row.fn = fn
    except Exception as e:  # noqa: BLE001 - a failing variant is a row of the table, not the end of the run
        row.error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        traceback.print_exc()


def _inference(fn):
    import torch

    def call():
        with torch.inference_mode():
            return fn()
    return call


def _compile_unsplit(row: Row, fn, kw: dict) -> None:
    """Compile (and for reduce-overhead record) the unsplit row's call: its first three calls, timed as
    compile_s; notes say what torch warned of, a cudagraph skip, and more than one graph."""
    from fastpipe.torch_compat import cudagraph_skips, unique_graphs

    t, skips, graphs = time.perf_counter(), cudagraph_skips(), unique_graphs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):          # reduce-overhead records its graph at the 2nd-3rd call
            fn()
    row.compile_s = time.perf_counter() - t
    row.notes += sorted({" ".join(str(w.message).split())[:200] for w in caught
                         if "cudagraph" in str(w.message).lower() or "recompil" in str(w.message).lower()})
    if kw.get("mode") == "reduce-overhead" and cudagraph_skips() > skips:
        row.notes.append("inductor ran it WITHOUT CUDA graphs (a cudagraph skip: see the torch._inductor "
                         "log, TORCH_LOGS=cudagraphs): this row is the default mode's")
    if unique_graphs() - graphs > 1:
        row.notes.append(f"torch.compile made {unique_graphs() - graphs} graphs (graph breaks or recompiles)")


def median(rows: list[Row], variant: str) -> float | None:
    r = next((r for r in rows if r.variant == variant and r.samples), None)
    return statistics.median(r.samples) if r else None


def verdicts(rows: list[Row], batch: int) -> dict:
    """The targets for one case: replay vs eager streams (>= 3x at batch 1), and the best
    fastpipe row against the best unsplit compiled row (<= 1.1x)."""
    out: dict = {}
    replay, streams, compiled = median(rows, REPLAY), median(rows, STREAMS), median(rows, COMPILED_STREAMS)
    if replay and streams:
        out["replay_vs_eager_streams"] = streams / replay
        if batch == 1:
            out["replay_target_met"] = streams / replay >= TARGET_REPLAY_VS_STREAMS
    if replay and compiled:
        out["replay_vs_compiled_streams"] = compiled / replay
    for per_tensor, grouped in PER_TENSOR_COPIES.items():
        slow, fast = median(rows, per_tensor), median(rows, grouped)
        if slow and fast:
            out["grouped_copies_gain"] = slow / fast
    for aliased, cloned in ALIASED.items():
        fast, slow = median(rows, aliased), median(rows, cloned)
        if slow and fast:
            out["aliased_outputs_gain"] = slow / fast
    for streams_row, region_row in STATIC_STREAMS.items():
        a, b = median(rows, streams_row), median(rows, region_row)
        if a and b:
            out.update(static_streams_vs_region=a / b, static_streams_row=streams_row)
    ok = [r for r in rows if r.samples and not r.check.startswith("MISMATCH")]
    ours = [r for r in ok if r.variant.startswith("fastpipe") and r.variant not in SERVING_PREFILL]
    theirs = [r for r in ok if r.variant in UNSPLIT_COMPILED]
    best = base = None
    if ours and theirs:
        best = min(ours, key=lambda r: statistics.median(r.samples))
        base = min(theirs, key=lambda r: statistics.median(r.samples))
        ratio = statistics.median(best.samples) / statistics.median(base.samples)
        out.update(best_fastpipe=best.variant, best_unsplit_compiled=base.variant, best_vs_unsplit_compiled=ratio,
                   unsplit_target_met=ratio <= TARGET_VS_UNSPLIT)
    serving = next((r for r in ok if r.variant in SERVING_PREFILL), None)
    last = [r for r in ok if r.variant in UNSPLIT_LAST]
    if serving is not None:
        med = statistics.median(serving.samples)
        if ours:
            full = min(ours, key=lambda r: statistics.median(r.samples))
            out.update(serving_prefill_gain=statistics.median(full.samples) / med, serving_prefill_vs=full.variant)
        if last:
            base_last = min(last, key=lambda r: statistics.median(r.samples))
            out.update(serving_prefill_vs_unsplit_last=med / statistics.median(base_last.samples),
                       best_unsplit_last=base_last.variant)
    return out


def table(rows: list[Row]) -> list[str]:
    base = min((m for v in UNSPLIT_COMPILED if (m := median(rows, v))), default=None)
    return region_table(rows, base, "best unsplit compiled", "logits")


def verdict_lines(v: dict) -> list[str]:
    out = []
    if "replay_vs_eager_streams" in v:
        t = f"target >= {TARGET_REPLAY_VS_STREAMS:g}x at batch 1"
        met = {True: f" ({t}: met)", False: f" ({t}: NOT met)"}
        out.append(f"graph replay vs eager streams: {v['replay_vs_eager_streams']:.2f}x faster"
                   + met.get(v.get("replay_target_met"), ""))
    if "replay_vs_compiled_streams" in v:
        out.append(f"graph replay vs the same compiled steps launched from Python: "
                   f"{v['replay_vs_compiled_streams']:.2f}x faster")
    if "grouped_copies_gain" in v:
        out.append(f"the replay's copies grouped (one launch per dtype) vs a copy per tensor: "
                   f"{v['grouped_copies_gain']:.2f}x faster")
    if "aliased_outputs_gain" in v:
        out.append(f"the replay handing out its output buffers vs cloning them: {v['aliased_outputs_gain']:.2f}x faster")
    if "static_streams_vs_region" in v:
        out.append(f"the engine's decode step on a processor of slots apart ({v['static_streams_row']}) / on the "
                   f"region processor: {v['static_streams_vs_region']:.2f}x")
    if "best_vs_unsplit_compiled" in v:
        out.append(f"best fastpipe ({v['best_fastpipe']}) / best unsplit compiled ({v['best_unsplit_compiled']}): "
                   f"{v['best_vs_unsplit_compiled']:.2f}x (target <= {TARGET_VS_UNSPLIT:g}x: "
                   f"{'met' if v['unsplit_target_met'] else 'NOT met'})")
    if "serving_prefill_gain" in v:
        out.append(f"serving prefill (the last token's logits) vs the best fastpipe prefill of every position's "
                   f"({v['serving_prefill_vs']}): {v['serving_prefill_gain']:.2f}x faster (its time / the serving prefill's)")
    if "serving_prefill_vs_unsplit_last" in v:
        out.append(f"serving prefill / best unsplit compiled with logits_to_keep=1 ({v['best_unsplit_last']}): "
                   f"{v['serving_prefill_vs_unsplit_last']:.2f}x")
    return out


def row_json(r: Row) -> dict:
    d = {"variant": r.variant, "compile_s": r.compile_s, "compile_shared": r.shared, "recompile_s": r.recompile_s,
         "check": r.check,
         "notes": r.notes, "error": r.error}
    if r.samples:
        d.update(median_ms=statistics.median(r.samples), p10_ms=pct(r.samples, 0.1), p90_ms=pct(r.samples, 0.9),
                 samples=len(r.samples), calls_per_sample=r.inner)
    return d


def write_json(path: str, doc: dict) -> None:
    from fastpipe.atomic import write_text

    write_text(path, json.dumps(doc, indent=1))


def case_entry(title: str, step: str, batch: int, rows: list[Row], partial: str | None = None) -> dict:
    """One case in --json: its rows and verdicts as far as it got (partial: "set-up" or "interrupted")."""
    return {"title": title, "step": step, "batch": batch, "rows": [row_json(r) for r in rows],
            "verdicts": verdicts(rows, batch), **({"partial": partial} if partial else {})}


def close_rows(rows: list[Row]) -> None:
    """Free a case's sessions (their threads, their device memory)."""
    for r in rows:
        sess = getattr(r, "session", None)
        if sess is not None:
            sess.close()
        r.fn = r.session = None


def case_order(steps: list[str], batches: list[int]) -> list[tuple[str, int]]:
    """Batch by batch, each batch's steps in turn: a run cut short has the smallest batch's (batch 1:
    the replay target's) cases first."""
    return [(step, b) for b in sorted(batches) for step in steps]


def over_budget(elapsed: float, longest: float, budget: float) -> bool:
    """Whether the next case would end past the budget, if it took as long as the longest so far
    (budget 0: no limit)."""
    return bool(budget) and elapsed + longest > budget


def main(argv=None) -> int:
    """Stops on SIGINT even where the process started with it ignored (bench.sigint: gpu_check.sh's stage
    limit); the handler before is restored at the end."""
    import signal

    before = stop_on_sigint()
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGINT, before)


def _main(argv) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    import torch

    from bench.machine import machine_info
    from fastpipe.weights import WeightStore

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
    info = machine_info()
    header = [("machine: " + ", ".join(f"{k} {v}" for k, v in info.items())
               + (f", cuda {torch.version.cuda}" if args.device == "cuda" else f", torch threads {torch.get_num_threads()}")),
              f"command: python bench/{Path(__file__).name} " + " ".join(sys.argv[1:] if argv is None else argv),
              f"model: Llama-family, {args.layers} layers, hidden {args.hidden}, {args.heads} q / {args.kv_heads} kv "
              f"heads, vocab {args.vocab}, {args.dtype}, tp=2, every slot on {args.device}",
              f"timing: median and p10/p90 of {args.repeat} samples per variant (each the mean of back-to-back calls "
              f"lasting ~{args.sample_ms:g} ms, every call synchronized), after {args.warmup} warm-up calls, "
              "variants interleaved"]
    print("\n".join(header), flush=True)
    doc = {"machine": info, "args": {k: v for k, v in vars(args).items() if not k.endswith("_list")},
           "cases": [], "not_run": []}
    todo = case_order(args.case_list, args.batch_list)
    failed = []
    longest = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        model = make_checkpoint(args, folder)
        model32 = None if args.dtype == "float32" else copy.deepcopy(model).float().to(args.device)
        model = model.to(args.device)
        store = WeightStore()
        for i, (step, b) in enumerate(todo):
            elapsed = time.perf_counter() - t_start
            if over_budget(elapsed, longest, args.budget_s):
                doc["not_run"] = [f"{s} batch {bb}" for s, bb in todo[i:]]
                print(f"\n(budget of {args.budget_s:g} s: {elapsed:.0f} s used and the longest case took "
                      f"{longest:.0f} s; not run: {', '.join(doc['not_run'])})")
                break
            t_case = time.perf_counter()
            title = (f"decode step, batch {b}, 1 token over {args.past} cached" if step == "decode"
                     else f"prefill step, batch {b}, {args.prefill_len} tokens")
            rows: list[Row] = []

            def progress(title=title, step=step, b=b, rows=rows):   # after each row's set-up: a cut-off run keeps them
                if args.json:
                    write_json(args.json, {**doc, "cases": doc["cases"] + [case_entry(title, step, b, rows, "set-up")]})
                if interrupted():
                    raise KeyboardInterrupt
            try:
                run_case(args, step, b, folder, model, store, Path(tmp) / f"{step}{b}", model32, rows, progress)
                measure(rows, args.repeat, args.warmup, args.sample_ms, stop=interrupted)
            except KeyboardInterrupt:            # gpu_check's stage limit (SIGINT): keep what this case has
                timed = sum(bool(r.samples) for r in rows)
                doc["interrupted"] = (f"{title}: interrupted after {time.perf_counter() - t_case:.0f} s, with "
                                      f"{len(rows)} rows set up and {timed} timed (each row's samples so far)")
                doc["cases"].append(case_entry(title, step, b, rows, "interrupted"))
                doc["not_run"] = [f"{s} batch {bb}" for s, bb in todo[i + 1:]]
                print(f"\n### {title} (INTERRUPTED)\n\n" + "\n".join(table(rows)) + f"\n\n{doc['interrupted']}")
                close_rows(rows)
                break
            v = verdicts(rows, b)
            print(f"\n### {title}\n\n" + "\n".join(table(rows)))
            for line in verdict_lines(v):
                print(f"\n{line}")
            notes = [(r.variant, n) for r in rows for n in r.notes]
            if notes:
                print()
                for variant, n in notes:
                    print(f"- {variant}: {n}")
            print(f"({time.perf_counter() - t_start:.0f} s so far)", flush=True)
            failed += [f"{title}: {r.variant}" for r in rows if r.variant.startswith("fastpipe")
                       and (r.error or r.check.startswith("MISMATCH"))]
            doc["cases"].append(case_entry(title, step, b, rows))
            if args.json:
                write_json(args.json, doc)
            close_rows(rows)
            del rows
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            longest = max(longest, time.perf_counter() - t_case)
    doc["failed"] = failed
    if args.json:
        write_json(args.json, doc)
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    if failed:
        print("fastpipe rows that failed or mismatched: " + "; ".join(failed))
    return 130 if "interrupted" in doc else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
