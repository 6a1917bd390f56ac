"""bench.sigint.stop_on_sigint: a bench script started with SIGINT ignored (a background job without job control,
as a gpu_check stage may be) still stops at SIGINT, and so does a child it starts afterwards."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD = "import time; print('child up', flush=True); time.sleep(60)"


def _script(install: bool) -> str:
    return textwrap.dedent(f"""
        import subprocess, sys, time
        from bench.sigint import stop_on_sigint
        if {install}:
            stop_on_sigint()
        child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE, text=True)
        child.stdout.readline()
        try:                                   # before "up": the signal may come at once
            print("up", child.pid, flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            print("child", child.wait(timeout=30), flush=True)
    """)


@pytest.mark.parametrize("install", [True, False])
def test_sigint_stops_a_script_started_with_it_ignored_and_its_children(install):
    proc = subprocess.Popen([sys.executable, "-c", _script(install)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN), start_new_session=True)
    try:
        line = proc.stdout.readline().split()
        assert line[0] == "up", line
        os.killpg(proc.pid, signal.SIGINT)          # as timeout -s INT signals its whole process group
        if install:
            out = proc.communicate(timeout=30)[0]
            assert "interrupted" in out and "child -2" in out, out   # the child died of SIGINT too
        else:                                       # the control: ignored, both sleep on
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
