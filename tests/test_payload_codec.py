"""Compute-supertask payload codec: round trips, producer compatibility, metas."""
from __future__ import annotations

import base64
import copy
import json
import math
import operator

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from fastpipe.errors import ParamError, PayloadError
from fastpipe.payload import (
    DecodedGraph,
    TensorMeta,
    bind_external,
    decode_payload,
    encode_payload,
    propagate_metas,
    unbound_external,
)

WHERE = 'supertasks["3"].data'


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _row_mask(rows, cols, *, seed):
    mask = torch.rand(rows, cols, generator=_gen(seed)) > 0.6
    mask[:, -1] = False  # never mask a whole row (softmax of all -inf is nan)
    return mask


def _outputs(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _check_against_eager(decoded: DecodedGraph, fn, inputs) -> None:
    got = decoded.gm(*inputs)
    assert isinstance(got, tuple)
    want = _outputs(fn(*inputs))
    assert len(got) == len(want)
    for g, w, meta in zip(got, want, decoded.output_metas):
        torch.testing.assert_close(g, w)
        assert meta == TensorMeta(tuple(w.shape), w.dtype)


# --- graphs: (id, fn, input factory(seed)) ----------------------------------------------

def _f_linear(x, w, b):
    return F.linear(x, w, b).relu()


def _f_matmul(x, y):
    return torch.matmul(x, y), x.transpose(1, 2) @ x


def _f_softmax(x):
    return torch.softmax(x, dim=-1), torch.log_softmax(x, dim=0)


def _f_layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-6)


def _f_split(x):
    a, b, c = torch.split(x, [1, 2, 3], dim=1)
    return c * 2, a + 1  # b unused: its getitem is absent (an `_unused_` name)


def _f_unbind_chunk(x):
    p, q = x.chunk(2, dim=0)
    return torch.stack([*x.unbind(1)], dim=0), q - p


def _f_slice(x):
    return x[:, 1:3], x[..., ::2], x[1:, -2:]


def _f_view(x):
    return x.view(2, -1), x.reshape(3, 2, 4).flatten(1), x.unsqueeze(0).squeeze(0).view(-1)


def _f_permute(x):
    return x.permute(2, 0, 1).contiguous(), x.transpose(0, 1)


def _f_embedding(ids, table):
    return F.embedding(ids, table), table[ids[0]]


def _f_cat(x, y):
    return torch.cat([x, y, x], dim=1), torch.stack([x, y])


def _f_where(x, y):
    return torch.where(x > 0, x, y), torch.where(y < 0, y, 0.5)


def _f_casts(x):
    return x.to(torch.float16), (x * 10).to(torch.int32), x.double().sum(), (x > 0).to(torch.int64)


def _f_memory_format(x):
    a = x.contiguous(memory_format=torch.channels_last)
    return a, a.clone(memory_format=torch.contiguous_format) + 1


def _f_reductions(x):
    return x.mean(dim=(0, 2), keepdim=True), x.sum(dim=-1), x.amax(1), x.sum(), x.var(dim=1, unbiased=False)


def _f_scalars(x, mask):
    y = torch.clamp(x * 2.5 + 1, min=-0.5, max=3.0) ** 2
    z = x.masked_fill(mask, float("-inf")).softmax(-1)
    ar = torch.arange(4, dtype=torch.float32, device="cpu")
    return y, z, F.gelu(x, approximate="tanh") + ar, torch.full((2, 4), 7, dtype=torch.int64)


def _f_passthrough(x, y):
    return y, x * y


def _f_single(x):
    return torch.tanh(x)  # bare (non-tuple) return


