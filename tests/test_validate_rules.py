"""One failing fixture per validation rule, with its one-line message asserted."""
import re

import pytest

from fastpipe.errors import ValidationError
from fastpipe.format import parse_pipeline
from fastpipe.validate import validate_structure
from tests.docs import comm_doc, tp_doc


def check(doc):
    return validate_structure(parse_pipeline(doc))


def refused(doc, pattern: str) -> str:
    with pytest.raises(ValidationError) as e:
        check(doc)
    msg = str(e.value)
    assert "\n" not in msg
    assert re.search(pattern, msg), msg
    return msg


def test_valid_docs_pass():
    c = check(tp_doc())
    assert set(c.groups) == {"g"} and c.groups["g"].members == ("3", "4")


# ---------------------------------------------------------------- structure
def test_one_input_supertask():
    d = tp_doc()
    d["supertasks"]["9"] = {"kind": "input", "inputs": [], "outputs": []}
    refused(d, r"^supertasks: expected exactly one input supertask, found 2 \(0, 9\)$")


def test_one_output_supertask():
    d = tp_doc()
    del d["supertasks"]["5"]
    refused(d, r"^supertasks: expected exactly one output supertask, found 0$")


def test_input_supertask_has_no_inputs():
    d = tp_doc()
    d["supertasks"]["0"]["inputs"] = ["w_0"]
    refused(d, r'^supertasks\["0"\]\.inputs: expected \[\] for the input supertask, found 1 tensors$')


def test_output_supertask_has_no_outputs():
    d = tp_doc()
    d["supertasks"]["5"]["outputs"] = ["x"]
    refused(d, r'^supertasks\["5"\]\.outputs: expected \[\] for the output supertask')


def test_undeclared_tensor():
    d = tp_doc()
    d["supertasks"]["1"]["inputs"].append("ghost")
    refused(d, r'^supertasks\["1"\]\.inputs\[2\]: expected a tensor declared in tensors, found "ghost"$')


def test_unused_tensor():
    d = tp_doc()
    d["tensors"]["extra"] = {"shape": [1], "dtype": "f32"}
    refused(d, r'^tensors\["extra"\]: expected every tensor to be an input or output of some supertask, found it unused$')


def test_constant_produced():
    d = tp_doc()
    d["tensors"]["p_0"]["value"] = {"path": "w.safetensors", "format": "safetensors", "name": "w"}
    refused(d, r'^tensors\["p_0"\]: expected a constant \(it has a value\) to be produced by no supertask, found it an output of supertask "1"$')


def test_constant_as_pipeline_output():
    d = tp_doc()
    d["supertasks"]["5"]["inputs"].append("w_0")
    refused(d, r'^tensors\["w_0"\]: expected a constant to feed compute or comm supertasks only')


def test_variable_without_producer():
    d = tp_doc()
    d["supertasks"]["0"]["outputs"] = []
    d["supertasks"]["5"]["inputs"].append("x")
    refused(d, r'^tensors\["x"\]: expected a variable tensor to be produced exactly once, found no producer \(and no value\)$')


def test_produced_twice():
    d = tp_doc()
    d["supertasks"]["2"]["outputs"] = ["p_0"]
    refused(d, r'expected a variable tensor to be produced exactly once, found 2 producers \(1, 2\)')


def test_input_and_output_at_once():
    d = tp_doc()
    d["supertasks"]["5"]["inputs"].append("x")
    refused(d, r'^tensors\["x"\]: expected a tensor to be exactly one of constant, pipeline input, pipeline output or intermediate, found it both')


def test_unconsumed_pipeline_input():
    d = tp_doc()
    d["tensors"]["z"] = {"shape": [1], "dtype": "f32"}
    d["supertasks"]["0"]["outputs"].append("z")
    refused(d, r'^tensors\["z"\]: expected the pipeline input to be consumed, found no consumer$')


def test_unconsumed_intermediate():
    d = tp_doc()
    d["supertasks"]["5"]["inputs"] = ["y_0"]
    refused(d, r'^tensors\["y_1"\]: expected the output of supertask "4" to be consumed, found no consumer$')


