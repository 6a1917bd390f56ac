"""Human-readable views of a pipeline: a text summary and a Graphviz drawing."""
from __future__ import annotations

from collections import Counter, defaultdict

from fastpipe import dtypes
from fastpipe.format.model import Pipeline


def _nbytes(shape, dtype: str) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtypes.to_torch(dtype).itemsize


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def constant_bytes_per_slot(p: Pipeline) -> dict[str, int]:
    """Bytes of constants each slot holds (a constant used on two slots counts on both)."""
    per: dict[str, int] = defaultdict(int)
    for slot in p.devices:
        per[slot] = 0
    for name, t in p.tensors.items():
        if not t.is_constant:
            continue
        slots = {st.device for st in p.supertasks.values() if name in st.inputs and st.device}
        for s in slots:
            per[s] += _nbytes(t.shape, t.dtype)
    return dict(per)


def _nested(v) -> str:
    return "[" + ", ".join(_nested(x) for x in v) + "]" if isinstance(v, tuple) else str(v)


def summary_text(p: Pipeline) -> str:
    lines = [f"pipeline {p.name!r}" + (f" (format version {p.version})" if p.version else "")]
    const = constant_bytes_per_slot(p)
    lines.append(f"slots: {len(p.devices)}")
    for slot, d in p.devices.items():
        kinds = Counter(st.kind for st in p.supertasks.values() if st.device == slot)
        what = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        dev = d.spelling or f"{d.kind}:{d.idx}"
        lines.append(f"  slot {slot:>4}  {dev:<10} constants {_human(const[slot]):>10}  supertasks: {what}")
    kinds = Counter(st.kind for st in p.supertasks.values() if st.kind not in ("input", "output"))
    lines.append("supertasks by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    groups = {st.group for st in p.supertasks.values() if st.is_comm}
    lines.append(f"comm groups: {len(groups)}")
    for c in p.device_constraints or ():
        lines.append(f"device constraint: {c.kind} over " + ("{} (no slots written)" if c.devices is None else _nested(c.devices)))
    n_const = sum(1 for t in p.tensors.values() if t.is_constant)
    lines.append(f"tensors: {len(p.tensors)} ({n_const} constants, {_human(sum(_nbytes(t.shape, t.dtype) for t in p.tensors.values() if t.is_constant))})")
    ins = ", ".join(f"{n} {p.tensors[n].dtype}{list(p.tensors[n].shape)}" for n in p.input_names)
    outs = ", ".join(f"{n} {p.tensors[n].dtype}{list(p.tensors[n].shape)}" for n in p.output_names)
    lines.append(f"inputs: {ins or '(none)'}")
    lines.append(f"outputs: {outs or '(none)'}")
    return "\n".join(lines) + "\n"


def _q(s: str) -> str:
    """A DOT quoted string: backslashes and quotes escaped, a newline as DOT's own ``\\n`` line break."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_text(p: Pipeline) -> str:
    """Graphviz: one cluster (lane) per slot; comm group members joined by dashed edges."""
    out = [f"digraph {_q(p.name or 'pipeline')} {{", "  rankdir=TB;", "  node [shape=box, fontsize=10];"]
    for slot in p.devices:
        out.append(f"  subgraph {_q('cluster_slot_' + slot)} {{")
        out.append(f"    label={_q('slot ' + slot)}; style=rounded;")
        for sid, st in p.supertasks.items():
            if st.device == slot:
                label = f"{sid}\n{st.kind}" + (f" [{st.group}]" if st.is_comm else "")
                shape = "ellipse" if st.is_comm else "box"
                out.append(f"    {_q('st_' + sid)} [label={_q(label)}, shape={shape}];")
        out.append("  }")
    for sid, st in p.supertasks.items():
        if st.kind in ("input", "output"):
            out.append(f"  {_q('st_' + sid)} [label={_q(st.kind)}, shape=oval, style=filled, fillcolor=lightgrey];")
    producer = {t: sid for sid, st in p.supertasks.items() for t in st.outputs}
    for sid, st in p.supertasks.items():
        for t in dict.fromkeys(st.inputs):
            if t in producer:
                out.append(f"  {_q('st_' + producer[t])} -> {_q('st_' + sid)} [label={_q(t)}, fontsize=8];")
    by_group = defaultdict(list)
    for sid, st in p.supertasks.items():
        if st.is_comm:
            by_group[st.group].append((st.device_idx, sid))
    for g, members in by_group.items():
        members.sort()
        for (_, a), (_, b) in zip(members, members[1:]):
            out.append(f"  {_q('st_' + a)} -> {_q('st_' + b)} [style=dashed, dir=none, constraint=false, color=blue];")
    out.append("}")
    return "\n".join(out) + "\n"
