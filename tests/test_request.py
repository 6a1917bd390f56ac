"""A Request is read from any thread, any number of times: each iterator gets the whole stream, a finished
request's tokens come at once, result(timeout=) times out and leaves the request running."""
import threading

import pytest

from fastpipe.errors import RunError
from fastpipe.serving.request import Request
from fastpipe.serving.sampling import SamplingParams


def _request() -> Request:
    return Request(7, [1, 2], 6, SamplingParams(), frozenset())


def _read_in_thread(fn, timeout=10.0):
    """fn() in a daemon thread: (finished?, its value or exception)."""
    out = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), (out[0] if out else None)


def test_every_iterator_gets_the_whole_stream_from_any_thread():
    req = _request()
    got: dict[int, list[int]] = {}
    started = threading.Barrier(5)

    def reader(i):
        started.wait()
        got[i] = list(req)
    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    started.wait()
    for tok in range(6):
        assert req._emit(tok)
    req._finish("length")
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert got == {i: [0, 1, 2, 3, 4, 5] for i in range(4)}


def test_a_finished_request_iterates_again_at_once():
    req = _request()
    for tok in (4, 5):
        req._emit(tok)
    first = iter(req)
    assert next(first) == 4                        # an iterator part-way through ...
    req._finish("eos")
    assert list(first) == [5]                      # ... ends with the rest
    for _ in range(2):
        finished, value = _read_in_thread(lambda: list(req), timeout=5)
        assert finished and value == [4, 5]
    assert req.result(timeout=0) == [4, 5] and req.done


def test_a_failed_request_gives_its_tokens_then_its_error_to_every_reader():
    req = _request()
    req._emit(3)
    req._finish("error", RunError("generation step: RuntimeError: device lost"))
    for _ in range(2):
        seen = []
        with pytest.raises(RunError, match="device lost"):
            for tok in req:
                seen.append(tok)
        assert seen == [3]
    with pytest.raises(RunError, match="device lost"):
        req.result()


def test_result_times_out_cleanly_and_the_request_goes_on():
    req = _request()
    req._emit(9)
    with pytest.raises(TimeoutError, match=r"^request 7: expected it finished within 0.05 s, found it running "
                                           r"\(1 of 6 tokens\)$"):
        req.result(timeout=0.05)
    assert not req.done and req._emit(8)
    req._finish("length")
    assert req.result(timeout=0) == [9, 8]


def test_a_finished_request_takes_no_more_tokens_and_keeps_its_first_reason():
    req = _request()
    req._emit(1)
    req._finish("cancelled")
    assert not req._emit(2)                        # the worker's late token after a close that timed out
    req._finish("error", RunError("late"))
    assert req.tokens == [1] and req.finish_reason == "cancelled" and req.error is None
