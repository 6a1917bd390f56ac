"""Foreign ops (fastpipe.payload.foreign_ops): the producer's `furiosa::*` known by name, a user's own
registered from outside the library, everything else refused with the JSON path and the op's name."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import fastpipe
from fastpipe.builder.assemble import Assembler
from fastpipe.errors import PayloadError
from fastpipe.format import parse_pipeline
from fastpipe.payload import (ForeignOp, decode_payload, encode_payload, foreign_op_names, register_foreign_op,
                              unregister_foreign_op)
from fastpipe.payload.foreign_ops import torch_op

NB, H, Dh, A = 12, 2, 4, 5        # blocks, kv heads, head dim, blocks read per row


def _graph(build) -> fx.GraphModule:
    """A GraphModule from `build(graph) -> outputs` (hand-made: tracing would decompose a foreign op)."""
    g = fx.Graph()
    g.output(tuple(build(g)))
    return fx.GraphModule(torch.nn.Module(), g)


def _paged_read(g, op="furiosa::sparse_select_v1_5", dummy=0):
    cache, ids = g.placeholder("cache"), g.placeholder("ids")
    rows = g.call_function(torch_op(op), (cache, [ids], dummy, A))              # [2*A, 1, H, Dh]
    return [g.call_function(torch.ops.aten.view.default, (rows, [2, A, H * Dh]))]


def _ids():
    # non-contiguous blocks, padding entries (0: the padding block) at the end of each row
    return torch.tensor([7, 3, 11, 0, 0, 5, 9, 2, 8, 0], dtype=torch.int32)


def test_builtin_entries_are_the_producers_ops():
    assert {"furiosa::sparse_select_v1_5", "furiosa::sparse_select", "furiosa::gather_i32"} <= set(foreign_op_names())
    assert str(torch_op("furiosa::sparse_select_v1_5")._schema) == (
        "furiosa::sparse_select_v1_5(Tensor x, Tensor[] indices, SymInt dummy_index, SymInt index_group_size) -> Tensor")


@pytest.mark.parametrize("op", ["furiosa::sparse_select_v1_5", "furiosa::sparse_select"])
def test_sparse_select_reads_blocks_by_id(op):
    cache = torch.randn(NB, 1, H, Dh)
    got = torch_op(op)(cache, [_ids()], 0, A)
    torch.testing.assert_close(got, cache[_ids().long()], rtol=0, atol=0)
    assert torch.equal(got[3], cache[0])        # a padding entry reads the padding block


def test_gather_i32_is_gather():
    x, idx = torch.randn(4, 6), torch.tensor([[0, 5], [1, 1], [3, 2], [4, 0]], dtype=torch.int32)
    torch.testing.assert_close(torch_op("furiosa::gather_i32")(x, 1, idx, False), torch.gather(x, 1, idx.long()))


def test_payload_round_trip_decodes_to_the_registered_op():
    gm = _graph(_paged_read)
    cache, ids = torch.randn(NB, 1, H, Dh), _ids()
    text = encode_payload(gm, [cache, ids])
    assert "torch.ops.furiosa.sparse_select_v1_5.default" in decode_payload(text, where="t").gm.code
    got = decode_payload(text, where="t").gm(cache, ids)[0]
    torch.testing.assert_close(got, cache[ids.long()].view(2, A, H * Dh), rtol=0, atol=0)


def paged_doc(build=_paged_read) -> dict:
    a = Assembler("paged_read")
    a.slot("0", "cpu")
    a.input("cache", (NB, 1, H, Dh), "f32")
    a.input("ids", (2 * A,), "i32")
    a.graph("0", _graph(build), ["cache", "ids"], ["y"])
    a.output(["y"])
    return a.to_json()


def paged_pipeline(build=_paged_read):
    return parse_pipeline(paged_doc(build))


@pytest.mark.parametrize("processor,compile", [("reference", "off"), ("cpu", "wait"), ("region", "off"),
                                               ("region", "wait")])
def test_pipeline_with_sparse_select_runs_on_every_processor(processor, compile):
    s = fastpipe.load(paged_pipeline(), device_map=None, processor=processor, compile=compile)
    cache = torch.randn(NB, 1, H, Dh)
    out = s.run({"cache": cache, "ids": _ids()})
    torch.testing.assert_close(out["y"], cache[_ids().long()].view(2, A, H * Dh), rtol=0, atol=0)


def _patched(change) -> dict:
    """The paged-read pipeline's document with its payload's JSON changed by `change(payload)`."""
    import base64
    import json

    doc = paged_doc()
    st = doc["supertasks"]["1"]
    payload = json.loads(base64.b64decode(st["data"]))
    change(payload)
    st["data"] = base64.b64encode(json.dumps(payload).encode()).decode()
    return doc


def _target(new_target: str) -> dict:
    return _patched(lambda payload: payload["nodes"][0].__setitem__("target", new_target))


def test_an_unknown_foreign_op_keeps_the_precise_refusal():
    doc = _target("torch.ops.furiosa.dequantize.default")
    with pytest.raises(PayloadError) as info:
        fastpipe.load(parse_pipeline(doc), device_map=None)
    msg = str(info.value)
    assert msg.startswith('supertasks["1"].data: nodes[0].target: expected a torch.ops target in namespaces aten, '
                          "fastpipe, prims (or operator.getitem), or a registered foreign op (")
    assert msg.endswith("found 'torch.ops.furiosa.dequantize.default'")


def test_only_the_default_overload_of_a_foreign_op():
    doc = _target("torch.ops.furiosa.sparse_select_v1_5.out")
    with pytest.raises(PayloadError, match=r"nodes\[0\]\.target: expected the default overload of the foreign op "
                                           r"furiosa::sparse_select_v1_5, found 'torch.ops.furiosa.sparse_select_v1_5.out'"):
        fastpipe.load(parse_pipeline(doc), device_map=None)


def test_a_dummy_index_outside_the_cache_is_refused_at_load():
    def dummy_12(payload):
        arg = next(a for a in payload["nodes"][0]["inputs"] if a["name"] == "dummy_index")
        arg["arg"] = {"as_int": NB}

    with pytest.raises(PayloadError, match=r'supertasks\["1"\].*sparse_select: expected 0 <= dummy_index < 12 .*found 12'):
        fastpipe.load(parse_pipeline(_patched(dummy_12)), device_map=None)


def test_a_users_op_registered_from_outside_runs_and_unregistered_is_refused():
    register_foreign_op(ForeignOp("fpt_user::scale_rows", "(Tensor x, Tensor s) -> Tensor",
                                  reference=lambda x, s: x * s[:, None], doc="rows of x times s"))
    try:
        def build(g):
            x, s = g.placeholder("x"), g.placeholder("s")
            return [g.call_function(torch_op("fpt_user::scale_rows"), (x, s))]

        a = Assembler("user_op")
        a.slot("0", "cpu")
        a.input("x", (3, 4), "f32")
        a.input("s", (3,), "f32")
        a.graph("0", _graph(build), ["x", "s"], ["y"])
        a.output(["y"])
        doc = a.to_json()
        x, s = torch.randn(3, 4), torch.tensor([1.0, -2.0, 0.5])
        for processor, compile in (("reference", "off"), ("region", "wait")):
            out = fastpipe.load(parse_pipeline(doc), device_map=None, processor=processor, compile=compile).run(
                {"x": x, "s": s})
            torch.testing.assert_close(out["y"], x * s[:, None])
    finally:
        unregister_foreign_op("fpt_user::scale_rows")
    with pytest.raises(PayloadError, match=r"found 'torch.ops.fpt_user.scale_rows.default'"):
        fastpipe.load(parse_pipeline(doc), device_map=None)
    with pytest.raises(ValueError, match=r"fpt_user::scale_rows is defined already with schema"):   # the op stays
        register_foreign_op(ForeignOp("fpt_user::scale_rows", "(Tensor x) -> Tensor", reference=lambda x: x))


def test_an_op_defined_by_its_own_library_is_adopted_when_the_schema_agrees():
    lib = torch.library.Library("fpt_adopt", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
    register_foreign_op(ForeignOp("fpt_adopt::twice", "(Tensor x) -> Tensor", reference=lambda x: x + x))
    register_foreign_op(ForeignOp("fpt_adopt::other", "(Tensor y) -> Tensor", reference=lambda y: y))
    lib.define("other(Tensor x) -> Tensor")
    lib.impl("other", lambda x: x, "CompositeExplicitAutograd")
    try:
        assert torch_op("fpt_adopt::twice") is torch.ops.fpt_adopt.twice.default
        with pytest.raises(ValueError, match=r"defined in this process with schema .*other\(Tensor x\).*expected "
                                             r"\(Tensor y\) -> Tensor"):
            torch_op("fpt_adopt::other")
    finally:
        unregister_foreign_op("fpt_adopt::twice")
        unregister_foreign_op("fpt_adopt::other")


@pytest.mark.parametrize("name,schema,message", [
    ("aten::mine", "(Tensor x) -> Tensor", "is not foreign"),
    ("no_namespace", "(Tensor x) -> Tensor", "expected a name 'namespace::op'"),
    ("fpt_bad::op", "(Tensor x -> Tensor", ""),
])
def test_registration_checks_its_entry(name, schema, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        register_foreign_op(ForeignOp(name, schema, reference=lambda x: x))
    assert name not in foreign_op_names()
