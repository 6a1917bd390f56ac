"""One thread per process compiles graphs for the tiered path: one compile at a time, busiest graph first.

    background().submit(job)    # queue job (held weakly); the thread starts on the first submit
    background().take(job)      # remove job from the queue (a foreground compile takes it over): bool
    background().wait_idle(t)   # until nothing is queued or compiling (tests, benchmarks): bool

A job is an object with `calls` (how often it has been called: its traffic; the thread picks the
queued job with the most, so a serving set's busiest bucket compiles first) and
`compile_in_background()` (fastpipe.runtime.compiling.compile.CompiledGraph). The job serialises its own
compiles (a lock), so a foreground compile of the same graph waits for this thread's, never runs
beside it. Jobs are held weakly: a graph whose sessions all closed is dropped from the queue.

FX's "tracing now" flag is process-global, and a compile traces with FX: so that compiled functions keep
running in other threads meanwhile, the first submit sets torch._dynamo.config.force_compile_during_fx_trace
(fastpipe.torch_compat.compiled_calls_beside_fx_tracing; older torch: error_on_nested_fx_trace=False, and a
compile that found the flag set, so compiled nothing, is queued again).

At interpreter exit the queue is emptied and no new job starts; a compile in progress is abandoned
with its daemon thread (its result was only ever an optimisation).
"""
from __future__ import annotations

import atexit
import logging
import threading
import weakref

log = logging.getLogger("fastpipe")


class BackgroundCompiler:
    def __init__(self):
        self._cond = threading.Condition()
        self._queue: list[weakref.ref] = []
        self._current = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, job) -> bool:
        """Queue `job`; False after shutdown (the caller keeps running eagerly)."""
        with self._cond:
            if self._closed:
                return False
            self._queue.append(weakref.ref(job))
            if self._thread is None or not self._thread.is_alive():
                from fastpipe.torch_compat import compiled_calls_beside_fx_tracing

                log.debug("fastpipe: background compiles: torch._dynamo.config.%s", compiled_calls_beside_fx_tracing())
                self._thread = threading.Thread(target=self._loop, name="fastpipe-compile", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def take(self, job) -> bool:
        """Remove `job` from the queue: True if it was queued (not yet started)."""
        with self._cond:
            for ref in self._queue:
                if ref() is job:
                    self._queue.remove(ref)
                    return True
            return False

    def busy(self) -> bool:
        with self._cond:
            return self._current is not None or any(ref() is not None for ref in self._queue)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or compiling; False if `timeout` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._current is None and not any(ref() is not None for ref in self._queue), timeout)

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()

    def _next(self):
        """The live queued job with the most calls (removed from the queue), or None after shutdown."""
        with self._cond:
            while True:
                self._queue = [ref for ref in self._queue if ref() is not None]
                if self._closed:
                    return None
                if self._queue:
                    jobs = [(ref, ref()) for ref in self._queue]
                    ref, job = max((p for p in jobs if p[1] is not None), key=lambda p: p[1].calls)
                    self._queue.remove(ref)
                    self._current = job
                    return job
                self._cond.wait()

    def _loop(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            try:
                job.compile_in_background()
            except BaseException:  # noqa: BLE001 - the job records its own failures; never kill the thread
                log.exception("fastpipe: background compile of %s failed unexpectedly", getattr(job, "where", job))
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()
                del job


_COMPILER = BackgroundCompiler()
atexit.register(_COMPILER.shutdown)


def background() -> BackgroundCompiler:
    """The process's background compiler."""
    return _COMPILER
