"""Which annotation an op call has: registration and lookup.

``register_annotation(op_or_name, annotation_or_factory)`` records, for an op,
either a fixed annotation (a string or :class:`Annotation`) or a *factory*
``fn(*args, **kwargs)`` called with the op's call arguments, returning an
annotation string, an :class:`Annotation`, a ``(string, {name: size})`` pair
(sizes for groups, stored in ``Annotation.sizes``), or ``None`` (no
annotation for this call). A later registration for the same op replaces the
earlier one.

Ops are named by key ``"<ns>.<name>.<overload>"`` (``str(OpOverload)``, e.g.
``"aten.mm.default"``). Accepted spellings: an ``OpOverload``; an
``OpOverloadPacket`` or ``"<ns>.<name>"`` (every overload without its own
entry); a ``torch.library.custom_op`` object; ``"torch.ops.aten.mm.default"``;
``"aten::mm"`` (the default overload) and ``"aten::add.Tensor"``.

How annotation inputs line up with a call (:func:`call_slots`): the op's
schema arguments in schema order (keyword-only ones included, missing ones
taking their defaults); an argument that is a list holding tensors counts as
one slot per element; every other argument is one slot. The annotation lists
the slots from the first on and may leave out trailing slots that are not
tensors. A tensor slot needs a tensor annotation or ``?`` (a 0-d tensor the
annotation ignores); a non-tensor slot needs ``?``. An ``torch.fx.Node`` is
read through ``node.meta["val"]``. Ops without a schema (plain callables) use
the positional arguments, then the keyword arguments in the order given.

``annotation_for(op, args, kwargs)`` returns the checked annotation or
``None`` when the op has no entry (or its factory declines the call).
"""
from __future__ import annotations

import threading
from typing import Callable, Union

import torch

from fastpipe.builder.dimops.errors import AnnotationError
from fastpipe.builder.dimops.grammar import Annotation, format_annotation, parse
from fastpipe.torch_compat import OpOverload, OpOverloadPacket

Factory = Callable[..., object]
Entry = Union[Annotation, Factory]

_ENTRIES: dict[str, Entry] = {}
_LOCK = threading.Lock()
_BUILTINS_LOADED = False