def test_consumed_on_another_slot():
    d = tp_doc()
    d["supertasks"]["2"]["inputs"] = ["p_0", "w_1"]
    d["supertasks"]["1"]["outputs"] = ["p_0"]
    d["supertasks"]["0"]["outputs"] = ["x"]
    d["tensors"]["p_1"]["shape"] = [4, 8]
    refused(d, r'^supertasks\["2"\]\.inputs: expected "p_0" to be consumed on its producer\'s slot "0" \(cross-slot data needs a comm supertask\), found slot "1"$')


def test_supertask_on_undeclared_slot():
    d = tp_doc()
    d["supertasks"]["2"]["device"] = "7"
    refused(d, r'^supertasks\["2"\]\.device: expected a declared slot \(0, 1\), found "7"$')


def test_declared_slot_unused():
    d = tp_doc()
    d["devices"]["2"] = {"kind": "cpu", "idx": 2}
    refused(d, r'^devices\["2"\]: expected every declared slot to run a supertask, found none on slot "2"$')


def test_self_consuming_supertask():
    d = tp_doc()
    d["supertasks"]["1"]["inputs"].append("p_0")
    refused(d, r'expected a supertask not to consume its own output')


# ---------------------------------------------------------------- order
def test_dead_supertask():
    """A chain whose results never reach an output: the first dead supertask is named."""
    d = tp_doc()
    d["tensors"]["dead_mid"] = {"shape": [1], "dtype": "f32"}
    d["supertasks"]["8"] = {"kind": "fx", "inputs": ["x"], "outputs": ["dead_mid"], "device": "0", "data": "AAAA"}
    d["supertasks"]["9"] = {"kind": "fx", "inputs": ["dead_mid"], "outputs": [], "device": "0", "data": "AAAA"}
    refused(d, r'^supertasks\["8"\]: expected every supertask to contribute to the pipeline outputs, found it dead')


def test_cycle_through_compute():
    d = tp_doc()
    d["tensors"]["loop"] = {"shape": [4, 8], "dtype": "f32"}
    d["supertasks"]["1"]["inputs"].append("loop")
    d["supertasks"]["6"] = {"kind": "fx", "inputs": ["p_0"], "outputs": ["loop"], "device": "0", "data": "AAAA"}
    refused(d, r'^supertasks: expected no cycle .*found supertasks\["1"\] -> supertasks\["6"\] -> supertasks\["1"\]$')


def test_collectives_in_opposite_orders_are_a_cycle():
    """slot 0 runs group A then B, slot 1 runs B then A: a hang on real NCCL."""
    f32 = {"shape": [2], "dtype": "f32"}
    t = {k: dict(f32) for k in ("x0", "x1", "a0", "a1", "b0", "b1", "m0", "m1", "n0", "n1")}
    s = {
        "in": {"kind": "input", "inputs": [], "outputs": ["x0", "x1"]},
        "A0": {"kind": "all_reduce", "inputs": ["x0"], "outputs": ["a0"], "device": "0", "group": "A", "device_idx": 0, "metadata": {"reduce_op": "sum"}},
        "f0": {"kind": "fx", "inputs": ["a0"], "outputs": ["m0"], "device": "0", "data": "AAAA"},
        "B0": {"kind": "all_reduce", "inputs": ["m0"], "outputs": ["b0"], "device": "0", "group": "B", "device_idx": 0, "metadata": {"reduce_op": "sum"}},
        "B1": {"kind": "all_reduce", "inputs": ["x1"], "outputs": ["b1"], "device": "1", "group": "B", "device_idx": 1, "metadata": {"reduce_op": "sum"}},
        "f1": {"kind": "fx", "inputs": ["b1"], "outputs": ["m1"], "device": "1", "data": "AAAA"},
        "A1": {"kind": "all_reduce", "inputs": ["m1"], "outputs": ["a1"], "device": "1", "group": "A", "device_idx": 1, "metadata": {"reduce_op": "sum"}},
        "out": {"kind": "output", "inputs": ["b0", "a1"], "outputs": []},
    }
    for k in ("n0", "n1"):
        del t[k]
    d = {"name": "opposite", "devices": {"0": "cpu:0", "1": "cpu:1"}, "tensors": t, "supertasks": s}
    msg = refused(d, r'^supertasks: expected no cycle \(a comm group counts as one node; collectives issued in opposite orders on two slots would hang\), found ')
    assert 'group "A"' in msg and 'group "B"' in msg


