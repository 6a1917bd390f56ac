"""Comm groups: membership, metadata, and shapes consistent with each kind's semantics.

A group is every comm supertask sharing `group`. It has one kind (send/recv
pairs excepted: one send and one recv), identical metadata, `device_idx`
exactly 0..n-1 on distinct slots, exactly its kind's metadata keys with valid
values, and input/output shapes and dtypes that the kind's semantics
(SPEC §1 "Comm semantics") produce. Every backend fastpipe targets (NCCL,
gloo, the fused kernels) needs equal-sized participants, so participants'
inputs must have identical shapes; dims are non-negative.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fastpipe import dtypes
from fastpipe.errors import ValidationError, key_path
from fastpipe.format.comm_shapes import comm_output_shape
from fastpipe.format.fields import show
from fastpipe.format.model import COMM_METADATA_KEYS, Pipeline, SuperTask
from fastpipe.format.reduce_ops import canonical_reduce_op


@dataclass(frozen=True)
class CommGroup:
    name: str
    kind: str                              # the group's kind; "p2p" for a send/recv pair
    members: tuple[str, ...]               # supertask ids ordered by device_idx
    params: dict                           # canonical metadata: reduce_op str, dims int, dst/src as member index


def _st(sid: str) -> str:
    return key_path("supertasks", sid)


def collect_groups(p: Pipeline) -> dict[str, CommGroup]:
    by_group: dict[str, list[str]] = defaultdict(list)
    for sid, st in p.supertasks.items():
        if st.is_comm:
            by_group[st.group].append(sid)
    for sid, st in p.supertasks.items():
        if st.is_comm and st.group_is_null:
            _check_null_group(p, sid, st, by_group[st.group])
    return {g: _check_group(p, g, sids) for g, sids in by_group.items()}


def _check_null_group(p: Pipeline, sid: str, st: SuperTask, members: list[str]) -> None:
    """`"group": null` makes a group of one (the supertask alone): a collective over a single
    participant, whose result is its input. A send or recv cannot pair with anything."""
    if st.kind in ("send", "recv"):
        raise ValidationError(f"{_st(sid)}.group: expected a group name shared by a {st.kind} and its "
                              f"{'recv' if st.kind == 'send' else 'send'}, found null")
    if len(members) != 1:
        other = next(m for m in members if m != sid)
        raise ValidationError(f"{_st(other)}.group: expected a name other than \"{st.group}\" (fastpipe's name for "
                              f"the group of supertask \"{sid}\", whose group is null), found it")


def _check_group(p: Pipeline, group: str, sids: list[str]) -> CommGroup:
    sts = {sid: p.supertasks[sid] for sid in sids}
    kinds = sorted({st.kind for st in sts.values()})
    first = sids[0]
    if kinds == ["recv", "send"] or kinds in (["send"], ["recv"]):
        return _check_p2p(p, group, sts)
    if len(kinds) != 1:
        other = next(s for s in sids if sts[s].kind != sts[first].kind)
        raise ValidationError(f"{_st(other)}.kind: expected every member of group \"{group}\" to be {sts[first].kind} "
                              f"(like supertask \"{first}\"), found {sts[other].kind}")
    kind = kinds[0]
    _check_keys(sts, kind)
    for sid in sids[1:]:
        if dict(sts[sid].metadata) != dict(sts[first].metadata) and _canon_meta(sts[sid]) != _canon_meta(sts[first]):
            raise ValidationError(f"{_st(sid)}.metadata: expected the same metadata as supertask \"{first}\" of group "
                                  f"\"{group}\" ({show(dict(sts[first].metadata))}), found {show(dict(sts[sid].metadata))}")
    members = _check_ranks(sts, group)
    n = len(members)
    slots = [sts[s].device for s in members]
    meta = sts[first].metadata
    params: dict = {}
    if "reduce_op" in meta:
        params["reduce_op"] = _reduce_op(meta["reduce_op"], f"{_st(first)}.metadata.reduce_op")
    for key in ("dst", "src"):
        if key in meta:
            slot = str(meta[key])
            if slot not in slots:
                raise ValidationError(f"{_st(first)}.metadata.{key}: expected a slot of group \"{group}\" "
                                      f"({', '.join(slots)}), found {show(meta[key])}")
            params[key] = slots.index(slot)
    _check_io_counts(sts, members, kind, params)
    x = _first_input(p, sts, members)
    for key in ("dim", "src_dim", "dst_dim"):
        if key in meta:
            params[key] = _dim(meta[key], len(x[0]), f"{_st(first)}.metadata.{key}")
    _check_shapes(p, sts, members, kind, params, n, x)
    return CommGroup(group, kind, tuple(members), params)


def _canon_meta(st: SuperTask) -> dict:
    out = {k: str(v) for k, v in st.metadata.items()}
    if "reduce_op" in st.metadata:
        try:
            out["reduce_op"] = canonical_reduce_op(st.metadata["reduce_op"])
        except (KeyError, ValueError):
            pass
    return out


def _reduce_op(value, path: str) -> str:
    try:
        return canonical_reduce_op(value)
    except (KeyError, ValueError):
        raise ValidationError(f"{path}: expected one of sum, avg, max, min (or a producer spelling such as "
                              f"\"RedOpType.SUM\" or 0), found {show(value)}") from None


def _dim(value, rank: int, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < rank:
        name = path.rsplit(".", 1)[-1]
        raise ValidationError(f"{path}: expected 0 <= {name} < {rank}, found {show(value)}")
    return value


def _check_keys(sts: dict[str, SuperTask], kind: str) -> None:
    want = set(COMM_METADATA_KEYS[kind])
    for sid, st in sts.items():
        have = set(st.metadata)
        if have != want:
            extra, missing = sorted(have - want), sorted(want - have)
            detail = (f"unknown key \"{extra[0]}\"" if extra else f"missing key \"{missing[0]}\"")
            raise ValidationError(f"{_st(sid)}.metadata: expected exactly the keys "
                                  f"[{', '.join(sorted(want))}] for {kind}, found {detail}")


def _check_ranks(sts: dict[str, SuperTask], group: str) -> list[str]:
    n = len(sts)
    by_rank: dict[int, str] = {}
    for sid, st in sts.items():
        if st.device_idx >= n:
            raise ValidationError(f"{_st(sid)}.device_idx: expected 0 <= device_idx < {n} (the size of group \"{group}\"), found {st.device_idx}")
        if st.device_idx in by_rank:
            raise ValidationError(f"{_st(sid)}.device_idx: expected a rank not used by another member of group \"{group}\", "
                                  f"found {st.device_idx} (also supertask \"{by_rank[st.device_idx]}\")")
        by_rank[st.device_idx] = sid
    members = [by_rank[i] for i in range(n)]
    seen: dict[str, str] = {}
    for sid in members:
        slot = sts[sid].device
        if slot in seen:
            raise ValidationError(f"{_st(sid)}.device: expected members of group \"{group}\" on distinct slots, "
                                  f"found slot \"{slot}\" also used by supertask \"{seen[slot]}\"")
        seen[slot] = sid
    return members


def _expect_count(sid: str, field: str, got: int, want: int, why: str) -> None:
    if got != want:
        raise ValidationError(f"{_st(sid)}.{field}: expected {want} tensor{'s' if want != 1 else ''} ({why}), found {got}")


def _check_io_counts(sts, members, kind: str, params: dict) -> None:
    for rank, sid in enumerate(members):
        st = sts[sid]
        if kind in ("reduce", "gather"):
            _expect_count(sid, "inputs", len(st.inputs), 1, f"every {kind} participant gives one")
            is_dst = rank == params["dst"]
            _expect_count(sid, "outputs", len(st.outputs), 1 if is_dst else 0,
                          f"only the dst participant of {kind} has an output")
        elif kind == "broadcast":
            is_src = rank == params["src"]
            _expect_count(sid, "inputs", len(st.inputs), 1 if is_src else 0, "only the src participant of broadcast gives an input")
            _expect_count(sid, "outputs", len(st.outputs), 1, "every broadcast participant outputs a copy")
        else:
            _expect_count(sid, "inputs", len(st.inputs), 1, f"{kind} takes one input per participant")
            _expect_count(sid, "outputs", len(st.outputs), 1, f"{kind} gives one output per participant")


def _first_input(p: Pipeline, sts, members) -> tuple[tuple[int, ...], str]:
    st = next(sts[s] for s in members if sts[s].inputs)
    t = p.tensors[st.inputs[0]]
    return t.shape, t.dtype


def _check_shapes(p: Pipeline, sts, members, kind: str, params: dict, n: int, x) -> None:
    in_shape, dtype = x
    for sid in members:
        for i, name in enumerate(sts[sid].inputs):
            t = p.tensors[name]
            if (t.shape, t.dtype) != (in_shape, dtype):
                raise ValidationError(f"{_st(sid)}.inputs[{i}]: expected {_desc(in_shape, dtype)} like the other members "
                                      f"of group \"{sts[sid].group}\", found {_desc(t.shape, t.dtype)} (\"{name}\")")
    if params.get("reduce_op") == "avg" and not dtypes.is_floating(dtype):
        raise ValidationError(f"{_st(members[0])}.metadata.reduce_op: expected sum, max or min for dtype {dtype} "
                              f"(avg needs a floating dtype), found avg")
    for key in ("dim", "src_dim"):
        if key in params and kind in ("reduce_scatter", "all_to_all") and in_shape[params[key]] % n:
            raise ValidationError(f"{_st(members[0])}.metadata.{key}: expected a dim whose size divides by the group size {n}, "
                                  f"found dim {params[key]} of size {in_shape[params[key]]}")
    out = comm_output_shape(kind, in_shape, n, params)
    for sid in members:
        for i, name in enumerate(sts[sid].outputs):
            t = p.tensors[name]
            if (t.shape, t.dtype) != (tuple(out), dtype):
                raise ValidationError(f"{_st(sid)}.outputs[{i}]: expected {_desc(tuple(out), dtype)} for {kind} of "
                                      f"{n} x {_desc(in_shape, dtype)}, found {_desc(t.shape, t.dtype)} (\"{name}\")")


def _desc(shape, dtype) -> str:
    return f"{dtype}{list(shape)}"


def _check_p2p(p: Pipeline, group: str, sts: dict[str, SuperTask]) -> CommGroup:
    sends = [s for s, st in sts.items() if st.kind == "send"]
    recvs = [s for s, st in sts.items() if st.kind == "recv"]
    any_sid = next(iter(sts))
    if len(sends) != 1 or len(recvs) != 1:
        raise ValidationError(f"{_st(any_sid)}.group: expected group \"{group}\" to pair one send with one recv, "
                              f"found {len(sends)} send and {len(recvs)} recv")
    _check_keys(sts, "send")
    s, r = sts[sends[0]], sts[recvs[0]]
    _expect_count(sends[0], "inputs", len(s.inputs), 1, "send takes one input")
    _expect_count(sends[0], "outputs", len(s.outputs), 0, "send has no outputs")
    _expect_count(recvs[0], "inputs", len(r.inputs), 0, "recv has no inputs")
    _expect_count(recvs[0], "outputs", len(r.outputs), 1, "recv gives one output")
    if s.device == r.device:
        raise ValidationError(f"{_st(recvs[0])}.device: expected the recv of group \"{group}\" on another slot than its send, found slot \"{r.device}\" for both")
    if {s.device_idx, r.device_idx} != {0, 1}:
        raise ValidationError(f"{_st(recvs[0])}.device_idx: expected send and recv of group \"{group}\" to have device_idx 0 and 1, "
                              f"found {s.device_idx} and {r.device_idx}")
    x, y = p.tensors[s.inputs[0]], p.tensors[r.outputs[0]]
    if (x.shape, x.dtype) != (y.shape, y.dtype):
        raise ValidationError(f"{_st(recvs[0])}.outputs[0]: expected {_desc(x.shape, x.dtype)} like the sent \"{s.inputs[0]}\", "
                              f"found {_desc(y.shape, y.dtype)} (\"{r.outputs[0]}\")")
    return CommGroup(group, "p2p", (sends[0], recvs[0]), {})
