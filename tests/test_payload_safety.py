"""Decoding never executes code from a payload, and refuses what it cannot trust.

Every refusal must be a one-line PayloadError that starts with the where-path
and names the offending field. Decoding runs with eval/exec/pickle/torch.load
replaced by tripwires.
"""
from __future__ import annotations

import base64
import builtins
import contextlib
import copy
import functools
import io
import json
import pickle

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from fastpipe.errors import PayloadError
from fastpipe.payload import allow_namespace, decode_payload, encode_payload
from fastpipe.payload import targets as payload_targets

WHERE = 'supertasks["3"].data'


# --- fixtures and helpers ----------------------------------------------------------------

def _base_fn(x, w):
    y = F.linear(x, w, torch.tensor([1.0, 2.0, 3.0]))  # a lifted constant in the blob
    a, b = y.split([1, 2], dim=1)
    return F.gelu(b, approximate="tanh"), a.sum(dim=0, keepdim=True)


def _base_inputs():
    return torch.randn(4, 5), torch.randn(3, 5)


@functools.lru_cache(maxsize=None)
def _base_text() -> str:
    gm = make_fx(_base_fn)(*_base_inputs())
    return base64.b64decode(encode_payload(gm)).decode("utf-8")


def base_doc() -> dict:
    return json.loads(_base_text())


def pack(doc) -> str:
    return base64.b64encode(json.dumps(doc).encode("utf-8")).decode("ascii")


def node(doc: dict, target_suffix: str) -> tuple[int, dict]:
    for i, n in enumerate(doc["nodes"]):
        if n["target"].endswith(target_suffix):
            return i, n
    raise KeyError(target_suffix)


@pytest.fixture(autouse=True)
def _fresh_namespaces(monkeypatch):
    """Each test starts from the default allow-list and leaves no namespace behind."""
    monkeypatch.setattr(payload_targets, "_extra_namespaces", set())


@contextlib.contextmanager
def tripwires():
    """Replace every way of running code from data; record (and refuse) any call."""
    calls: list[str] = []

    def trip(name):
        def _tripped(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called during decode")
        return _tripped

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "eval", trip("eval"))
        mp.setattr(builtins, "exec", trip("exec"))
        mp.setattr(builtins, "compile", trip("compile"))
        mp.setattr(pickle, "loads", trip("pickle.loads"))
        mp.setattr(pickle, "load", trip("pickle.load"))
        mp.setattr(pickle, "Unpickler", trip("pickle.Unpickler"))
        mp.setattr(torch, "load", trip("torch.load"))
        yield calls


def guarded_decode(data):
    with tripwires() as calls:
        try:
            return decode_payload(data, where=WHERE)
        finally:
            assert calls == [], f"decode called {calls}"


def refused(data, *fields: str) -> str:
    with pytest.raises(PayloadError) as info:
        guarded_decode(data)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message
    assert message.startswith(WHERE + ": "), message
    for field in fields:
        assert field in message, (field, message)
    return message


def test_base_payload_decodes_under_tripwires():
    decoded = guarded_decode(pack(base_doc()))
    x, w = _base_inputs()
    for got, want in zip(decoded.gm(x, w), _base_fn(x, w)):  # runs outside the tripwires
        torch.testing.assert_close(got, want)
    assert isinstance(guarded_decode(pack(base_doc()).encode("ascii")).gm, torch.fx.GraphModule)


# --- call targets ----------------------------------------------------------------------------

def test_builtins_eval_message_is_exact():
    doc = base_doc()
    doc["nodes"][2]["target"] = "builtins.eval"
    message = refused(pack(doc))
    assert message == (
        'supertasks["3"].data: nodes[2].target: expected a torch.ops target in namespaces '
        "aten, fastpipe, prims (or operator.getitem), or a registered foreign op (furiosa::gather_i32, "
        "furiosa::sparse_select, furiosa::sparse_select_v1_5), found 'builtins.eval'"
    )


