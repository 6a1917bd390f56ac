"""A public hook for compute supertask kinds fastpipe cannot run itself (`dfg`).

A handler is called once per supertask at load time:
``handler(supertask_id, supertask, payload_text) -> fn`` where
``fn(list[Tensor]) -> list[Tensor]`` computes the supertask's outputs from its
inputs. Without a registered handler a `dfg` supertask is refused.
"""
from __future__ import annotations

from typing import Callable

_HANDLERS: dict[str, Callable] = {}


def register_compute_handler(kind: str, handler: Callable) -> None:
    if kind == "fx":
        raise ValueError("fx supertasks are run by fastpipe itself; register handlers for other kinds (e.g. dfg)")
    _HANDLERS[kind] = handler


def unregister_compute_handler(kind: str) -> None:
    _HANDLERS.pop(kind, None)


def compute_handler(kind: str) -> Callable | None:
    return _HANDLERS.get(kind)
