"""Tiered compiles (RunOptions.compile="background"): eager at once, compiled in the background, swapped in
between calls once ready and measured faster; the estimate that skips what cannot pay; the one-compile-at-
a-time background thread, busiest first; CUDA-graph capture held back until every compile settled.

The compiled graphs here are small chains of pointwise ops on CPU (a compile of a few seconds, cached on
disk after the first), and most tests replace the compiled function by a plain Python one: what is
tested is when it is called, from where, and what the caller gets.
"""
from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

import fastpipe
from fastpipe.errors import CompileError
from fastpipe.runtime.compiling import compile as compile_mod
from fastpipe.runtime.compiling import compile_estimate
from fastpipe.runtime.compiling.background_compile import BackgroundCompiler, background
from fastpipe.runtime.compiling.compile import MEASURED_CALLS, CompiledGraph


class _Chain(torch.nn.Module):
    """y = a chain of `n` pointwise ops on x (sin, mul, add): compile fuses it into one loop."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x):
        for i in range(self.n):
            x = torch.sin(x) * 1.01 + 0.1 if i % 2 else torch.cos(x) - 0.2
        return (x,)


def _gm(n: int) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(_Chain(n))


def _eager_ref(n: int, x: torch.Tensor) -> torch.Tensor:
    return _Chain(n)(x.clone())[0]


@pytest.fixture
def worth(monkeypatch):
    """Every graph is worth compiling (the estimate is tested on its own)."""
    monkeypatch.setattr(compile_estimate, "not_worth_compiling", lambda gm, n_args, out_bytes: None)


def _spy_fn(cg: CompiledGraph, *, delay: float = 0.0, fail: Exception | None = None) -> dict:
    """Replace cg's compiled function by the eager graph plus bookkeeping: calls, threads, most at once."""
    seen = {"calls": 0, "threads": [], "active": 0, "most": 0}
    lock = threading.Lock()
    eager = cg.gm

    def fn(*xs):
        cg._variants[0] += 1                       # as inductor's backend counts a compile
        with lock:
            seen["calls"] += 1
            seen["threads"].append(threading.current_thread().name)
            seen["active"] += 1
            seen["most"] = max(seen["most"], seen["active"])
        try:
            time.sleep(delay)
            if fail is not None:
                raise fail
            return eager(*xs)
        finally:
            with lock:
                seen["active"] -= 1

    cg.fn = fn
    return seen


