"""Decode a compute-supertask payload into a torch.fx GraphModule.

Own reader of torch.export's serialized ``Graph`` JSON (any schema from torch
2.1 on, with or without ``NamedArgument.kind`` / ``Node.name``; torch 2.1's
``dataclasses.asdict`` spelling is first rewritten by :mod:`fastpipe.payload.legacy`)
plus the producer's ``metadata`` key (absent in furiosa-llm 2024.1.x payloads). Nothing from the payload is executed: targets
come from an allow-list, values are plain JSON data, constants are read from
a safetensors blob.
"""
from __future__ import annotations

import binascii
import json
import operator
import re
from typing import Any

import torch

from fastpipe.errors import PayloadError
from fastpipe.payload import constants as const
from fastpipe.payload.arguments import decode_argument, place
from fastpipe.torch_compat import make_graph_module
from fastpipe.payload.decoded import DecodedGraph, TensorMeta
from fastpipe.payload.jsonread import Reader, entry, item, member
from fastpipe.payload.legacy import normalize
from fastpipe.payload.metas import read_tensor_meta
from fastpipe.payload.targets import resolve

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
_GRAPH_CLASS = "DecodedPayload"


def load_json(r: Reader, data: str | bytes) -> dict:
    """base64 -> UTF-8 -> JSON object, every failure a PayloadError."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            data = bytes(data).decode("ascii")
        except UnicodeDecodeError:
            raise r.error("", "standard base64 text", found_text="non-ASCII bytes") from None
    if not isinstance(data, str):
        raise r.error("", "a base64 string", found_text=type(data).__name__)
    try:
        raw = const.b64decode_strict(data)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise r.error("", "standard base64 text", found_text="invalid base64") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise r.error("", "base64 of UTF-8 JSON", found_text=f"invalid UTF-8 at byte {exc.start}") from None
    try:
        root = json.loads(text)
    except RecursionError:
        raise r.error("", "base64 of JSON", found_text="JSON nested too deeply") from None
    except ValueError as exc:
        raise r.error("", "base64 of JSON", found_text=f"invalid JSON ({exc})") from None
    return r.obj(root, "")


def _is_tensor_list(schema_type: object) -> bool:
    return isinstance(schema_type, torch.ListType) and isinstance(schema_type.getElementType(), torch.TensorType)


def _fx_name(name: str) -> str:
    # fx renames Python keywords and builtins itself; `self` it would keep.
    return "self_" if name == "self" else name


class _Decoder:
    def __init__(self, r: Reader, root: dict):
        self.r = r
        self.root = root
        self.graph = torch.fx.Graph()
        self.module = torch.nn.Module()
        self.env: dict[str, torch.fx.Node] = {}  # tensor name -> node
        self.tuples: dict[str, torch.fx.Node] = {}  # multi-output node name -> node

    # -- names --------------------------------------------------------------
    def name(self, value: Any, path: str) -> str:
        text = self.r.string(value, path)
        if not _NAME.fullmatch(text):
            raise self.r.error(path, "an identifier name", text)
        return text

    def define(self, name: str, node: torch.fx.Node, path: str) -> None:
        if name in self.env or name in self.tuples:
            raise self.r.error(path, "a name not defined before", name)
        self.env[name] = node

    def lookup(self, name: str, path: str) -> torch.fx.Node:
        node = self.env.get(name)
        if node is None:
            raise self.r.error(path, "a tensor name defined earlier in the graph", name)
        return node

    # -- top level ------------------------------------------------------------
    def run(self, where: str) -> DecodedGraph:
        r, root = self.r, self.root
        for key in ("sym_int_values", "sym_bool_values", "sym_float_values"):
            self.check_static_values(key)
        custom = root.get("custom_obj_values") or {}
        if r.obj(custom, "custom_obj_values"):
            raise r.error("custom_obj_values", "no custom objects", custom)
        tv_path = "tensor_values"
        tensor_values = r.obj(r.key(root, "tensor_values", ""), tv_path)
        metas = {k: read_tensor_meta(r, v, entry(tv_path, k)) for k, v in tensor_values.items()}

        metadata = r.obj(r.key(root, "metadata", "", default={}), "metadata")
        lifted = self.read_lifted(metadata)
        input_names = self.read_inputs(metas, lifted)
        consts, external, attrs = self.add_constants(metadata, lifted, metas)

        nodes_json = r.lst(r.key(root, "nodes", ""), "nodes")
        for i, node_json in enumerate(nodes_json):
            self.add_node(node_json, item("nodes", i))

        output_names, output_nodes = self.read_outputs(metas)
        self.graph.output(tuple(output_nodes))
        for node in reversed(list(self.graph.nodes)):
            if node.target is operator.getitem and not node.users:
                self.graph.erase_node(node)
        try:
            self.graph.lint()
        except Exception as exc:  # defensive: the builder above should never produce this
            raise r.error("nodes", "a well-formed graph", found_text=str(exc).splitlines()[0][:120]) from None
        gm = make_graph_module(self.module, self.graph, _GRAPH_CLASS)
        constant_metas = {attr: metas[p] for p, attr in lifted.items()}
        return DecodedGraph(
            gm=gm,
            input_metas=tuple(metas[n] for n in input_names),
            output_metas=tuple(metas[n] for n in output_names),
            constants=consts,
            external_constants=external,
            input_names=tuple(input_names),
            output_names=tuple(output_names),
            constant_attrs=attrs,
            constant_metas=constant_metas,
            where=where,
        )

    def check_static_values(self, key: str) -> None:
        values = self.r.obj(self.root.get(key) or {}, key)
        scalar = {"sym_int_values": "as_int", "sym_bool_values": "as_bool", "sym_float_values": "as_float"}[key]
        for name, value in values.items():
            path = entry(key, name)
            tag, _inner = self.r.union(value, path)
            if tag == "as_expr":
                raise self.r.error(member(path, tag), f"a static value ({scalar})", found_text="a symbolic expression")
            if tag != scalar:
                raise self.r.error(member(path, tag), f"a static value ({scalar})", found_text=repr(tag))

    # -- inputs and constants -------------------------------------------------
    def read_lifted(self, metadata: dict) -> dict[str, str]:
        path = "metadata.getattr_node_targets"
        targets = self.r.obj(metadata.get("getattr_node_targets") or {}, path)
        for name, attr in targets.items():
            self.r.string(attr, entry(path, name))
            if not attr:
                raise self.r.error(entry(path, name), "an attribute name", attr)
        names = metadata.get("node_names")
        if names is not None:
            for i, n in enumerate(self.r.lst(names, "metadata.node_names")):
                self.r.string(n, item("metadata.node_names", i))
        return dict(targets)

    def read_inputs(self, metas: dict[str, TensorMeta], lifted: dict[str, str]) -> list[str]:
        r = self.r
        inputs = r.lst(r.key(self.root, "inputs", ""), "inputs")
        real: list[str] = []
        seen: set[str] = set()
        for i, arg in enumerate(inputs):
            path = item("inputs", i)
            tag, inner = r.union(arg, path)
            if tag != "as_tensor":
                raise r.error(member(path, tag), "a tensor input (as_tensor)", found_text=repr(tag[:60]))
            name_path = member(member(path, tag), "name")
            name = self.name(r.key(r.obj(inner, member(path, tag)), "name", member(path, tag)), name_path)
            if name in seen:
                raise r.error(name_path, "a name not defined before", name)
            seen.add(name)
            if name not in metas:
                raise r.error(name_path, "an input with a tensor_values entry", name)
            if name in lifted:
                if real:
                    raise r.error(name_path, "embedded constants before the real inputs", name)
                continue
            real.append(name)
            node = self.graph.placeholder(_fx_name(name))
            node.target = node.name  # the forward() parameter: always fx-sanitized
            self.define(name, node, name_path)
        for name in lifted:
            if name not in seen:
                raise r.error(entry("metadata.getattr_node_targets", name), "the name of a graph input", name)
        return real

    def add_constants(self, metadata: dict, lifted: dict[str, str], metas: dict[str, TensorMeta]):
        r = self.r
        info_path = "metadata.constant_saved_info"
        info = metadata.get("constant_saved_info")
        info = {} if info is None else r.obj(info, info_path)
        blob_path = member(info_path, "blob")
        blob = const.read_blob(r, info.get("blob"), blob_path)
        external_all = const.read_external(r, info, info_path)
        consts: dict[str, torch.Tensor] = {}
        external: dict[str, tuple[str, str, str]] = {}
        attrs: dict[str, str] = {}
        first_meta: dict[str, TensorMeta] = {}
        for placeholder, attr in lifted.items():
            path = entry("metadata.getattr_node_targets", placeholder)
            meta = metas[placeholder]
            if attr in first_meta:
                if first_meta[attr] != meta:
                    raise r.error(path, "the same tensor_values meta for every use of a constant", attr)
            else:
                first_meta[attr] = meta
                if attr in blob and attr in external_all:
                    raise r.error(path, "a constant stored once (blob or param file)", attr)
                if attr in blob:
                    tensor = blob[attr]
                    if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
                        raise r.error(
                            entry(blob_path, attr),
                            f"shape {list(meta.shape)} dtype {meta.dtype} (as in tensor_values)",
                            found_text=f"shape {list(tensor.shape)} dtype {tensor.dtype}",
                        )
                    consts[attr] = tensor
                elif attr in external_all:
                    tensor = const.placeholder_for(meta)
                    external[attr] = external_all[attr]
                else:
                    raise r.error(path, "an attribute stored in constant_saved_info", attr)
                attrs[attr] = const.buffer_name(attr, set(attrs.values()), self.module)
                self.module.register_buffer(attrs[attr], tensor, persistent=False)
            node = self.graph.create_node("get_attr", attrs[attr], name=_fx_name(placeholder))
            self.define(placeholder, node, path)
        return consts, external, attrs

    # -- nodes ------------------------------------------------------------------
    def add_node(self, node_json: Any, path: str) -> None:
        r = self.r
        node = r.obj(node_json, path)
        target_path = member(path, "target")
        target = resolve(r.key(node, "target", path), f"{r.where}: {target_path}")
        inputs = r.lst(r.key(node, "inputs", path), member(path, "inputs"))
        outputs = r.lst(r.key(node, "outputs", path), member(path, "outputs"))
        metadata = node.get("metadata")
        if metadata is not None:
            r.obj(metadata, member(path, "metadata"))
        own_name = node.get("name")
        if own_name is not None:
            own_name = self.name(own_name, member(path, "name"))
        if target is operator.getitem:
            self.add_getitem(inputs, outputs, path)
            return
        provided: dict[str, tuple[Any, int | None, str]] = {}
        for i, named in enumerate(inputs):
            arg_path = item(member(path, "inputs"), i)
            obj = r.obj(named, arg_path)
            arg_name = r.string(r.key(obj, "name", arg_path), member(arg_path, "name"))
            if arg_name in provided:
                raise r.error(member(arg_path, "name"), "each argument once", arg_name)
            kind = obj.get("kind")
            if kind is not None and (r.integer(kind, member(arg_path, "kind")) not in (0, 1, 2)):
                raise r.error(member(arg_path, "kind"), "0, 1 or 2 (ArgumentKind)", kind)
            value = decode_argument(r, r.key(obj, "arg", arg_path), member(arg_path, "arg"), self.lookup)
            provided[arg_name] = (value, kind, arg_path)
        args, kwargs = place(r, target, provided, path)
        self.add_outputs(target, args, kwargs, outputs, own_name, path)

    def add_outputs(self, op, args, kwargs, outputs: list, own_name: str | None, path: str) -> None:
        r = self.r
        out_path = member(path, "outputs")
        returns = op._schema.returns
        plan = [self.output_plan(o, item(out_path, i)) for i, o in enumerate(outputs)]
        single_list = len(returns) == 1 and _is_tensor_list(returns[0].type)
        if len(plan) != len(returns) and not (len(returns) == 0 and all(p is None for p in plan)):
            raise r.error(out_path, f"{len(returns)} outputs as in the schema of {op._schema.name}", outputs)
        if len(returns) == 1 and not single_list:
            if isinstance(plan[0], list):
                raise r.error(item(out_path, 0), "as_tensor or as_none", found_text="as_tensors")
            name = plan[0][0] if plan[0] is not None else (own_name or op._schema.name.split("::")[-1])
            fx_node = self.graph.create_node("call_function", op, args, kwargs, name=_fx_name(name))
            if plan[0] is not None:
                self.define(plan[0][0], fx_node, plan[0][1])
            return
        name = own_name or op._schema.name.split("::")[-1]
        fx_node = self.graph.create_node("call_function", op, args, kwargs, name=_fx_name(name))
        if own_name is not None:
            if own_name in self.tuples or own_name in self.env:
                raise r.error(member(path, "name"), "a name not defined before", own_name)
            self.tuples[own_name] = fx_node
        if single_list:
            if not isinstance(plan[0], list):
                raise r.error(item(out_path, 0), "as_tensors for a Tensor[] result", found_text="a single tensor")
            plan = plan[0]
            for k, part in enumerate(plan):
                self.getitem(fx_node, k, part)
            return
        for k, part in enumerate(plan):
            if isinstance(part, list):
                inner = self.graph.create_node("call_function", operator.getitem, (fx_node, k))
                for j, sub in enumerate(part):
                    self.getitem(inner, j, sub)
            else:
                self.getitem(fx_node, k, part)

    def getitem(self, parent: torch.fx.Node, index: int, part: tuple[str, str] | None) -> None:
        if part is None:
            return
        name, path = part
        node = self.graph.create_node("call_function", operator.getitem, (parent, index), name=_fx_name(name))
        self.define(name, node, path)

    def output_plan(self, value: Any, path: str):
        """None (as_none), (name, path) (as_tensor) or a list of those (as_tensors)."""
        r = self.r
        tag, inner = r.union(value, path)
        p = member(path, tag)
        if tag == "as_none":
            return None
        if tag == "as_tensor":
            obj = r.obj(inner, p)
            return (self.name(r.key(obj, "name", p), member(p, "name")), member(p, "name"))
        if tag == "as_tensors":
            parts = []
            for i, t in enumerate(r.lst(inner, p)):
                q = item(p, i)
                parts.append((self.name(r.key(r.obj(t, q), "name", q), member(q, "name")), member(q, "name")))
            return parts
        raise r.error(p, "a tensor output (as_tensor, as_tensors or as_none)", found_text=repr(tag[:60]))

    def add_getitem(self, inputs: list, outputs: list, path: str) -> None:
        r = self.r
        in_path = member(path, "inputs")
        if len(inputs) != 2:
            raise r.error(in_path, "2 arguments for getitem", inputs)

        def lookup_any(name: str, p: str) -> torch.fx.Node:
            node = self.env.get(name) or self.tuples.get(name)
            if node is None:
                raise r.error(p, "a name defined earlier in the graph", name)
            return node

        values = []
        for i, named in enumerate(inputs):
            arg_path = item(in_path, i)
            obj = r.obj(named, arg_path)
            values.append(decode_argument(r, r.key(obj, "arg", arg_path), member(arg_path, "arg"), lookup_any))
        if not isinstance(values[0], torch.fx.Node) or isinstance(values[1], bool) or not isinstance(values[1], int):
            raise r.error(in_path, "(tensor or multi-output node, integer index)", found_text="other arguments")
        out_path = member(path, "outputs")
        if len(outputs) != 1:
            raise r.error(out_path, "one output", outputs)
        part = self.output_plan(outputs[0], item(out_path, 0))
        if not isinstance(part, tuple):
            raise r.error(item(out_path, 0), "as_tensor", found_text="another output kind")
        self.getitem(values[0], values[1], part)

    # -- outputs ----------------------------------------------------------------
    def read_outputs(self, metas: dict[str, TensorMeta]) -> tuple[list[str], list[torch.fx.Node]]:
        r = self.r
        outputs = r.lst(r.key(self.root, "outputs", ""), "outputs")
        names, nodes = [], []
        for i, arg in enumerate(outputs):
            path = item("outputs", i)
            tag, inner = r.union(arg, path)
            if tag != "as_tensor":
                raise r.error(member(path, tag), "a tensor output (as_tensor)", found_text=repr(tag[:60]))
            name_path = member(member(path, tag), "name")
            name = self.name(r.key(r.obj(inner, member(path, tag)), "name", member(path, tag)), name_path)
            node = self.lookup(name, name_path)
            if name not in metas:
                raise r.error(name_path, "an output with a tensor_values entry", name)
            names.append(name)
            nodes.append(node)
        return names, nodes


def decode_payload(data: str | bytes, *, where: str) -> DecodedGraph:
    """Decode a supertask's ``data``; every problem is a one-line PayloadError."""
    r = Reader(where)
    root = load_json(r, data)
    try:
        return _Decoder(r, normalize(r, root)).run(where)
    except PayloadError:
        raise
    except RecursionError:
        raise r.error("", "a payload of reasonable nesting", found_text="structures nested too deeply") from None
    except Exception as exc:  # a bug or an unforeseen torch behaviour: still one PayloadError
        detail = " ".join(str(exc).split())[:120]
        raise r.error("", "a decodable payload", found_text=f"{type(exc).__name__}: {detail}") from exc