@pytest.mark.parametrize(
    "target",
    [
        "builtins.eval",
        "builtins.exec",
        "os.system",
        "subprocess.run",
        "torch.load",
        "torch.ops.aten.__class__",
        "torch.ops.aten.__class__.__name__",
        "torch.ops.aten.mm.__call__",
        "torch.ops.aten.mm",
        "torch.ops.higher_order.cond.default",
        "torch.ops.myns.op.default",
        "torch.ops.aten.mm.default; import os",
        "torch.ops.aten.mm.default\nimport os",
        "torch.ops.aten..mm.default",
        "",
    ],
)
def test_targets_outside_the_allow_list_are_refused(target):
    doc = base_doc()
    i, _ = node(doc, "gelu.default")
    doc["nodes"][i]["target"] = target
    refused(pack(doc), f"nodes[{i}].target", "expected a torch.ops target")


@pytest.mark.parametrize(
    "target,why",
    [
        ("torch.ops.aten.no_such_op.default", "registered"),
        ("torch.ops.aten.gelu.no_such_overload", "registered"),
        ("torch.ops.aten.gelu.overloads", "registered"),  # a method of the packet, not an OpOverload
        ("torch.ops.aten.save.default", "file side effects"),
        ("torch.ops.aten.from_file.default", "file side effects"),
    ],
)
def test_unresolvable_or_io_operators_are_refused(target, why):
    doc = base_doc()
    i, _ = node(doc, "gelu.default")
    doc["nodes"][i]["target"] = target
    refused(pack(doc), f"nodes[{i}].target", why)


def test_non_string_target_is_refused():
    doc = base_doc()
    doc["nodes"][0]["target"] = {"as_operator": "builtins.eval"}
    refused(pack(doc), "nodes[0].target")


_custom_lib = None


def _register_custom_op():
    global _custom_lib
    if _custom_lib is None:
        _custom_lib = torch.library.Library("fpt_custom", "DEF")
        _custom_lib.define("scale2(Tensor self) -> Tensor")
        _custom_lib.impl("scale2", lambda self: self * 2, "CompositeExplicitAutograd")


def test_custom_namespace_needs_allow_namespace():
    _register_custom_op()
    doc = base_doc()
    i, gelu = node(doc, "gelu.default")
    gelu["target"] = "torch.ops.fpt_custom.scale2.default"
    gelu["inputs"] = gelu["inputs"][:1]  # scale2(Tensor self)
    data = pack(doc)
    refused(data, f"nodes[{i}].target", "'torch.ops.fpt_custom.scale2.default'")

    def uses_custom(x):
        return torch.ops.fpt_custom.scale2.default(x) + 1

    custom_gm = make_fx(uses_custom)(torch.randn(3))
    with pytest.raises(PayloadError, match="allow_namespace"):
        encode_payload(custom_gm)  # the encoder never writes what the decoder would refuse

    allow_namespace("fpt_custom")
    round_trip = guarded_decode(encode_payload(custom_gm))
    v = torch.randn(3)
    torch.testing.assert_close(round_trip.gm(v)[0], v * 2 + 1)
    decoded = guarded_decode(data)
    x, w = _base_inputs()
    got, _ = decoded.gm(x, w)
    b = F.linear(x, w, torch.tensor([1.0, 2.0, 3.0]))[:, 1:]
    torch.testing.assert_close(got, b * 2)
    with pytest.raises(ValueError):
        allow_namespace("not a namespace")
    with pytest.raises(ValueError):
        allow_namespace("higher_order")


# --- argument kinds that could carry code ----------------------------------------------------

_EXPR = {"expr_str": "__import__('os').system('touch /tmp/fastpipe_pwned')", "hint": None}


