"""Decoding serialized ``Argument`` values and placing them by an op's schema.

Only the argument kinds a static-shape aten graph needs are accepted. Graphs
(``as_graph``), custom objects, operator references, symbolic names and any
unknown kind are refused.
"""
from __future__ import annotations

import keyword
from typing import Any, Callable

import torch

from fastpipe.payload.jsonread import Reader, item, member
from fastpipe.payload.schema_enums import (
    LAYOUT_TO_TORCH,
    MEMORY_FORMAT_TO_TORCH,
    SCALAR_TYPE_TO_DTYPE,
    make_device,
)
from fastpipe.torch_compat import OpOverload

Lookup = Callable[[str, str], torch.fx.Node]
POSITIONAL, KEYWORD = 1, 2
_SUPPORTED = "a static-shape aten argument"


def _static(r: Reader, value: Any, path: str, scalar: str, read: Callable[[Any, str], Any]) -> Any:
    """A Sym{Int,Bool,Float}Argument that must hold a concrete value."""
    tag, inner = r.union(value, path)
    if tag == scalar:
        return read(inner, member(path, tag))
    if tag == "as_name":
        raise r.error(member(path, tag), f"a static value ({scalar})", found_text="a symbolic name")
    if tag == "as_expr":
        raise r.error(member(path, tag), f"a static value ({scalar})", found_text="a symbolic expression")
    raise r.error(member(path, tag), f"a static value ({scalar})", found_text=repr(tag))


def _tensor_ref(r: Reader, value: Any, path: str, lookup: Lookup) -> torch.fx.Node:
    obj = r.obj(value, path)
    name_path = member(path, "name")
    return lookup(r.string(r.key(obj, "name", path), name_path), name_path)


def _optional_tensor(r: Reader, value: Any, path: str, lookup: Lookup) -> torch.fx.Node | None:
    tag, inner = r.union(value, path)
    if tag == "as_none":
        return None
    if tag == "as_tensor":
        return _tensor_ref(r, inner, member(path, tag), lookup)
    raise r.error(member(path, tag), "as_tensor or as_none", found_text=repr(tag))


def _each(r: Reader, value: Any, path: str, read: Callable[[Any, str], Any]) -> list:
    return [read(v, item(path, i)) for i, v in enumerate(r.lst(value, path))]


def decode_argument(r: Reader, value: Any, path: str, lookup: Lookup) -> Any:
    """The Python / fx value of one serialized ``Argument``."""
    tag, inner = r.union(value, path)
    p = member(path, tag)
    if tag == "as_none":
        return None
    if tag == "as_tensor":
        return _tensor_ref(r, inner, p, lookup)
    if tag == "as_tensors":
        return _each(r, inner, p, lambda v, q: _tensor_ref(r, v, q, lookup))
    if tag == "as_optional_tensor":
        return _optional_tensor(r, inner, p, lookup)
    if tag == "as_optional_tensors":
        return _each(r, inner, p, lambda v, q: _optional_tensor(r, v, q, lookup))
    if tag in ("as_int", "as_ints", "as_int_lists"):
        depth = {"as_int": 0, "as_ints": 1, "as_int_lists": 2}[tag]
        return _nested(r, inner, p, depth, r.integer)
    if tag in ("as_float", "as_floats", "as_float_lists"):
        depth = {"as_float": 0, "as_floats": 1, "as_float_lists": 2}[tag]
        return _nested(r, inner, p, depth, r.number)
    if tag == "as_bool":
        return r.boolean(inner, p)
    if tag == "as_bools":
        return _each(r, inner, p, r.boolean)
    if tag == "as_string":
        return r.string(inner, p)
    if tag == "as_strings":
        return _each(r, inner, p, r.string)
    if tag == "as_sym_int":
        return _static(r, inner, p, "as_int", r.integer)
    if tag == "as_sym_ints":
        return _each(r, inner, p, lambda v, q: _static(r, v, q, "as_int", r.integer))
    if tag == "as_sym_bool":
        return _static(r, inner, p, "as_bool", r.boolean)
    if tag == "as_sym_bools":
        return _each(r, inner, p, lambda v, q: _static(r, v, q, "as_bool", r.boolean))
    if tag == "as_sym_float":
        return _static(r, inner, p, "as_float", r.number)
    if tag == "as_sym_floats":
        return _each(r, inner, p, lambda v, q: _static(r, v, q, "as_float", r.number))
    if tag == "as_scalar_type":
        return _enum(r, inner, p, SCALAR_TYPE_TO_DTYPE, "a known ScalarType")
    if tag == "as_memory_format":
        return _enum(r, inner, p, MEMORY_FORMAT_TO_TORCH, "a known MemoryFormat")
    if tag == "as_layout":
        return _enum(r, inner, p, LAYOUT_TO_TORCH, "Layout 7 (strided)")
    if tag == "as_device":
        return read_device(r, inner, p)
    if tag == "as_complex":
        obj = r.obj(inner, p)
        real = r.number(r.key(obj, "real", p), member(p, "real"))
        return complex(real, r.number(r.key(obj, "imag", p), member(p, "imag")))
    raise r.error(p, _SUPPORTED, found_text=repr(tag[:60]))


