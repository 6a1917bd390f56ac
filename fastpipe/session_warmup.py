"""A session's warm-up, off the request path: compile, tune, capture (Session.compile, .capture, .wait_compiled).

    report = session.compile()        # one warm-up run on seeded inputs: compiles, tunes, captures
    session.capture(inputs)           # the run's CUDA graph, on these inputs' buffers
    session.wait_compiled(timeout)    # tiered: until the background compiler has done this session's graphs

Each is a Session method; the processor does the work (Processor.compiled_graphs, tune, capture).
"""
from __future__ import annotations

import time
from typing import Mapping

import torch


def compile(session, inputs: Mapping[str, torch.Tensor] | None = None, *, capture: bool = True):
    """Warm up now, off the request path: compile every fx supertask (region processor: every region)
    in one warm-up run on seeded inputs, timed apart from runs, then capture the run's CUDA graph
    (region and cuda processors on one GPU with cuda_graph=True), so that the first run() is already a
    replay. The processor then tunes (the region processor keeps, per CPU region, the faster of the
    compiled graph and the stitched graph run eagerly; describe() says).
    `inputs`: what to capture on (default: the seeded inputs), never run by compile(): a server
    passes its own state tensors (an engine's KV caches) so they become the graph's buffers.
    capture=False: warm up only (the second run captures, on what it is given).
    With compile="background" it does the same now: the warm-up run decides (the estimate) at once,
    and what it queues compiles in this thread (or is waited for, if the background thread has it).

    Returns a CompileReport (distinct graphs, seconds, supertasks left eager by a failed compile).
    """
    from fastpipe.runtime.compiling.compile import CompileReport, warmup_inputs

    t = time.perf_counter()
    session.compile_report = CompileReport(0, 0.0, ())      # mark as started: run() must not recurse
    warm = warmup_inputs(session.pipeline)
    proc = session.runner
    graphs = {id(c): c for c in proc.compiled_graphs().values()}.values()
    if session.background:              # tiered: the warm-up run decides (estimate) and queues at once
        for cg in graphs:
            cg.decide_now = True
    session.run(warm)
    if session.background:              # ... and the compile happens here (or is waited for), not beside
        for cg in graphs:
            cg.finish()
    proc.tune(warm)                     # compiled or eager, whichever is faster (where the processor chooses)
    if capture:
        _capture(session, warm if inputs is None else inputs, given=inputs is not None)
    compiled = proc.compiled_graphs()
    eager = tuple(sid for sid, cg in compiled.items() if cg.eager)
    session.compile_report = CompileReport(len({id(cg) for cg in compiled.values()}), time.perf_counter() - t, eager)
    return session.compile_report


def capture(session, inputs: Mapping[str, torch.Tensor] | None = None) -> bool:
    """Capture the run's CUDA graph now, so that the next run() replays it: compile() when this
    session has not warmed up yet (it captures), else a capture on `inputs` (one run's inputs; their
    state tensors become the graph's buffers), unless the graph held already has those buffers
    (inputs=None: any graph held). The capture runs nothing. Returns whether a graph is held: False
    where the processor replays none (reference, cpu, dist; several GPUs; cuda_graph=False) or after a
    failed capture (compile_policy "warn": a RuntimeWarning with the reason; "raise": CompileError)."""
    replays = session.runner.graph_replays()
    if session.compile_report is None:
        session.compile(inputs)
        return any(r.replaying for r in replays)
    if inputs is None:
        if any(r.replaying for r in replays):
            return True
        from fastpipe.runtime.compiling.compile import warmup_inputs

        return _capture(session, warmup_inputs(session.pipeline))
    return _capture(session, inputs, given=True)


def _capture(session, inputs, *, given: bool = False) -> bool:
    """The processor captures on `inputs` (checked first when the caller gave them)."""
    proc = session.runner
    if not proc.graph_replays():
        return False
    if given:
        from fastpipe.runtime.binding.inputs import check_inputs

        check_inputs(session.pipeline, inputs, session.program.input_devices())
        if proc.prepared.state:
            from fastpipe.runtime.binding.state import check_state_inputs

            check_state_inputs(inputs, proc.prepared.state)
    return proc.capture(inputs)


def wait_compiled(session, timeout: float | None = None) -> bool:
    """Tiered compiles: block until the background compiler has compiled every graph this session has
    queued (not until each is measured: that takes real calls). True when none is left pending."""
    from fastpipe.runtime.compiling.background_compile import background

    end = None if timeout is None else time.monotonic() + timeout
    for cg in session.compiled_graphs().values():
        while cg.stage == "compiling":
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            background().wait_idle(0.05 if left is None else min(0.05, left))
    return True