def op_key(op: object) -> str:
    """The registry key of ``op`` (see the module docstring)."""
    inner = getattr(op, "_opoverload", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(inner, OpOverload):
        op = inner
    if isinstance(op, (OpOverload, OpOverloadPacket)):
        return str(op)
    if isinstance(op, str):
        name = op.strip()
        if name.startswith("torch.ops."):
            name = name[len("torch.ops."):]
        if "::" in name:
            ns, _, rest = name.partition("::")
            return f"{ns}.{rest}" if "." in rest else f"{ns}.{rest}.default"
        if name.count(".") in (1, 2) and all(p.isidentifier() for p in name.split(".")):
            return name
        raise AnnotationError(f'op name "{op}": expected "ns.name.overload", "ns.name" or "ns::name[.overload]"')
    if callable(op):
        mod = getattr(op, "__module__", None) or "python"
        return f"{mod}.{getattr(op, '__qualname__', repr(op))}"
    raise AnnotationError(f"expected an op (OpOverload, packet, custom op, name or callable), found {op!r}")


def register_annotation(op_or_name: object, annotation_or_factory: object) -> None:
    """Record the annotation (or factory) of an op; strings are parsed now,
    so a malformed annotation fails here."""
    _ensure_builtins()
    if isinstance(annotation_or_factory, (str, Annotation)):
        entry: Entry = parse(annotation_or_factory)
    elif callable(annotation_or_factory):
        entry = annotation_or_factory
    else:
        raise AnnotationError(f"register_annotation: expected an annotation string or a factory, found {annotation_or_factory!r}")
    with _LOCK:
        _ENTRIES[op_key(op_or_name)] = entry


def unregister_annotation(op_or_name: object) -> None:
    """Forget an op's entry (no error when there is none)."""
    with _LOCK:
        _ENTRIES.pop(op_key(op_or_name), None)


def _lookup(op: object) -> Entry | None:
    _ensure_builtins()
    key = op_key(op)
    entry = _ENTRIES.get(key)
    if entry is None and key.count(".") == 2:
        entry = _ENTRIES.get(key.rsplit(".", 1)[0])
    return entry


def _value(x: object) -> object:
    meta = getattr(x, "meta", None)
    if isinstance(meta, dict) and "val" in meta and hasattr(x, "op") and hasattr(x, "target"):
        return meta["val"]  # torch.fx.Node
    return x


def _values(x: object) -> object:
    """``x`` with fx Nodes (also inside a list or tuple) replaced by their values."""
    if isinstance(x, list):
        return [_value(e) for e in x]
    if type(x) is tuple:
        return tuple(_value(e) for e in x)
    return _value(x)


def _is_tensor(x: object) -> bool:
    return isinstance(_value(x), torch.Tensor)


def call_slots(op: object, args: tuple, kwargs: dict) -> list[object]:
    """The call's input slots, in the order annotation inputs list them."""
    kwargs = dict(kwargs or {})
    schema = getattr(getattr(op, "_opoverload", op), "_schema", None)
    if schema is not None:
        values = []
        for i, arg in enumerate(schema.arguments):
            if i < len(args) and not arg.kwarg_only:
                values.append(args[i])
            elif arg.name in kwargs:
                values.append(kwargs[arg.name])
            else:
                values.append(arg.default_value if arg.has_default_value() else None)
    else:
        values = list(args) + list(kwargs.values())
    slots: list[object] = []
    for v in values:
        if isinstance(v, (list, tuple)) and any(_is_tensor(e) for e in v):
            slots.extend(v)
        else:
            slots.append(v)
    return slots


def input_shapes_for(anno: Annotation, op: object, args: tuple, kwargs: dict) -> list[tuple[int, ...] | None]:
    """``input_shapes`` for :func:`infer_shapes` / :func:`split` from a call:
    one entry per annotation input, a tensor's shape or ``None``."""
    slots = call_slots(op, args, kwargs)[: len(anno.inputs)]
    return [tuple(_value(s).shape) if _is_tensor(s) else None for s in slots]


def _check_call(anno: Annotation, op: object, args: tuple, kwargs: dict) -> None:
    slots = call_slots(op, args, kwargs)
    text = format_annotation(anno)
    key = op_key(op)
    if len(anno.inputs) > len(slots):
        raise AnnotationError(f'annotation "{text}" of {key}: {len(anno.inputs)} inputs but the call has {len(slots)} argument slots')
    for i, (t, s) in enumerate(zip(anno.inputs, slots)):
        if t is not None and not _is_tensor(s):
            raise AnnotationError(f'annotation "{text}" of {key}: input {i} is annotated as a tensor but the call gives {type(_value(s)).__name__}')
    for i in range(len(anno.inputs), len(slots)):
        if _is_tensor(slots[i]):
            raise AnnotationError(f'annotation "{text}" of {key}: argument slot {i} is a tensor the annotation leaves out (write "?" to ignore it)')


def annotation_for(op: object, args: tuple = (), kwargs: dict | None = None) -> Annotation | None:
    """The annotation of this call of ``op``, checked against the call's
    argument slots, or ``None`` when ``op`` has no entry or its factory
    returns ``None``."""
    kwargs = dict(kwargs or {})
    entry = _lookup(op)
    if entry is None:
        return None
    if isinstance(entry, Annotation):
        anno = entry
    else:
        result = entry(*[_values(a) for a in args], **{k: _values(v) for k, v in kwargs.items()})
        if result is None:
            return None
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
            anno = parse(result[0]).with_sizes(**result[1])
        elif isinstance(result, (str, Annotation)):
            anno = parse(result)
        else:
            raise AnnotationError(f"annotation factory of {op_key(op)}: expected a string, an Annotation, (string, sizes) or None, found {result!r}")
    _check_call(anno, op, tuple(args), kwargs)
    return anno


def _ensure_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    with _LOCK:
        if _BUILTINS_LOADED:
            return
        _BUILTINS_LOADED = True
    from fastpipe.builder.dimops.aten import BUILTINS

    for op, entry in BUILTINS:
        register_annotation(op, entry)


__all__ = ["register_annotation", "unregister_annotation", "annotation_for", "call_slots", "input_shapes_for", "op_key"]