@pytest.mark.parametrize(
    "arg,field",
    [
        ({"as_sym_int": {"as_expr": _EXPR}}, "arg.as_sym_int.as_expr"),
        ({"as_sym_int": {"as_name": "s0"}}, "arg.as_sym_int.as_name"),
        ({"as_sym_ints": [{"as_int": 1}, {"as_expr": _EXPR}]}, "arg.as_sym_ints[1].as_expr"),
        ({"as_graph": {"name": "g", "graph": {"inputs": [], "outputs": [], "nodes": []}}}, "arg.as_graph"),
        ({"as_custom_obj": {"name": "obj", "class_fqn": "__torch__.os.system"}}, "arg.as_custom_obj"),
        ({"as_operator": "builtins.eval"}, "arg.as_operator"),
        ({"as_string_to_argument": {"a": {"as_int": 1}}}, "arg.as_string_to_argument"),
        ({"as_nested_tensors": [[{"name": "x_1"}]]}, "arg.as_nested_tensors"),
        ({"as_python_object": "gASV"}, "arg.as_python_object"),
        ({"as_int": 1, "as_graph": {}}, "arg"),
        ({"as_int": "1"}, "arg.as_int"),
        ({"as_int": True}, "arg.as_int"),
        ({"as_scalar_type": 99}, "arg.as_scalar_type"),
        ({"as_device": {"type": "cpu')); import os; ((", "index": None}}, "arg.as_device"),
    ],
)
def test_refused_argument_kinds(arg, field):
    doc = base_doc()
    i, split = node(doc, "split_with_sizes.default")
    split["inputs"][2]["arg"] = arg  # the `dim` argument
    refused(pack(doc), f"nodes[{i}].inputs[2].{field}")


def test_symbolic_sizes_are_refused():
    doc = base_doc()
    doc["tensor_values"]["x_1"]["sizes"][0] = {"as_expr": _EXPR}
    refused(pack(doc), 'tensor_values["x_1"].sizes[0].as_expr', "symbolic expression")
    doc = base_doc()
    doc["tensor_values"]["addmm"]["strides"][1] = {"as_expr": _EXPR}
    refused(pack(doc), 'tensor_values["addmm"].strides[1].as_expr')
    doc = base_doc()
    doc["sym_int_values"] = {"s0": {"as_expr": _EXPR}}
    refused(pack(doc), 'sym_int_values["s0"].as_expr')
    doc = base_doc()
    doc["sym_bool_values"] = {"b0": {"as_expr": {"expr_str": "Eq(s0, 1)"}}}
    refused(pack(doc), 'sym_bool_values["b0"].as_expr')


def test_custom_objects_are_refused():
    doc = base_doc()
    doc["inputs"].append({"as_custom_obj": {"name": "obj", "class_fqn": "__torch__.evil"}})
    refused(pack(doc), "inputs[3].as_custom_obj")
    doc = base_doc()
    doc["custom_obj_values"] = {"obj": {"name": "obj", "class_fqn": "__torch__.evil"}}
    refused(pack(doc), "custom_obj_values")
    doc = base_doc()
    i, gelu = node(doc, "gelu.default")
    gelu["outputs"] = [{"as_sym_int": {"as_name": "s0"}}]
    refused(pack(doc), f"nodes[{i}].outputs[0].as_sym_int")


def test_code_in_strings_and_names_stays_inert(tmp_path):
    sentinel = tmp_path / "pwned"
    doc = base_doc()
    i, gelu = node(doc, "gelu.default")
    gelu["inputs"][1]["arg"]["as_string"] = f"tanh'); open({str(sentinel)!r}, 'w'); ('"
    decoded = guarded_decode(pack(doc))  # a string is data: decoding accepts it ...
    with pytest.raises(RuntimeError):
        decoded.gm(*_base_inputs())  # ... and gelu rejects the value at run time
    assert not sentinel.exists()

    doc = base_doc()
    doc["inputs"][1]["as_tensor"]["name"] = "x): import os #"
    refused(pack(doc), "inputs[1].as_tensor.name", "identifier")

    # names that are legal but clash with Python / generated code still work
    doc = json.loads(_base_text().replace('"x_1"', '"self"').replace('"w_1"', '"torch"'))
    decoded = guarded_decode(pack(doc))
    x, w = _base_inputs()
    torch.testing.assert_close(decoded.gm(x, w)[1], _base_fn(x, w)[1])
    assert decoded.input_names == ("self", "torch")