CASES = [
    ("linear", _f_linear, lambda s: (rand(3, 5, seed=s), rand(4, 5, seed=s + 1), rand(4, seed=s + 2))),
    ("matmul", _f_matmul, lambda s: (rand(2, 3, 4, seed=s), rand(4, 5, seed=s + 1))),
    ("softmax", _f_softmax, lambda s: (rand(3, 7, seed=s),)),
    ("layer_norm", _f_layer_norm, lambda s: (rand(2, 3, 8, seed=s), rand(8, seed=s + 1), rand(8, seed=s + 2))),
    ("split", _f_split, lambda s: (rand(2, 6, 3, seed=s),)),
    ("unbind_chunk", _f_unbind_chunk, lambda s: (rand(4, 3, seed=s),)),
    ("slice", _f_slice, lambda s: (rand(4, 5, seed=s),)),
    ("view", _f_view, lambda s: (rand(6, 4, seed=s),)),
    ("permute", _f_permute, lambda s: (rand(2, 3, 4, seed=s),)),
    ("embedding", _f_embedding,
     lambda s: (torch.randint(0, 10, (2, 5), generator=_gen(s)), rand(10, 6, seed=s + 1))),
    ("cat", _f_cat, lambda s: (rand(2, 3, seed=s), rand(2, 3, seed=s + 1))),
    ("where", _f_where, lambda s: (rand(3, 4, seed=s), rand(3, 4, seed=s + 1))),
    ("casts", _f_casts, lambda s: (rand(3, 4, seed=s),)),
    ("memory_format", _f_memory_format, lambda s: (rand(2, 3, 4, 5, seed=s),)),
    ("reductions", _f_reductions, lambda s: (rand(3, 4, 5, seed=s),)),
    ("scalars", _f_scalars, lambda s: (rand(2, 4, seed=s), _row_mask(2, 4, seed=s + 1))),
    ("passthrough", _f_passthrough, lambda s: (rand(2, 2, seed=s), rand(2, 2, seed=s + 1))),
    ("single_return", _f_single, lambda s: (rand(5, seed=s),)),
]


@pytest.mark.parametrize("name,fn,make_inputs", CASES, ids=[c[0] for c in CASES])
def test_round_trip_matches_eager(name, fn, make_inputs):
    gm = make_fx(fn)(*make_inputs(0))
    decoded = decode_payload(encode_payload(gm), where=WHERE)
    fresh = make_inputs(100)
    assert decoded.input_metas == tuple(TensorMeta(tuple(t.shape), t.dtype) for t in fresh)
    _check_against_eager(decoded, fn, fresh)
    assert decoded.constants == {} and decoded.external_constants == {}


def test_round_trip_keeps_channels_last_layout():
    gm = make_fx(_f_memory_format)(rand(2, 3, 4, 5, seed=0))
    decoded = decode_payload(encode_payload(gm), where=WHERE)
    a, b = decoded.gm(rand(2, 3, 4, 5, seed=1))
    assert a.is_contiguous(memory_format=torch.channels_last)
    assert b.is_contiguous()


def test_encode_uses_example_inputs_without_meta():
    gm = torch.fx.symbolic_trace(lambda x: x)  # placeholder graph, then rebuild with aten ops and no meta
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, x))
    s = graph.call_function(torch.ops.aten.split.Tensor, (y, 2))
    parts = [graph.call_function(__import__("operator").getitem, (s, i)) for i in range(2)]
    graph.output((parts[1], y))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    with pytest.raises(PayloadError, match="example_inputs"):
        encode_payload(gm)
    decoded = decode_payload(encode_payload(gm, example_inputs=[torch.ones(4, 3)]), where=WHERE)
    x_in = rand(4, 3, seed=5)
    first, second = decoded.gm(x_in)
    torch.testing.assert_close(first, (x_in * x_in)[2:])
    torch.testing.assert_close(second, x_in * x_in)


# --- embedded constants ----------------------------------------------------------------

class _WithConstants(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4))

    def forward(self, x):
        bias = torch.tensor([1.0, -1.0, 0.5, 0.0])  # a lifted tensor constant
        return (self.proj(x) * self.scale + bias,)


def _constants_model():
    torch.manual_seed(0)
    return _WithConstants().eval()