def test_recv_before_its_send_is_a_cycle():
    """slot 1 must receive y before it can compute what slot 0 needs to send y."""
    f32 = {"shape": [2], "dtype": "f32"}
    t = {k: dict(f32) for k in ("x", "u", "u_r", "y", "y_r", "z")}
    s = {
        "in": {"kind": "input", "inputs": [], "outputs": ["x"]},
        "f1": {"kind": "fx", "inputs": ["y_r", "x"], "outputs": ["u"], "device": "1", "data": "AAAA"},
        "s1": {"kind": "send", "inputs": ["u"], "outputs": [], "device": "1", "group": "p", "device_idx": 0, "metadata": {}},
        "r0": {"kind": "recv", "inputs": [], "outputs": ["u_r"], "device": "0", "group": "p", "device_idx": 1, "metadata": {}},
        "f0": {"kind": "fx", "inputs": ["u_r"], "outputs": ["y", "z"], "device": "0", "data": "AAAA"},
        "s0": {"kind": "send", "inputs": ["y"], "outputs": [], "device": "0", "group": "q", "device_idx": 0, "metadata": {}},
        "r1": {"kind": "recv", "inputs": [], "outputs": ["y_r"], "device": "1", "group": "q", "device_idx": 1, "metadata": {}},
        "out": {"kind": "output", "inputs": ["z"], "outputs": []},
    }
    d = {"name": "p2p-cycle", "devices": {"0": "cpu:0", "1": "cpu:1"}, "tensors": t, "supertasks": s}
    refused(d, r'expected no cycle .*group "(p|q)"')


# ---------------------------------------------------------------- comm groups
def test_group_mixed_kinds():
    d = tp_doc()
    d["supertasks"]["4"]["kind"] = "all_gather"
    d["supertasks"]["4"]["metadata"] = {"dim": 0}
    refused(d, r'^supertasks\["4"\]\.kind: expected every member of group "g" to be all_reduce \(like supertask "3"\), found all_gather$')


def test_group_metadata_differs():
    d = tp_doc()
    d["supertasks"]["4"]["metadata"]["reduce_op"] = "max"
    refused(d, r'^supertasks\["4"\]\.metadata: expected the same metadata as supertask "3" of group "g"')


def test_group_metadata_same_meaning_other_spelling_is_fine():
    d = tp_doc()
    d["supertasks"]["4"]["metadata"]["reduce_op"] = "RedOpType.SUM"
    check(d)


@pytest.mark.parametrize("idx, pattern", [
    ((0, 0), r'^supertasks\["4"\]\.device_idx: expected a rank not used by another member of group "g", found 0 \(also supertask "3"\)$'),
    ((0, 2), r'^supertasks\["4"\]\.device_idx: expected 0 <= device_idx < 2 \(the size of group "g"\), found 2$'),
])
def test_device_idx_exactly_0_to_n(idx, pattern):
    d = tp_doc()
    d["supertasks"]["3"]["device_idx"], d["supertasks"]["4"]["device_idx"] = idx
    refused(d, pattern)


def test_group_members_on_distinct_slots():
    d = comm_doc("all_reduce", 2, [4], [[4], [4]], {"reduce_op": "sum"})
    d["supertasks"]["c1"]["device"] = "0"
    d["devices"].pop("1")
    refused(d, r'^supertasks\["c1"\]\.device: expected members of group "g" on distinct slots, found slot "0" also used by supertask "c0"$')


