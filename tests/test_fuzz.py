"""Property-based fuzzing of whole pipelines: mutate the examples in graphs/ and run them.

Mutations touch pipeline.json (fields removed, types changed, numbers perturbed, names
swapped, supertasks dropped or duplicated, payload internals perturbed), the param file's
bytes (the 8-byte header length, the JSON header, the data) and the ``<blob-id>.fx`` side
files. Some mutations mean the same pipeline (consistent renames, other spellings, other
key orders); they must run and give the reference outputs. Every other case must either
run or raise a FastpipeError: never another exception, a crash, a hang (a watchdog fails a
case after TIMEOUT_S) or a write anywhere (the case folder is compared before and after;
CLI cases may write only their --outputs file, in its own subfolder).

The engine (``make_case``, ``run_case``) is shared with scripts/fuzz_campaign.py, which
runs thousands of cases; here a bounded, derandomized number runs in CI.
"""
from __future__ import annotations

import base64
import contextlib
import copy
import io
import json
import logging
import os
import random
import shutil
import struct
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = ROOT / "graphs"
EXAMPLES = ("tp_mlp", "two_stage_skip", "seq_parallel", "moe_all_to_all")
TIMEOUT_S = 20.0
PROCESSOR = "reference"        # scripts/fuzz_campaign.py --processor cpu tries the threaded processor too

# ----------------------------------------------------------------------------- mutations
# Each mutation edits a Case in place; it returns a short note, or None if it did not apply.


@dataclass
class Case:
    example: str
    doc: dict
    weights: bytearray
    side_files: dict[str, bytes]
    inputs: dict[str, torch.Tensor]
    expected: dict[str, torch.Tensor]
    notes: list[str] = field(default_factory=list)
    neutral: bool = True           # every mutation so far keeps the meaning: outputs must match
    doc_text: str | None = None    # set when the JSON text itself was mutated


