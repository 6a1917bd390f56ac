"""Encode an aten-level fx graph as a compute-supertask payload.

Writes the same JSON the producer (furiosa-llm ``serialize_gm`` with torch
2.1 - 2.5) writes: torch.export's ``Graph`` in the schema subset every torch
from 2.1 on reads (no ``NamedArgument.kind``, no ``Node.name``), get_attr
tensors lifted into leading placeholders and stored in a safetensors blob,
plus the producer's ``metadata`` key. The JSON is built here, without torch's
private serializer.
"""
from __future__ import annotations

import base64
import json
import operator
from typing import Any, Sequence

import safetensors.torch
import torch

from fastpipe.errors import PayloadError
from fastpipe.payload.fake import FakeRunError, run_fake, spec_of
from fastpipe.payload.metas import tensor_meta_json
from fastpipe.payload.schema_enums import (
    DTYPE_TO_SCALAR_TYPE,
    TORCH_TO_LAYOUT,
    TORCH_TO_MEMORY_FORMAT,
    device_json,
)
from fastpipe.payload.targets import resolve, target_name
from fastpipe.torch_compat import OpOverload

_WHERE = "encode_payload"


def _fail(node: torch.fx.Node | None, expected: str, found: str) -> PayloadError:
    place = f"node {node.name!r}" if node is not None else "graph"
    return PayloadError(f"{_WHERE}: {place}: expected {expected}, found {found}")


