"""`fastpipe run` across processes: launching workers (`--nproc N`) and being one rank
(torchrun-launched, `--processor dist`); the rank plan, process groups and the dist processor
itself are in fastpipe.runtime.processors.dist_setup and fastpipe.runtime.processors.dist."""
from __future__ import annotations

import os

import torch

from fastpipe.cli.common import (check_counts, check_writable, device_map_of, load_options, read_tensors,
                                 reading_safetensors, report_results, run_options)
from fastpipe.errors import FastpipeError, InputError
from fastpipe.runtime.processors.dist_setup import check_slot_ranks, env_world
from fastpipe.runtime.binding.microbatch import repeat_chunks


def parse_slot_ranks_option(text: str) -> dict[str, str]:
    """`0=0,1=1` -> {"0": "0", "1": "1"} (values are checked by check_slot_ranks)."""
    out: dict[str, str] = {}
    for i, part in enumerate(p for p in text.split(",") if p.strip()):
        slot, sep, rank = part.partition("=")
        if not sep or not slot.strip() or not rank.strip():
            raise InputError(f"--slot-ranks[{i}]: expected SLOT=RANK (e.g. 0=0,1=1), found \"{part}\"")
        if slot.strip() in out:
            raise InputError(f"--slot-ranks[\"{slot.strip()}\"]: expected each slot once, found it twice")
        out[slot.strip()] = rank.strip()
    if not out:
        raise InputError("--slot-ranks: expected SLOT=RANK pairs (e.g. 0=0,1=1), found none")
    return out



# ------------------------------------------------------------------------------ `fastpipe run --nproc N`
def child_argv(argv: list[str]) -> list[str]:
    """The CLI's arguments without --nproc (and its value): what every launched worker runs."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        key = tok.split("=", 1)[0]
        if len(key) >= 4 and key.startswith("--np") and "--nproc".startswith(key):
            skip = "=" not in tok
            continue
        out.append(tok)
    return out


def launch(nproc: int, argv: list[str]) -> int:
    """Run `python -m fastpipe <argv>` in `nproc` workers through torch's elastic launcher (as
    `torchrun --standalone --nproc-per-node N -m fastpipe ...` would). Returns the exit status of the
    run: 2 when a worker found invalid input, 1 when one failed otherwise, 0 when every worker succeeded."""
    import sys

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if "OMP_NUM_THREADS" not in os.environ:    # share the cores instead of torchrun's warned default of 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    args = torchrun.parse_args(["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
                                "--monitor-interval", "0.1", "-m", "fastpipe", *child_argv(argv)])
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        # which rank failed first is not reliable (peers of a failed rank fail too, in the same
        # instant): name every failed rank; exit 2 if any found invalid input, else 1
        codes = {rank: f.exitcode for rank, f in sorted(e.failures.items())}
        shown = ", ".join(f"rank {r}: " + (f"exit status {c}" if c >= 0 else f"signal {-c}") for r, c in codes.items())
        print(f"fastpipe: error: --nproc {nproc}: {len(codes)} of {nproc} ranks failed ({shown}); their errors are above",
              file=sys.stderr)
        return 2 if 2 in codes.values() else 1
    return 0


# ------------------------------------------------------------------------------ `fastpipe run` on a rank
def wants_dist(args) -> bool:
    """`fastpipe run` goes multi-process with --nproc, --processor dist, or auto under torchrun."""
    from fastpipe.runtime.processors.registry import runs_per_rank

    multi = args.nproc is not None or runs_per_rank(args.processor, os.environ)
    if not multi and args.slot_ranks:
        raise InputError(f"--slot-ranks: expected a multi-process run (torchrun, --nproc N or --processor dist), "
                         f"found --processor {args.processor}")
    return multi


def _check_common(args) -> None:
    check_counts(args)
    if not args.dist_timeout > 0:
        raise InputError(f"--dist-timeout: expected seconds > 0, found {args.dist_timeout:g}")
    from fastpipe.runtime.processors.registry import AUTO, per_rank_processors

    if args.processor != AUTO and args.processor not in per_rank_processors():
        raise InputError(f"--processor: expected {' or '.join((AUTO,) + per_rank_processors())} for a multi-process "
                         f"run, found {args.processor}")


def cli_run(args) -> int:
    """`fastpipe run` for the dist processor: launch (--nproc) or be one rank (torchrun-launched)."""
    _check_common(args)
    if args.nproc is not None:
        if "WORLD_SIZE" in os.environ:
            raise InputError("--nproc: expected a plain process, found one launched by torchrun (WORLD_SIZE is set); "
                             "drop --nproc")
        if args.nproc < 1:
            raise InputError(f"--nproc: expected >= 1, found {args.nproc}")
        _precheck(args, args.nproc)
        return launch(args.nproc, args.argv)
    if env_world() is None:
        raise InputError("--processor dist: expected a process launched by torchrun (WORLD_SIZE is not set), found a "
                         "plain process; use --nproc N to launch N processes")
    rank = env_world()[0]
    try:
        return _rank_main(args, rank)
    except FastpipeError as e:
        return _die(rank, str(e), e.exit_code, args)
    except Exception as e:  # noqa: BLE001 - a bug of ours: still one line unless --verbose
        msg = " ".join(str(e).split())
        return _die(rank, f"internal error: {type(e).__name__}: {msg} (rerun with --verbose for the traceback)", 1, args,
                    internal=True)


def _die(rank: int, msg: str, code: int, args, internal: bool = False) -> int:
    """Print this rank's one-line error and end the process at once: no teardown may wait on peers."""
    import sys
    import traceback

    import torch.distributed as dist

    if getattr(args, "verbose", False):
        traceback.print_exc()
    if not msg.startswith(f"[rank {rank}]"):
        msg = f"[rank {rank}] {msg}"
    print(f"fastpipe: {'' if internal else 'error: '}{msg}", file=sys.stderr)
    if dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _precheck(args, world: int) -> None:
    """What the parent of --nproc can refuse before starting any worker (exit 2, one line)."""
    from fastpipe.format import read_pipeline
    from fastpipe.runtime.binding.device_map import resolve_device_map
    from fastpipe.runtime.passes.fuse import check_fuse_for_dist
    from fastpipe.validate import validate_structure

    device_map = device_map_of(args)
    for path, opt in ((args.outputs, "--outputs"), (args.trace, "--trace")):
        if path:
            check_writable(path, opt)
    for path, opt in ((args.inputs, "--inputs"), (args.check, "--check")):
        if path and not os.path.isfile(path):
            raise InputError(f"{opt}: expected a safetensors file, found no file \"{path}\"")
    p = read_pipeline(args.pipeline)
    validate_structure(p)
    resolve_device_map(p, device_map)
    check_slot_ranks(parse_slot_ranks_option(args.slot_ranks) if args.slot_ranks else None, p.devices, world, "--slot-ranks")
    load_options(args)
    check_fuse_for_dist(args.fuse)
    if args.inputs:
        read_local_inputs(args.inputs, p, ())      # names only: no tensor data is read here