# ---------------------------------------------------------------------------------------------- estimate
def test_estimate_counts_fusable_ops_not_matmuls_or_views():
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    mm = g.call_function(torch.ops.aten.mm.default, (x, w))
    v = g.call_function(torch.ops.aten.view.default, (mm, [-1]))
    r = g.call_function(torch.ops.aten.relu.default, (v,))
    s = g.call_function(torch.ops.aten.add.Tensor, (r, 1))
    g.output((s,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert compile_estimate.fusable_ops(gm) == 2
    assert compile_estimate.not_worth_compiling(_gm(0), 1, 1024) == "nothing to fuse (matmuls and views only)"


def test_estimate_skips_a_few_small_ops_and_keeps_many_or_large_ones():
    few = compile_estimate.not_worth_compiling(_gm(4), 2, 1024)       # 4 x (op, op[, op]): about 10 ops
    assert few is not None and "fusable ops would save" in few and "a compiled call costs" in few
    assert compile_estimate.not_worth_compiling(_gm(60), 2, 1024) is None        # dispatch of ~150 ops
    assert compile_estimate.not_worth_compiling(_gm(4), 2, 64 << 20) is None     # 64 MiB intermediates: traffic


def test_readme_example_runs_eagerly_without_a_compile():
    """The README's main job: 11 fusable ops on [8, 64] tensors; a compiled call cannot pay, so nothing
    is queued and describe() says why."""
    from safetensors.torch import load_file

    s = fastpipe.load("graphs/tp_mlp/pipeline.json")
    assert s.processor == "region" and s.run_options.compile == "background"
    x = load_file("graphs/tp_mlp/inputs.safetensors")
    for _ in range(3):
        out = s.run(x)
    (cg,) = s.runner.compiled_graphs().values()
    assert cg.skipped is not None and not cg._queued and cg.use_eager and not cg.compiled, (cg.state(), cg.calls)
    assert "eager, one call (not compiled: 11 fusable ops would save" in s.describe()
    assert s.compile_settled() and s.compile_state() == "1 skipped (cannot pay)"
    torch.testing.assert_close(out["y"], load_file("graphs/tp_mlp/expected.safetensors")["y"], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- tiering
def test_eager_until_compiled_then_measured_and_the_faster_kept(worth):
    cg = CompiledGraph(_gm(6), "test chain", "warn", background=True, device="cpu")
    seen = _spy_fn(cg, delay=0.3)                 # the background compile takes 0.3 s
    x = torch.randn(16)
    ref = _eager_ref(6, x)
    assert cg.state() == "eager, one call (whether to compile is decided at its second call)"
    for _ in range(2):                             # call 2 decides and queues
        torch.testing.assert_close(cg(x)[0], ref)
    assert cg._queued and cg.state() == "eager, one call, compiling in the background"
    torch.testing.assert_close(cg(x)[0], ref)     # still eager: the compile takes 0.3 s
    assert seen["threads"] in ([], ["fastpipe-compile"])    # never compiled on the caller's thread
    assert background().wait_idle(30)
    assert seen["threads"] == ["fastpipe-compile"]        # compiled on the background thread, once
    assert cg._ready and not cg.compiled and cg.state() == "compiled in the background, measuring against eager"
    for _ in range(2 * MEASURED_CALLS):
        torch.testing.assert_close(cg(x)[0], ref)
    assert seen["calls"] == 1 + MEASURED_CALLS     # alternated: half the measured calls ran compiled
    assert cg.compiled and cg.timing is not None and cg.measured_at == "on real calls"
    c, e = cg.timing
    assert cg.use_eager == (e < c)
    assert cg.state().startswith("compiled as one graph, but run eagerly (faster on real calls" if cg.use_eager
                                 else "compiled as one graph (faster on real calls")


def test_the_faster_is_kept_both_ways(worth):
    for slow_compiled in (True, False):
        cg = CompiledGraph(_gm(2), "test chain", "warn", background=True, device="cpu")
        seen = _spy_fn(cg)
        eager = cg.gm
        if slow_compiled:
            fn = cg.fn
            cg.fn = lambda *xs: (time.sleep(0.02), fn(*xs))[1]
        else:
            cg.gm = lambda *xs: (time.sleep(0.02), eager(*xs))[1]
        x = torch.randn(8)
        for _ in range(3):
            cg(x)
        assert background().wait_idle(30) and seen["calls"] == 1
        for _ in range(2 * MEASURED_CALLS):
            cg(x)
        assert cg.compiled and cg.use_eager is slow_compiled, cg.timing


def test_never_two_compiles_of_one_graph_at_once(worth):
    cg = CompiledGraph(_gm(2), "test chain", "warn", background=True, device="cpu")
    seen = _spy_fn(cg, delay=0.3)
    x = torch.randn(8)
    for _ in range(3):
        cg(x)                                      # queued at the third; the background thread starts on it
    finishers = [threading.Thread(target=cg.finish) for _ in range(3)]    # Session.compile()'s foreground waits
    for t in finishers:
        t.start()
    for t in finishers:
        t.join(30)
    assert background().wait_idle(30)
    assert seen["calls"] == 1 and seen["most"] == 1 and cg._ready


def _failed_in_the_background(policy: str):
    """A graph whose background compile failed (its failure not yet reported), and the input it ran on."""
    cg = CompiledGraph(_gm(2), "test chain", policy, background=True, device="cpu")
    _spy_fn(cg, fail=RuntimeError("inductor said no"))
    x = torch.randn(8)
    for _ in range(3):
        cg(x)
    assert background().wait_idle(30) and cg._failure is not None
    return cg, x


def test_a_failed_background_compile_warns_at_the_next_call_and_stays_eager(worth):
    cg, x = _failed_in_the_background("warn")
    with pytest.warns(RuntimeWarning, match=r"test chain: torch.compile failed \(RuntimeError: inductor said no\); "
                                            "running this supertask eagerly"):
        out = cg(x)
    torch.testing.assert_close(out[0], _eager_ref(2, x))
    assert cg.eager and cg.settled and cg.state() == "compile failed, eager"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cg(x)                                      # warned once


def test_a_failed_background_compile_raises_with_policy_raise(worth):
    cg, x = _failed_in_the_background("raise")
    with pytest.raises(CompileError, match="test chain: torch.compile failed: RuntimeError: inductor said no"):
        cg(x)


def test_a_real_background_compile_matches_eager():
    """No stand-ins: inductor compiles the chain on the background thread; the swapped-in graph's
    outputs equal the eager graph's, and under inference mode as the region processor calls it."""
    cg = CompiledGraph(_gm(40), "test chain", "warn", background=True, device="cpu")
    x = torch.randn(64, 64)
    ref = _eager_ref(40, x)
    with torch.inference_mode():
        for _ in range(3):
            cg(x)
        assert cg._queued and cg.skipped is None
        assert background().wait_idle(300) and cg._ready, cg.state()
        for _ in range(2 * MEASURED_CALLS):
            torch.testing.assert_close(cg(x)[0], ref, rtol=1e-5, atol=1e-5)
    assert cg.compiled and cg.compile_seconds > 0 and not cg._recompile_warned


# ---------------------------------------------------------------------------------------------- the thread
class _Job:
    def __init__(self, name: str, calls: int, log: list, gate: threading.Event | None = None):
        self.name, self.calls, self.log, self.gate = name, calls, log, gate

    def compile_in_background(self):
        if self.gate is not None:
            self.gate.wait(30)
        self.log.append(self.name)


def test_the_busiest_graph_compiles_first_and_dead_ones_are_dropped():
    bc, log, gate = BackgroundCompiler(), [], threading.Event()
    first = _Job("first", 0, log, gate)
    bc.submit(first)
    time.sleep(0.05)                               # the thread holds "first" until the gate opens
    quiet, busy, gone = _Job("quiet", 1, log), _Job("busy", 50, log), _Job("gone", 99, log)
    for j in (quiet, busy, gone):
        bc.submit(j)
    del j, gone                                    # its sessions closed: held weakly, dropped
    gate.set()
    assert bc.wait_idle(30)
    assert log == ["first", "busy", "quiet"]
    bc.shutdown()
    assert not bc.submit(_Job("late", 1, log))


def test_take_removes_a_queued_job():
    bc, log, gate = BackgroundCompiler(), [], threading.Event()
    first = _Job("first", 0, log, gate)            # held: the compiler holds its jobs weakly
    bc.submit(first)
    time.sleep(0.05)
    job = _Job("second", 1, log)
    bc.submit(job)
    assert bc.take(job) and not bc.take(job)
    gate.set()
    assert bc.wait_idle(30) and log == ["first"]
    bc.shutdown()


def test_compiled_calls_run_while_another_thread_fx_traces():
    """A compile traces with FX, whose "tracing now" flag is one global: once the background compiler has
    started, a compiled function called from any thread meanwhile still runs compiled (dynamo would
    otherwise refuse it: "Detected that you are using FX to symbolically trace ...")."""
    import torch.fx._symbolic_trace as fx_trace

    from fastpipe.torch_compat import compiled_calls_beside_fx_tracing

    compiled_calls_beside_fx_tracing()
    fn = torch.compile(lambda x: torch.sin(x) + 1, backend="eager", fullgraph=True)
    got = []
    old = fx_trace._is_fx_tracing_flag
    fx_trace._is_fx_tracing_flag = True            # what a compile's tracing does, in another thread
    try:
        t = threading.Thread(target=lambda: got.append(fn(torch.zeros(3))))
        t.start()
        t.join(60)
    finally:
        fx_trace._is_fx_tracing_flag = old
    assert len(got) == 1 and got[0].tolist() == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------------------- CUDA graphs
def test_no_capture_until_the_compiles_settle():
    """GraphReplay.ready holds the capture back: calls run fn until ready() is true; the first call after
    tries to capture (on a CPU it fails, with the policy's warning: proof that it was tried)."""
    from fastpipe.runtime.cuda.graph_replay import GraphReplay

    calls = []
    replay = GraphReplay(lambda inputs: calls.append(1) or {"y": inputs["x"] + 1}, torch.device("cpu"))
    settled = [False]
    replay.ready = lambda: settled[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            assert replay({"x": torch.ones(2)})["y"].tolist() == [2.0, 2.0]
    assert len(calls) == 4 and replay.failure is None
    settled[0] = True
    with pytest.warns(RuntimeWarning, match="CUDA-graph capture failed"):
        replay({"x": torch.ones(2)})
    assert replay.failure is not None


# ---------------------------------------------------------------------------------------------- options
def test_compile_modes_and_their_old_spellings():
    from fastpipe.errors import InputError
    from fastpipe.options import RunOptions

    assert RunOptions().compile == "background" and RunOptions().processor == "auto"
    assert RunOptions(compile=True).compile == "wait" and RunOptions(compile=False).compile == "off"
    with pytest.raises(InputError, match="compile: expected background, wait or off"):
        RunOptions(compile="later")


def test_load_defaults_to_the_cli_path_and_reference_is_explicit():
    s = fastpipe.load("graphs/tp_mlp/pipeline.json")
    assert (s.processor, s.run_options.compile, s.background) == ("region", "background", True)
    r = fastpipe.load("graphs/tp_mlp/pipeline.json", processor="reference", compile="off")
    assert r.processor == "reference" and not r.compiles and r.describe() == "reference processor"


def test_compile_off_never_queues(monkeypatch):
    monkeypatch.setattr(compile_mod.CompiledGraph, "_tiered", lambda *a: pytest.fail("tiered with compile off"))
    from safetensors.torch import load_file

    s = fastpipe.load("graphs/tp_mlp/pipeline.json", compile="off")
    x = load_file("graphs/tp_mlp/inputs.safetensors")
    for _ in range(3):
        s.run(x)
    assert s.runner.compiled_graphs() == {} and s.compile_state() == "compile off"


# ---------------------------------------------------------------------------------------------- exiting
def test_the_cli_does_not_wait_for_a_compile_in_the_background(monkeypatch):
    """`fastpipe ...` ends with os._exit when a background compile still runs (its result was an
    optimisation only), after flushing its output; with nothing compiling it exits normally."""
    import os
    import sys

    from fastpipe.runtime.compiling import background_compile

    import importlib

    cli_main = importlib.import_module("fastpipe.cli.main")   # the module (the attribute fastpipe.cli.main is the function)

    class Busy(BackgroundCompiler):
        def busy(self):
            return True

    busy = Busy()
    exits = []
    monkeypatch.setattr(background_compile, "_COMPILER", busy)
    monkeypatch.setattr(cli_main, "main", lambda: 0)
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code))
    with pytest.raises(SystemExit) as e:           # os._exit patched: entry() goes on to sys.exit
        cli_main.entry()
    assert exits == [0] and e.value.code == 0 and busy._closed
    monkeypatch.setattr(background_compile, "_COMPILER", BackgroundCompiler())
    with pytest.raises(SystemExit):
        cli_main.entry()
    assert exits == [0]
    assert "fastpipe.runtime.compiling.background_compile" in sys.modules