def _attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _is_multi_output(node: Any) -> bool:
    """An op returning several values / a Tensor[] (or a Tensor[] element of one)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _is_multi_output(node.args[0])
    if not isinstance(node.target, OpOverload):
        return False
    returns = node.target._schema.returns
    return len(returns) > 1 or (len(returns) == 1 and _is_tensor_list(returns[0].type))


def _is_tensor_list(schema_type: Any) -> bool:
    if isinstance(schema_type, torch.OptionalType):
        schema_type = schema_type.getElementType()
    return isinstance(schema_type, torch.ListType) and isinstance(schema_type.getElementType(), torch.TensorType)


class _Encoder:
    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any] | None):
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.values = self._values(example_inputs)
        self.alias: dict[str, str] = {}  # duplicate getitem name -> first one
        self.tensor_values: dict[str, dict] = {}

    # -- metas --------------------------------------------------------------------
    def _values(self, example_inputs: Sequence[Any] | None) -> dict[torch.fx.Node, Any]:
        needed = [n for n in self.nodes if n.op in ("placeholder", "call_function")]
        if all("val" in n.meta for n in needed):
            return {n: n.meta["val"] for n in needed}
        if example_inputs is None:
            missing = next(n for n in needed if "val" not in n.meta)
            raise _fail(missing, "node.meta['val'] or example_inputs", "neither")
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        if len(example_inputs) != len(placeholders) or not all(isinstance(t, torch.Tensor) for t in example_inputs):
            raise _fail(None, f"{len(placeholders)} example input tensors", f"{len(example_inputs)} values")
        try:
            _out, env = run_fake(self.gm, [spec_of(t) for t in example_inputs])
        except FakeRunError as err:
            detail = " ".join(str(err.cause).split())[:200]
            raise _fail(err.node, "example inputs the graph accepts", detail) from None
        return env

    def _record(self, name: str, value: Any, node: torch.fx.Node) -> None:
        if not isinstance(value, torch.Tensor):
            raise _fail(node, "a tensor value", type(value).__name__)
        if name in self.tensor_values:
            raise _fail(node, "unique value names", repr(name))
        try:
            self.tensor_values[name] = tensor_meta_json(value)
        except ValueError as exc:
            raise _fail(node, "a serializable tensor", str(exc)) from None

    # -- arguments ------------------------------------------------------------------
    def ref(self, node: torch.fx.Node, user: torch.fx.Node) -> dict:
        if node.op not in ("placeholder", "get_attr", "call_function"):
            raise _fail(user, "tensor arguments", f"a {node.op} node")
        if node.op == "call_function" and node.target is not operator.getitem:
            returns = node.target._schema.returns
            if len(returns) != 1 or _is_tensor_list(returns[0].type):
                raise _fail(user, "a tensor argument", f"the multi-output node {node.name!r}")
        return {"name": self.alias.get(node.name, node.name)}

    def arg(self, value: Any, schema_type: Any, user: torch.fx.Node) -> dict:
        if isinstance(value, torch.fx.Node):
            return {"as_tensor": self.ref(value, user)}
        if value is None:
            return {"as_none": True}
        if type(value) is bool:
            return {"as_bool": value}
        if type(value) is int:
            return {"as_int": value}
        if type(value) is float:
            return {"as_float": value}
        if type(value) is str:
            return {"as_string": value}
        if type(value) is complex:
            return {"as_complex": {"real": value.real, "imag": value.imag}}
        if isinstance(value, torch.dtype) and value in DTYPE_TO_SCALAR_TYPE:
            return {"as_scalar_type": DTYPE_TO_SCALAR_TYPE[value]}
        if isinstance(value, torch.memory_format) and value in TORCH_TO_MEMORY_FORMAT:
            return {"as_memory_format": TORCH_TO_MEMORY_FORMAT[value]}
        if isinstance(value, torch.layout) and value in TORCH_TO_LAYOUT:
            return {"as_layout": TORCH_TO_LAYOUT[value]}
        if isinstance(value, torch.device):
            return {"as_device": device_json(value)}
        if isinstance(value, (list, tuple)):
            return self.list_arg(list(value), schema_type, user)
        raise _fail(user, "a serializable argument", type(value).__name__)

    def list_arg(self, values: list, schema_type: Any, user: torch.fx.Node) -> dict:
        if not values:
            elem = schema_type.getElementType() if isinstance(schema_type, torch.OptionalType) else schema_type
            elem = elem.getElementType() if isinstance(elem, torch.ListType) else elem
            if isinstance(elem, torch.OptionalType):
                elem = elem.getElementType()
            for kind, tag in ((torch.BoolType, "as_bools"), (torch.IntType, "as_ints"),
                              (torch.FloatType, "as_floats"), (torch.StringType, "as_strings"),
                              (torch.TensorType, "as_tensors")):
                if isinstance(elem, kind):
                    return {tag: []}
            raise _fail(user, "an empty list of a known element type", str(schema_type))
        for kind, tag in ((bool, "as_bools"), (int, "as_ints"), (float, "as_floats"), (str, "as_strings")):
            if all(type(v) is kind for v in values):
                return {tag: list(values)}
        if all(isinstance(v, torch.fx.Node) for v in values):
            return {"as_tensors": [self.ref(v, user) for v in values]}
        if all(isinstance(v, (torch.fx.Node, type(None))) for v in values):
            return {"as_optional_tensors": [
                {"as_none": True} if v is None else {"as_tensor": self.ref(v, user)} for v in values
            ]}
        if all(isinstance(v, (list, tuple)) and all(type(x) is int for x in v) for v in values):
            return {"as_int_lists": [list(v) for v in values]}
        raise _fail(user, "a homogeneous list argument", repr([type(v).__name__ for v in values]))

    def inputs(self, node: torch.fx.Node) -> list[dict]:
        out = []
        for i, schema_arg in enumerate(node.target._schema.arguments):
            if schema_arg.name in node.kwargs:
                value = node.kwargs[schema_arg.name]
            elif not schema_arg.kwarg_only and i < len(node.args):
                value = node.args[i]
            else:
                continue  # defaulted: not written, as torch does
            out.append({"name": schema_arg.name, "arg": self.arg(value, schema_arg.type, node)})
        unknown = set(node.kwargs) - {a.name for a in node.target._schema.arguments}
        if unknown:
            raise _fail(node, "keyword arguments of the schema", repr(sorted(unknown)))
        return out

    # -- outputs ------------------------------------------------------------------------
    def getitem_users(self, node: torch.fx.Node) -> dict[int, torch.fx.Node]:
        users: dict[int, torch.fx.Node] = {}
        for user in node.users:
            if user.target is not operator.getitem or user.op != "call_function":
                raise _fail(user, f"only getitem users of the multi-output node {node.name!r}", user.op)
            index = user.args[1]
            if index in users:
                self.alias[user.name] = users[index].name
            else:
                users[index] = user
        return users

    def element(self, parent: torch.fx.Node, index: int, value: Any, users: dict[int, torch.fx.Node]) -> dict:
        name = users[index].name if index in users else f"{parent.name}_unused_{index}"
        if value is None:
            return {"as_none": True}
        self._record(name, value, parent)
        return {"as_tensor": {"name": name}}

    def outputs(self, node: torch.fx.Node) -> list[dict]:
        returns = node.target._schema.returns
        value = self.values[node]
        if not returns:
            return []
        if len(returns) == 1 and _is_tensor_list(returns[0].type):
            users = self.getitem_users(node)
            names = []
            for i, v in enumerate(value):
                element = self.element(node, i, v, users)
                if "as_tensor" not in element:
                    raise _fail(node, "tensors in a Tensor[] result", "None")
                names.append(element["as_tensor"])
            return [{"as_tensors": names}]
        if len(returns) == 1:
            if value is None:
                return [{"as_none": True}]
            self._record(node.name, value, node)
            return [{"as_tensor": {"name": node.name}}]
        users = self.getitem_users(node)
        out = []
        for i, (v, ret) in enumerate(zip(value, returns)):
            if isinstance(v, (list, tuple)) and _is_tensor_list(ret.type):
                inner_users = self.getitem_users(users[i]) if i in users else {}
                holder = users[i] if i in users else None
                names = []
                for j, t in enumerate(v):
                    name = inner_users[j].name if j in inner_users else f"{node.name}_unused_{i}_{j}"
                    self._record(name, t, holder or node)
                    names.append({"name": name})
                out.append({"as_tensors": names})
            else:
                out.append(self.element(node, i, v, users))
        return out

    def created_names(self, node: torch.fx.Node, outputs: list[dict]) -> list[str]:
        """The names of the nodes torch's deserializer makes for ``node``: the call itself, then a
        getitem per output (unused ones too, under their `_unused_` names), in output order. The
        producer's deserialize_gm renames the deserialized nodes from metadata.node_names one by
        one, so the list must follow that order and count."""
        returns = node.target._schema.returns
        if len(returns) == 1 and not _is_tensor_list(returns[0].type):
            return [node.name]
        names = [node.name]
        if len(returns) == 1:
            return names + [t["name"] for t in outputs[0]["as_tensors"]]
        for i, out in enumerate(outputs):
            if "as_tensor" in out:
                names.append(out["as_tensor"]["name"])
            elif "as_tensors" in out:
                names.append(f"{node.name}_list_{i}")
                names += [t["name"] for t in out["as_tensors"]]
        return names

    # -- whole graph --------------------------------------------------------------------------
    def run(self) -> str:
        lifted = [n for n in self.nodes if n.op == "get_attr"]
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        constants: dict[str, torch.Tensor] = {}
        for n in lifted:
            try:
                tensor = _attr(self.gm, n.target)
            except AttributeError:
                raise _fail(n, "an existing attribute", repr(n.target)) from None
            if not isinstance(tensor, torch.Tensor):
                raise _fail(n, "a tensor attribute", type(tensor).__name__)
            constants[n.target] = tensor.detach()
            self._record(n.name, tensor, n)
        for n in placeholders:
            self._record(n.name, self.values[n], n)

        graph_nodes = []
        created: list[str] = []    # node names in the order torch's deserializer creates the nodes
        output_node = None
        for n in self.nodes:
            if n.op in ("placeholder", "get_attr"):
                continue
            if n.op == "output":
                output_node = n
                continue
            if n.op == "call_module" and n.target == "_guards_fn" and not n.users:
                continue  # torch.export .module()'s input-guard hook: shapes are static here anyway
            if n.op != "call_function":
                raise _fail(n, "call_function nodes of aten-level operators", n.op)
            if n.target is operator.getitem:
                if not _is_multi_output(n.args[0]):
                    raise _fail(n, "getitem of a multi-output operator", f"getitem of {n.args[0]!r}")
                continue
            if not isinstance(n.target, OpOverload):
                raise _fail(n, "a torch.ops operator overload", repr(getattr(n.target, "__name__", n.target)))
            name = target_name(n.target)
            try:
                resolve(name, f"{_WHERE}: node {n.name!r}")
            except PayloadError:
                raise _fail(n, "an operator the decoder accepts (see allow_namespace, register_foreign_op)", repr(name)) from None
            graph_nodes.append({
                "target": name,
                "inputs": self.inputs(n),
                "outputs": self.outputs(n),
                "metadata": {},
            })
            created += self.created_names(n, graph_nodes[-1]["outputs"])
        if output_node is None:
            raise _fail(None, "an output node", "none")
        result = output_node.args[0]
        single = isinstance(result, torch.fx.Node)
        results = [result] if single else list(result)
        outputs = []
        for r in results:
            if not isinstance(r, torch.fx.Node):
                raise _fail(output_node, "tensor outputs", type(r).__name__)
            outputs.append({"as_tensor": self.ref(r, output_node)})

        graph = {
            "inputs": [{"as_tensor": {"name": n.name}} for n in lifted + placeholders],
            "outputs": outputs,
            "nodes": graph_nodes,
            "tensor_values": self.tensor_values,
            "sym_int_values": {},
            "sym_bool_values": {},
            "is_single_tensor_return": single,
            "custom_obj_values": {},
        }
        graph["metadata"] = {
            "node_metas": {},
            "node_dynamo_source_info": {},
            "node_names": [n.name for n in lifted + placeholders] + created + [output_node.name],
            "constant_saved_info": {
                "param_files": {},
                "tensor_to_saved_file_id_and_saved_name": {},
                "blob": _blob(constants),
            },
            "getattr_node_targets": {n.name: n.target for n in lifted},
        }
        text = json.dumps(graph)
        return base64.b64encode(text.encode("utf-8")).decode("ascii")


def _blob(constants: dict[str, torch.Tensor]) -> str:
    plain = {k: v.to("cpu").contiguous().clone() for k, v in constants.items()}
    try:
        raw = safetensors.torch.save(plain)
    except Exception as exc:
        raise _fail(None, "constants safetensors can store", " ".join(str(exc).split())[:160]) from None
    return base64.b64encode(raw).decode("ascii")


def encode_payload(gm: torch.fx.GraphModule, example_inputs: Sequence[Any] | None = None) -> str:
    """base64 payload for ``gm`` (an aten-level graph: make_fx / torch.export style)."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise PayloadError(f"{_WHERE}: expected a torch.fx.GraphModule, found {type(gm).__name__}")
    return _Encoder(gm, example_inputs).run()
