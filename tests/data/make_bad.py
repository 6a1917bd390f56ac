"""Generate tests/data/bad/: one broken pipeline per refusal, on disk.

    python tests/data/make_bad.py                 # rewrites tests/data/bad/ and docs/refusals.md
    python tests/data/make_bad.py --out DIR       # writes the corpus elsewhere (docs untouched)

Each case is a folder ``bad/<case>/`` holding ``pipeline.json`` (plus whatever files it
needs: a tiny weights.safetensors, .fx side files, a torch.save or torch.export file, a
relative symlink) and ``expect.json``:

    {"command": ["validate"], "exit": 2, "stderr": "<regex for the one stderr line>",
     "section": "<the docs/validation.md section>", "refuses": "<what, in words>"}

The CLI is run with the case folder as the working directory, as
``fastpipe <command[0]> pipeline.json <command[1:]...>``: file arguments in ``command``
are relative to the case folder. tests/test_refusals.py runs every case.

Every case is a valid pipeline (built from small torch functions with
fastpipe.builder.assemble.Assembler, so payloads are real) with exactly one thing broken, so
the refusal it pins does not depend on the order in which fastpipe checks things.
The output is deterministic for a given torch version. Symlinks are relative (git
keeps them); ``SYMLINKS`` lists them so a checkout without symlink support can
re-create them (tests/test_refusals.py does).
"""
from __future__ import annotations

import argparse
import base64
import copy
import functools
import json
import os
import pickle
import shutil
import struct
import sys
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from fastpipe.builder.assemble import Assembler  # noqa: E402

BAD = HERE / "bad"
DOCS = ROOT / "docs" / "refusals.md"

# The sections of docs/validation.md (its "## " headings). Every one has at least one case.
SECTIONS = {
    "file": "The file itself",
    "structure": "Structure",
    "comm": "Comm groups",
    "metadata": "Metadata",
    "payload": "Graph payloads",
    "params": "Param files (headers only; no data is read)",
    "run": "At run time",
}

VALIDATE = ["validate"]
RUN = ["run", "--inputs", "inputs.safetensors", "--processor", "reference", "--no-compile", "--warmup", "0", "--repeat", "1"]

# The name of the file the pickled torch.save payload would create (relative: in the cwd,
# i.e. the case folder) if anything ever unpickled it unsafely.
MARKER = "PWNED_BY_PICKLE"

# case -> {link name: relative target}: created by the generator; the test re-creates them
# where a checkout turned them into plain files. Relative, so git keeps them; this one
# resolves to /etc/passwd from any folder.
SYMLINKS: dict[str, dict[str, str]] = {
    "param_symlink_escape": {"escape.safetensors": "../" * 40 + "etc/passwd"},
}

E = r"^fastpipe: error: "          # every stderr line starts so

# Cases fastpipe gets wrong today (reported; see docs/fuzzing.md). tests/test_refusals.py runs them
# as strict xfails, so the entry must go once the bug is fixed.
KNOWN_BUGS: dict[str, str] = {}   # cases fastpipe gets wrong today (all fixed: see docs/fuzzing.md)


class Case:
    def __init__(self, name, section, refuses, stderr, build, command, exit_code):
        self.name, self.section, self.refuses, self.stderr = name, section, refuses, stderr
        self.build, self.command, self.exit = build, command, exit_code

    def expect(self) -> dict:
        return {"command": list(self.command), "exit": self.exit, "stderr": self.stderr,
                "section": SECTIONS[self.section], "refuses": self.refuses}


CASES: dict[str, Case] = {}


def case(name: str, section: str, refuses: str, stderr: str, *, command=VALIDATE, exit_code: int = 2):
    """Register ``build(folder)`` as case ``name``; ``stderr`` is the regex after ``fastpipe: error: ``."""
    assert section in SECTIONS, section

    def deco(build: Callable[[Path], None]):
        assert name not in CASES, name
        CASES[name] = Case(name, section, refuses, E + stderr, build, command, exit_code)
        return build
    return deco


# ----------------------------------------------------------------------------- building blocks
def _weights() -> dict[str, torch.Tensor]:
    return {"w": (torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10).contiguous(),
            "b": torch.ones(4, dtype=torch.float32)}


def write_weights(folder: Path, name: str = "weights.safetensors", tensors=None) -> None:
    save_file(tensors if tensors is not None else _weights(), str(folder / name))


def _mm(x, w):
    return x @ w.transpose(0, 1)


def _add(h, b):
    return h + b


@functools.lru_cache(maxsize=None)
def _tp_doc() -> dict:
    """2 slots: p_r = x @ w_r^T (one blob "mm"), all_reduce "g" -> y_0, y_1 (both outputs)."""
    a = Assembler("bad_tp", version="0.1.0")
    a.input("x", (2, 4), "f32")
    for r in range(2):
        a.slot(str(r), {"kind": "cpu", "idx": r})
        a.constant(f"w_{r}", shape=(4, 4), dtype="f32", path="weights.safetensors", name_in_file="w",
                   placements=[[4 * r, 4 * r + 4], [0, 4]])
    for r in range(2):
        a.fx(str(r), _mm, ["x", f"w_{r}"], [f"p_{r}"], blob="mm")               # ids 1, 2
    a.comm("all_reduce", "g", [("0", ["p_0"], ["y_0"]), ("1", ["p_1"], ["y_1"])], reduce_op="sum")  # 3, 4
    a.output(["y_0", "y_1"])
    a.original_input("x", (2, 4), "f32", 0)
    a.original_output("y", (2, 4), "f32", 0)
    a.slice_of("inputs", "x", "x", [[0, 2], [0, 4]], "0")
    a.slice_of("outputs", "y_0", "y", [[0, 2], [0, 4]], "0")
    a.slice_of("outputs", "y_1", "y", [[0, 2], [0, 4]], "1")
    return a.to_json()


def tp(folder: Path) -> dict:
    """The tensor-parallel base (a fresh copy) with its weights written into ``folder``."""
    write_weights(folder)
    return copy.deepcopy(_tp_doc())


@functools.lru_cache(maxsize=None)
def _p2p_doc() -> dict:
    """2 stages: h = x @ w^T on slot 0 (id 1), send/recv "p" (2, 3), y = h_r + b on slot 1 (4)."""
    a = Assembler("bad_p2p", version="0.1.0")
    a.slot("0", "cpu:0")
    a.slot("1", "cpu:1")
    a.input("x", (2, 4), "f32")
    a.constant("w", shape=(4, 4), dtype="f32", path="weights.safetensors", name_in_file="w", placements=[[0, 4], [0, 4]])
    a.constant("b", shape=(4,), dtype="f32", path="weights.safetensors", name_in_file="b")
    a.fx("0", _mm, ["x", "w"], ["h"])
    a.send_recv("p", "0", "h", "1", "h_r")
    a.fx("1", _add, ["h_r", "b"], ["y"])
    a.output(["y"])
    a.original_input("x", (2, 4), "f32", 0)
    a.original_output("y", (2, 4), "f32", 0)
    a.slice_of("inputs", "x", "x", [[0, 2], [0, 4]], "0")
    a.slice_of("outputs", "y", "y", [[0, 2], [0, 4]], "1")
    return a.to_json()


def p2p(folder: Path, *, inputs: dict | None = None) -> dict:
    write_weights(folder)
    if inputs is not None:
        save_file(inputs, str(folder / "inputs.safetensors"))
    return copy.deepcopy(_p2p_doc())


def comm_only(kind: str, n: int, in_shape, out_shapes, metadata: dict, *, dtype: str = "f32") -> dict:
    """n slots: pipeline inputs x_r -> <kind> group "g" -> outputs y_r (None: rank r has no output)."""
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
    return {"name": f"bad_{kind}", "devices": {str(r): f"cpu:{r}" for r in range(n)}, "tensors": t, "supertasks": s}


