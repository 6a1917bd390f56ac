"""Small hand-written pipeline documents (plain JSON data) for format and validation tests.

`data` payloads here are placeholders: these documents are for the structural
rules (fastpipe.validate.validate_structure), which never decode payloads.
"""
from __future__ import annotations

import copy


def tp_doc() -> dict:
    """2 slots: x -> fx(x, w_r) = p_r -> all_reduce -> y_r; y_0 and y_1 are outputs."""
    t = {
        "x": {"shape": [4, 8], "dtype": "f32"},
        "w_0": {"shape": [8, 8], "dtype": "f32", "value": {"path": "w.safetensors", "format": "safetensors", "name": "w", "placements": [[0, 8], [0, 8]]}},
        "w_1": {"shape": [8, 8], "dtype": "f32", "value": {"path": "w.safetensors", "format": "safetensors", "name": "w", "placements": [[8, 16], [0, 8]]}},
        "p_0": {"shape": [4, 8], "dtype": "f32"},
        "p_1": {"shape": [4, 8], "dtype": "f32"},
        "y_0": {"shape": [4, 8], "dtype": "f32"},
        "y_1": {"shape": [4, 8], "dtype": "f32"},
    }
    s = {
        "0": {"kind": "input", "inputs": [], "outputs": ["x"]},
        "1": {"kind": "fx", "inputs": ["x", "w_0"], "outputs": ["p_0"], "device": "0", "data": "AAAA"},
        "2": {"kind": "fx", "inputs": ["x", "w_1"], "outputs": ["p_1"], "device": "1", "data": "AAAA"},
        "3": {"kind": "all_reduce", "inputs": ["p_0"], "outputs": ["y_0"], "device": "0", "group": "g", "device_idx": 0, "metadata": {"reduce_op": "sum"}},
        "4": {"kind": "all_reduce", "inputs": ["p_1"], "outputs": ["y_1"], "device": "1", "group": "g", "device_idx": 1, "metadata": {"reduce_op": "sum"}},
        "5": {"kind": "output", "inputs": ["y_0", "y_1"], "outputs": []},
    }
    return {"name": "tp", "devices": {"0": {"kind": "cpu", "idx": 0}, "1": {"kind": "cpu", "idx": 1}},
            "tensors": t, "supertasks": s,
            "metadata": {"tensors": {"inputs": {"x": {"shape": [4, 8], "dtype": "f32", "idx": 0}},
                                     "outputs": {"y": {"shape": [4, 8], "dtype": "f32", "idx": 0}}},
                         "tensor_slices": {"inputs": {"x": {"placements": [[0, 4], [0, 8]], "origin": "x", "dtype": "f32", "device": "0"}},
                                           "outputs": {"y_0": {"placements": [[0, 4], [0, 8]], "origin": "y", "dtype": "f32", "device": "0"}}}}}


def comm_doc(kind: str, n: int, in_shape, out_shapes, metadata: dict, *, dtype: str = "f32") -> dict:
    """n slots: x_r (pipeline inputs) -> <kind> -> outputs; out_shapes[r] None means no output for rank r."""
    t, s = {}, {"in": {"kind": "input", "inputs": [], "outputs": []}}
    outs = []
    for r in range(n):
        t[f"x_{r}"] = {"shape": list(in_shape), "dtype": dtype}
        s["in"]["outputs"].append(f"x_{r}")
        o = []
        if out_shapes[r] is not None:
            t[f"y_{r}"] = {"shape": list(out_shapes[r]), "dtype": dtype}
            o = [f"y_{r}"]
            outs.append(f"y_{r}")
        s[f"c{r}"] = {"kind": kind, "inputs": [f"x_{r}"], "outputs": o, "device": str(r), "group": "g",
                      "device_idx": r, "metadata": copy.deepcopy(metadata)}
    s["out"] = {"kind": "output", "inputs": outs, "outputs": []}
    return {"name": kind, "devices": {str(r): {"kind": "cpu", "idx": r} for r in range(n)}, "tensors": t, "supertasks": s}


def write_bad_index_pipeline(folder, n_ids: int = 3):
    """One slot, y = table[ids]: valid, but fails at run time when an id is out of range."""
    import json

    from fastpipe.builder.assemble import Assembler

    a = Assembler("bad_index")
    a.slot("0", "cpu:0")
    a.input("ids", (n_ids,), "i64")
    a.input("table", (4, 2), "f32")
    a.fx("0", lambda i, t: t[i], ["ids", "table"], ["y"])
    a.output(["y"])
    path = folder / "p.json"
    path.write_text(json.dumps(a.to_json()))
    return path