def test_embedded_constants_round_trip_via_blob():
    model = _constants_model()
    with torch.no_grad():
        gm = make_fx(model)(rand(3, 6, seed=0))
    getattrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert len(getattrs) >= 3
    data = encode_payload(gm)
    doc = json.loads(base64.b64decode(data))
    meta = doc["metadata"]
    assert set(meta["getattr_node_targets"].values()) == getattrs
    lifted = [a["as_tensor"]["name"] for a in doc["inputs"][: len(getattrs)]]
    assert set(lifted) == set(meta["getattr_node_targets"])
    blob = safetensors.torch.load(base64.b64decode(meta["constant_saved_info"]["blob"]))
    assert set(blob) == getattrs

    decoded = decode_payload(data, where=WHERE)
    placeholders = [n for n in decoded.gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 1 and len(decoded.input_metas) == 1
    assert set(decoded.constants) == getattrs
    for attr, tensor in decoded.constants.items():
        torch.testing.assert_close(tensor, blob[attr])
        assert getattr(decoded.gm, decoded.constant_attrs[attr]) is tensor
    x = rand(3, 6, seed=7)
    with torch.no_grad():
        _check_against_eager(decoded, model, (x,))


# --- the producer's own encoding (torch's serializer), new and old schema ---------------

def _lift_like_producer(gm: torch.fx.GraphModule):
    """furiosa-llm's _separate_constants_in_gm: get_attr -> placeholders before the first one."""
    gm = copy.deepcopy(gm)
    constants = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    first = next(n for n in gm.graph.nodes if n.op == "placeholder")
    targets = {}
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        with gm.graph.inserting_before(first):
            new = gm.graph.placeholder(node.target)
        targets[node.name] = node.target
        node.replace_all_uses_with(new)
        new.meta = node.meta.copy()
        new.meta["val"] = getattr(gm, node.target)
        gm.graph.erase_node(node)
        new.name = node.name
        new.target = node.target
    return gm, constants, targets


def producer_payload(gm: torch.fx.GraphModule, *, old_schema: bool = False) -> str:
    serde = pytest.importorskip("torch._export.serde.serialize")
    from torch.export.graph_signature import ExportGraphSignature

    lifted, constants, targets = _lift_like_producer(gm)
    graph = serde.GraphModuleSerializer(ExportGraphSignature([], []), []).serialize_graph(lifted)
    graph_dict = serde._dataclass_to_dict(graph)
    if old_schema:  # what torch 2.1 - 2.5 wrote
        for node in graph_dict["nodes"]:
            node.pop("name", None)
            node.pop("is_hop_single_tensor_return", None)
            for named in node["inputs"]:
                named.pop("kind", None)
                if "as_float" in named["arg"] and isinstance(named["arg"]["as_float"], str):
                    named["arg"]["as_float"] = float(named["arg"]["as_float"].replace("Infinity", "inf"))
                if "as_none" in named["arg"]:
                    named["arg"]["as_none"] = []
        graph_dict.pop("sym_float_values", None)
    blob = base64.b64encode(safetensors.torch.save({k: v.contiguous() for k, v in constants.items()})).decode()
    graph_dict["metadata"] = {
        "node_metas": {},
        "node_dynamo_source_info": {},
        "node_names": [n.name for n in lifted.graph.nodes],
        "constant_saved_info": {"param_files": {}, "tensor_to_saved_file_id_and_saved_name": {}, "blob": blob},
        "getattr_node_targets": targets,
    }
    text = json.dumps(graph_dict, cls=serde.EnumEncoder)
    return base64.b64encode(text.encode("utf-8")).decode("utf-8")


def _producer_fn(x, w, mask):
    y = F.linear(x, w, torch.tensor([0.5, -0.5, 1.0]))
    a, b = y.split([1, 2], dim=-1)
    n = F.layer_norm(b, (2,))
    return n.masked_fill(mask, float("-inf")).softmax(-1), a.to(torch.float16), y.sum(0, keepdim=True)


def _producer_inputs(seed):
    return rand(4, 5, seed=seed), rand(3, 5, seed=seed + 1), _row_mask(4, 2, seed=seed + 2)


@pytest.mark.parametrize("old_schema", [False, True], ids=["torch-2.13-schema", "torch-2.5-schema"])
def test_decodes_producer_built_payload(old_schema):
    gm = make_fx(_producer_fn)(*_producer_inputs(0))
    data = producer_payload(gm, old_schema=old_schema)
    doc = json.loads(base64.b64decode(data))
    assert ("kind" in doc["nodes"][0]["inputs"][0]) is not old_schema
    decoded = decode_payload(data, where=WHERE)
    assert len(decoded.constants) == 1
    _check_against_eager(decoded, _producer_fn, _producer_inputs(50))


def test_decodes_producer_module_with_parameters():
    model = _constants_model()
    with torch.no_grad():
        gm = make_fx(model)(rand(3, 6, seed=0))
    decoded = decode_payload(producer_payload(gm, old_schema=True), where=WHERE)
    with torch.no_grad():
        _check_against_eager(decoded, model, (rand(3, 6, seed=9),))


def test_torch_deserializer_reads_our_payload():
    """What the producer's deserialize_gm does, with torch's own deserializer (private API)."""
    serde = pytest.importorskip("torch._export.serde.serialize")
    from torch._export.serde.schema import Graph
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental import symbolic_shapes

    gm = make_fx(_producer_fn)(*_producer_inputs(0))
    doc = json.loads(base64.b64decode(encode_payload(gm)))
    metadata = doc.pop("metadata")
    deserializer = serde.GraphModuleDeserializer()
    deserializer.shape_env = symbolic_shapes.ShapeEnv(assume_static_by_default=True)
    deserializer.fake_tensor_mode = FakeTensorMode(shape_env=deserializer.shape_env, allow_non_fake_inputs=True)
    deserializer.symbol_name_to_symbol = {}
    deserializer.symbol_name_to_range = {}
    deserializer.unbacked_symbols = set()
    deserializer.deserialize_graph(serde._dict_to_dataclass(Graph, doc))
    graph = deserializer.graph
    nodes = list(graph.nodes)
    assert len(nodes) == len(metadata["node_names"])  # the producer zips these
    for node, name in zip(nodes, metadata["node_names"]):
        node.name = name
    blob = safetensors.torch.load(base64.b64decode(metadata["constant_saved_info"]["blob"]))
    root = torch.nn.Module()
    for placeholder, attr in metadata["getattr_node_targets"].items():
        root.register_buffer(attr, blob[attr])
        node = next(n for n in graph.nodes if n.name == placeholder)
        with graph.inserting_before(node):
            get_attr = graph.get_attr(attr)
        node.replace_all_uses_with(get_attr)
        graph.erase_node(node)
    theirs = torch.fx.GraphModule(root, graph)
    inputs = _producer_inputs(3)
    for got, want in zip(theirs(*inputs), _producer_fn(*inputs)):
        torch.testing.assert_close(got, want)


def test_node_names_follow_the_deserializer_when_outputs_are_unused():
    """Unused outputs of multi-output ops (dead getitems removed, as the builder's graphs have
    them) are still created by torch's deserializer: node_names must name them, in its order."""
    serde = pytest.importorskip("torch._export.serde.serialize")
    from torch._export.serde.schema import Graph
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental import symbolic_shapes

    def f(x, w, b):
        y = torch.ops.aten.native_layer_norm.default(x, [8], w, b, 1e-5)[0]
        a, _c = torch.split(y, 4, dim=-1)
        return a * 2

    inputs = (torch.randn(2, 8), torch.randn(8), torch.randn(8))
    gm = make_fx(f)(*inputs)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    doc = json.loads(base64.b64decode(encode_payload(gm, inputs)))
    names = doc.pop("metadata")["node_names"]
    d = serde.GraphModuleDeserializer()
    d.shape_env = symbolic_shapes.ShapeEnv(assume_static_by_default=True)
    d.fake_tensor_mode = FakeTensorMode(shape_env=d.shape_env, allow_non_fake_inputs=True)
    d.symbol_name_to_symbol, d.symbol_name_to_range, d.unbacked_symbols = {}, {}, set()
    d.deserialize_graph(serde._dict_to_dataclass(Graph, doc))
    nodes = list(d.graph.nodes)
    assert len(nodes) == len(names)                      # the producer's deserialize_gm zips these
    assert any("_unused_" in n for n in names)
    for node, name in zip(nodes, names):
        if node.op == "call_function" and node.target is operator.getitem:
            assert name.startswith("getitem") or "_unused_" in name, (node, name)


def test_encoded_json_is_the_producer_shape():
    gm = make_fx(_producer_fn)(*_producer_inputs(0))
    doc = json.loads(base64.b64decode(encode_payload(gm)))
    assert list(doc) == ["inputs", "outputs", "nodes", "tensor_values", "sym_int_values",
                         "sym_bool_values", "is_single_tensor_return", "custom_obj_values", "metadata"]
    node = doc["nodes"][0]
    assert list(node) == ["target", "inputs", "outputs", "metadata"]
    assert all(list(a) == ["name", "arg"] for n in doc["nodes"] for a in n["inputs"])
    assert list(doc["metadata"]) == ["node_metas", "node_dynamo_source_info", "node_names",
                                     "constant_saved_info", "getattr_node_targets"]
    assert doc["metadata"]["node_names"][-1] == "output"
    meta = next(iter(doc["tensor_values"].values()))
    assert list(meta) == ["dtype", "sizes", "requires_grad", "device", "strides", "storage_offset", "layout"]
    floats = [a["arg"]["as_float"] for n in doc["nodes"] for a in n["inputs"] if "as_float" in a["arg"]]
    assert -math.inf in floats  # written as the JSON literal -Infinity, as the producer's json.dumps does


# --- propagate_metas ----------------------------------------------------------------------------

def test_propagate_metas_shapes_and_dtypes():
    gm = make_fx(_producer_fn)(*_producer_inputs(0))
    decoded = decode_payload(encode_payload(gm), where=WHERE)
    metas = propagate_metas(decoded, decoded.input_metas)
    assert metas == decoded.output_metas
    assert metas == (
        TensorMeta((4, 2), torch.float32),
        TensorMeta((4, 1), torch.float16),
        TensorMeta((1, 3), torch.float32),
    )
    # the batch dimension flows through a static-shape graph where no op pins it
    other = propagate_metas(decoded, (TensorMeta((7, 5), torch.float32),) + decoded.input_metas[1:2]
                            + (TensorMeta((7, 2), torch.bool),))
    assert other[0] == TensorMeta((7, 2), torch.float32) and other[2] == TensorMeta((1, 3), torch.float32)


def test_propagate_metas_rejects_mismatched_shape():
    decoded = decode_payload(encode_payload(make_fx(_f_matmul)(rand(2, 3, 4, seed=0), rand(4, 5, seed=1))),
                             where=WHERE)
    bad = (TensorMeta((2, 3, 4), torch.float32), TensorMeta((6, 5), torch.float32))
    with pytest.raises(PayloadError) as info:
        propagate_metas(decoded, bad)
    message = str(info.value)
    assert message.startswith(WHERE + ": node ") and "\n" not in message
    with pytest.raises(PayloadError, match="expected 2 input metas, found 1"):
        propagate_metas(decoded, bad[:1])


# --- external constants --------------------------------------------------------------------------

def _with_external(data: str, attr_to_file: dict[str, str], fmt: str = "safetensors") -> str:
    doc = json.loads(base64.b64decode(data))
    info = doc["metadata"]["constant_saved_info"]
    blob = safetensors.torch.load(base64.b64decode(info["blob"]))
    for attr, path in attr_to_file.items():
        del blob[attr]
        info["param_files"]["owned"] = {"path": path, "format": fmt}
        info["tensor_to_saved_file_id_and_saved_name"][attr] = ["owned", "saved." + attr]
    info["blob"] = base64.b64encode(safetensors.torch.save(blob)).decode()
    return base64.b64encode(json.dumps(doc).encode()).decode()


def test_external_constants_are_described_then_bound():
    model = _constants_model()
    with torch.no_grad():
        gm = make_fx(model)(rand(3, 6, seed=0))
    attr = next(n.target for n in gm.graph.nodes if n.op == "get_attr")
    real = getattr(gm, attr).detach().clone()
    decoded = decode_payload(_with_external(encode_payload(gm), {attr: "/models/consts.safetensors"}), where=WHERE)
    assert decoded.external_constants == {attr: ("/models/consts.safetensors", "safetensors", "saved." + attr)}
    assert attr not in decoded.constants
    assert getattr(decoded.gm, decoded.constant_attrs[attr]).device.type == "meta"
    assert propagate_metas(decoded, decoded.input_metas) == decoded.output_metas  # works before binding
    assert unbound_external(decoded) == [attr]
    with pytest.raises(ParamError, match="expected shape"):
        bind_external(decoded, {attr: torch.zeros(real.numel() + 1)})
    with pytest.raises(ParamError, match="unknown name"):
        bind_external(decoded, {"nope": real})
    bind_external(decoded, {attr: real})
    assert unbound_external(decoded) == []
    with torch.no_grad():
        _check_against_eager(decoded, model, (rand(3, 6, seed=4),))


def test_external_constant_in_pickle_format_is_refused():
    model = _constants_model()
    with torch.no_grad():
        gm = make_fx(model)(rand(3, 6, seed=0))
    attr = next(n.target for n in gm.graph.nodes if n.op == "get_attr")
    data = _with_external(encode_payload(gm), {attr: "/m.pt"}, fmt="torch.save")
    with pytest.raises(PayloadError) as info:
        decode_payload(data, where=WHERE)
    assert str(info.value).startswith(WHERE + ': metadata.constant_saved_info.param_files["owned"].format: ')


# --- decoded graphs re-encode; hand-written payloads ----------------------------------------------

def test_decoded_graph_re_encodes_with_example_inputs():
    model = _constants_model()
    with torch.no_grad():
        gm = make_fx(model)(rand(3, 6, seed=0))
    first = decode_payload(encode_payload(gm), where=WHERE)
    again = decode_payload(encode_payload(first.gm, example_inputs=[torch.empty(3, 6)]), where=WHERE)
    assert set(again.constants) == set(first.constant_attrs.values())
    with torch.no_grad():
        _check_against_eager(again, model, (rand(3, 6, seed=2),))


def _pack(doc: dict) -> str:
    return base64.b64encode(json.dumps(doc).encode()).decode()


def test_minimal_hand_written_payload_and_keyword_named_arguments():
    """`from` is a Python keyword: it must be passed positionally even when marked KEYWORD."""
    vec = {"dtype": 7, "sizes": [{"as_int": 1000}]}
    doc = {
        "inputs": [{"as_tensor": {"name": "x"}}],
        "outputs": [{"as_tensor": {"name": "u"}}],
        "nodes": [{
            "target": "torch.ops.aten.uniform.default",
            "inputs": [
                {"name": "self", "arg": {"as_tensor": {"name": "x"}}, "kind": 1},
                {"name": "to", "arg": {"as_float": 0.5}, "kind": 2},
                {"name": "from", "arg": {"as_float": 0.25}, "kind": 2},
            ],
            "outputs": [{"as_tensor": {"name": "u"}}],
            "metadata": {},
        }],
        "tensor_values": {"x": vec, "u": vec},
        "sym_int_values": {},
        "sym_bool_values": {},
        "metadata": {},
    }
    decoded = decode_payload(_pack(doc), where=WHERE)
    (u,) = decoded.gm(torch.zeros(1000))
    assert 0.25 <= float(u.min()) and float(u.max()) <= 0.5 and float(u.max()) > 0.4
    assert decoded.input_metas == decoded.output_metas == (TensorMeta((1000,), torch.float32),)


def test_torch_export_module_round_trip_with_dotted_constant_names():
    model = _constants_model()
    exported = torch.export.export(model, (rand(3, 6, seed=0),)).module()
    decoded = decode_payload(encode_payload(exported), where=WHERE)
    assert {"proj.weight", "proj.bias", "scale"} <= set(decoded.constants)
    assert "." not in decoded.constant_attrs["proj.weight"]  # stored under a safe buffer name
    torch.testing.assert_close(decoded.constants["proj.weight"], model.proj.weight.detach())
    with torch.no_grad():
        _check_against_eager(decoded, model, (rand(3, 6, seed=8),))


def test_explicit_getitem_node_on_a_named_multi_output_node():
    gm = make_fx(_producer_fn)(*_producer_inputs(0))
    doc = json.loads(base64.b64decode(producer_payload(gm)))  # 2.13 schema: nodes carry `name`
    split = next(n for n in doc["nodes"] if n["target"].endswith("split_with_sizes.default"))
    doc["nodes"].append({
        "target": "_operator.getitem",
        "inputs": [{"name": "", "arg": {"as_tensor": {"name": split["name"]}}},
                   {"name": "", "arg": {"as_int": 1}}],
        "outputs": [{"as_tensor": {"name": "second_part"}}],
        "metadata": {},
    })
    doc["outputs"].append({"as_tensor": {"name": "second_part"}})
    doc["tensor_values"]["second_part"] = {"dtype": 7, "sizes": [{"as_int": 4}, {"as_int": 2}]}
    decoded = decode_payload(_pack(doc), where=WHERE)
    inputs = _producer_inputs(11)
    got = decoded.gm(*inputs)
    y = F.linear(inputs[0], inputs[1], torch.tensor([0.5, -0.5, 1.0]))
    torch.testing.assert_close(got[-1], y[:, 1:])
    assert decoded.output_metas[-1] == TensorMeta((4, 2), torch.float32)
