"""One generation request as its callers see it: a stream of tokens that any thread may read, any number of times.

    req = engine.submit([5, 7, 9], max_new_tokens=16)
    for token in req: ...            # the tokens as they are made; each iterator gets the whole stream
    req.result(timeout=10)           # all of them once finished (TimeoutError: still running, unchanged)
    req.cancel()
    req.on_change(callback)          # callback() after each token and at the end (an async bridge's hook)

Every iterator starts at the first token and ends when the request finishes (raising what failed it,
if it failed): iterators in several threads each see every token; iterating a finished request yields
its tokens at once. The engine's worker is the only writer (`_emit`, `_finish`); once finished, a
request takes no more tokens, so a request ended from another thread (a close that timed out) keeps
what it had.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator

from fastpipe.serving.sampling import SamplingParams

@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    eos: frozenset
    tokens: list[int] = field(default_factory=list)       # appended by the engine only
    finish_reason: str | None = None                      # "eos", "length", "cancelled" or "error" once finished
    error: BaseException | None = None
    _changed: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _cancel: bool = False
    _listeners: list = field(default_factory=list, repr=False)

    def __iter__(self) -> Iterator[int]:
        i = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: len(self.tokens) > i or self.finish_reason is not None)
                new, finished = self.tokens[i:], self.finish_reason is not None
            yield from new
            i += len(new)
            if finished and i == len(self.tokens):
                if self.error is not None:
                    raise self.error
                return

    def result(self, timeout: float | None = None) -> list[int]:
        """All tokens, once the request is finished (raises what failed it; TimeoutError if it is still
        running after `timeout` seconds: the request goes on)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.finish_reason is not None, timeout):
                raise TimeoutError(f"request {self.id}: expected it finished within {timeout} s, found it "
                                   f"running ({len(self.tokens)} of {self.max_new_tokens} tokens)")
            tokens = list(self.tokens)
        if self.error is not None:
            raise self.error
        return tokens

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Stop at the engine's next step (finish_reason "cancelled"; the tokens made so far stay)."""
        self._cancel = True

    def since(self, start: int) -> tuple[list[int], bool]:
        """(the tokens from index `start` on, whether the request is finished), read together."""
        with self._changed:
            return self.tokens[start:], self.finish_reason is not None

    def on_change(self, callback) -> None:
        """Call callback() (no arguments, from the engine's worker) after each token this request gets and
        once it finishes; at once when it has tokens or is finished already. It must be quick and must not
        raise (a server hands it to its event loop: loop.call_soon_threadsafe); one that raises is dropped."""
        with self._changed:
            self._listeners.append(callback)
            now = bool(self.tokens) or self.finish_reason is not None
        if now:
            self._tell(callback)

    def _tell(self, callback) -> None:
        try:
            callback()
        except Exception:  # noqa: BLE001 - a listener gone (its event loop closed) must not fail the engine
            with self._changed:
                if callback in self._listeners:
                    self._listeners.remove(callback)

    def _notify(self) -> None:
        if self._listeners:                   # every token of every request passes here
            for callback in list(self._listeners):
                self._tell(callback)

    # the engine's side
    def _emit(self, token: int) -> bool:
        """Append a token; False (nothing appended) once the request is finished."""
        with self._changed:
            if self.finish_reason is not None:
                return False
            self.tokens.append(token)
            self._changed.notify_all()
        self._notify()
        return True

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        """End the request (the first reason given stays)."""
        with self._changed:
            if self.finish_reason is not None:
                return
            self.finish_reason, self.error = reason, error
            self._changed.notify_all()
        self._notify()