def _nested(r: Reader, value: Any, path: str, depth: int, leaf: Callable[[Any, str], Any]) -> Any:
    if depth == 0:
        return leaf(value, path)
    return _each(r, value, path, lambda v, q: _nested(r, v, q, depth - 1, leaf))


def _enum(r: Reader, value: Any, path: str, table: dict, expected: str) -> Any:
    code = r.integer(value, path)
    if code not in table:
        raise r.error(path, expected, code)
    return table[code]


def read_device(r: Reader, value: Any, path: str) -> torch.device:
    obj = r.obj(value, path)
    device_type = r.string(r.key(obj, "type", path), member(path, "type"))
    index = obj.get("index")
    if index is not None:
        index = r.integer(index, member(path, "index"))
    device = make_device(device_type, index)
    if device is None:
        raise r.error(path, "a valid torch device", found_text=repr(f"{device_type}:{index}"[:60]))
    return device


def _mentions_tensor(schema_type: object) -> bool:
    return "Tensor" in str(schema_type)


def _has_node(value: Any) -> bool:
    if isinstance(value, torch.fx.Node):
        return True
    return isinstance(value, (list, tuple)) and any(_has_node(v) for v in value)


def check_type(r: Reader, schema_arg: Any, value: Any, path: str) -> None:
    """Cheap sanity check of a value against its schema type (full checks happen at run time)."""
    type_text = str(schema_arg.type)
    if _has_node(value) and not _mentions_tensor(type_text):
        raise r.error(path, f"a value of type {type_text}", found_text="a tensor")
    # (the converse is legal: aten graphs pass Python scalars to Tensor parameters)


def place(
    r: Reader, op: OpOverload, provided: dict[str, tuple[Any, int | None, str]], path: str
) -> tuple[tuple, dict]:
    """Split ``{name: (value, kind, json_path)}`` into call args/kwargs by ``op``'s schema."""
    schema_args = list(op._schema.arguments)
    index = {a.name: i for i, a in enumerate(schema_args)}
    for name, (value, _kind, arg_path) in provided.items():
        if name not in index:
            raise r.error(member(arg_path, "name"), f"an argument of {op._schema.name}", name)
        check_type(r, schema_args[index[name]], value, member(arg_path, "arg"))
    for a in schema_args:
        if a.name not in provided and not a.has_default_value():
            raise r.error(member(path, "inputs"), f"argument {a.name!r} of {op._schema.name}", found_text="nothing")

    def wants_positional(name: str) -> bool:
        a = schema_args[index[name]]
        if a.kwarg_only:
            return False
        return provided[name][1] != KEYWORD or keyword.iskeyword(name)

    # Arguments named like Python keywords cannot be passed by keyword in
    # generated code: everything before them becomes positional (defaults fill gaps).
    must = [index[n] for n in provided if keyword.iskeyword(n) and not schema_args[index[n]].kwarg_only]
    args: list = []
    for j in range(max(must) + 1 if must else 0):
        a = schema_args[j]
        if a.name in provided:
            args.append(provided[a.name][0])
        elif a.has_default_value():
            args.append(a.default_value)
        else:  # unreachable: required arguments were checked above
            raise r.error(member(path, "inputs"), f"argument {a.name!r}", found_text="nothing")
    j = len(args)
    while j < len(schema_args) and schema_args[j].name in provided and wants_positional(schema_args[j].name):
        args.append(provided[schema_args[j].name][0])
        j += 1
    kwargs = {
        name: value
        for name, (value, _kind, _p) in sorted(provided.items(), key=lambda kv: index[kv[0]])
        if index[name] >= j
    }
    return tuple(args), kwargs