@functools.lru_cache(maxsize=None)
def fx_data(fn: Callable, shapes: tuple, n_out: int = 1) -> str:
    """The payload of ``fn`` traced on f32 inputs of ``shapes`` (``n_out`` outputs)."""
    a = Assembler("payload")
    names = [f"i{k}" for k in range(len(shapes))]
    for n, sh in zip(names, shapes):
        a.input(n, sh, "f32")
    sid = a.fx("0", fn, names, [f"o{k}" for k in range(n_out)])
    return a.doc["supertasks"][sid]["data"]


def fx(slot: str, fn: Callable, ins: list, outs: list, shapes: tuple) -> dict:
    return {"kind": "fx", "inputs": ins, "outputs": outs, "device": slot, "data": fx_data(fn, shapes, len(outs))}


def unpack(data: str) -> dict:
    return json.loads(base64.b64decode(data))


def pack(doc: dict) -> str:
    return base64.b64encode(json.dumps(doc).encode()).decode("ascii")


def node_with(graph: dict, suffix: str) -> dict:
    return next(n for n in graph["nodes"] if n["target"].endswith(suffix))


def save(folder: Path, doc: dict) -> None:
    (folder / "pipeline.json").write_text(json.dumps(doc, indent=1) + "\n")


def raw_safetensors(header: bytes, data: bytes, n: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if n is None else n) + header + data


def good_safetensors_bytes() -> bytes:
    from safetensors.torch import save
    return save(_weights())


# ============================================================================== the file itself
@case("invalid_json", "file", "text that is not JSON (truncated), with its line and column",
      r"pipeline\.json: invalid JSON at line \d+ column \d+: .+$")
