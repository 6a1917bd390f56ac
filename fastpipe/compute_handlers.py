"""A public hook for compute supertask kinds fastpipe cannot run itself (`dfg`, `edf`).

A handler is called once per supertask at load time:
``handler(supertask_id, supertask, payload) -> fn`` where
``fn(list[Tensor]) -> list[Tensor]`` computes the supertask's outputs from its
inputs. ``payload`` is the inline `data` string, or the bytes of the side file
`<blob-id>.<kind>` when the blob is null (the producer saves an edf blob as
`<blob-id>.edf`). Without a registered handler a `dfg` or `edf` supertask is refused.
"""
from __future__ import annotations

from typing import Callable

_HANDLERS: dict[str, Callable] = {}


def register_compute_handler(kind: str, handler: Callable) -> None:
    if kind == "fx":
        raise ValueError("fx supertasks are run by fastpipe itself; register handlers for other kinds (dfg, edf)")
    _HANDLERS[kind] = handler


def unregister_compute_handler(kind: str) -> None:
    _HANDLERS.pop(kind, None)


def compute_handler(kind: str) -> Callable | None:
    return _HANDLERS.get(kind)


def required_handler(kind: str, sid: str) -> Callable:
    """The handler for an NPU-graph supertask, or the one-line refusal naming the field."""
    from fastpipe.errors import PayloadError, key_path

    handler = _HANDLERS.get(kind)
    if handler is None:
        raise PayloadError(f"{key_path('supertasks', sid)}.kind: expected a kind fastpipe can run (fx), found {kind} "
                           f"(an NPU compiler graph; register a handler with fastpipe.register_compute_handler(\"{kind}\", ...))")
    return handler
