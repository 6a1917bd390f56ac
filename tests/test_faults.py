"""Faults at run time: a supertask raising (a registered test op), out-of-memory, Ctrl-C.
The error names the supertask and slot, the session stays usable, no thread is left behind."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import fastpipe
from fastpipe.builder.assemble import Assembler
from fastpipe.errors import RunError
from fastpipe.payload import allow_namespace, disallow_namespace
from tests.examples import ROOT

# a registered test op: fails on demand (x[0] < 0 -> ValueError, x[0] > 1e6 -> out of memory), else x + 1
@torch.library.custom_op("fastpipe_faults::maybe_fail", mutates_args=())
def maybe_fail(x: torch.Tensor) -> torch.Tensor:
    v = float(x.flatten()[0])
    if v < 0:
        raise ValueError("the test op was asked to fail")
    if v > 1e6:
        raise torch.OutOfMemoryError("simulated: tried to allocate 80.00 GiB")
    if 100 <= v < 1000:
        time.sleep(0.05)                       # a slow step, for interrupting
    return x + 1


@maybe_fail.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.fixture(autouse=True, scope="module")
def _allow_test_namespace():
    """Payloads may call the test op only while these tests run (the allow-list is process-wide)."""
    allow_namespace("fastpipe_faults")
    yield
    disallow_namespace("fastpipe_faults")


def chain(tmp_path, n=4, slots=2):
    """n supertasks alternating over `slots` slots (send/recv between), each applying the test op."""
    a = Assembler("faults")
    for s in range(slots):
        a.slot(str(s), f"cpu:{s}")
    a.input("x0", (4,), "f32")
    cur, slot = "x0", "0"
    for i in range(n):
        s = str(i % slots)
        if s != slot:
            a.send_recv(f"p{i}", slot, cur, s, f"r{i}")
            cur, slot = f"r{i}", s
        a.fx(s, lambda x: torch.ops.fastpipe_faults.maybe_fail(x), [cur], [f"x{i + 1}"])
        cur = f"x{i + 1}"
    a.output([cur])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(a.to_json()))
    return path, cur


@pytest.mark.parametrize("processor", ["reference", "cpu"])
def test_raising_supertask_names_supertask_and_slot(tmp_path, processor):
    path, out = chain(tmp_path)
    sess = fastpipe.load(path, processor=processor)
    before = threading.active_count()
    with pytest.raises(RunError, match=r'^supertasks\["\d+"\] on slot "0": failed: ValueError: the test op was asked to fail$'):
        sess.run({"x0": torch.full((4,), -5.0)})
    assert threading.active_count() == before
    torch.testing.assert_close(sess.run({"x0": torch.zeros(4)})[out], torch.full((4,), 4.0))   # still usable


@pytest.mark.parametrize("processor", ["reference", "cpu"])
def test_out_of_memory_is_reported_with_its_step(tmp_path, processor):
    path, out = chain(tmp_path)
    sess = fastpipe.load(path, processor=processor)
    with pytest.raises(RunError, match=r'^supertasks\["\d+"\] on slot "0": failed: OutOfMemoryError: simulated: tried to allocate 80.00 GiB$'):
        sess.run({"x0": torch.full((4,), 2e6)})
    assert sess.run({"x0": torch.ones(4)})[out].tolist() == [5.0] * 4


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt here, as in a terminal, also where the suite was started with SIGINT
    ignored (a shell's background job: Python then installs no handler, and a real Ctrl-C does nothing)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("processor", ["reference", "cpu"])
def test_ctrl_c_stops_every_slot(tmp_path, processor, ctrl_c_raises):
    path, out = chain(tmp_path, n=40)
    sess = fastpipe.load(path, processor=processor)
    before = threading.active_count()
    timer = threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGINT))   # a real Ctrl-C
    timer.start()
    t = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        sess.run({"x0": torch.full((4,), 100.0)})          # 40 slow steps: ~2 s uninterrupted
    assert time.perf_counter() - t < 1.5
    timer.join()
    assert threading.active_count() == before
    assert sess.run({"x0": torch.zeros(4)})[out].tolist() == [40.0] * 4


def test_cli_ctrl_c_exits_130_without_traceback_or_output(tmp_path):
    path, _ = chain(tmp_path, n=40)
    from safetensors.torch import save_file

    save_file({"x0": torch.full((4,), 100.0)}, str(tmp_path / "in.safetensors"))
    # SIGINT's default action restored first: the child of a suite started with SIGINT ignored inherits that
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "import sys, torch; sys.path.insert(0, %r); import tests.test_faults; "
            "from fastpipe.payload import allow_namespace; allow_namespace('fastpipe_faults'); "
            "from fastpipe.cli import main; sys.exit(main(sys.argv[1:]))") % str(ROOT)
    proc = subprocess.Popen([sys.executable, "-c", code, "run", str(path), "--inputs", str(tmp_path / "in.safetensors"),
                             "--outputs", str(tmp_path / "out.safetensors"), "--no-compile", "--processor", "cpu",
                             "--repeat", "50"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    time.sleep(6)                                             # imports + load, then well inside the timed runs
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "fastpipe: interrupted" and "Traceback" not in err
    assert not (tmp_path / "out.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.safetensors")]
