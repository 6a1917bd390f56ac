"""`fastpipe run` in one process: load, compile, time, write and check the outputs."""
from __future__ import annotations

import statistics
import time

from fastpipe.cli.common import (check_counts, check_writable, device_map_of, load_options, read_tensors, report_results,
                                 run_options)
from fastpipe.errors import InputError


def _settle(sess, inputs, chunks: int, max_calls: int = 16) -> str:
    """Tiered compiles (RunOptions.compile "background"): wait for the background compiles the first runs
    queued, then run until each has been measured against eager and settled (a few calls), so that the
    timed runs measure what stays. Returns what that took, for the summary line ("" when nothing compiled)."""
    t = time.perf_counter()
    for _ in range(max_calls):
        if sess.compile_settled():
            break
        sess.wait_compiled()
        sess.run(inputs, chunks=chunks)
    if not sess.compiled_graphs() or all(cg.skipped for cg in sess.compiled_graphs().values()):
        return ""
    return f"; compiled in the background, settled after {time.perf_counter() - t:.1f} s more"


def cmd_run(args) -> int:
    import torch

    from fastpipe.cli import dist
    from fastpipe.format import read_pipeline
    from fastpipe.model_io import complete_inputs
    from fastpipe.random_inputs import random_inputs
    from fastpipe.runtime.binding.microbatch import repeat_chunks
    from fastpipe.session import Session

    if dist.wants_dist(args):      # multi-process: torchrun-launched, --nproc or --processor dist
        for option in ("state_in", "state_out"):
            if getattr(args, option, None):
                raise InputError(f"--{option.replace('_', '-')}: expected a one-process run, found a distributed one "
                                 "(each rank's caller keeps its own state)")
        return dist.cli_run(args)
    if not 0 <= args.seed < 2**63:
        raise InputError(f"--seed: expected 0 <= seed < 2**63, found {args.seed}")
    check_counts(args)
    device_map = device_map_of(args)
    if args.outputs:
        check_writable(args.outputs, "--outputs")
    if args.state_out:
        check_writable(args.state_out, "--state-out")
    p = read_pipeline(args.pipeline)
    given = read_tensors(args.inputs, "--inputs") if args.inputs else None
    state_in = read_tensors(args.state_in, "--state-in") if args.state_in else None
    expected = read_tensors(args.check, "--check") if args.check else None
    if args.trace:
        check_writable(args.trace, "--trace")
    t0 = time.perf_counter()
    sess = Session(p, device_map=device_map, load_options=load_options(args), run_options=run_options(args))
    load_s = time.perf_counter() - t0
    # pipeline inputs the file lacks, sliced through the metadata from the model input it holds (once the
    # pipeline is known valid: it names its inputs)
    written = sess.written_inputs
    if state_in is not None:
        given = dict(random_inputs(p, args.seed, bounds=sess.index_bounds) if given is None else given)
        given = _with_state(p, given, state_in, written, args.state_in)
    inputs = complete_inputs(p, given, chunks=args.chunks, views=written) if given is not None else None
    if inputs is None:   # integer inputs used as indices stay below the size of what they index (from its graphs)
        inputs = random_inputs(p, args.seed, bounds=sess.index_bounds)
        if args.chunks > 1:
            inputs = repeat_chunks(inputs, args.chunks)
    if args.state_out and not written:
        raise InputError(f"--state-out: expected a pipeline whose graphs write inputs in place, found none in {args.pipeline}")
    compile_msg = ""
    if sess.run_options.compile == "wait":         # benchmarks: compile at warm-up, before any timed run
        rep = sess.compile()
        compile_msg = f"; compiled {rep.graphs} graph{'s' if rep.graphs != 1 else ''} in {rep.seconds:.1f} s" + (f" ({len(rep.eager)} eager)" if rep.eager else "")
    t = time.perf_counter()
    outs = first = sess.run(inputs, chunks=args.chunks)
    first_s = time.perf_counter() - t
    if written:          # the first run is the one asked for; the rest (settling, timing) write into copies
        if args.state_out:
            _write_state(p, {n: inputs[n] for n in written}, args.state_out)
        inputs = {n: (t.clone() if n in written else t) for n, t in inputs.items()}
    if sess.background:                            # tiered: time the steady state, once every compile settled
        compile_msg = _settle(sess, inputs, args.chunks)
    for _ in range(args.warmup):
        sess.run(inputs, chunks=args.chunks)
    times = []
    for i in range(args.repeat):
        t = time.perf_counter()
        outs = sess.run(inputs, chunks=args.chunks, trace=args.trace if args.trace and i == args.repeat - 1 else None)
        for dev in {d for d in sess.slot_devices.values() if d.type == "cuda"}:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    ms = sorted(x * 1e3 for x in times)
    timed = (f"{args.repeat} runs: median {statistics.median(ms):.3f} ms, min {ms[0]:.3f} ms, max {ms[-1]:.3f} ms"
             if ms else "no timed runs")
    print(f"{p.name}: {sess.describe()}; loaded in {load_s * 1e3:.1f} ms{compile_msg}; first run {first_s * 1e3:.1f} ms; "
          f"{timed}")
    for d in sess.fusion:              # what the fusion policy (--fuse) did with each candidate group, and why
        print("fusion: " + d.line())
    memory = sess.memory_report()
    if any("measured_peak_bytes" in r for r in memory.values()):   # measured peak GPU memory beside the plan's
        from fastpipe.runtime.cuda.stream_issue import format_memory_report

        for line in format_memory_report(memory):
            print(f"memory: {line}")
    if args.state_out:
        print(f"wrote {len(written)} inputs written in place to {args.state_out}")
    return report_results(args, first if written else outs, expected)


def _with_state(p, given: dict, state: dict, written, path: str) -> dict:
    """`given` with the --state-in tensors over it; each must name an input the graphs write in place (a
    pipeline input's name, or the model input it holds whole)."""
    from fastpipe.model_io import state_keys

    keys = state_keys(p, written)
    allowed = set(written) | set(keys.values())
    for name in state:
        if name not in allowed:
            raise InputError(f"--state-in: {path}: expected tensors of inputs the graphs write in place "
                             f"({', '.join(sorted(allowed)) or 'none'}), found \"{name}\"")
    # a state tensor given under its model input's name replaces the pipeline input it fills (--inputs may hold it)
    replaced = {n for n, k in keys.items() if k in state and k != n}
    return {**{k: v for k, v in given.items() if k not in replaced}, **state}


def _write_state(p, tensors: dict, path: str) -> None:
    from safetensors.torch import save_file

    from fastpipe.atomic import atomic_path
    from fastpipe.model_io import state_keys

    keys = state_keys(p, tensors)
    with atomic_path(path) as tmp:
        save_file({keys[n]: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(tmp))


