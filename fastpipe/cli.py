"""The `fastpipe` command line (also `python -m fastpipe`).

Exit status: 0 success; 2 anything given is invalid (pipeline, param files,
payloads, inputs, options); 1 a valid run failed or --check found a mismatch.
Errors print as one line (`fastpipe: error: ...`); --verbose adds the traceback.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

from fastpipe.errors import FastpipeError, InputError

EXIT_INVALID = 2
EXIT_FAILED = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        raise InputError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="fastpipe", description="Validate, inspect and run split-model pipelines (pipeline.json).")
    ap.add_argument("--verbose", "-v", action="store_true", help="show tracebacks and debug logs")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p):
        p.add_argument("pipeline", help="path to pipeline.json")
        p.add_argument("--allow-outside-paths", action="store_true",
                       help="allow param/payload files by absolute path or outside the pipeline's folder")
        p.add_argument("--trust-export-archives", action="store_true",
                       help="allow torch.export archives (their loader can unpickle, i.e. run code)")
        p.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    v = sub.add_parser("validate", help="check a pipeline (structure, payloads, param-file headers); exit 0 or one error")
    common(v)
    s = sub.add_parser("show", help="summary: slots, supertasks by kind, constant bytes per slot")
    common(s)
    s.add_argument("--dot", metavar="FILE", help="also write a Graphviz drawing (one cluster per slot)")
    s.add_argument("--plan", action="store_true",
                   help="also print the lowered Program: a step x slot table, peak bytes per slot, and the checker's verdict")
    r = sub.add_parser("run", help="run a pipeline and print a latency summary")
    common(r)
    r.add_argument("--inputs", metavar="FILE", help="safetensors file keyed by pipeline input names (default: seeded random)")
    r.add_argument("--outputs", metavar="FILE", help="write outputs (safetensors, keyed by pipeline output names)")
    r.add_argument("--check", metavar="FILE", help="compare outputs with this safetensors file; exit 1 on mismatch")
    r.add_argument("--rtol", type=float, help="relative tolerance for --check (default: per dtype)")
    r.add_argument("--atol", type=float, help="absolute tolerance for --check (default: per dtype)")
    r.add_argument("--device-map", metavar="MAP", help="slot placement, e.g. 0=cpu,1=cuda:0")
    r.add_argument("--seed", type=int, default=0, help="seed for random inputs (default 0)")
    r.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    r.add_argument("--repeat", type=int, default=5, help="timed runs (default 5)")
    r.add_argument("--processor", choices=("auto", "reference", "cpu", "cuda", "dist"), default="auto",
                   help="auto (default): dist under torchrun or with --nproc, else cuda when every slot is on a GPU, "
                        "else cpu (a thread per slot)")
    r.add_argument("--no-compile", action="store_true", help="run fx supertasks eagerly instead of torch.compile")
    r.add_argument("--compile-errors", choices=("warn", "raise"), default="warn",
                   help="a graph that cannot be compiled: warn and run it eagerly (default), or fail")
    r.add_argument("--no-cuda-graph", action="store_true", help="cuda processor: issue on streams, no graph capture")
    r.add_argument("--chunks", type=int, default=1, help="micro-batches along dim 0 (inputs carry chunks x the batch)")
    r.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of the last timed run (a lane per slot)")
    # -- multi-process runs (fastpipe.runtime.dist_setup, docs/distributed.md)
    r.add_argument("--nproc", type=int, metavar="N",
                   help="run N processes on this machine through torch's elastic launcher (like torchrun)")
    r.add_argument("--slot-ranks", metavar="MAP", help="slot -> rank, e.g. 0=0,1=0,2=1,3=1 (default: contiguous blocks)")
    r.add_argument("--dist-timeout", type=float, default=120.0, metavar="S",
                   help="seconds any collective may wait before the run fails (default 120)")
    b = sub.add_parser("build", help="split a local Hugging Face checkpoint folder into a tp x pp pipeline")
    b.add_argument("model", help="folder with config.json and *.safetensors (no network is used)")
    b.add_argument("-o", "--output", required=True, help="output folder: pipeline.json, with the checkpoint files hard-linked in place")
    b.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    b.add_argument("--pp", type=int, default=1, help="pipeline stages, layers split evenly (default 1)")
    b.add_argument("--split-points", metavar="MODULES", help="comma-separated module names each stage after the first starts at")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--seq-len", type=int, default=128)
    b.add_argument("--past-len", type=int, default=None,
                   help="decoders: omit for no KV cache; 0 for a prefill that outputs the cache; P for a decode step over P cached tokens")
    b.add_argument("--sequence-parallel", action="store_true", help="reduce_scatter/all_gather on the sequence dim instead of all_reduce")
    b.add_argument("--style", choices=("fastpipe", "producer", "producer-2024.1"), default="fastpipe",
                   help="fastpipe: its own compact spelling (default); producer: what furiosa-llm (2024.2.0 and later) "
                        "writes and its Pipeline.load reads (every field, null where absent, payloads in <blob-id>.fx "
                        "files); producer-2024.1: the same with torch 2.1 payloads, for furiosa-llm 2024.1.x")
    b.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return ap


def _cmd_validate(args) -> int:
    from fastpipe.format import read_pipeline
    from fastpipe.validate import validate

    p = read_pipeline(args.pipeline)
    validate(p, _options(args))
    print(f"{args.pipeline}: valid ({len(p.devices)} slots, {len(p.supertasks)} supertasks, {len(p.tensors)} tensors)")
    return 0


def _options(args):
    from fastpipe.options import LoadOptions

    return LoadOptions(allow_outside_paths=args.allow_outside_paths, trust_export_archives=args.trust_export_archives)


def _cmd_show(args) -> int:
    from fastpipe.atomic import write_text
    from fastpipe.format import read_pipeline
    from fastpipe.summary import dot_text, summary_text
    from fastpipe.validate import validate_structure

    p = read_pipeline(args.pipeline)
    checked = validate_structure(p)
    sys.stdout.write(summary_text(p))
    if args.plan:
        from fastpipe.lower import ProgramError, check_program, format_table, lower

        program = lower(checked)
        try:
            check_program(program, checked)
        except ProgramError as e:
            sys.stdout.write(format_table(program, mark=e.marks, pipeline=p))
            raise
        table = format_table(program, pipeline=p)
        sys.stdout.write(table if table.endswith("\n") else table + "\n")
        for line in _fusion_lines(p, checked, args):
            print(line)
        print("plan: checked: every wait is satisfied and every comm group is issued in one order by all its members")
    if args.dot:
        _check_writable(args.dot, "--dot")
        write_text(args.dot, dot_text(p))
        print(f"wrote {args.dot}")
    return 0


def _fusion_lines(p, checked, args) -> list[str]:
    """Which comm groups the fusion pass would fuse (policy auto, default device map) and why others not."""
    from types import SimpleNamespace

    from fastpipe.runtime import fuse
    from fastpipe.runtime.device_map import resolve_device_map
    from fastpipe.validate import Checked
    from fastpipe.validate.payloads import decode_all

    graphs = decode_all(p, _options(args), check=False)
    view = SimpleNamespace(pipeline=p, checked=Checked(p, checked.flow, checked.groups, checked.order, graphs),
                           slot_devices=resolve_device_map(p, None))
    return ["fusion: " + d.line() for d in fuse.analyze(view, "auto")]


def _read_tensors(path: str, option: str):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except FileNotFoundError:
        raise InputError(f"{option}: expected a safetensors file, found no file \"{path}\"") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{option}: expected a safetensors file, found \"{path}\" unreadable: {' '.join(str(e).split())}") from None


def _check_writable(path: str, option: str) -> None:
    import os
    from pathlib import Path

    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise InputError(f"{option}: expected a file in an existing folder, found no folder \"{parent}\"")
    if Path(path).is_dir():
        raise InputError(f"{option}: expected a file path, found a folder \"{path}\"")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{option}: expected a writable folder, found \"{parent}\" read-only")


def _processor(args, p, device_map) -> str:
    if args.processor != "auto":
        return args.processor
    from fastpipe.runtime.device_map import resolve_device_map

    devs = resolve_device_map(p, device_map).values()
    return "cuda" if all(d.type == "cuda" for d in devs) else "cpu"


def _cmd_run(args) -> int:
    import torch

    from fastpipe.format import read_pipeline
    from fastpipe.random_inputs import random_inputs
    from fastpipe.runtime.device_map import parse_device_map_option
    from fastpipe.session import Session

    from fastpipe.runtime import dist_setup      # multi-process: torchrun-launched, --nproc or --processor dist
    if dist_setup.wants_dist(args):
        return dist_setup.cli_run(args)
    if not 0 <= args.seed < 2**63:
        raise InputError(f"--seed: expected 0 <= seed < 2**63, found {args.seed}")
    if args.repeat < 1 or args.warmup < 0:
        raise InputError(f"--repeat/--warmup: expected --repeat >= 1 and --warmup >= 0, found {args.repeat} and {args.warmup}")
    device_map = parse_device_map_option(args.device_map) if args.device_map else None
    if args.outputs:
        _check_writable(args.outputs, "--outputs")
    p = read_pipeline(args.pipeline)
    inputs = _read_tensors(args.inputs, "--inputs") if args.inputs else random_inputs(p, args.seed)
    expected = _read_tensors(args.check, "--check") if args.check else None
    if args.chunks < 1:
        raise InputError(f"--chunks: expected >= 1, found {args.chunks}")
    if args.trace:
        _check_writable(args.trace, "--trace")
    if args.chunks > 1 and not args.inputs:
        inputs = {k: torch.cat([v] * args.chunks, dim=0) for k, v in inputs.items()}
    t0 = time.perf_counter()
    sess = Session(p, device_map=device_map, options=_options(args), processor=_processor(args, p, device_map),
                   compile=not args.no_compile, compile_policy=args.compile_errors, cuda_graph=not args.no_cuda_graph)
    load_s = time.perf_counter() - t0
    compile_msg = ""
    if not args.no_compile:
        rep = sess.compile()
        compile_msg = f"; compiled {rep.graphs} graphs in {rep.seconds:.1f} s" + (f" ({len(rep.eager)} eager)" if rep.eager else "")
    for _ in range(args.warmup):
        sess.run(inputs, chunks=args.chunks)
    times, outs = [], None
    for i in range(args.repeat):
        t = time.perf_counter()
        outs = sess.run(inputs, chunks=args.chunks, trace=args.trace if args.trace and i == args.repeat - 1 else None)
        if any(d.type == "cuda" for d in sess.slot_devices.values()):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    ms = sorted(x * 1e3 for x in times)
    print(f"{p.name}: {sess.processor} processor; loaded in {load_s * 1e3:.1f} ms{compile_msg}; {args.repeat} runs: "
          f"median {statistics.median(ms):.3f} ms, min {ms[0]:.3f} ms, max {ms[-1]:.3f} ms")
    return report_results(args, outs, expected)


def report_results(args, outs, expected) -> int:
    """The end of `fastpipe run` (single process, or rank 0 of a distributed run): the trace note,
    outputs written atomically, and the --check comparison (CheckMismatch on a mismatch)."""
    from fastpipe.atomic import atomic_path
    from fastpipe.compare import compare
    from fastpipe.errors import CheckMismatch

    if args.trace:
        print(f"wrote trace {args.trace}")
    if args.outputs:
        from safetensors.torch import save_file

        with atomic_path(args.outputs) as tmp:
            save_file({k: v.detach().cpu().contiguous() for k, v in outs.items()}, str(tmp))
        print(f"wrote {len(outs)} outputs to {args.outputs}")
    if expected is not None:
        rows = compare(outs, expected, args.rtol, args.atol)
        for r in rows:
            extra = f" ({r.why})" if r.why else ""
            print(f"  {r.name}: max abs {r.max_abs:.3g}, max rel {r.max_rel:.3g}: {'ok' if r.ok else 'MISMATCH'}{extra}")
        bad = [r.name for r in rows if not r.ok]
        if bad:
            raise CheckMismatch(f"--check: expected outputs to match {args.check}, found {len(bad)} mismatching ({', '.join(bad)})")
        print(f"check: {len(rows)} outputs match {args.check}")
    return 0


def _cmd_build(args) -> int:
    import time
    from pathlib import Path

    from fastpipe.build.hf.build import build_hf

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise InputError(f"model: expected a Hugging Face checkpoint folder with config.json, found \"{model_dir}\"")
    if args.tp < 1 or args.pp < 1 or args.batch < 1 or args.seq_len < 1:
        raise InputError(f"--tp/--pp/--batch/--seq-len: expected values >= 1, found {args.tp}/{args.pp}/{args.batch}/{args.seq_len}")
    if args.past_len is not None and args.past_len < 0:
        raise InputError(f"--past-len: expected >= 0, found {args.past_len}")
    t0 = time.perf_counter()
    try:
        built = build_hf(model_dir, tp=args.tp, pp=args.pp, batch=args.batch, seq_len=args.seq_len,
                         past_len=args.past_len, sequence_parallel=args.sequence_parallel,
                         split_points=args.split_points.split(",") if args.split_points else None)
    except ValueError as e:
        raise InputError(f"build: {' '.join(str(e).split())}") from None
    try:
        path = built.save(args.output, style=args.style)
    except OSError as e:
        raise InputError(f"-o/--output: {' '.join(str(e).split())}") from None
    n = len(built.doc["supertasks"]) - 2
    print(f"wrote {path}: {len(built.doc['devices'])} slots, {n} supertasks, built in {time.perf_counter() - t0:.1f} s")
    return 0


COMMANDS = {"validate": _cmd_validate, "show": _cmd_show, "run": _cmd_run, "build": _cmd_build}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verbose = "--verbose" in argv or "-v" in argv
    try:
        args = _parser().parse_args(argv)
        args.argv = list(argv)       # --nproc relaunches the same command line
        if getattr(args, "verbose", False):
            import logging

            logging.basicConfig(level=logging.DEBUG)
        return COMMANDS[args.command](args)
    except FastpipeError as e:
        if verbose:
            traceback.print_exc()
        print(f"fastpipe: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("fastpipe: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a bug of ours: still one line unless --verbose
        if verbose:
            traceback.print_exc()
        msg = " ".join(str(e).split())
        print(f"fastpipe: internal error: {type(e).__name__}: {msg} (rerun with --verbose for the traceback)", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
