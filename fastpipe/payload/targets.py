"""Which call targets a payload may name, and how they are resolved.

A target is ``torch.ops.<ns>.<op>.<overload>`` (identifiers only, no dunders)
with ``<ns>`` in the allow-list, resolving to an ``OpOverload`` (``fastpipe.torch_compat``);
the default overload of a registered foreign op (``fastpipe.payload.foreign_ops``: the producer's
``furiosa::sparse_select_v1_5`` and the like); or ``operator.getitem`` / ``_operator.getitem``.
Nothing else is looked up.
"""
from __future__ import annotations

import operator
import re
import threading

import torch

from fastpipe.errors import PayloadError
from fastpipe.payload import foreign_ops
from fastpipe.torch_compat import OpOverload

DEFAULT_NAMESPACES = frozenset({"aten", "prims", "fastpipe"})
GETITEM_NAMES = frozenset({"operator.getitem", "_operator.getitem"})

_IDENT = r"(?!__)[A-Za-z_][A-Za-z0-9_]*"
_TARGET = re.compile(rf"torch\.ops\.({_IDENT})\.({_IDENT})\.({_IDENT})")
_NAMESPACE = re.compile(_IDENT)

# Allow-listed namespaces that nevertheless contain operators touching files.
_DENIED_OPS = frozenset({"aten::save", "aten::from_file"})

_lock = threading.Lock()
_extra_namespaces: set[str] = set()


def allow_namespace(ns: str) -> None:
    """Allow payloads to call operators registered (e.g. with torch.library) under ``ns``."""
    if not isinstance(ns, str) or not _NAMESPACE.fullmatch(ns):
        raise ValueError(f"allow_namespace: expected an identifier namespace, found {ns!r}")
    if ns in {"higher_order", "profiler", "debugprims"}:
        raise ValueError(f"allow_namespace: namespace {ns!r} cannot be allowed")
    with _lock:
        _extra_namespaces.add(ns)


def disallow_namespace(ns: str) -> None:
    """Undo allow_namespace (the default namespaces stay allowed)."""
    with _lock:
        _extra_namespaces.discard(ns)


def allowed_namespaces() -> frozenset[str]:
    with _lock:
        return DEFAULT_NAMESPACES | frozenset(_extra_namespaces)


def _expected() -> str:
    names = ", ".join(sorted(allowed_namespaces()))
    foreign = ", ".join(foreign_ops.foreign_op_names())
    foreign = f", or a registered foreign op ({foreign})" if foreign else ""
    return f"a torch.ops target in namespaces {names} (or operator.getitem){foreign}"


def _is_denied(op: OpOverload) -> bool:
    schema = op._schema
    if schema.name in _DENIED_OPS:
        return True
    # Any string argument naming a file (future I/O operators).
    return any(
        arg.name in ("filename", "path", "file") and "str" in str(arg.type) for arg in schema.arguments
    )


def resolve(target: object, where: str) -> object:
    """Resolve a serialized target string; ``where`` is the full error prefix."""
    if not isinstance(target, str):
        raise PayloadError(f"{where}: expected {_expected()}, found a {type(target).__name__}")
    if target in GETITEM_NAMES:
        return operator.getitem
    shown = repr(target if len(target) <= 80 else target[:77] + "...")
    match = _TARGET.fullmatch(target)
    if match is None:
        raise PayloadError(f"{where}: expected {_expected()}, found {shown}")
    if match.group(1) not in allowed_namespaces():
        return _foreign(match, where, shown)
    ns, name, overload = match.groups()
    try:
        packet = getattr(getattr(torch.ops, ns), name)
        op = getattr(packet, overload)
    except Exception:  # unknown operator or overload: torch raises several types
        op = None
    if not isinstance(op, OpOverload) or op.namespace != ns:
        raise PayloadError(f"{where}: expected an operator overload registered in torch.ops, found {shown}")
    if _is_denied(op):
        raise PayloadError(f"{where}: expected an operator without file side effects, found {shown}")
    return op


def _foreign(match: re.Match, where: str, shown: str) -> object:
    """A target outside the allowed namespaces: a registered foreign op's default overload, or refused."""
    ns, name, overload = match.groups()
    qualified = f"{ns}::{name}"
    if foreign_ops.foreign_op(qualified) is None:
        raise PayloadError(f"{where}: expected {_expected()}, found {shown}")
    if overload != "default":
        raise PayloadError(f"{where}: expected the default overload of the foreign op {qualified}, found {shown}")
    try:
        return foreign_ops.torch_op(qualified)
    except ValueError as exc:           # defined in this process with another schema
        raise PayloadError(f"{where}: expected {qualified} as registered, found {exc}") from None


def target_name(op: object) -> str:
    """The serialized spelling of an OpOverload (inverse of :func:`resolve`)."""
    if op is operator.getitem:
        return "_operator.getitem"
    if not isinstance(op, OpOverload):
        raise TypeError(f"not an OpOverload: {op!r}")
    ns, name = op._schema.name.split("::", 1)
    overload = op._schema.overload_name or "default"
    return f"torch.ops.{ns}.{name}.{overload}"
