"""Ctrl-C, or scripts/gpu_check.sh's SIGINT at a stage's limit, stops a bench script even where it started with
SIGINT ignored.

    if __name__ == "__main__":
        stop_on_sigint()
        sys.exit(main())

A process started as a background job without job control inherits SIGINT ignored, and Python leaves an ignored
SIGINT ignored: the script would run on until the stage's SIGKILL, 20 s later, and a child it starts (fastpipe
tune) would ignore it too. With Python's handler installed, SIGINT raises KeyboardInterrupt, and children started
after it get SIGINT's default action back (exec resets a handled signal, not an ignored one).
"""
from __future__ import annotations

import signal


def stop_on_sigint() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