@pytest.mark.parametrize("kind, meta, pattern", [
    ("all_reduce", {}, r'^supertasks\["c0"\]\.metadata: expected exactly the keys \[reduce_op\] for all_reduce, found missing key "reduce_op"$'),
    ("all_reduce", {"reduce_op": "sum", "dim": 0}, r'found unknown key "dim"$'),
    ("all_reduce", {"reduce_op": "prod"}, r'^supertasks\["c0"\]\.metadata\.reduce_op: expected one of sum, avg, max, min .*found "prod"$'),
    ("all_gather", {"dim": 2}, r'^supertasks\["c0"\]\.metadata\.dim: expected 0 <= dim < 2, found 2$'),
    ("all_gather", {"dim": "x"}, r'^supertasks\["c0"\]\.metadata\.dim: expected 0 <= dim < 2, found "x"$'),
    ("reduce_scatter", {"reduce_op": "sum", "dim": 1}, r'^supertasks\["c0"\]\.metadata\.dim: expected a dim whose size divides by the group size 2, found dim 1 of size 3$'),
    ("all_to_all", {"src_dim": 1, "dst_dim": 0}, r'^supertasks\["c0"\]\.metadata\.src_dim: expected a dim whose size divides by the group size 2, found dim 1 of size 3$'),
    ("reduce", {"reduce_op": "sum", "dst": "5"}, r'^supertasks\["c0"\]\.metadata\.dst: expected a slot of group "g" \(0, 1\), found "5"$'),
    ("broadcast", {"src": 9}, r'^supertasks\["c0"\]\.metadata\.src: expected a slot of group "g" \(0, 1\), found 9$'),
])
def test_metadata_keys_and_values(kind, meta, pattern):
    outs = {"all_reduce": [[4, 3]] * 2, "all_gather": [[8, 3]] * 2, "reduce_scatter": [[4, 1]] * 2,
            "all_to_all": [[8, 1]] * 2, "reduce": [[4, 3], None], "broadcast": [[4, 3]] * 2}[kind]
    refused(comm_doc(kind, 2, [4, 3], outs, meta), pattern)


def test_avg_on_integers_refused():
    refused(comm_doc("all_reduce", 2, [4], [[4], [4]], {"reduce_op": "avg"}, dtype="i32"),
            r'^supertasks\["c0"\]\.metadata\.reduce_op: expected sum, max or min for dtype i32 \(avg needs a floating dtype\), found avg$')


@pytest.mark.parametrize("kind, meta, outs, pattern", [
    ("all_reduce", {"reduce_op": "sum"}, [[4, 3], [4, 4]], r'^supertasks\["c1"\]\.outputs\[0\]: expected f32\[4, 3\] for all_reduce of 2 x f32\[4, 3\], found f32\[4, 4\]'),
    ("all_gather", {"dim": 1}, [[4, 6], [8, 3]], r'^supertasks\["c1"\]\.outputs\[0\]: expected f32\[4, 6\] for all_gather'),
    ("reduce_scatter", {"reduce_op": "sum", "dim": 0}, [[2, 3], [4, 3]], r'^supertasks\["c1"\]\.outputs\[0\]: expected f32\[2, 3\] for reduce_scatter'),
    ("all_to_all", {"src_dim": 0, "dst_dim": 1}, [[2, 6], [4, 3]], r'^supertasks\["c1"\]\.outputs\[0\]: expected f32\[2, 6\] for all_to_all'),
    ("gather", {"dim": 0, "dst": "0"}, [[4, 3], None], r'^supertasks\["c0"\]\.outputs\[0\]: expected f32\[8, 3\] for gather'),
])
def test_shapes_follow_the_kind(kind, meta, outs, pattern):
    refused(comm_doc(kind, 2, [4, 3], outs, meta), pattern)


def test_participant_inputs_must_agree():
    d = comm_doc("all_reduce", 2, [4], [[4], [4]], {"reduce_op": "sum"})
    d["tensors"]["x_1"]["dtype"] = "f16"
    refused(d, r'^supertasks\["c1"\]\.inputs\[0\]: expected f32\[4\] like the other members of group "g", found f16\[4\] \("x_1"\)$')


@pytest.mark.parametrize("kind, meta, outs, pattern", [
    ("reduce", {"reduce_op": "sum", "dst": "0"}, [[4], [4]], r'^supertasks\["c1"\]\.outputs: expected 0 tensors \(only the dst participant of reduce has an output\), found 1$'),
    ("gather", {"dim": 0, "dst": "1"}, [[8], None], r'^supertasks\["c0"\]\.outputs: expected 0 tensors'),
    ("all_reduce", {"reduce_op": "sum"}, [None, [4]], r'^supertasks\["c0"\]\.outputs: expected 1 tensor \(all_reduce gives one output per participant\), found 0$'),
])
def test_io_counts(kind, meta, outs, pattern):
    refused(comm_doc(kind, 2, [4], outs, meta), pattern)