def read_local_inputs(path: str, p, names, chunks: int = 1) -> dict[str, torch.Tensor]:
    """Open the --inputs file; check its names against the pipeline's; read only `names`, and what those
    the file lacks are sliced from (fastpipe.model_io.complete_inputs: through the metadata; `chunks`
    batches along dim 0)."""
    from safetensors import safe_open

    from fastpipe.model_io import complete_inputs, input_sources

    with reading_safetensors(path, "--inputs"), safe_open(path, framework="pt") as f:
        keys = list(f.keys())
        for k in keys:
            if k not in p.input_names and k not in p.metadata.tensors_inputs:
                raise InputError(f"inputs[\"{k}\"]: expected one of the pipeline inputs ({', '.join(p.input_names)}), "
                                 "found an unknown name")
        sources = input_sources(p, keys)      # every pipeline input: in the file, or derived from what is
        read = {k for k in names if k in keys} | {sources[k] for k in names if k in sources}
        got = complete_inputs(p, {k: f.get_tensor(k) for k in read}, names=names, chunks=chunks)
        return {k: got[k] for k in names}


def _rank_main(args, rank: int) -> int:
    """One rank of `fastpipe run`: load this rank's slots, run with the others, rank 0 reports and writes."""
    import statistics
    import time

    from fastpipe.format import read_pipeline
    from fastpipe.random_inputs import random_inputs
    from fastpipe.session import Session

    lead = rank == 0
    device_map = device_map_of(args)
    if lead and args.outputs:
        check_writable(args.outputs, "--outputs")
    if lead and args.trace:
        check_writable(args.trace, "--trace")
    p = read_pipeline(args.pipeline)
    world = env_world()[1]
    slot_ranks = (check_slot_ranks(parse_slot_ranks_option(args.slot_ranks), p.devices, world, "--slot-ranks")
                  if args.slot_ranks else check_slot_ranks(None, p.devices, world, "--slot-ranks"))
    t0 = time.perf_counter()
    sess = Session(p, device_map=device_map, load_options=load_options(args),
                   run_options=run_options(args, processor="dist", slot_ranks=slot_ranks, dist_timeout=args.dist_timeout))
    load_s = time.perf_counter() - t0
    runner = sess.runner
    if args.inputs:
        inputs = read_local_inputs(args.inputs, p, runner.needed_inputs, args.chunks)
    else:
        inputs = {k: v for k, v in random_inputs(p, args.seed, bounds=sess.index_bounds).items()
                  if k in runner.needed_inputs}
        if args.chunks > 1:
            inputs = repeat_chunks(inputs, args.chunks)
    expected = read_tensors(args.check, "--check") if lead and args.check else None
    compile_msg = ""
    if sess.compiles:                 # every rank compiles at warm-up, together (no tiering across ranks)
        rep = sess.compile()
        compile_msg = (f"; compiled {rep.graphs} graphs on rank 0 in {rep.seconds:.1f} s"
                       + (f" ({len(rep.eager)} eager)" if rep.eager else ""))
    for _ in range(args.warmup):
        sess.run(inputs, chunks=args.chunks)
    times, outs = [], None
    cuda = any(d.type == "cuda" for d in sess.slot_devices.values())
    for i in range(args.repeat):
        t = time.perf_counter()
        outs = sess.run(inputs, chunks=args.chunks, trace=args.trace if args.trace and i == args.repeat - 1 else None)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    if not lead:
        runner.close()
        return 0
    plan = sess.runner.plan
    ms = sorted(x * 1e3 for x in times)
    print(f"{p.name}: dist processor, {plan.world} ranks ({plan.backend}); loaded in {load_s * 1e3:.1f} ms{compile_msg}; "
          f"{args.repeat} runs: median {statistics.median(ms):.3f} ms, min {ms[0]:.3f} ms, max {ms[-1]:.3f} ms")
    try:
        return report_results(args, outs, expected)
    finally:
        runner.close()