def _(f):
    text = json.dumps(tp(f), indent=1)
    (f / "pipeline.json").write_text(text[: len(text) // 2])


@case("json_nested_too_deeply", "file", "JSON nested thousands of levels deep (a stack-exhaustion attempt)",
      r"pipeline\.json: .*$")
def _(f):
    depth = 5000
    (f / "pipeline.json").write_text('{"name": "deep", "metadata": ' + '{"a": ' * depth + "1" + "}" * depth + "}\n")


@case("duplicate_key", "file", "a key given twice in one object",
      r'tensors\["x"\]\.dtype: duplicate key "dtype"$')
def _(f):
    text = json.dumps(tp(f), indent=1)
    old = '"x": {\n   "shape": [\n    2,\n    4\n   ],\n   "dtype": "f32"\n  }'
    assert old in text
    (f / "pipeline.json").write_text(text.replace(old, old[:-4] + ',\n   "dtype": "f16"\n  }', 1))


@case("nan", "file", "NaN, which is not JSON", r"pipeline\.json: invalid JSON: NaN is not valid JSON$")
def _(f):
    text = json.dumps(tp(f), indent=1)
    (f / "pipeline.json").write_text(text.replace('"idx": 0', '"idx": NaN', 1))


@case("infinity", "file", "Infinity, which is not JSON", r"pipeline\.json: invalid JSON: -?Infinity is not valid JSON$")
def _(f):
    text = json.dumps(tp(f), indent=1)
    (f / "pipeline.json").write_text(text.replace('"device_idx": 1', '"device_idx": Infinity', 1))


@case("unknown_field_top", "file", "an unknown top-level field",
      r"extra: unknown field \(allowed: blobs, device_constraints, devices, metadata, name, param_files, supertasks, tensors, version\)$")
def _(f):
    d = tp(f)
    d["extra"] = 1
    save(f, d)


@case("next_gen_format", "file", "furiosa-llm's experimental stage-based format (next_gen.py), which is not this format",
      r"stages: expected the supertask format \(devices, tensors, supertasks\), found furiosa-llm's experimental stage-based format .*$")
def _(f):
    save(f, {"name": "next_gen", "inputs": {}, "outputs": {}, "stages": [], "version": "0.1.0"})


@case("compute_data_and_blob_null", "file", "a compute supertask whose data and data_blob are both null",
      r'supertasks\["1"\]: expected exactly one of "data" or "data_blob" for a fx supertask \(the other absent or null\), found neither$')
def _(f):
    d = tp(f)
    d["supertasks"]["1"]["data_blob"] = None
    d["supertasks"]["1"]["data"] = None
    save(f, d)


@case("device_rngd_bad_pe_count", "file", "an rngd:N:K device whose K is not 1, 2, 4 or 8 fused processing elements",
      r'devices\["0"\]: expected a device like cpu, .*rngd:N:K.*found "rngd:0:3"$')
def _(f):
    d = tp(f)
    d["devices"]["0"] = "rngd:0:3"
    save(f, d)


@case("device_constraint_unknown_slot", "structure", "a device_constraints entry naming an undeclared slot",
      r'device_constraints\[0\]\.devices\[0\]\[1\]: expected a declared slot \(0, 1\), found "7"$')
def _(f):
    d = tp(f)
    d["device_constraints"] = [{"kind": "ring", "devices": [["0", "7"]]}]
    save(f, d)


@case("unknown_field_tensor", "file", "an unknown field in a tensor",
      r'tensors\["x"\]\.layout: unknown field \(allowed: dtype, shape, value\)$')
def _(f):
    d = tp(f)
    d["tensors"]["x"]["layout"] = "strided"
    save(f, d)


@case("unknown_field_supertask", "file", "an unknown field in a supertask",
      r'supertasks\["1"\]\.priority: unknown field \(allowed: .*\)$')
def _(f):
    d = tp(f)
    d["supertasks"]["1"]["priority"] = 1
    save(f, d)


@case("unknown_field_value", "file", "an unknown field in a constant's value",
      r'tensors\["w_0"\]\.value\.offset: unknown field \(allowed: .*\)$')
def _(f):
    d = tp(f)
    d["tensors"]["w_0"]["value"]["offset"] = 16
    save(f, d)


@case("unknown_field_metadata", "file", "an unknown field in metadata",
      r"metadata\.generator: unknown field \(allowed: .*\)$")
def _(f):
    d = tp(f)
    d["metadata"]["generator"] = "x"
    save(f, d)


@case("unknown_field_slice", "file", "an unknown field in a tensor slice of metadata",
      r'metadata\.tensor_slices\.inputs\["x"\]\.stride: unknown field \(allowed: .*\)$')
def _(f):
    d = tp(f)
    d["metadata"]["tensor_slices"]["inputs"]["x"]["stride"] = [4, 1]
    save(f, d)


@case("data_on_comm", "file", "data (a compute field) on a comm supertask",
      r'supertasks\["3"\]\.data: unknown field \(allowed: device, device_idx, group, inputs, kind, metadata, outputs\)$')
def _(f):
    d = tp(f)
    d["supertasks"]["3"]["data"] = d["blobs"]["mm"]
    save(f, d)


@case("group_on_compute", "file", "group (a comm field) on a compute supertask",
      r'supertasks\["1"\]\.group: unknown field \(allowed: data, data_blob, device, inputs, kind, outputs\)$')
def _(f):
    d = tp(f)
    d["supertasks"]["1"]["group"] = "g"
    save(f, d)


@case("unknown_dtype", "file", "a dtype outside the list", r'tensors\["x"\]\.dtype: expected one of f64 f32 .*, found "f128"$')
def _(f):
    d = tp(f)
    d["tensors"]["x"]["dtype"] = "f128"
    save(f, d)


@case("dtype_not_a_string", "file", "a dtype of the wrong JSON type (an array)",
      r'tensors\["x"\]\.dtype: expected one of f64 f32 .*, found \[\]$')
def _(f):
    d = tp(f)
    d["tensors"]["x"]["dtype"] = []
    save(f, d)


@case("kind_not_a_string", "file", "a supertask kind of the wrong JSON type (an object)",
      r'supertasks\["3"\]\.kind: expected one of .*, found \{\}$')
def _(f):
    d = tp(f)
    d["supertasks"]["3"]["kind"] = {}
    save(f, d)


@case("negative_shape", "file", "a negative dimension",
      r'tensors\["x"\]\.shape\[0\]: expected a non-negative integer, found -2$')
def _(f):
    d = tp(f)
    d["tensors"]["x"]["shape"][0] = -2
    save(f, d)


@case("shape_not_array", "file", "a shape of the wrong JSON type",
      r'tensors\["x"\]\.shape: expected an array of non-negative integers, found a string$')
def _(f):
    d = tp(f)
    d["tensors"]["x"]["shape"] = "2x4"
    save(f, d)


@case("placements_start_after_end", "file", "a [start, end] pair with start > end",
      r'tensors\["w_0"\]\.value\.placements\[0\]: expected .*start <= end.*, found \[4, 0\]$')
def _(f):
    d = tp(f)
    d["tensors"]["w_0"]["value"]["placements"][0] = [4, 0]
    save(f, d)


@case("unknown_device_kind", "file", "a device of an unknown kind",
      r'devices\["1"\]\.kind: expected one of cpu, npu, cuda, gpu, found "tpu"$')
def _(f):
    d = tp(f)
    d["devices"]["1"]["kind"] = "tpu"
    save(f, d)


@case("missing_field", "file", "a required field left out",
      r'supertasks\["4"\]: missing required field "device_idx".*$')
def _(f):
    d = tp(f)
    del d["supertasks"]["4"]["device_idx"]
    save(f, d)


# ============================================================================== structure
@case("two_input_supertasks", "structure", "a second input supertask",
      r"supertasks: expected exactly one input supertask, found 2 \(in, in2\)$")
def _(f):
    d = tp(f)
    d["supertasks"]["in2"] = {"kind": "input", "inputs": [], "outputs": []}
    save(f, d)


@case("no_output_supertask", "structure", "no output supertask",
      r"supertasks: expected exactly one output supertask, found 0$")
def _(f):
    d = tp(f)
    del d["supertasks"]["out"]
    save(f, d)


@case("input_supertask_with_inputs", "structure", "an input supertask that lists inputs",
      r'supertasks\["in"\]\.inputs: expected \[\] for the input supertask, found 1 tensors$')
def _(f):
    d = tp(f)
    d["supertasks"]["in"]["inputs"] = ["y_0"]
    save(f, d)


@case("undeclared_tensor", "structure", "a supertask naming a tensor not declared in tensors",
      r'supertasks\["1"\]\.inputs\[2\]: expected a tensor declared in tensors, found "ghost"$')
def _(f):
    d = tp(f)
    d["supertasks"]["1"]["inputs"].append("ghost")
    save(f, d)


@case("unused_tensor", "structure", "a declared tensor no supertask uses",
      r'tensors\["extra"\]: expected every tensor to be an input or output of some supertask, found it unused$')
def _(f):
    d = tp(f)
    d["tensors"]["extra"] = {"shape": [1], "dtype": "f32"}
    save(f, d)


@case("constant_produced", "structure", "a constant (it has a value) that a supertask produces",
      r'tensors\["p_0"\]: expected a constant \(it has a value\) to be produced by no supertask, found it an output of supertask "1"$')
def _(f):
    d = tp(f)
    d["tensors"]["p_0"]["value"] = {"path": "weights.safetensors", "format": "safetensors", "name": "w", "placements": [[0, 2], [0, 4]]}
    save(f, d)


@case("variable_without_producer", "structure", "a variable tensor nobody produces",
      r'tensors\["x"\]: expected a variable tensor to be produced exactly once, found no producer \(and no value\)$')
def _(f):
    d = tp(f)
    d["supertasks"]["in"]["outputs"] = []
    save(f, d)


@case("produced_twice", "structure", "a variable tensor produced by two supertasks",
      r'tensors\["p_0"\]: expected a variable tensor to be produced exactly once, found 2 producers \(1, 2\)$')
def _(f):
    d = tp(f)
    d["supertasks"]["2"]["outputs"] = ["p_0"]
    save(f, d)


@case("input_is_also_output", "structure", "a pipeline input that is also a pipeline output",
      r'tensors\["x"\]: expected a tensor to be exactly one of constant, pipeline input, pipeline output or intermediate, found it both.*$')
def _(f):
    d = tp(f)
    d["supertasks"]["out"]["inputs"].append("x")
    save(f, d)


@case("unconsumed_intermediate", "structure", "an intermediate tensor nobody consumes",
      r'tensors\["y_1"\]: expected the output of supertask "4" to be consumed, found no consumer$')
def _(f):
    d = tp(f)
    d["supertasks"]["out"]["inputs"] = ["y_0"]
    del d["metadata"]["tensor_slices"]["outputs"]["y_1"]
    save(f, d)


@case("consumed_on_another_slot", "structure", "a tensor consumed on another slot than its producer's, without comm",
      r'supertasks\["4"\]\.inputs: expected "p_0" to be consumed on its producer\'s slot "0" \(cross-slot data needs a comm supertask\), found slot "1"$')
def _(f):
    d = tp(f)
    d["supertasks"]["4"]["inputs"] = ["p_0"]
    d["supertasks"]["2"]["outputs"] = []
    del d["tensors"]["p_1"]
    save(f, d)


@case("undeclared_slot", "structure", "a supertask on a slot not declared in devices",
      r'supertasks\["2"\]\.device: expected a declared slot \(0, 1\), found "7"$')
def _(f):
    d = tp(f)
    d["supertasks"]["2"]["device"] = "7"
    save(f, d)


@case("unused_slot", "structure", "a declared slot that runs nothing",
      r'devices\["2"\]: expected every declared slot to run a supertask, found none on slot "2"$')
def _(f):
    d = tp(f)
    d["devices"]["2"] = {"kind": "cpu", "idx": 2}
    save(f, d)


@case("dead_supertask", "structure", "a supertask whose results never reach an output",
      r'supertasks\["dead"\]: expected every supertask to contribute to the pipeline outputs, found it dead.*$')
def _(f):
    d = tp(f)
    d["tensors"]["z"] = {"shape": [2, 4], "dtype": "f32"}
    d["supertasks"]["dead"] = fx("0", _add, ["x", "x"], ["z"], ((2, 4), (2, 4)))
    d["supertasks"]["sink"] = fx("0", lambda z: (), ["z"], [], ((2, 4),))      # a graph with no outputs
    save(f, d)


@case("cycle_compute", "structure", "a cycle through two compute supertasks",
      r'supertasks: expected no cycle .*, found supertasks\["1"\] -> supertasks\["loop"\] -> supertasks\["1"\]$')
def _(f):
    d = tp(f)
    d["tensors"]["back"] = {"shape": [2, 4], "dtype": "f32"}
    d["supertasks"]["1"]["inputs"].append("back")
    d["supertasks"]["1"].pop("data_blob")
    d["supertasks"]["1"]["data"] = fx_data(lambda x, w, back: x @ w.transpose(0, 1) + back, ((2, 4), (4, 4), (2, 4)))
    d["supertasks"]["3"]["inputs"] = ["p_0b"]
    d["tensors"]["p_0b"] = {"shape": [2, 4], "dtype": "f32"}
    d["supertasks"]["loop"] = {"kind": "fx", "inputs": ["p_0", "p_0"], "outputs": ["back"], "device": "0",
                               "data": fx_data(_add, ((2, 4), (2, 4)))}
    d["supertasks"]["tee"] = {"kind": "fx", "inputs": ["p_0", "p_0"], "outputs": ["p_0b"], "device": "0",
                              "data": fx_data(_add, ((2, 4), (2, 4)))}
    save(f, d)


@case("cycle_collectives_opposite_order", "structure",
      "two all_reduce groups issued in opposite orders on two slots (a hang on NCCL)",
      r'supertasks: expected no cycle \(a comm group counts as one node; collectives issued in opposite orders on two slots would hang\), found .*group "[AB]".*group "[AB]".*$')
def _(f):
    f32 = {"shape": [2, 4], "dtype": "f32"}
    t = {k: dict(f32) for k in ("x0", "x1", "a0", "a1", "b0", "b1", "m0", "m1")}
    relu = fx_data(torch.relu, ((2, 4),))
    s = {
        "in": {"kind": "input", "inputs": [], "outputs": ["x0", "x1"]},
        "A0": {"kind": "all_reduce", "inputs": ["x0"], "outputs": ["a0"], "device": "0", "group": "A", "device_idx": 0, "metadata": {"reduce_op": "sum"}},
        "f0": {"kind": "fx", "inputs": ["a0"], "outputs": ["m0"], "device": "0", "data": relu},
        "B0": {"kind": "all_reduce", "inputs": ["m0"], "outputs": ["b0"], "device": "0", "group": "B", "device_idx": 0, "metadata": {"reduce_op": "sum"}},
        "B1": {"kind": "all_reduce", "inputs": ["x1"], "outputs": ["b1"], "device": "1", "group": "B", "device_idx": 1, "metadata": {"reduce_op": "sum"}},
        "f1": {"kind": "fx", "inputs": ["b1"], "outputs": ["m1"], "device": "1", "data": relu},
        "A1": {"kind": "all_reduce", "inputs": ["m1"], "outputs": ["a1"], "device": "1", "group": "A", "device_idx": 1, "metadata": {"reduce_op": "sum"}},
        "out": {"kind": "output", "inputs": ["b0", "a1"], "outputs": []},
    }
    save(f, {"name": "opposite_orders", "devices": {"0": "cpu:0", "1": "cpu:1"}, "tensors": t, "supertasks": s})


@case("cycle_recv_before_send", "structure", "a recv needed before its own send can run",
      r'supertasks: expected no cycle .*found .*group "[pq]".*$')
def _(f):
    f32 = {"shape": [2, 4], "dtype": "f32"}
    t = {k: dict(f32) for k in ("x", "u", "u_r", "y", "y_r", "z")}
    add = fx_data(_add, ((2, 4), (2, 4)))
    two = fx_data(lambda a: (a + 1, a * 2), ((2, 4),), 2)
    s = {
        "in": {"kind": "input", "inputs": [], "outputs": ["x"]},
        "f1": {"kind": "fx", "inputs": ["y_r", "x"], "outputs": ["u"], "device": "1", "data": add},
        "s1": {"kind": "send", "inputs": ["u"], "outputs": [], "device": "1", "group": "p", "device_idx": 0, "metadata": {}},
        "r0": {"kind": "recv", "inputs": [], "outputs": ["u_r"], "device": "0", "group": "p", "device_idx": 1, "metadata": {}},
        "f0": {"kind": "fx", "inputs": ["u_r"], "outputs": ["y", "z"], "device": "0", "data": two},
        "s0": {"kind": "send", "inputs": ["y"], "outputs": [], "device": "0", "group": "q", "device_idx": 0, "metadata": {}},
        "r1": {"kind": "recv", "inputs": [], "outputs": ["y_r"], "device": "1", "group": "q", "device_idx": 1, "metadata": {}},
        "out": {"kind": "output", "inputs": ["z"], "outputs": []},
    }
    save(f, {"name": "recv_before_send", "devices": {"0": "cpu:0", "1": "cpu:1"}, "tensors": t, "supertasks": s})


# ============================================================================== comm groups
@case("null_group_send", "comm", "a send whose group is null (a null group is a group of one; a send needs its recv)",
      r'supertasks\["2"\]\.group: expected a group name shared by a send and its recv, found null$')
def _(f):
    d = p2p(f)
    d["supertasks"]["2"]["group"] = None
    save(f, d)


@case("group_mixed_kinds", "comm", "one group holding two kinds",
      r'supertasks\["4"\]\.kind: expected every member of group "g" to be all_reduce \(like supertask "3"\), found all_gather$')
def _(f):
    d = tp(f)
    d["supertasks"]["4"]["kind"] = "all_gather"
    d["supertasks"]["4"]["metadata"] = {"dim": 0}
    save(f, d)


@case("group_metadata_differs", "comm", "members of one group with different metadata",
      r'supertasks\["4"\]\.metadata: expected the same metadata as supertask "3" of group "g".*$')
def _(f):
    d = tp(f)
    d["supertasks"]["4"]["metadata"]["reduce_op"] = "max"
    save(f, d)


@case("metadata_missing_key", "comm", "a comm supertask without a key its kind needs",
      r'supertasks\["3"\]\.metadata: expected exactly the keys \[reduce_op\] for all_reduce, found missing key "reduce_op"$')
def _(f):
    d = tp(f)
    d["supertasks"]["3"]["metadata"] = {}
    d["supertasks"]["4"]["metadata"] = {}
    save(f, d)


@case("metadata_unknown_key", "comm", "a comm supertask with a key its kind does not take",
      r'supertasks\["3"\]\.metadata: expected exactly the keys \[reduce_op\] for all_reduce, found unknown key "dim"$')
def _(f):
    d = tp(f)
    for sid in ("3", "4"):
        d["supertasks"][sid]["metadata"]["dim"] = 0
    save(f, d)


@case("reduce_op_unknown", "comm", "a reduce_op fastpipe does not implement (product)",
      r'supertasks\["3"\]\.metadata\.reduce_op: expected one of sum, avg, max, min .*found "prod"$')
def _(f):
    d = tp(f)
    for sid in ("3", "4"):
        d["supertasks"][sid]["metadata"]["reduce_op"] = "prod"
    save(f, d)


@case("dim_out_of_range", "comm", "an all_gather dim outside 0 <= dim < rank",
      r'supertasks\["c0"\]\.metadata\.dim: expected 0 <= dim < 2, found 2$')
def _(f):
    save(f, comm_only("all_gather", 2, [4, 3], [[8, 3]] * 2, {"dim": 2}))


@case("dst_not_in_group", "comm", "a reduce dst that is not a slot of the group",
      r'supertasks\["c0"\]\.metadata\.dst: expected a slot of group "g" \(0, 1\), found "5"$')
def _(f):
    save(f, comm_only("reduce", 2, [4, 3], [[4, 3], None], {"reduce_op": "sum", "dst": "5"}))


@case("src_not_in_group", "comm", "a broadcast src that is not a slot of the group",
      r'supertasks\["c0"\]\.metadata\.src: expected a slot of group "g" \(0, 1\), found 9$')
def _(f):
    save(f, comm_only("broadcast", 2, [4, 3], [[4, 3]] * 2, {"src": 9}))


@case("device_idx_duplicate", "comm", "two members of a group with the same device_idx",
      r'supertasks\["4"\]\.device_idx: expected a rank not used by another member of group "g", found 0 \(also supertask "3"\)$')
def _(f):
    d = tp(f)
    d["supertasks"]["4"]["device_idx"] = 0
    save(f, d)


@case("device_idx_gap", "comm", "device_idx values that skip a rank (0, 2)",
      r'supertasks\["4"\]\.device_idx: expected 0 <= device_idx < 2 \(the size of group "g"\), found 2$')
def _(f):
    d = tp(f)
    d["supertasks"]["4"]["device_idx"] = 2
    save(f, d)


@case("group_members_same_slot", "comm", "two members of one group on the same slot",
      r'supertasks\["c1"\]\.device: expected members of group "g" on distinct slots, found slot "0" also used by supertask "c0"$')
def _(f):
    d = comm_only("all_reduce", 2, [4], [[4], [4]], {"reduce_op": "sum"})
    d["supertasks"]["c1"]["device"] = "0"
    d["devices"].pop("1")
    save(f, d)


@case("reduce_output_on_non_dst", "comm", "an output on a reduce participant that is not dst",
      r'supertasks\["c1"\]\.outputs: expected 0 tensors \(only the dst participant of reduce has an output\), found 1$')
def _(f):
    save(f, comm_only("reduce", 2, [4], [[4], [4]], {"reduce_op": "sum", "dst": "0"}))


@case("broadcast_non_src_input", "comm", "an input on a broadcast participant that is not src",
      r'supertasks\["c1"\]\.inputs: expected 0 tensors \(only the src participant of broadcast gives an input\), found 1$')
def _(f):
    save(f, comm_only("broadcast", 2, [4], [[4], [4]], {"src": "0"}))


@case("all_gather_output_shape", "comm", "an all_gather output that is not the inputs concatenated",
      r'supertasks\["c1"\]\.outputs\[0\]: expected f32\[4, 6\] for all_gather.*, found f32\[8, 3\].*$')
def _(f):
    save(f, comm_only("all_gather", 2, [4, 3], [[4, 6], [8, 3]], {"dim": 1}))


@case("participant_inputs_disagree", "comm", "group members whose inputs differ in dtype",
      r'supertasks\["c1"\]\.inputs\[0\]: expected f32\[4\] like the other members of group "g", found f16\[4\] \("x_1"\)$')
def _(f):
    d = comm_only("all_reduce", 2, [4], [[4], [4]], {"reduce_op": "sum"})
    d["tensors"]["x_1"]["dtype"] = "f16"
    save(f, d)


@case("reduce_scatter_indivisible", "comm", "a reduce_scatter dim that does not divide by the group size",
      r'supertasks\["c0"\]\.metadata\.dim: expected a dim whose size divides by the group size 2, found dim 1 of size 3$')
def _(f):
    save(f, comm_only("reduce_scatter", 2, [4, 3], [[4, 1]] * 2, {"reduce_op": "sum", "dim": 1}))


@case("avg_on_integers", "comm", "avg on an integer dtype",
      r'supertasks\["c0"\]\.metadata\.reduce_op: expected sum, max or min for dtype i32 \(avg needs a floating dtype\), found avg$')
def _(f):
    save(f, comm_only("all_reduce", 2, [4], [[4], [4]], {"reduce_op": "avg"}, dtype="i32"))


@case("send_recv_shape_mismatch", "comm", "a recv whose shape differs from its send's",
      r'supertasks\["3"\]\.outputs\[0\]: expected f32\[2, 4\] like the sent "h", found f32\[2, 5\] \("h_r"\)$')
def _(f):
    d = p2p(f)
    d["tensors"]["h_r"]["shape"] = [2, 5]
    save(f, d)


@case("unpaired_send", "comm", "a send/recv group with two sends",
      r'supertasks\["2b?"\]\.group: expected group "p" to pair one send with one recv, found 2 send and 1 recv$')
def _(f):
    d = p2p(f)
    d["supertasks"]["2b"] = dict(d["supertasks"]["2"], device="1", device_idx=2, inputs=["h_r"])
    save(f, d)


@case("unpaired_recv", "comm", "a recv with no send in its group",
      r'supertasks\["3"\]\.group: expected group "p" to pair one send with one recv, found 0 send and 1 recv$')
def _(f):
    d = p2p(f)
    del d["supertasks"]["2"]
    # h is no longer sent: feed it to the output so that only the pairing is wrong
    d["supertasks"]["out"]["inputs"].append("h")
    d["metadata"]["tensor_slices"]["outputs"]["h"] = {"placements": [[0, 2], [0, 4]], "origin": "y", "dtype": "f32", "device": "0"}
    save(f, d)


@case("send_recv_device_idx", "comm", "a send and recv that do not have device_idx 0 and 1",
      r'supertasks\["3"\]\.device_idx: expected send and recv of group "p" to have device_idx 0 and 1, found 0 and 0$')
def _(f):
    d = p2p(f)
    d["supertasks"]["3"]["device_idx"] = 0
    save(f, d)


@case("p2p_with_metadata", "comm", "a send with metadata keys",
      r'supertasks\["2"\]\.metadata: expected exactly the keys \[\] for send, found unknown key "dim"$')
def _(f):
    d = p2p(f)
    d["supertasks"]["2"]["metadata"] = {"dim": 0}
    save(f, d)


# ============================================================================== metadata
def _meta_case(name, refuses, stderr, mutate):
    @case(name, "metadata", refuses, stderr)
    def _(f):
        d = tp(f)
        mutate(d["metadata"])
        save(f, d)


_meta_case("slice_of_non_input", "a tensor_slices.inputs key that is not a pipeline input",
           r'metadata\.tensor_slices\.inputs\["p_0"\]: expected a pipeline input tensor, found "p_0"$',
           lambda m: m["tensor_slices"]["inputs"].update(p_0=dict(m["tensor_slices"]["inputs"]["x"])))
_meta_case("slice_unknown_origin", "a slice whose origin is not in metadata.tensors",
           r'metadata\.tensor_slices\.inputs\["x"\]\.origin: expected a name in metadata\.tensors\.inputs, found "q"$',
           lambda m: m["tensor_slices"]["inputs"]["x"].update(origin="q"))
_meta_case("slice_dtype", "a slice whose dtype disagrees with the tensor",
           r'metadata\.tensor_slices\.inputs\["x"\]\.dtype: expected f32.*, found .*f16.*$',
           lambda m: m["tensor_slices"]["inputs"]["x"].update(dtype="f16"))
_meta_case("slice_placements_rank", "slice placements of the wrong rank",
           r'metadata\.tensor_slices\.inputs\["x"\]\.placements: expected 2 \[start, end\] pairs \(the rank of "x"\), found 1$',
           lambda m: m["tensor_slices"]["inputs"]["x"].update(placements=[[0, 2]]))
_meta_case("slice_placements_out_of_bounds", "slice placements outside the origin",
           r'metadata\.tensor_slices\.inputs\["x"\]\.placements\[1\]: expected 0 <= start <= end <= 4, found \[0, 9\]$',
           lambda m: m["tensor_slices"]["inputs"]["x"].update(placements=[[0, 2], [0, 9]]))
_meta_case("slice_shape", "slice placements that do not give the tensor's shape",
           r'metadata\.tensor_slices\.inputs\["x"\]\.placements: expected a slice of shape \[2, 4\] \(tensor "x"\), found \[1, 4\]$',
           lambda m: m["tensor_slices"]["inputs"]["x"].update(placements=[[0, 1], [0, 4]]))
_meta_case("slice_shape_transposed", "slice placements with the tensor's element count but not its shape (transposed)",
           r'metadata\.tensor_slices\.inputs\["x"\]\.placements: expected a slice of shape \[2, 4\] \(tensor "x"\), found \[4, 2\]$',
           lambda m: (m["tensors"]["inputs"]["x"].update(shape=[4, 4]),      # an origin the [4, 2] slice fits in
                      m["tensor_slices"]["inputs"]["x"].update(placements=[[0, 4], [0, 2]])))
_meta_case("slice_undeclared_slot", "a slice on an undeclared slot",
           r'metadata\.tensor_slices\.inputs\["x"\]\.device: expected a declared slot \(0, 1\), found "9"$',
           lambda m: m["tensor_slices"]["inputs"]["x"].update(device="9"))
_meta_case("slice_wrong_slot", "an output slice on a slot that does not produce it",
           r'metadata\.tensor_slices\.outputs\["y_0"\]\.device: expected a slot that produces "y_0" \(0\), found "1"$',
           lambda m: m["tensor_slices"]["outputs"]["y_0"].update(device="1"))
_meta_case("metadata_idx_duplicate", "two original inputs with the same idx",
           r'metadata\.tensors\.inputs\["z"\]\.idx: expected a position not used by another original input, found 0 \(also "x"\)$',
           lambda m: m["tensors"]["inputs"].update(z={"shape": [1], "dtype": "f32", "idx": 0}))


# ============================================================================== graph payloads
def _blob_case(name, refuses, stderr, mutate):
    @case(name, "payload", refuses, stderr)
    def _(f):
        d = tp(f)
        g = unpack(d["blobs"]["mm"])
        mutate(g)
        d["blobs"]["mm"] = pack(g)
        save(f, d)


def _target(t):
    def mutate(g):
        node_with(g, "mm.default")["target"] = t
    return mutate


_blob_case("payload_builtins_exec", "a payload calling builtins.exec",
           r'blobs\["mm"\]: nodes\[\d+\]\.target: expected a torch\.ops target in namespaces aten, fastpipe, prims \(or operator\.getitem\), or a registered foreign op \(furiosa::gather_i32, furiosa::sparse_select, furiosa::sparse_select_v1_5\), found \'builtins\.exec\'$',
           _target("builtins.exec"))
_blob_case("payload_os_system", "a payload calling os.system",
           r'blobs\["mm"\]: nodes\[\d+\]\.target: expected a torch\.ops target .*found \'os\.system\'$',
           _target("os.system"))
_blob_case("payload_aten_save", "a payload calling torch.ops.aten.save (writes a file)",
           r'blobs\["mm"\]: nodes\[\d+\]\.target: .*file side effects.*$',
           _target("torch.ops.aten.save.default"))
_blob_case("payload_foreign_namespace", "a payload calling an op in a namespace not allowed",
           r'blobs\["mm"\]: nodes\[\d+\]\.target: expected a torch\.ops target .*found \'torch\.ops\.higher_order\.cond\.default\'$',
           _target("torch.ops.higher_order.cond.default"))
_blob_case("payload_foreign_op_unregistered", "a payload calling a producer's op that is not a registered foreign op",
           r'blobs\["mm"\]: nodes\[\d+\]\.target: expected a torch\.ops target .*or a registered foreign op '
           r'\(furiosa::gather_i32, furiosa::sparse_select, furiosa::sparse_select_v1_5\), '
           r'found \'torch\.ops\.furiosa\.dequantize\.default\'$',
           _target("torch.ops.furiosa.dequantize.default"))


def _writer(f: Path, constant: bool, late_reader: bool) -> None:
    """One slot: supertask 1 writes its second input in place (a weight, or an input another supertask
    reads with nothing ordering it before the write)."""
    a = Assembler("bad_written", version="0.1.0")
    a.slot("0", "cpu")
    a.input("x", (8, 4), "f32")
    if constant:
        write_weights(f)
        a.constant("w", shape=(8, 4), dtype="f32", name_in_file="w", path="weights.safetensors")
    else:
        a.input("w", (8, 4), "f32")
    a.fx("0", lambda x, w: w.copy_(x) + 1, ["x", "w"], ["y"])
    outs = ["y"]
    if late_reader:
        a.fx("0", lambda w: w * 2, ["w"], ["z"])
        outs.append("z")
    a.output(outs)
    save(f, a.to_json())


@case("written_constant", "payload", "a graph writing a constant (a weight every session shares) in place",
      r'supertasks\["1"\]\.inputs\[1\]: expected a pipeline input where the graph writes in place \(node copy_\), '
      r'found "w", a constant \(shared by every session\)$')
def _(f):
    _writer(f, constant=True, late_reader=False)


@case("written_input_read_unordered", "payload",
      "an input a graph writes in place that another supertask reads with nothing ordering it before the write",
      r'supertasks\["1"\]\.inputs\[1\]: expected every other reader of "w", written in place by this graph '
      r'\(node copy_\), to come before it in the dataflow, found supertasks\["2"\], which the write could overtake$')
def _(f):
    _writer(f, constant=False, late_reader=True)


def _as_expr(g):
    n = node_with(g, "transpose.int")
    n["inputs"][1]["arg"] = {"as_sym_int": {"as_expr": {"expr_str": "__import__('os').system('touch PWNED_BY_EXPR')", "hint": None}}}


_blob_case("payload_as_expr", "a payload argument carrying an expression string (as_sym_int.as_expr)",
           r'blobs\["mm"\]: nodes\[\d+\]\.inputs\[1\]\.arg\.as_sym_int\.as_expr: .*$', _as_expr)


def _pickle_blob(g):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch PWNED_BY_BLOB",))
    g["metadata"]["constant_saved_info"]["blob"] = base64.b64encode(pickle.dumps({"c": Evil()})).decode()


def _legacy_pickled_constant(g):
    """furiosa-llm 2024.1's torch 2.1 spelling keeps constants as base64 torch.save files; this one
    holds a pickled object whose __reduce__ would create MARKER."""
    import io

    class MarkerWriter:
        def __reduce__(self):
            return (open, (MARKER, "w"))

    buf = io.BytesIO()
    torch.save({"c": MarkerWriter()}, buf)
    g.pop("metadata")
    g["constants"] = {"c": base64.b64encode(buf.getvalue()).decode()}


_blob_case("payload_pickle_blob", "a payload whose constants blob is a pickle",
           r'blobs\["mm"\]: metadata\.constant_saved_info\.blob: .*$', _pickle_blob)
_blob_case("payload_legacy_constant_pickle",
           "a torch 2.1-spelled payload (furiosa-llm 2024.1) whose torch.save constant holds a pickled object",
           r'blobs\["mm"\]: constants\["c"\]: expected a torch\.save file holding one tensor \(read with '
           r'weights_only=True\), found bytes it refuses .*$', _legacy_pickled_constant)


@case("payload_not_base64", "payload", "a payload that is not base64",
      r'supertasks\["1"\]\.data: .*base64.*$')
def _(f):
    d = p2p(f)
    d["supertasks"]["1"]["data"] = "!!not base64!!"
    save(f, d)


@case("payload_output_shape", "payload", "a supertask output shape that disagrees with its graph",
      r'supertasks\["4"\]\.outputs\[0\]: expected f32\[2, 4\] \(graph output 0 in supertasks\["4"\]\.data\), found f32\[2, 5\]$')
def _(f):
    d = p2p(f)
    d["tensors"]["y"]["shape"] = [2, 5]
    d["metadata"]["tensors"]["outputs"]["y"]["shape"] = [2, 5]
    d["metadata"]["tensor_slices"]["outputs"]["y"]["placements"] = [[0, 2], [0, 5]]
    save(f, d)


@case("payload_input_count", "payload", "a graph with more inputs than its supertask",
      r'supertasks\["4"\]\.data: expected 2 graph inputs \(the inputs of supertask "4"\), found 3$')
def _(f):
    d = p2p(f)
    d["supertasks"]["4"]["data"] = fx_data(lambda h, b, c: h + b + c, ((2, 4), (4,), (4,)))
    save(f, d)


@case("payload_shapes_do_not_propagate", "payload",
      "a graph that fails fake-tensor shape propagation from its supertask's inputs (expand to a wrong size)",
      r'supertasks\["4"\]\.data: node \'expand\' \(aten\.expand\.default\): expected inputs the graph accepts, found RuntimeError: .*$')
def _(f):
    d = p2p(f)
    g = unpack(fx_data(lambda h, b: h + b.expand(2, 4), ((2, 4), (4,))))
    node_with(g, "expand.default")["inputs"][1]["arg"] = {"as_ints": [2, 99]}
    d["supertasks"]["4"]["data"] = pack(g)
    save(f, d)


def _external_constant(path: str):
    def build(f):
        d = p2p(f)
        g = unpack(fx_data(lambda h, b: h + b + torch.tensor([1.0, 2.0, 3.0, 4.0]), ((2, 4), (4,))))
        attr = next(iter(g["metadata"]["getattr_node_targets"]))
        csi = g["metadata"]["constant_saved_info"]
        csi["blob"] = None
        csi["param_files"] = {"f": {"path": path, "format": "safetensors"}}
        csi["tensor_to_saved_file_id_and_saved_name"] = {attr: ["f", "c"]}
        d["supertasks"]["4"]["data"] = pack(g)
        save(f, d)
    return build


case("payload_external_constant_missing", "payload",
     "a payload constant stored in a param file (constant_saved_info.param_files) that does not exist",
     r'supertasks\["4"\]\.data: .*constant_saved_info.*missing\.safetensors.*$')(_external_constant("missing.safetensors"))
case("payload_external_constant_escaping", "payload",
     "a payload constant stored in a param file outside the pipeline's folder (../)",
     r'supertasks\["4"\]\.data: .*constant_saved_info.*expected a file inside .*$')(_external_constant("../outside.safetensors"))


@case("dfg_without_handler", "payload", "a dfg supertask with no registered handler",
      r'supertasks\["4"\]\.kind: expected a kind fastpipe can run \(fx\), found dfg .*register_compute_handler.*$')
def _(f):
    d = p2p(f)
    d["supertasks"]["4"]["kind"] = "dfg"
    d["supertasks"]["4"]["data"] = "NPU-COMPILER-GRAPH"
    save(f, d)


@case("edf_without_handler", "payload", "an edf supertask (an NPU binary) with no registered handler",
      r'supertasks\["4"\]\.kind: expected a kind fastpipe can run \(fx\), found edf .*register_compute_handler\("edf".*$')
def _(f):
    d = p2p(f)
    d["supertasks"]["4"]["kind"] = "edf"
    d["supertasks"]["4"]["data"] = None
    d["supertasks"]["4"]["data_blob"] = "npu0"
    d["blobs"] = {"npu0": None}
    (f / "npu0.edf").write_bytes(b"\x7fEDF")
    save(f, d)


@case("data_blob_unknown", "payload", "a data_blob naming no entry of blobs",
      r'supertasks\["2"\]\.data_blob: expected an id in blobs \(mm\), found "nope"$')
def _(f):
    d = tp(f)
    d["supertasks"]["2"]["data_blob"] = "nope"
    save(f, d)


@case("blob_side_file_missing", "payload", "a null blob whose <blob-id>.fx side file is missing",
      r'blobs\["mm"\]: expected the payload file "mm\.fx" beside the pipeline \(the blob is null\), found no such file$')
def _(f):
    d = tp(f)
    d["blobs"]["mm"] = None
    save(f, d)


@case("blob_id_escaping", "payload", "a null blob whose id walks out of the folder (../x.fx)",
      r'blobs\["\.\./mm"\]\.path: expected a file inside .*, found \'\.\./mm\.fx\'.*$')
def _(f):
    d = tp(f)
    d["blobs"] = {"../mm": None}
    for sid in ("1", "2"):
        d["supertasks"][sid]["data_blob"] = "../mm"
    save(f, d)


# ============================================================================== param files
def _param_case(name, refuses, stderr, mutate=None, files=None):
    @case(name, "params", refuses, stderr)
    def _(f):
        d = tp(f)
        if files is not None:
            files(f)
        if mutate is not None:
            mutate(d)
        save(f, d)


def _w0(**kw):
    return lambda d: d["tensors"]["w_0"]["value"].update(**kw)


W0 = r'tensors\["w_0"\]\.value'

_param_case("param_missing_file", "a param file that does not exist",
            W0 + r'\.path: expected an existing file, found \'.*/missing\.safetensors\' \(no such file\)$',
            _w0(path="missing.safetensors"))
_param_case("param_dotdot", "a param path that walks out of the folder with ..",
            W0 + r'\.path: expected a file inside .* \(pass --allow-outside-paths to permit\), found \'\.\./weights\.safetensors\'.*$',
            _w0(path="../weights.safetensors"))
_param_case("param_absolute", "an absolute param path",
            W0 + r'\.path: expected a relative path to a file inside .* \(pass --allow-outside-paths to permit\), found \'/etc/passwd\'$',
            _w0(path="/etc/passwd"))


@case("param_symlink_escape", "params", "a param file that is a symlink to a file outside the folder",
      W0 + r'\.path: expected a file inside .* \(pass --allow-outside-paths to permit\), found \'escape\.safetensors\' \(resolves to /etc/passwd\)$')
def _(f):
    d = tp(f)
    for link, target in SYMLINKS["param_symlink_escape"].items():
        os.symlink(target, f / link)
    d["tensors"]["w_0"]["value"]["path"] = "escape.safetensors"
    save(f, d)


def _dir(f):
    (f / "weights.d").mkdir()
    (f / "weights.d" / "README").write_text("a folder, not a param file\n")


_param_case("param_is_directory", "a param path that is a folder",
            W0 + r'\.path: expected a regular file, found a directory \'.*/weights\.d\'$', _w0(path="weights.d"), _dir)


def _bytes_case(name, refuses, stderr, data: Callable[[], bytes]):
    def files(f):
        (f / "bad.safetensors").write_bytes(data())
    _param_case(name, refuses, stderr, _w0(path="bad.safetensors"), files)


_bytes_case("safetensors_too_short", "a safetensors file shorter than its 8-byte header length",
            W0 + r'\.path: .*file is 5 bytes, shorter than the 8-byte header length.*$', lambda: b"\x10\x00\x00\x00\x00")
_bytes_case("safetensors_header_length", "a safetensors header length past the end of the file",
            W0 + r'\.path: .*header length 1099511627776 past end of file \(\d+ bytes\).*$',
            lambda: struct.pack("<Q", 1 << 40) + good_safetensors_bytes()[8:])
_bytes_case("safetensors_header_garbage", "a safetensors header that is not JSON",
            W0 + r'\.path: .*header is not valid JSON .*$',
            lambda: raw_safetensors(b"{not json at all: 'x'}  ", b"\x00" * 144))
_bytes_case("safetensors_data_offsets_past_end", "safetensors data_offsets past the end of the data area (a truncated file)",
            W0 + r'\.path: .*data_offsets \[\d+, \d+\] past end of data area \(\d+ bytes; truncated file\?\).*$',
            lambda: good_safetensors_bytes()[:-40])
_bytes_case("safetensors_offsets_mismatch", "safetensors data_offsets that do not match dtype x shape",
            W0 + r'\.path: .*data_offsets \[\d+, \d+\] hold \d+ bytes, but F32 x \[8, 4\] needs 128.*$',
            lambda: raw_safetensors(json.dumps({"b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                                "w": {"dtype": "F32", "shape": [8, 4], "data_offsets": [16, 140]}}).encode(),
                                    b"\x00" * 140))


def _half(f):
    write_weights(f, "half.safetensors", {"w": torch.zeros(8, 4, dtype=torch.float16)})


_param_case("param_name_missing", "a name that is not in the param file",
            W0 + r'\.name: expected .*found \'nope\'.*$', _w0(name="nope"))
_param_case("param_dtype_disagrees", "a stored dtype that differs from the declared one",
            W0 + r'\.name: expected dtype f32.*$', _w0(path="half.safetensors"), _half)
_param_case("param_shape_disagrees", "a stored shape that differs from the declared one (no placements: the whole [8, 4])",
            W0 + r'.*expected .*\[4, 4\].*found .*\[8, 4\].*$',
            lambda d: d["tensors"]["w_0"]["value"].pop("placements"))
_param_case("param_placements_out_of_bounds", "placements outside the stored tensor",
            W0 + r'\.placements\[0\]: expected 0 <= start <= end <= 8, found \[6, 10\]$',
            _w0(placements=[[6, 10], [0, 4]]))
_param_case("param_placements_rank", "placements of the wrong rank for the stored tensor",
            W0 + r'\.placements: expected 2 .*found 1.*$', _w0(placements=[[0, 4]]))
_param_case("param_placements_shape", "placements whose slice has the declared element count but not its shape ([8, 2] for [4, 4])",
            W0 + r'\.placements: expected a slice of shape \[4, 4\] \(the declared shape\), found \[\[0, 8\], \[0, 2\]\] of shape '
            r'\[8, 2\] \(tensor \'w\' in \'weights\.safetensors\'\)$', _w0(placements=[[0, 8], [0, 2]]))
_param_case("param_file_id_unknown", "a param_file naming no entry of param_files",
            W0 + r'\.param_file: expected an id in param_files \(ckpt\), found "other"$',
            lambda d: (d.__setitem__("param_files", {"ckpt": {"path": "weights.safetensors", "format": "safetensors"}}),
                       d["tensors"]["w_0"].__setitem__("value", {"name": "w", "param_file": "other", "placements": [[0, 4], [0, 4]]})))
_param_case("param_unknown_format", "a param format outside safetensors, torch.save, torch.export",
            W0 + r'\.format: expected one of safetensors, torch\.save, torch\.export, found "pickle"$',
            _w0(format="pickle"))


def _evil_pt(f):
    class MarkerWriter:            # unpickling it would create MARKER in the working directory
        def __reduce__(self):
            return (open, (MARKER, "w"))
    torch.save({"w": _weights()["w"], "evil": MarkerWriter()}, str(f / "evil.pt"))


_param_case("torch_save_pickled_object", "a torch.save file holding a pickled object (its __reduce__ would create a file)",
            W0 + r'\.path: expected a torch\.save file of plain tensors \(weights_only=True\), found objects it refuses to unpickle in \'evil\.pt\': .*$',
            _w0(path="evil.pt", format="torch.save"), _evil_pt)


def _corrupt_pt(f):
    import io
    buf = io.BytesIO()
    torch.save({"w": _weights()["w"]}, buf)
    (f / "trunc.pt").write_bytes(buf.getvalue()[:100])


_param_case("torch_save_corrupt", "a truncated torch.save file",
            W0 + r'\.path: corrupt torch\.save file \'trunc\.pt\': .*$',
            _w0(path="trunc.pt", format="torch.save"), _corrupt_pt)


def _export(f):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(_weights()["w"])

        def forward(self, x):
            return x @ self.w.transpose(0, 1)
    ep = torch.export.export(M(), (torch.zeros(2, 4),))
    torch.export.save(ep, str(f / "model.pt2"))


_param_case("torch_export_untrusted", "a torch.export archive without --trust-export-archives",
            W0 + r'\.format: expected a trusted torch\.export archive, found untrusted \'model\.pt2\'.*--trust-export-archives.*$',
            _w0(path="model.pt2", format="torch.export"), _export)


# ============================================================================== at run time
def _x(**kw):
    t = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    return {k: v(t).clone() for k, v in kw.items()}


def _run_case(name, refuses, stderr, inputs, *, exit_code=2, command=RUN, edit=None):
    @case(name, "run", refuses, stderr, command=command, exit_code=exit_code)
    def _(f):
        d = p2p(f, inputs=inputs)
        if edit is not None:
            edit(f, d)
        save(f, d)


_run_case("run_input_unknown_name", "an input the pipeline does not have",
          r'inputs\["z"\]: expected one of the pipeline inputs \(x\), found an unknown name$',
          _x(x=lambda t: t, z=lambda t: t))
_run_case("run_input_missing", "a pipeline input left out",
          r'inputs\["x"\]: expected a tensor for this pipeline input, found none$', {})
_run_case("run_input_shape", "an input of the wrong shape",
          r'inputs\["x"\]\.shape: expected \[2, 4\], found \[4, 2\]$', _x(x=lambda t: t.reshape(4, 2).contiguous()))
_run_case("run_input_dtype", "an input of the wrong dtype",
          r'inputs\["x"\]\.dtype: expected f32, found f64$', _x(x=lambda t: t.double()))


def _garbage_inputs(f, d):
    (f / "inputs.safetensors").write_bytes(b"this is not a safetensors file")


_run_case("run_inputs_not_safetensors", "an --inputs file that is not safetensors",
          r'--inputs: expected a safetensors file, found "inputs\.safetensors" unreadable: .*$',
          _x(x=lambda t: t), edit=_garbage_inputs)
_run_case("run_bad_option", "an option out of range (--chunks 0)",
          r'--chunks: expected >= 1, found 0$', _x(x=lambda t: t), command=RUN + ["--chunks", "0"])


def _index_edit(f, d):
    # slot 1 gathers rows of b by ids computed from h: valid, fails at run time (index out of range)
    d["tensors"]["y"]["dtype"] = "f32"
    d["supertasks"]["4"]["data"] = fx_data(lambda h, b: h + b[(h * 100).long().clamp(min=0) % 4 + 7], ((2, 4), (4,)))


_run_case("run_supertask_fails", "a valid pipeline whose supertask fails while running (exit 1)",
          r'supertasks\["4"\] on slot "1": failed: .*$', _x(x=lambda t: t), exit_code=1, edit=_index_edit)


# ============================================================================== driver
def generate(out: Path = BAD, only: list[str] | None = None) -> list[str]:
    torch.manual_seed(0)
    if out.exists() and only is None:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for name, c in CASES.items():
        if only is not None and name not in only:
            continue
        folder = out / name
        if folder.exists() or folder.is_symlink():
            shutil.rmtree(folder)
        folder.mkdir()
        c.build(folder)
        (folder / "expect.json").write_text(json.dumps(c.expect(), indent=1) + "\n")
        names.append(name)
    return names


def refusals_md() -> str:
    lines = ["# What fastpipe refuses: the corpus", "",
             "<!-- generated by tests/data/make_bad.py; do not edit by hand -->", "",
             "`tests/data/bad/` holds one broken pipeline per refusal, each with the exact one-line",
             "error it must produce and the exit status (2: invalid input; 1: a valid run that failed).",
             "`tests/test_refusals.py` runs every case through the CLI. The rules themselves are",
             "described in [validation.md](validation.md); this page lists the cases by its sections.",
             "Regenerate with `python tests/data/make_bad.py`.", ""]
    for key, title in SECTIONS.items():
        cs = [c for c in CASES.values() if c.section == key]
        lines += [f"## {title}", "", "| case | refuses | command | exit |", "|---|---|---|---|"]
        for c in cs:
            cmd = c.command[0] + (" --inputs ..." if "--inputs" in c.command else "")
            extra = [a for a in c.command if a.startswith("--chunks")]
            if extra:
                cmd += " --chunks 0"
            note = f" **(fastpipe gets this wrong today: {KNOWN_BUGS[c.name].split(':')[0]}, see [fuzzing.md](fuzzing.md))**" \
                if c.name in KNOWN_BUGS else ""
            lines.append(f"| `{c.name}` | {c.refuses}{note} | `{cmd}` | {c.exit} |")
        lines.append("")
    lines += ["## Why", "",
              "- Everything is checked before any weight data is read, and nothing from a pipeline is",
              "  ever executed: payloads are decoded without pickle, eval or exec, call targets come only",
              "  from allowed torch.ops namespaces and registered foreign ops (each a schema and a plain-torch",
              "  reference: fastpipe.payload.foreign_ops), torch.save files load with `weights_only=True`, and",
              "  torch.export archives need `--trust-export-archives`. `tests/test_no_code_execution.py`",
              "  proves it: malicious payloads, blobs, side files and param files of every format are",
              "  loaded through `fastpipe.load` and the CLI with tripwires on eval, exec, compile, pickle,",
              "  os.system, os.popen and subprocess, and no tripwire fires and no marker file appears.",
              "- **The one exception, by design: a trusted torch.export archive.** Its loader can",
              "  unpickle, i.e. run code from the file. `--trust-export-archives` /",
              "  `trust_export_archives=True` means \"I made this file\"; without it the archive is",
              "  refused before it is opened (`torch_export_untrusted`).",
              "- Files are confined to the pipeline's folder (no `..`, absolute paths or symlinks out)",
              "  unless `--allow-outside-paths` is given.",
              "- Structure, comm groups and metadata are refused when a real runtime would hang,",
              "  deadlock, or compute something other than what the producer meant.",
              f"- The corpus has {len(CASES)} cases; `tests/test_fuzz.py` and `scripts/fuzz_campaign.py`",
              "  check that random mutations of the examples give a FastpipeError or correct outputs,",
              "  never a crash ([fuzzing.md](fuzzing.md)).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the corpus here instead of tests/data/bad (docs untouched)")
    ap.add_argument("--only", nargs="*", help="only these cases")
    args = ap.parse_args(argv)
    names = generate(args.out or BAD, args.only)
    if args.out is None and args.only is None:
        DOCS.write_text(refusals_md())
    total = sum(p.stat().st_size for p in (args.out or BAD).rglob("*") if p.is_file() and not p.is_symlink())
    print(f"wrote {len(names)} cases ({total / 1024:.0f} KiB) to {args.out or BAD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
