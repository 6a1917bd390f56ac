"""Ctrl-C, or scripts/gpu_check.sh's SIGINT at a stage's limit, stops a bench script even where it started with
SIGINT ignored.

    if __name__ == "__main__":
        stop_on_sigint()
        sys.exit(main())
    ...
    if interrupted(): ...      # a SIGINT came (even if something below swallowed its KeyboardInterrupt)

A process started as a background job without job control inherits SIGINT ignored, and Python leaves an ignored
SIGINT ignored: the script would run on until the stage's SIGKILL, 20 s later, and a child it starts (fastpipe
tune) would ignore it too. With this handler installed, SIGINT raises KeyboardInterrupt, as Python's own does,
and is remembered, so a loop can stop at its next step where torch swallowed the exception; children started
after it get SIGINT's default action back (exec resets a handled signal, not an ignored one).
"""
from __future__ import annotations

import signal

_SEEN: list[int] = []


def _on_sigint(signum, frame) -> None:
    _SEEN.append(signum)
    raise KeyboardInterrupt


def stop_on_sigint():
    """Install the handler (forgetting earlier signals); returns the handler it replaced."""
    _SEEN.clear()
    return signal.signal(signal.SIGINT, _on_sigint)


def interrupted() -> bool:
    """Whether a SIGINT came since stop_on_sigint()."""
    return bool(_SEEN)