def test_broadcast_non_src_has_no_input():
    d = comm_doc("broadcast", 2, [4], [[4], [4]], {"src": "0"})
    refused(d, r'^supertasks\["c1"\]\.inputs: expected 0 tensors \(only the src participant of broadcast gives an input\), found 1$')


def _p2p(send_idx=0, recv_idx=1, recv_slot="1", recv_shape=(4,), extra_send=False):
    t = {"x": {"shape": [4], "dtype": "f32"}, "y": {"shape": list(recv_shape), "dtype": "f32"}}
    s = {"in": {"kind": "input", "inputs": [], "outputs": ["x"]},
         "s": {"kind": "send", "inputs": ["x"], "outputs": [], "device": "0", "group": "p", "device_idx": send_idx, "metadata": {}},
         "r": {"kind": "recv", "inputs": [], "outputs": ["y"], "device": recv_slot, "group": "p", "device_idx": recv_idx, "metadata": {}},
         "out": {"kind": "output", "inputs": ["y"], "outputs": []}}
    if extra_send:
        s["s2"] = dict(s["s"], device="1", device_idx=1)
    devices = {"0": "cpu:0", "1": "cpu:1"}
    return {"name": "p2p", "devices": devices, "tensors": t, "supertasks": s}


def test_p2p_pair_valid():
    assert check(_p2p()).groups["p"].kind == "p2p"


def test_send_recv_shape_mismatch():
    refused(_p2p(recv_shape=(5,)), r'^supertasks\["r"\]\.outputs\[0\]: expected f32\[4\] like the sent "x", found f32\[5\] \("y"\)$')


def test_send_recv_same_slot():
    d = _p2p(recv_slot="0")
    d["devices"].pop("1")
    refused(d, r'^supertasks\["r"\]\.device: expected the recv of group "p" on another slot than its send')


def test_unpaired_send():
    refused(_p2p(extra_send=True), r'expected group "p" to pair one send with one recv, found 2 send and 1 recv$')


def test_send_recv_device_idx():
    refused(_p2p(send_idx=0, recv_idx=0), r'^supertasks\["r"\]\.device_idx: expected send and recv of group "p" to have device_idx 0 and 1, found 0 and 0$')


def test_p2p_with_metadata_refused():
    d = _p2p()
    d["supertasks"]["s"]["metadata"] = {"dim": 0}
    refused(d, r'^supertasks\["s"\]\.metadata: expected exactly the keys \[\] for send, found unknown key "dim"$')