def _paths(value, prefix=()):
    """Every path in a JSON value (dict keys and list indices)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def _set(doc, path, value):
    _get(doc, path[:-1])[path[-1]] = value


def _fmt(path) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)


def _interesting_paths(doc) -> list[tuple]:
    """Every non-empty path (payload strings are leaves here; payload_number mutates inside them)."""
    return [p for p in _paths(doc) if p]


def m_remove_field(rng: random.Random, c: Case):
    paths = [p for p in _interesting_paths(c.doc) if isinstance(_get(c.doc, p[:-1]), dict)]
    p = rng.choice(paths)
    del _get(c.doc, p[:-1])[p[-1]]
    c.neutral = c.neutral and p in (("metadata",), ("version",), ("device_constraints",))
    return f"remove {_fmt(p)}"


_TYPE_VALUES: list[Any] = [None, 0, 1, -1, 2.5, float("1e300"), True, "", "x", "0", [], [0], [[0, 1]], {}, {"a": 1},
                           2 ** 63, -2 ** 63, "cpu:0", "f32", "sum"]


def m_change_type(rng: random.Random, c: Case):
    p = rng.choice(_interesting_paths(c.doc))
    old = _get(c.doc, p)
    choices = [v for v in _TYPE_VALUES if type(v) is not type(old)]
    new = copy.deepcopy(rng.choice(choices))
    if isinstance(old, (int, float)) and not isinstance(old, bool) and rng.random() < 0.3:
        new = str(old)          # int <-> str of the same number
    _set(c.doc, p, new)
    c.neutral = False
    return f"type {_fmt(p)}: {json.dumps(old)[:30]} -> {json.dumps(new)[:30]}"


_NUMERIC_KEYS = ("shape", "placements", "dim", "src_dim", "dst_dim", "device_idx", "idx", "dst", "src", "reduce_op")


def m_perturb_number(rng: random.Random, c: Case):
    paths = [p for p in _interesting_paths(c.doc)
             if isinstance(_get(c.doc, p), int) and not isinstance(_get(c.doc, p), bool)]
    pref = [p for p in paths if any(k in _NUMERIC_KEYS for k in p if isinstance(k, str))]
    p = rng.choice(pref if pref and rng.random() < 0.85 else paths)
    old = _get(c.doc, p)
    new = rng.choice([old + 1, old - 1, 0, -1, old * 2, old // 2, 2 ** 31, 2 ** 62, 2 ** 64, -2 ** 40, old + 7])
    if new == old:
        new = old + 1
    _set(c.doc, p, new)
    c.neutral = False
    return f"number {_fmt(p)}: {old} -> {new}"


def m_swap_names(rng: random.Random, c: Case):
    sts = c.doc["supertasks"]
    what = rng.choice(["tensor", "group", "slot", "device_idx", "output"])
    if what in ("tensor", "output"):
        key = "inputs" if what == "tensor" else "outputs"
        cands = [(sid, i) for sid, s in sts.items() for i in range(len(s.get(key, [])))]
        if len(cands) < 2:
            return None
        (a, i), (b, j) = rng.sample(cands, 2)
        sts[a][key][i], sts[b][key][j] = sts[b][key][j], sts[a][key][i]
        note = f"swap {key} supertasks[{a}][{i}] <-> supertasks[{b}][{j}]"
    else:
        field_ = {"group": "group", "slot": "device", "device_idx": "device_idx"}[what]
        cands = [sid for sid, s in sts.items() if field_ in s]
        if len(cands) < 2:
            return None
        a, b = rng.sample(cands, 2)
        if sts[a][field_] == sts[b][field_]:
            return None
        sts[a][field_], sts[b][field_] = sts[b][field_], sts[a][field_]
        note = f"swap {field_} of supertasks {a} <-> {b}"
    c.neutral = False
    return note


def m_drop_supertask(rng: random.Random, c: Case):
    sid = rng.choice(list(c.doc["supertasks"]))
    del c.doc["supertasks"][sid]
    c.neutral = False
    return f"drop supertask {sid}"


def m_duplicate_supertask(rng: random.Random, c: Case):
    sid = rng.choice(list(c.doc["supertasks"]))
    c.doc["supertasks"][f"{sid}_dup"] = copy.deepcopy(c.doc["supertasks"][sid])
    c.neutral = False
    return f"duplicate supertask {sid}"


def _payload_sources(c: Case) -> list[tuple[str, Callable[[], str], Callable[[str], None]]]:
    """(label, get text, set text) for every payload: inline data, inline blobs, side files."""
    out = []
    for sid, s in c.doc["supertasks"].items():
        if isinstance(s.get("data"), str):
            out.append((f"supertasks[{sid}].data", lambda s=s: s["data"], lambda t, s=s: s.__setitem__("data", t)))
    for bid, text in (c.doc.get("blobs") or {}).items():
        if isinstance(text, str):
            blobs = c.doc["blobs"]
            out.append((f"blobs[{bid}]", lambda b=bid: blobs[b], lambda t, b=bid: blobs.__setitem__(b, t)))
    for name in c.side_files:
        out.append((name, lambda n=name: c.side_files[n].decode("ascii"),
                    lambda t, n=name: c.side_files.__setitem__(n, t.encode("ascii"))))
    return out


def m_payload_number(rng: random.Random, c: Case):
    """Perturb a number (or a name) inside a decoded payload: sizes, dims, argument values."""
    srcs = _payload_sources(c)
    if not srcs:
        return None
    label, get, put = rng.choice(srcs)
    try:
        g = json.loads(base64.b64decode(get()))
    except (ValueError, UnicodeDecodeError):        # an earlier mutation broke it already
        return None
    if not isinstance(g, dict):
        return None
    paths = [p for p in _paths(g) if p and p[0] != "metadata"
             and isinstance(_get(g, p), (int, str)) and not isinstance(_get(g, p), bool)]
    p = rng.choice(paths)
    old = _get(g, p)
    if isinstance(old, int):
        new = rng.choice([old + 1, old - 1, 0, -1, old * 3, 2 ** 40, 99])
    else:
        new = rng.choice(["x_1", old + "_", "", "transpose", "torch.ops.aten.add.Tensor", "mm"])
    if new == old:
        return None
    _set(g, p, new)
    put(base64.b64encode(json.dumps(g).encode()).decode("ascii"))
    c.neutral = False
    return f"payload {label}{_fmt(p)}: {old!r} -> {new!r}"


# --- param-file and side-file bytes
def _header_len(b: bytes) -> int:
    return int.from_bytes(b[:8], "little") if len(b) >= 8 else 0


def m_weights_bytes(rng: random.Random, c: Case):
    w = c.weights
    n = _header_len(w)
    region = rng.choice(["length", "header", "header", "data", "truncate", "extend"])
    if region == "length":
        i = rng.randrange(8)
        w[i] = rng.choice([w[i] ^ (1 << rng.randrange(8)), 0, 0xFF])
        note = f"weights byte {i} (header length)"
    elif region == "header":
        i = 8 + rng.randrange(max(1, min(n, len(w) - 8)))
        w[i] = rng.choice([w[i] ^ (1 << rng.randrange(8)), ord(rng.choice('{}[]",:0123456789 -e.')), 0])
        note = f"weights byte {i} (JSON header)"
    elif region == "data":
        if len(w) <= 8 + n:
            return None
        i = rng.randrange(8 + n, len(w))
        w[i] ^= 1 << rng.randrange(8)
        note = f"weights byte {i} (data)"
    elif region == "truncate":
        k = rng.choice([0, 4, 8, 9, 8 + n // 2, 8 + n, 8 + n + 1, len(w) - 1, len(w) - 4, rng.randrange(len(w))])
        del w[k:]
        note = f"weights truncated to {k} bytes"
    else:
        extra = bytes(rng.randrange(256) for _ in range(rng.choice([1, 3, 8, 64])))
        w.extend(extra)
        note = f"weights extended by {len(extra)} bytes"
    c.neutral = False
    return note


def m_weights_header_json(rng: random.Random, c: Case):
    """Edit the safetensors header as JSON (still a valid header length): dtype, shape, offsets, names."""
    w = bytes(c.weights)
    n = _header_len(w)
    try:
        hdr = json.loads(w[8:8 + n])
    except ValueError:
        return None
    names = [k for k in hdr if k != "__metadata__"]
    name = rng.choice(names)
    what = rng.choice(["dtype", "shape", "offsets", "rename", "drop", "meta", "pad"])
    e = hdr[name]
    if what == "dtype":
        e["dtype"] = rng.choice(["F16", "BF16", "I32", "F64", "U8", "BOOL", "F8_E4M3", "X99", 7])
    elif what == "shape":
        e["shape"] = rng.choice([e["shape"][::-1], e["shape"] + [1], e["shape"][:-1], [0], [-1], [2 ** 62, 2], "x"])
    elif what == "offsets":
        b, end = e["data_offsets"]
        e["data_offsets"] = rng.choice([[b, end + 4], [b + 4, end], [end, b], [b, 2 ** 63], [-1, end], [b]])
    elif what == "rename":
        hdr[name + "_x"] = hdr.pop(name)
    elif what == "drop":
        del hdr[name]
    elif what == "meta":
        hdr["__metadata__"] = rng.choice([{"a": 1}, "x", {"format": "pt", "k": "v"}, None])
    raw = json.dumps(hdr).encode()
    if what == "pad":
        raw = raw + b" " * rng.choice([1, 7, 8])        # safetensors pads headers with spaces
    c.weights = bytearray(struct.pack("<Q", len(raw)) + raw + w[8 + n:])
    harmless = what == "pad" or (what == "meta" and hdr.get("__metadata__") == {"format": "pt", "k": "v"})
    c.neutral = c.neutral and harmless
    return f"weights header {what} {name}"


_BITS = {"F64": 64, "I64": 64, "U64": 64, "C64": 64, "F32": 32, "I32": 32, "U32": 32, "F16": 16, "BF16": 16, "I16": 16,
         "U16": 16, "U8": 8, "I8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4}


def m_weights_reinterpret(rng: random.Random, c: Case):
    """A self-consistent header that reads a tensor's bytes as another dtype (the last dim rescaled),
    or swaps the data of two same-size tensors: the file is valid; the pipeline may not be."""
    w = bytes(c.weights)
    n = _header_len(w)
    try:
        hdr = json.loads(w[8:8 + n])
        names = [k for k in hdr if k != "__metadata__"]
        name = rng.choice(names)
        e = hdr[name]
        bits = _BITS[e["dtype"]]
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    if rng.random() < 0.7:
        new = rng.choice(sorted(_BITS))
        last = e["shape"][-1] if e["shape"] else 1
        total = last * bits
        if total % _BITS[new]:
            return None
        e["dtype"] = new
        e["shape"] = (e["shape"][:-1] or []) + [total // _BITS[new]]
        note = f"weights header: {name} read as {new} {e['shape']}"
    else:
        same = [k for k in names if k != name and hdr[k].get("data_offsets", [0, 0])[1] - hdr[k].get("data_offsets", [0, 0])[0]
                == e["data_offsets"][1] - e["data_offsets"][0]]
        if not same:
            return None
        other = rng.choice(same)
        e["data_offsets"], hdr[other]["data_offsets"] = hdr[other]["data_offsets"], e["data_offsets"]
        note = f"weights header: data of {name} <-> {other}"
    raw = json.dumps(hdr).encode()
    c.weights = bytearray(struct.pack("<Q", len(raw)) + raw + w[8 + n:])
    c.neutral = False
    return note


def m_inputs(rng: random.Random, c: Case):
    """Run-time inputs: a wrong dtype, shape or name, a missing or extra input, NaN/inf values."""
    if not c.inputs:
        return None
    name = rng.choice(sorted(c.inputs))
    t = c.inputs[name]
    what = rng.choice(["dtype", "shape", "rename", "drop", "extra", "nan", "scalar", "empty"])
    if what == "dtype":
        c.inputs[name] = t.to(rng.choice([torch.float64, torch.float16, torch.int64, torch.bool, torch.bfloat16]))
    elif what == "shape":
        c.inputs[name] = t.reshape(-1) if t.dim() != 1 else t.reshape(1, -1)
    elif what == "rename":
        c.inputs[name + "_"] = c.inputs.pop(name)
    elif what == "drop":
        del c.inputs[name]
    elif what == "extra":
        c.inputs["extra_input"] = t.clone()
    elif what == "nan":
        t = t.clone()
        if t.is_floating_point() and t.numel():
            t.view(-1)[0] = rng.choice([float("nan"), float("inf"), -float("inf")])
        c.inputs[name] = t
    elif what == "scalar":
        c.inputs[name] = torch.tensor(1.0)
    else:
        c.inputs[name] = t.new_zeros((0,) + tuple(t.shape[1:]))
    c.neutral = False
    return f"inputs {name}: {what}"


def m_side_file_bytes(rng: random.Random, c: Case):
    if not c.side_files:
        return None
    name = rng.choice(sorted(c.side_files))
    b = bytearray(c.side_files[name])
    op = rng.choice(["flip", "truncate", "extend", "empty"])
    if op == "flip":
        i = rng.randrange(len(b))
        b[i] = rng.choice([b[i] ^ 1, ord("="), ord("!"), 0xFF])
    elif op == "truncate":
        del b[rng.randrange(len(b)):]
    elif op == "extend":
        b.extend(rng.choice([b"=", b"\n", b"AAAA", b"\xff"]))
    else:
        b = bytearray()
    c.side_files[name] = bytes(b)
    c.neutral = False
    return f"side file {name}: {op}"


# --- neutral mutations: same meaning, other names, spellings or orders
def _rename_tensor(c: Case, old: str, new: str) -> None:
    d = c.doc
    d["tensors"] = {(new if k == old else k): v for k, v in d["tensors"].items()}
    for s in d["supertasks"].values():
        for key in ("inputs", "outputs"):
            s[key] = [new if t == old else t for t in s[key]]
    for side in ("inputs", "outputs"):
        ts = d.get("metadata", {}).get("tensor_slices", {}).get(side)
        if ts and old in ts:
            ts[new] = ts.pop(old)
    for io_ in (c.inputs, c.expected):
        if old in io_:
            io_[new] = io_.pop(old)


def n_rename_tensor(rng: random.Random, c: Case):
    old = rng.choice(sorted(c.doc["tensors"]))
    new = rng.choice([old + "_renamed", "t" + str(rng.randrange(1000)), "x y", "ü", "supertasks", "0"])
    if new in c.doc["tensors"]:
        return None
    _rename_tensor(c, old, new)
    return f"rename tensor {old!r} -> {new!r}"


def n_rename_supertask(rng: random.Random, c: Case):
    old = rng.choice(sorted(c.doc["supertasks"]))
    new = old + "_id"
    c.doc["supertasks"] = {(new if k == old else k): v for k, v in c.doc["supertasks"].items()}
    return f"rename supertask {old!r} -> {new!r}"


def n_rename_group(rng: random.Random, c: Case):
    groups = sorted({s["group"] for s in c.doc["supertasks"].values() if "group" in s})
    if not groups:
        return None
    old = rng.choice(groups)
    for s in c.doc["supertasks"].values():
        if s.get("group") == old:
            s["group"] = old + "/renamed"
    return f"rename group {old!r}"


def n_rename_slot(rng: random.Random, c: Case):
    old = rng.choice(sorted(c.doc["devices"]))
    new = "slot_" + old
    d = c.doc
    d["devices"] = {(new if k == old else k): v for k, v in d["devices"].items()}
    for s in d["supertasks"].values():
        if s.get("device") == old:
            s["device"] = new
        md = s.get("metadata") or {}
        for k in ("dst", "src"):
            if k in md and str(md[k]) == old:
                md[k] = new
    for side in ("inputs", "outputs"):
        for sl in d.get("metadata", {}).get("tensor_slices", {}).get(side, {}).values():
            if sl.get("device") == old:
                sl["device"] = new
    return f"rename slot {old!r} -> {new!r}"


def n_respell(rng: random.Random, c: Case):
    d = c.doc
    what = rng.choice(["device", "kind", "reduce_op", "blob_inline"])
    if what == "device":
        slot = rng.choice(sorted(d["devices"]))
        dev = d["devices"][slot]
        if isinstance(dev, dict):
            d["devices"][slot] = f"{dev['kind']}:{dev['idx']}"
        elif isinstance(dev, str) and ":" in dev and "," not in dev and dev.count(":") == 1:
            kind, idx = dev.split(":")
            d["devices"][slot] = {"kind": kind, "idx": int(idx)}
        else:
            return None
        return f"respell device {slot}"
    if what == "kind":
        sts = [s for s in d["supertasks"].values() if s["kind"] in ("fx", "FX")]
        if not sts:
            return None
        for s in sts:
            s["kind"] = {"fx": "FX", "FX": "fx"}[s["kind"]]
        return "respell fx/FX"
    if what == "reduce_op":
        groups: dict[str, list] = {}
        for s in d["supertasks"].values():
            if "reduce_op" in (s.get("metadata") or {}):
                groups.setdefault(s["group"], []).append(s)
        if not groups:
            return None
        g = rng.choice(sorted(groups))
        new = rng.choice(["sum", "SUM", "RedOpType.SUM", "ReduceOp.SUM", 0])
        if any(str(s["metadata"]["reduce_op"]).lower().split(".")[-1] not in ("sum", "0") for s in groups[g]):
            return None
        for s in groups[g]:
            s["metadata"]["reduce_op"] = new
        return f"respell reduce_op of {g} as {new!r}"
    # blob_inline: a supertask's data_blob replaced by its payload inline
    sts = [(sid, s) for sid, s in d["supertasks"].items() if "data_blob" in s]
    if not sts:
        return None
    sid, s = rng.choice(sts)
    text = d["blobs"][s["data_blob"]]
    if text is None:
        text = c.side_files[f"{s['data_blob']}.fx"].decode("ascii")
    del s["data_blob"]
    s["data"] = text
    return f"inline the payload of supertask {sid}"


def n_reorder(rng: random.Random, c: Case):
    key = rng.choice(["supertasks", "tensors", "devices"])
    items = list(c.doc[key].items())
    rng.shuffle(items)
    c.doc[key] = dict(items)
    return f"reorder {key}"


def n_whitespace(rng: random.Random, c: Case):
    c.doc_text = json.dumps(c.doc, indent=rng.choice([None, 0, 4]), separators=rng.choice([(",", ":"), (", ", ": ")]))
    return "reformat JSON"


MUTATIONS: dict[str, Callable] = {
    "remove_field": m_remove_field, "change_type": m_change_type, "perturb_number": m_perturb_number,
    "swap_names": m_swap_names, "drop_supertask": m_drop_supertask, "duplicate_supertask": m_duplicate_supertask,
    "payload_number": m_payload_number, "weights_bytes": m_weights_bytes, "weights_header_json": m_weights_header_json,
    "side_file_bytes": m_side_file_bytes, "weights_reinterpret": m_weights_reinterpret, "inputs": m_inputs,
    # neutral
    "rename_tensor": n_rename_tensor, "rename_supertask": n_rename_supertask, "rename_group": n_rename_group,
    "rename_slot": n_rename_slot, "respell": n_respell, "reorder": n_reorder, "whitespace": n_whitespace,
}
NEUTRAL = ("rename_tensor", "rename_supertask", "rename_group", "rename_slot", "respell", "reorder", "whitespace")


# ----------------------------------------------------------------------------- cases
_EXAMPLE_CACHE: dict[str, tuple] = {}


def _example(name: str):
    if name not in _EXAMPLE_CACHE:
        folder = GRAPHS / name
        side = {p.name: p.read_bytes() for p in folder.glob("*.fx")}
        _EXAMPLE_CACHE[name] = (json.loads((folder / "pipeline.json").read_text()), (folder / "weights.safetensors").read_bytes(),
                                side, load_file(str(folder / "inputs.safetensors")), load_file(str(folder / "expected.safetensors")))
    return _EXAMPLE_CACHE[name]


def make_case(example: str, kinds: list[str], rng: random.Random) -> Case:
    doc, weights, side, inputs, expected = _example(example)
    c = Case(example, copy.deepcopy(doc), bytearray(weights), dict(side), dict(inputs), dict(expected))
    for kind in kinds:
        if kind != "whitespace" and c.doc_text is not None:
            continue
        try:
            note = MUTATIONS[kind](rng, c)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            note, c.neutral = None, False      # an earlier mutation broke the structure it needs
        if note is None:
            c.notes.append(f"{kind}: did not apply")
        else:
            c.notes.append(note)
    return c


def write_case(c: Case, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    text = c.doc_text if c.doc_text is not None else json.dumps(c.doc, indent=1)
    (folder / "pipeline.json").write_text(text)
    (folder / "weights.safetensors").write_bytes(bytes(c.weights))
    for name, b in c.side_files.items():
        (folder / name).write_bytes(b)
    save_file({k: v.contiguous() for k, v in c.inputs.items()}, str(folder / "inputs.safetensors"))


def snapshot(folder: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            out[str(p.relative_to(folder))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@dataclass
class Outcome:
    status: str                    # "ran", "refused", "FAIL"
    detail: str                    # error class, or what failed
    message: str = ""


def _with_watchdog(fn: Callable[[], Outcome], timeout: float) -> Outcome:
    box: list = []

    def target():
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - reported as a failure below
            box.append(Outcome("FAIL", f"uncaught {type(e).__name__}", traceback.format_exc()))

    t = threading.Thread(target=target, daemon=True, name="fuzz-case")
    t.start()
    t.join(timeout)
    if t.is_alive():
        frames = sys._current_frames().get(t.ident)
        stack = "".join(traceback.format_stack(frames)) if frames else ""
        return Outcome("FAIL", "hang", f"no result after {timeout:.0f} s\n{stack}")
    return box[0]


def _compare(c: Case, outs: dict) -> str | None:
    """None if the outputs are right (neutral case) or at least well formed (any case)."""
    if not isinstance(outs, dict):
        return f"run returned {type(outs).__name__}"
    if c.neutral:
        if set(outs) != set(c.expected):
            return f"outputs {sorted(outs)} != expected {sorted(c.expected)}"
        for k, v in c.expected.items():
            try:
                torch.testing.assert_close(outs[k], v, rtol=1e-4, atol=1e-5)
            except AssertionError as e:
                return f"output {k!r} differs: {' '.join(str(e).split())[:200]}"
    for k, v in outs.items():
        if not isinstance(v, torch.Tensor):
            return f"output {k!r} is {type(v).__name__}"
    return None


def run_in_process(c: Case, folder: Path) -> Outcome:
    """fastpipe.load + run (reference processor, no compile) on the written case."""
    import fastpipe
    from fastpipe.errors import FastpipeError
    from fastpipe.weights import WeightStore

    def body() -> Outcome:
        try:
            sess = fastpipe.load(folder / "pipeline.json", store=WeightStore(), processor=PROCESSOR, compile=False)
            outs = sess.run(c.inputs)
        except FastpipeError as e:
            msg = str(e)
            if "\n" in msg or not msg:
                return Outcome("FAIL", f"{type(e).__name__} message not one line", msg)
            return Outcome("refused", type(e).__name__, msg)
        bad = _compare(c, outs)
        return Outcome("FAIL", "wrong outputs", bad) if bad else Outcome("ran", "ok")

    return _with_watchdog(body, TIMEOUT_S)


@contextlib.contextmanager
def error_logs():
    """Collect ERROR records logged anywhere: logging's handlers print them (torch's with a
    traceback) to the process's stderr, beside the CLI's one line."""
    records: list[logging.LogRecord] = []
    handle = logging.Logger.handle

    def recording(self, record):
        if record.levelno >= logging.ERROR:
            records.append(record)
        return handle(self, record)

    logging.Logger.handle = recording
    try:
        yield records
    finally:
        logging.Logger.handle = handle


# Known fastpipe bugs, reported to the lead: (outcome detail prefix, reason). A case that hits one is
# counted as "KNOWN" (the campaign lists them) instead of failing CI; the strict xfail tests in
# tests/test_refusals.py flip to failures once the bug is fixed, and then this entry goes.
KNOWN_BUGS: list[tuple[Callable[[Outcome], bool], str]] = []   # all fixed (docs/fuzzing.md)


def run_cli(c: Case, folder: Path) -> Outcome:
    """``fastpipe run ... --outputs out/o.safetensors`` in-process: exit 0, 1 or 2 and one clean line."""
    from fastpipe.cli import main

    (folder / "out").mkdir(exist_ok=True)
    argv = ["run", str(folder / "pipeline.json"), "--inputs", str(folder / "inputs.safetensors"),
            "--outputs", str(folder / "out" / "o.safetensors"), "--processor", PROCESSOR, "--no-compile",
            "--warmup", "0", "--repeat", "1"]

    def body() -> Outcome:
        out, err = io.StringIO(), io.StringIO()
        with error_logs() as logs, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
        e = err.getvalue()
        lines = e.splitlines()
        if logs:      # printed to the real stderr by logging's own handlers: not one line
            r = logs[0]
            return Outcome("FAIL", f"torch logged an error ({r.name}) besides exit {rc}",
                           f"{r.getMessage()[:200]}; then: {lines[:1]}")
        if "Traceback" in e or "Traceback" in out.getvalue():
            return Outcome("FAIL", "traceback printed", e)
        if rc == 0:
            if lines:
                return Outcome("FAIL", "stderr on success", e)
            got = load_file(str(folder / "out" / "o.safetensors"))
            bad = _compare(c, got)
            return Outcome("FAIL", "wrong outputs", bad) if bad else Outcome("ran", "exit 0")
        if len(lines) != 1:
            return Outcome("FAIL", f"exit {rc} with {len(lines)} stderr lines", e)
        if "internal error" in lines[0] or not lines[0].startswith("fastpipe: error: "):
            return Outcome("FAIL", f"exit {rc}: internal error", lines[0])
        if rc not in (1, 2):
            return Outcome("FAIL", f"exit {rc}", lines[0])
        if (folder / "out" / "o.safetensors").exists():
            return Outcome("FAIL", "outputs written by a failed run", lines[0])
        return Outcome("refused", f"exit {rc}", lines[0])

    return _with_watchdog(body, TIMEOUT_S)


def run_case(c: Case, base: Path, *, cli: bool = False) -> Outcome:
    """Write the case into ``base``/case, run it, and check nothing else was written."""
    folder = base / "case"
    if folder.exists():
        shutil.rmtree(folder)
    write_case(c, folder)
    if cli:
        (folder / "out").mkdir()
    before = snapshot(base)
    outcome = (run_cli if cli else run_in_process)(c, folder)
    after = snapshot(base)
    allowed = {str(Path("case") / "out"), str(Path("case") / "out" / "o.safetensors")} if cli else set()
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k) and k not in allowed)
    if changed and outcome.detail != "hang":
        return Outcome("FAIL", "wrote files", f"changed: {changed}; outcome was {outcome.status} {outcome.detail}")
    for matches, why in KNOWN_BUGS:
        if outcome.status == "FAIL" and matches(outcome):
            return Outcome("KNOWN", outcome.detail, why)
    return outcome


def describe(c: Case) -> str:
    return f"{c.example}: " + "; ".join(c.notes) + (" (neutral)" if c.neutral else "")


# ----------------------------------------------------------------------------- the CI tests
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KINDS = sorted(MUTATIONS)
_settings = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="fastpipe_fuzz_") as d:
        yield Path(d)


def _check(c: Case, outcome: Outcome) -> None:
    if outcome.status == "FAIL":
        pytest.fail(f"{describe(c)}\n{outcome.detail}\n{outcome.message}", pytrace=False)


@settings(_settings, max_examples=300)
@given(example=st.sampled_from(EXAMPLES), kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
       seed=st.integers(0, 2 ** 32 - 1))
def test_mutated_pipelines_run_or_refuse(workdir, example, kinds, seed):
    c = make_case(example, kinds, random.Random(seed))
    _check(c, run_case(c, workdir))


@settings(_settings, max_examples=80)
@given(example=st.sampled_from(EXAMPLES), kinds=st.lists(st.sampled_from(NEUTRAL), min_size=1, max_size=4),
       seed=st.integers(0, 2 ** 32 - 1))
def test_neutral_mutations_give_the_reference_outputs(workdir, example, kinds, seed):
    c = make_case(example, kinds, random.Random(seed))
    assert c.neutral
    outcome = run_case(c, workdir)
    _check(c, outcome)
    assert outcome.status == "ran", f"{describe(c)}: refused: {outcome.message}"


@settings(_settings, max_examples=80)
@given(example=st.sampled_from(EXAMPLES), kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=2),
       seed=st.integers(0, 2 ** 32 - 1))
def test_mutated_pipelines_through_the_cli(workdir, example, kinds, seed):
    c = make_case(example, kinds, random.Random(seed))
    _check(c, run_case(c, workdir, cli=True))


def test_the_harness_notices_failures(workdir):
    """A hang, a stray write and a non-FastpipeError are each reported as a failure."""
    assert _with_watchdog(lambda: (threading.Event().wait(2), Outcome("ran", "ok"))[1], 0.2).detail == "hang"
    assert _with_watchdog(lambda: 1 / 0, 5).detail == "uncaught ZeroDivisionError"
    c = make_case("two_stage_skip", [], random.Random(0))
    assert run_case(c, workdir).status == "ran"
    c.expected = {k: v + 1 for k, v in c.expected.items()}
    assert run_case(c, workdir).detail == "wrong outputs"
    c = make_case("two_stage_skip", [], random.Random(0))
    folder = workdir / "case"
    real = run_in_process
    try:
        globals()["run_in_process"] = lambda c, f: ((f.parent / "stray").write_text("x"), real(c, f))[1]
        assert run_case(c, workdir).detail == "wrote files"
    finally:
        globals()["run_in_process"] = real
        (workdir / "stray").unlink(missing_ok=True)
    assert folder.exists()
