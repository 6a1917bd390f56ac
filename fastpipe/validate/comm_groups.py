"""Comm groups: membership, metadata, and shapes consistent with each kind's semantics.

A group is every comm supertask sharing `group`. It has one kind (send/recv
pairs excepted: one send and one recv), identical metadata, `device_idx`
exactly 0..n-1 on distinct slots, exactly its kind's metadata keys with valid
values, and input/output shapes and dtypes that the kind's semantics
(SPEC §1 "Comm semantics") produce. Every backend fastpipe targets (NCCL,
gloo, the fused kernels) needs equal-sized participants, so participants'
inputs must have identical shapes; dims are non-negative.

What each kind takes and gives is its spec (fastpipe.format.comm_kinds): its metadata keys
and their types (reduce_op, dim, slot), which members hold an input and an output, and the
output shape rule. A send and a recv (specs of group "p2p") form a pair.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fastpipe import dtypes
from fastpipe.errors import ValidationError, key_path
from fastpipe.format.comm_kinds import COMM_KINDS, CommKindSpec
from fastpipe.format.fields import show
from fastpipe.format.model import Pipeline, SuperTask
from fastpipe.format.reduce_ops import canonical_reduce_op


@dataclass(frozen=True)
class CommGroup:
    name: str
    kind: str                              # the group's kind (its spec's group_kind): "p2p" for a send/recv pair
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
    partner = COMM_KINDS[st.kind].partner
    if partner is not None:
        raise ValidationError(f"{_st(sid)}.group: expected a group name shared by a {st.kind} and its "
                              f"{partner}, found null")
    if len(members) != 1:
        other = next(m for m in members if m != sid)
        raise ValidationError(f"{_st(other)}.group: expected a name other than \"{st.group}\" (fastpipe's name for "
                              f"the group of supertask \"{sid}\", whose group is null), found it")


def _check_group(p: Pipeline, group: str, sids: list[str]) -> CommGroup:
    sts = {sid: p.supertasks[sid] for sid in sids}
    kinds = sorted({st.kind for st in sts.values()})
    first = sids[0]
    if {COMM_KINDS[k].group_kind for k in kinds} == {"p2p"}:
        return _check_p2p(p, group, sts)
    if len(kinds) != 1:
        other = next(s for s in sids if sts[s].kind != sts[first].kind)
        raise ValidationError(f"{_st(other)}.kind: expected every member of group \"{group}\" to be {sts[first].kind} "
                              f"(like supertask \"{first}\"), found {sts[other].kind}")
    kind = kinds[0]
    spec = COMM_KINDS[kind]
    _check_keys(sts, spec)
    for sid in sids[1:]:
        if dict(sts[sid].metadata) != dict(sts[first].metadata) and _canon_meta(sts[sid]) != _canon_meta(sts[first]):
            raise ValidationError(f"{_st(sid)}.metadata: expected the same metadata as supertask \"{first}\" of group "
                                  f"\"{group}\" ({show(dict(sts[first].metadata))}), found {show(dict(sts[sid].metadata))}")
    members = _check_ranks(sts, group)
    n = len(members)
    slots = [sts[s].device for s in members]
    meta = sts[first].metadata
    params: dict = {}
    for prm in spec.of_type("reduce_op"):
        if prm.name in meta:
            params[prm.name] = _reduce_op(meta[prm.name], f"{_st(first)}.metadata.{prm.name}")
    for prm in spec.of_type("slot"):
        if prm.name in meta:
            slot = str(meta[prm.name])
            if slot not in slots:
                raise ValidationError(f"{_st(first)}.metadata.{prm.name}: expected a slot of group \"{group}\" "
                                      f"({', '.join(slots)}), found {show(meta[prm.name])}")
            params[prm.name] = slots.index(slot)
    _check_io_counts(sts, members, spec, params)
    x = _first_input(p, sts, members)
    for prm in spec.of_type("dim"):
        if prm.name in meta:
            params[prm.name] = _dim(meta[prm.name], len(x[0]), f"{_st(first)}.metadata.{prm.name}")
    _check_shapes(p, sts, members, spec, params, n, x)
    return CommGroup(group, spec.group_kind, tuple(members), params)


def _canon_meta(st: SuperTask) -> dict:
    """The metadata as members must agree on it: values as strings, reduce ops in any spelling."""
    out = {k: str(v) for k, v in st.metadata.items()}
    for prm in COMM_KINDS[st.kind].of_type("reduce_op"):
        if prm.name in st.metadata:
            try:
                out[prm.name] = canonical_reduce_op(st.metadata[prm.name])
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


def _check_keys(sts: dict[str, SuperTask], spec: CommKindSpec) -> None:
    want = {prm.name for prm in spec.params if prm.required}
    allowed = set(spec.keys)
    optional = sorted(allowed - want)
    for sid, st in sts.items():
        have = set(st.metadata)
        extra, missing = sorted(have - allowed), sorted(want - have)
        if extra or missing:
            detail = (f"unknown key \"{extra[0]}\"" if extra else f"missing key \"{missing[0]}\"")
            keys = f"[{', '.join(sorted(want))}]" + (f" (optional: {', '.join(optional)})" if optional else "")
            raise ValidationError(f"{_st(sid)}.metadata: expected {'' if optional else 'exactly '}the keys "
                                  f"{keys} for {spec.name}, found {detail}")


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


def _check_io_counts(sts, members, spec: CommKindSpec, params: dict) -> None:
    """Each member holds what its spec says (`inputs`/`outputs`: all, the root only, none)."""
    for rank, sid in enumerate(members):
        st = sts[sid]
        for side in ("inputs", "outputs"):
            _expect_count(sid, side, len(getattr(st, side)), spec.count(side, rank, params), spec.explain(side))


def _first_input(p: Pipeline, sts, members) -> tuple[tuple[int, ...], str]:
    st = next(sts[s] for s in members if sts[s].inputs)
    t = p.tensors[st.inputs[0]]
    return t.shape, t.dtype


def _check_shapes(p: Pipeline, sts, members, spec: CommKindSpec, params: dict, n: int, x) -> None:
    in_shape, dtype = x
    for sid in members:
        for i, name in enumerate(sts[sid].inputs):
            t = p.tensors[name]
            if (t.shape, t.dtype) != (in_shape, dtype):
                raise ValidationError(f"{_st(sid)}.inputs[{i}]: expected {_desc(in_shape, dtype)} like the other members "
                                      f"of group \"{sts[sid].group}\", found {_desc(t.shape, t.dtype)} (\"{name}\")")
    for prm in spec.of_type("reduce_op"):
        if params.get(prm.name) == "avg" and not dtypes.is_floating(dtype):
            raise ValidationError(f"{_st(members[0])}.metadata.{prm.name}: expected sum, max or min for dtype {dtype} "
                                  f"(avg needs a floating dtype), found avg")
    for prm in spec.of_type("dim"):
        if prm.split and prm.name in params and in_shape[params[prm.name]] % n:
            raise ValidationError(f"{_st(members[0])}.metadata.{prm.name}: expected a dim whose size divides by the group size {n}, "
                                  f"found dim {params[prm.name]} of size {in_shape[params[prm.name]]}")
    out = spec.shape(in_shape, n, params)
    for sid in members:
        for i, name in enumerate(sts[sid].outputs):
            t = p.tensors[name]
            if (t.shape, t.dtype) != (tuple(out), dtype):
                raise ValidationError(f"{_st(sid)}.outputs[{i}]: expected {_desc(tuple(out), dtype)} for {spec.name} of "
                                      f"{n} x {_desc(in_shape, dtype)}, found {_desc(t.shape, t.dtype)} (\"{name}\")")


def _desc(shape, dtype) -> str:
    return f"{dtype}{list(shape)}"


def _check_p2p(p: Pipeline, group: str, sts: dict[str, SuperTask]) -> CommGroup:
    """The "p2p" group: one send (device_idx 0 or 1) and one recv, on two slots, x -> y like x."""
    sends = [s for s, st in sts.items() if st.kind == "send"]
    recvs = [s for s, st in sts.items() if st.kind == "recv"]
    any_sid = next(iter(sts))
    if len(sends) != 1 or len(recvs) != 1:
        raise ValidationError(f"{_st(any_sid)}.group: expected group \"{group}\" to pair one send with one recv, "
                              f"found {len(sends)} send and {len(recvs)} recv")
    _check_keys(sts, COMM_KINDS["send"])
    s, r = sts[sends[0]], sts[recvs[0]]
    _check_io_counts(sts, sends, COMM_KINDS["send"], {})
    _check_io_counts(sts, recvs, COMM_KINDS["recv"], {})
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
