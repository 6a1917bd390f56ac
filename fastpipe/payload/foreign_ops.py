"""Operators of other libraries that payloads may call, known by name (a registry).

    register_foreign_op(ForeignOp("furiosa::sparse_select_v1_5",
                                  "(Tensor x, Tensor[] indices, SymInt dummy_index, SymInt index_group_size) -> Tensor",
                                  reference=lambda x, indices, dummy_index, index_group_size: ...,
                                  doc="..."))

A producer's graphs may call operators that its own libraries define (furiosa-llm's decode graphs
call `torch.ops.furiosa.sparse_select_v1_5`). A payload names them by string; nothing in a file
runs code, so a target outside the allowed namespaces (fastpipe.payload.targets) is accepted only
when an entry here names it. An entry is plain data and one plain-torch function:
- `name`: `namespace::op` (payloads call its `default` overload: `torch.ops.namespace.op.default`);
- `schema`: its argument schema, as torch.library writes it: the decoder places and type-checks each
  serialized argument by it, and a payload that disagrees is refused naming the argument;
- `reference`: what the op means, in plain torch ops. It is the op's implementation on every device
  (registered as CompositeImplicitAutograd), so fake and meta tensors propagate through it (validation's
  shape check) and torch.compile traces straight through it: a compiled graph holds the aten ops it is
  made of, fused with their neighbours by inductor (the fast path). It should check what the schema
  cannot (ranges, dtypes) and raise ValueError with a one-line reason.

The torch operator is defined when a payload first names it (`resolve`), not at import, so a process
that also imports the op's own library (which defines the same name) keeps working: when the name is
already defined there, its schema must equal the entry's, and the existing definition runs.
The producer's ops are built-in entries (fastpipe.payload.producer_ops, registered when fastpipe.payload
is imported); `register_foreign_op` adds one from outside the library.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from fastpipe.torch_compat import parse_schema

_NAME = re.compile(r"((?!__)[A-Za-z_][A-Za-z0-9_]*)::((?!__)[A-Za-z_][A-Za-z0-9_]*)")
_RESERVED = frozenset({"aten", "prims", "fastpipe", "higher_order", "profiler", "debugprims"})


@dataclass(frozen=True)
class ForeignOp:
    """One foreign operator: see the module docstring."""
    name: str                       # "namespace::op"
    schema: str                     # "(Tensor x, ...) -> Tensor"
    reference: Callable             # plain torch: the op's meaning
    doc: str = ""                   # one line: what it means and where it comes from

    @property
    def namespace(self) -> str:
        return self.name.split("::", 1)[0]

    @property
    def op_name(self) -> str:
        return self.name.split("::", 1)[1]


_lock = threading.Lock()
_entries: dict[str, ForeignOp] = {}
_defined: dict[str, object] = {}          # name -> the torch OpOverload once defined or adopted
_libraries: list = []                     # torch.library.Library objects must stay alive


def register_foreign_op(op: ForeignOp) -> None:
    """Let payloads call `op.name` (its default overload), with `op.reference` as its meaning."""
    if not isinstance(op, ForeignOp):
        raise TypeError(f"register_foreign_op: expected a ForeignOp, found {type(op).__name__}")
    m = _NAME.fullmatch(op.name)
    if m is None:
        raise ValueError(f"register_foreign_op: expected a name 'namespace::op', found {op.name!r}")
    if m.group(1) in _RESERVED:
        raise ValueError(f"register_foreign_op: namespace {m.group(1)!r} is not foreign (it is fastpipe's or torch's)")
    if not callable(op.reference):
        raise ValueError(f"register_foreign_op: {op.name}: expected a callable reference, found {op.reference!r}")
    parse_schema(f"{op.name}{op.schema}")          # a malformed schema fails here, not at first use
    with _lock:
        defined = _defined.get(op.name)       # a torch op defined for an earlier entry of this name stays
        if defined is not None and not _same_schema(defined._schema, op):
            raise ValueError(f"register_foreign_op: {op.name} is defined already with schema {defined._schema}")
        _entries[op.name] = op


def unregister_foreign_op(name: str) -> None:
    """Payloads may no longer name `name` (a torch operator already defined stays defined in the process)."""
    with _lock:
        _entries.pop(name, None)


def foreign_op(name: str) -> ForeignOp | None:
    """The entry for "namespace::op", or None."""
    with _lock:
        return _entries.get(name)


def foreign_op_names() -> tuple[str, ...]:
    """The registered names, sorted."""
    with _lock:
        return tuple(sorted(_entries))


def torch_op(name: str):
    """The torch OpOverload (default overload) for a registered name, defining it on first use."""
    entry = foreign_op(name)
    if entry is None:
        raise KeyError(name)
    with _lock:
        op = _defined.get(name)
        if op is None:
            op = _define(entry)
            _defined[name] = op
        return op


def _define(entry: ForeignOp):
    ns, op_name = entry.namespace, entry.op_name
    existing = _existing(ns, op_name)
    if existing is not None:      # defined by its own library, loaded in this process: use it, same schema
        if not _same_schema(existing._schema, entry):
            raise ValueError(f"foreign op {entry.name}: defined in this process with schema {existing._schema}, "
                             f"expected {entry.schema}")
        return existing
    lib = torch.library.Library(ns, "FRAGMENT")
    lib.define(f"{op_name}{entry.schema}")
    lib.impl(op_name, entry.reference, "CompositeImplicitAutograd")
    _libraries.append(lib)
    return getattr(getattr(torch.ops, ns), op_name).default


def _same_schema(have, entry: ForeignOp) -> bool:
    """Whether a defined operator's schema has the entry's arguments (names, types) and returns."""
    want = parse_schema(f"{entry.name}{entry.schema}")
    return ([(a.name, str(a.type)) for a in have.arguments] == [(a.name, str(a.type)) for a in want.arguments]
            and [str(r.type) for r in have.returns] == [str(r.type) for r in want.returns])


def _existing(ns: str, op_name: str):
    try:
        return getattr(getattr(getattr(torch.ops, ns), op_name), "default")
    except (AttributeError, RuntimeError):
        return None