# --- constants blob ----------------------------------------------------------------------------

def _set_blob(doc, raw: bytes | str):
    text = raw if isinstance(raw, str) else base64.b64encode(raw).decode()
    doc["metadata"]["constant_saved_info"]["blob"] = text
    return doc


BLOB = "metadata.constant_saved_info.blob"


def test_blob_that_is_not_safetensors_is_refused():
    refused(pack(_set_blob(base_doc(), b"\x00" * 64)), BLOB, "safetensors")
    refused(pack(_set_blob(base_doc(), b"definitely not a safetensors file")), BLOB, "safetensors")
    refused(pack(_set_blob(base_doc(), "not base64 !!")), BLOB, "base64")


def test_pickled_blob_is_refused():
    class Boom:
        def __reduce__(self):
            return (builtins.exec, ("raise SystemExit('pickle ran')",))

    refused(pack(_set_blob(base_doc(), pickle.dumps({"_tensor_constant0": Boom()}))), BLOB)
    buffer = io.BytesIO()
    torch.save({"_tensor_constant0": torch.ones(3)}, buffer)
    refused(pack(_set_blob(base_doc(), buffer.getvalue())), BLOB)


def test_blob_constant_must_match_its_declared_meta():
    doc = _set_blob(base_doc(), safetensors.torch.save({"_tensor_constant0": torch.ones(4)}))
    refused(pack(doc), BLOB + '["_tensor_constant0"]', "shape [3]")
    doc = _set_blob(base_doc(), safetensors.torch.save({"other": torch.ones(3)}))
    refused(pack(doc), 'metadata.getattr_node_targets["_tensor_constant0"]')


# --- framing and structure ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "data,expected",
    [
        ("###", "base64"),
        ("YWJj=", "base64"),
        ("caf\u00e9", "base64"),
        (b"\xff\xfe", "base64"),
        (base64.b64encode(b"\xff\xfe\xfd").decode(), "UTF-8"),
        (base64.b64encode(b'{"inputs": [').decode(), "JSON"),
        (base64.b64encode(b"[1, 2]").decode(), "JSON object"),
        (base64.b64encode(b"[" * 100000 + b"]" * 100000).decode(), "JSON"),
        (12, "base64"),
    ],
)
def test_framing_errors(data, expected):
    message = refused(data, expected)
    assert len(message) < 400


def _drop(doc, *path):
    target = doc
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return doc