# ---------------------------------------------------------------- metadata
@pytest.mark.parametrize("mutate, pattern", [
    (lambda m: m["tensor_slices"]["inputs"].update(p_0=m["tensor_slices"]["inputs"]["x"]), r'^metadata\.tensor_slices\.inputs\["p_0"\]: expected a pipeline input tensor, found "p_0"$'),
    (lambda m: m["tensor_slices"]["inputs"]["x"].update(origin="q"), r'^metadata\.tensor_slices\.inputs\["x"\]\.origin: expected a name in metadata\.tensors\.inputs, found "q"$'),
    (lambda m: m["tensor_slices"]["inputs"]["x"].update(dtype="f16"), r'^metadata\.tensor_slices\.inputs\["x"\]\.dtype: expected f32'),
    (lambda m: m["tensor_slices"]["inputs"]["x"].update(placements=[[0, 4]]), r'^metadata\.tensor_slices\.inputs\["x"\]\.placements: expected 2 \[start, end\] pairs \(the rank of "x"\), found 1$'),
    (lambda m: m["tensor_slices"]["inputs"]["x"].update(placements=[[0, 4], [0, 9]]), r'^metadata\.tensor_slices\.inputs\["x"\]\.placements\[1\]: expected 0 <= start <= end <= 8, found \[0, 9\]$'),
    (lambda m: m["tensor_slices"]["inputs"]["x"].update(placements=[[0, 2], [0, 8]]), r'^metadata\.tensor_slices\.inputs\["x"\]\.placements: expected a slice of shape \[4, 8\] \(tensor "x"\), found \[2, 8\]$'),
    (lambda m: m["tensor_slices"]["inputs"]["x"].update(device="9"), r'^metadata\.tensor_slices\.inputs\["x"\]\.device: expected a declared slot \(0, 1\), found "9"$'),
    (lambda m: m["tensor_slices"]["outputs"]["y_0"].update(device="1"), r'^metadata\.tensor_slices\.outputs\["y_0"\]\.device: expected a slot that produces "y_0" \(0\), found "1"$'),
    (lambda m: m["tensor_slices"]["outputs"].update(x=m["tensor_slices"]["outputs"]["y_0"]), r'^metadata\.tensor_slices\.outputs\["x"\]: expected a pipeline output tensor, found "x"$'),
    (lambda m: m["tensors"]["inputs"].update(z={"shape": [1], "dtype": "f32", "idx": 0}), r'^metadata\.tensors\.inputs\["z"\]\.idx: expected a position not used by another original input, found 0 \(also "x"\)$'),
])
def test_metadata_slices(mutate, pattern):
    d = tp_doc()
    mutate(d["metadata"])
    refused(d, pattern)


def test_input_slice_on_a_consuming_slot():
    d = tp_doc()
    d["metadata"]["tensor_slices"]["inputs"]["x"]["device"] = "1"   # x is consumed on 0 and 1: both fine
    check(d)


# ---------------------------------------------------------------- null comm groups (the producer's `group: str | None`)
def test_null_group_is_a_singleton_group():
    doc = comm_doc("all_gather", 2, (2, 3), [(2, 3), (2, 3)], {"dim": 0})
    for sid, r in (("c0", 0), ("c1", 0)):
        doc["supertasks"][sid]["group"] = None
        doc["supertasks"][sid]["device_idx"] = r
    c = check(doc)
    assert {g: cg.members for g, cg in c.groups.items()} == {"<null:c0>": ("c0",), "<null:c1>": ("c1",)}


def test_null_group_needs_device_idx_0():
    doc = comm_doc("all_reduce", 2, (2, 3), [(2, 3), (2, 3)], {"reduce_op": "sum"})
    doc["supertasks"]["c1"]["group"] = None
    refused(doc, r'^supertasks\["c1"\]\.device_idx: expected 0 <= device_idx < 1 \(the size of group "<null:c1>"\), found 1$')


def test_null_group_name_taken_by_a_real_group():
    doc = comm_doc("all_reduce", 2, (2, 3), [(2, 3), (2, 3)], {"reduce_op": "sum"})
    doc["supertasks"]["c0"]["group"] = None
    doc["supertasks"]["c1"]["group"] = "<null:c0>"
    refused(doc, r'^supertasks\["c1"\]\.group: expected a name other than "<null:c0>" .*found it$')


def test_null_group_on_recv_is_refused():
    doc = comm_doc("all_reduce", 2, (2, 3), [(2, 3), (2, 3)], {"reduce_op": "sum"})
    doc["supertasks"]["c0"].update(kind="send", outputs=[], metadata={})
    doc["supertasks"]["c1"].update(kind="recv", inputs=[], group=None, device_idx=0, metadata={})
    doc["supertasks"]["in"]["outputs"] = ["x_0"]
    doc["supertasks"]["out"]["inputs"] = ["y_1"]
    del doc["tensors"]["x_1"], doc["tensors"]["y_0"]
    refused(doc, r'^supertasks\["c1"\]\.group: expected a group name shared by a recv and its send, found null$')


def test_device_constraints_name_declared_slots():
    doc = tp_doc()
    doc["device_constraints"] = [{"kind": "ring", "devices": [["0", "1"]]}, {"kind": "x", "devices": {}}]
    check(doc)
    doc["device_constraints"][0]["devices"][0][1] = "9"
    refused(doc, r'^device_constraints\[0\]\.devices\[0\]\[1\]: expected a declared slot \(0, 1\), found "9"$')