def test_structural_errors_name_the_field():
    refused(pack(_drop(base_doc(), "nodes")), "nodes: expected key 'nodes'")
    # no metadata key (furiosa-llm 2024.1.x writes none): no lifted constants, every input is real
    plain = decode_payload(pack(_drop(base_doc(), "metadata")), where="w")
    lifted = decode_payload(pack(base_doc()), where="w")
    assert len(plain.input_metas) == len(lifted.input_metas) + 1 and not plain.constants
    refused(pack(_drop(base_doc(), "nodes", 1, "target")), "nodes[1].target")
    refused(pack(_drop(base_doc(), "nodes", 1, "inputs", 0, "arg")), "nodes[1].inputs[0].arg")

    doc = base_doc()
    doc["tensor_values"]["x_1"]["dtype"] = 99
    refused(pack(doc), 'tensor_values["x_1"].dtype', "ScalarType", "99")

    doc = base_doc()
    doc["tensor_values"]["x_1"]["layout"] = 1
    refused(pack(doc), 'tensor_values["x_1"].layout')

    doc = base_doc()
    doc["nodes"].reverse()  # uses before definitions
    refused(pack(doc), "nodes[0].inputs[0].arg.as_tensor.name", "defined earlier")

    doc = base_doc()
    del doc["tensor_values"]["w_1"]
    refused(pack(doc), "inputs[2].as_tensor.name", "tensor_values")

    doc = base_doc()
    doc["inputs"].append({"as_tensor": {"name": "x_1"}})
    refused(pack(doc), "inputs[3].as_tensor.name", "not defined before")

    doc = base_doc()
    doc["inputs"] = doc["inputs"][1:] + doc["inputs"][:1]  # lifted constant after real inputs
    refused(pack(doc), "inputs[2].as_tensor.name", "before the real inputs")

    doc = base_doc()
    doc["metadata"]["getattr_node_targets"]["ghost"] = "_tensor_constant0"
    refused(pack(doc), 'metadata.getattr_node_targets["ghost"]')

    doc = base_doc()
    i, gelu = node(doc, "gelu.default")
    gelu["outputs"] = [{"as_tensor": {"name": "t"}}]  # redefinition
    refused(pack(doc), f"nodes[{i}].outputs[0].as_tensor.name", "not defined before")

    doc = base_doc()
    i, gelu = node(doc, "gelu.default")
    gelu["outputs"].append({"as_tensor": {"name": "extra"}})
    refused(pack(doc), f"nodes[{i}].outputs", "1 outputs")

    doc = base_doc()
    i, gelu = node(doc, "gelu.default")
    gelu["inputs"][1]["name"] = "approximation"
    refused(pack(doc), f"nodes[{i}].inputs[1].name", "aten::gelu")

    doc = base_doc()
    i, split = node(doc, "split_with_sizes.default")
    del split["inputs"][1]  # required split_sizes
    refused(pack(doc), f"nodes[{i}].inputs", "split_sizes")

    doc = base_doc()
    i, gelu = node(doc, "gelu.default")
    gelu["inputs"][0]["kind"] = 7
    refused(pack(doc), f"nodes[{i}].inputs[0].kind")

    doc = base_doc()
    i, split = node(doc, "split_with_sizes.default")
    split["inputs"][1]["arg"] = {"as_tensor": {"name": "x_1"}}  # a tensor where int[] is expected
    refused(pack(doc), f"nodes[{i}].inputs[1].arg", "int")

    doc = base_doc()
    doc["outputs"].append({"as_tensor": {"name": "nowhere"}})
    refused(pack(doc), "outputs[2].as_tensor.name")

    doc = base_doc()
    doc["outputs"][0] = {"as_int": 3}
    refused(pack(doc), "outputs[0].as_int")

    doc = base_doc()
    doc["metadata"]["constant_saved_info"]["param_files"] = {"f": {"path": "/x.pt", "format": "torch.save"}}
    doc["metadata"]["constant_saved_info"]["tensor_to_saved_file_id_and_saved_name"] = {"w": ["f", "w"]}
    refused(pack(doc), 'metadata.constant_saved_info.param_files["f"].format', "'torch.save'")


# --- fuzzing: anything else is a PayloadError, never another exception, never code --------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=12) | st.sampled_from(["as_expr", "as_graph", "builtins.eval", "x_1", "Infinity"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["as_int", "as_tensor", "name", "as_expr", "as_none", "arg", "kind", "as_ints"])
        | st.text(max_size=6),
        inner,
        max_size=3,
    ),
    max_leaves=8,
)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


_ALL_PATHS = None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_payloads_fail_cleanly(data):
    global _ALL_PATHS
    if _ALL_PATHS is None:
        _ALL_PATHS = [p for p in _paths(base_doc()) if p and p[:2] != ("metadata", "node_metas")]
    doc = base_doc()
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_ALL_PATHS))
        target = doc
        try:
            for key in path[:-1]:
                target = target[key]
            if data.draw(st.booleans()) and isinstance(target, dict):
                target.pop(path[-1], None)
            else:
                target[path[-1]] = data.draw(_json_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed this path
    try:
        guarded_decode(pack(copy.deepcopy(doc)))
    except PayloadError as err:
        message = str(err)
        assert message.startswith(WHERE) and "\n" not in message
