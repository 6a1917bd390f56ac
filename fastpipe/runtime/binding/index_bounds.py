"""Integer pipeline inputs used as indices: the range of values they may hold, found in the graphs.

    bounds = index_bounds(pipeline, checked.graphs)   # input name -> IndexBound (only inputs used as indices)
    bounds["token_type_ids"].high                     # 2: an embedding of 2 rows
    check_index_bounds(inputs, bounds)                # InputError for a value out of range (CPU tensors)

An integer pipeline input is followed into every compute supertask that reads it, from its
placeholder through ops that keep its values (view, reshape, unsqueeze, squeeze, expand, flatten,
permute, clone, contiguous, alias, detach, a cast to an integer dtype; aten overloads, torch
functions and Tensor methods alike) and ops that keep part of them (slice, select, narrow, split,
chunk, unbind and getitem), to an op that indexes a tensor with it: `aten.embedding` /
`torch.nn.functional.embedding` (bound: the weight's rows), `aten.index_select` and `aten.gather`
(the size of the indexed dim) and `aten.index.Tensor` (the size of the dim its position indexes;
it wraps negative indices, so [-size, size) is valid there). What is indexed must be a constant
of the model: a pipeline constant bound to a placeholder (its declared shape) or the graph's own
constant (get_attr), also through a cast or copy of it. A table that is a run-time tensor (another
pipeline input, an activation) bounds nothing: its rows are data, and ids outside them fail the
run (a RunError). An input that is never used as an index has no bound; one used by several such
ops gets the tightest range. Inputs passed on by comm supertasks are not
followed (a compute supertask's direct reads only), nor are values computed from an input (an
offset: vocab-parallel embeddings subtract their first row and mask, so their ids need no bound).

The check runs before a run on inputs that live on the CPU (one aminmax per bounded input).
Tensors already on a GPU are not checked: reading their range would synchronize the device, and
an index out of range there fails inside the kernel instead. Where only part of an input is used
as indices (through a slice), that part is what is checked.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from fastpipe import dtypes
from fastpipe.errors import FastpipeError, InputError
from fastpipe.torch_compat import OpOverload, OpOverloadPacket


@dataclass(frozen=True)
class IndexUse:
    """One op that uses (a part of) a pipeline input as indices."""
    low: int                   # the smallest valid value (inclusive): 0, or -size where negatives wrap
    high: int                  # the exclusive upper bound: the indexed dim's size
    what: str                  # e.g. "indices into an embedding of 2 rows"
    supertask: str
    # the part-taking ops from the input to the use, as (op, target, args, kwargs) to replay on the
    # input: () when all of it is used, None when the part cannot be taken again (then it is not checked)
    path: tuple | None = ()


@dataclass(frozen=True)
class IndexBound:
    """Every index use of one pipeline input; `low`/`high`: the range valid for all of them."""
    uses: tuple[IndexUse, ...]

    @property
    def high(self) -> int:
        return min(u.high for u in self.uses)

    @property
    def low(self) -> int:
        return max(u.low for u in self.uses)


# ------------------------------------------------------------------------------------------ op tables
# names of ops (aten overload packets, torch functions, Tensor methods) whose first argument's values
# all reach the output, in another shape or memory layout
_KEEP = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "expand", "expand_as",
    "broadcast_to", "flatten", "unflatten", "contiguous", "clone", "alias", "detach", "lift_fresh_copy",
    "permute", "transpose", "t", "movedim", "view_as", "reshape_as", "repeat", "_to_copy", "to", "type",
    "long", "int", "short", "char", "byte",
})
# ops whose output holds a part of their first argument's values (their arguments replay the part)
_PART = frozenset({"slice", "select", "narrow", "split", "split_with_sizes", "unsafe_split", "chunk", "unbind",
                   "getitem", "tensor_split"})
# ops that cast: followed only when the result is still integer
_CASTS = frozenset({"_to_copy", "to", "type"})


def _name(node: torch.fx.Node) -> str | None:
    t = node.target
    if node.op == "call_method":
        return t
    if node.op != "call_function":
        return None
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, OpOverload):
        if t == torch.ops.aten.view.dtype:
            return None                                  # a reinterpretation of the bits, not a reshape
        return t.overloadpacket.__name__
    if isinstance(t, OpOverloadPacket):
        return t.__name__
    if t is torch.nn.functional.embedding:
        return "F.embedding"
    return getattr(t, "__name__", None)


def _integer_cast(node: torch.fx.Node, name: str) -> bool:
    """A cast (`_to_copy`, `to`, `type`) whose result is an integer tensor: no dtype given, or an integer one."""
    rest = (*node.args[1:], *node.kwargs.values())
    given = [a for a in rest if isinstance(a, torch.dtype)]
    if any(not _is_int(d) for d in given):
        return False
    if given:
        return True
    if name == "type":                 # type("torch.FloatTensor"), type(other): not followed
        return not rest
    return not any(isinstance(a, torch.fx.Node) for a in rest)     # to(other): its dtype is unknown here


def _is_int(dt: torch.dtype) -> bool:
    return not dt.is_floating_point and not dt.is_complex and dt != torch.bool


def _arg(node: torch.fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


# ------------------------------------------------------------------------------------------ the finder
def graph_index_uses(gm: torch.fx.GraphModule, input_shapes: Mapping[str, tuple] | None = None,
                     *, supertask: str = "") -> dict[str, list[IndexUse]]:
    """Placeholder name -> the index uses reached from it. `input_shapes`: placeholder name -> shape,
    for the placeholders that may be indexed (index_bounds: those bound to pipeline constants);
    get_attr constants are looked up on `gm`."""
    shapes = dict(input_shapes or {})
    out: dict[str, list[IndexUse]] = {}
    for ph in gm.graph.nodes:
        if ph.op != "placeholder":
            continue
        uses: list[IndexUse] = []
        _follow(gm, ph, (), shapes, supertask, uses, set())
        if uses:
            out[ph.name] = uses
    return out


def _follow(gm, node, path, shapes, sid, uses, seen) -> None:
    if node in seen:
        return
    seen.add(node)
    for user in node.users:
        name = _name(user)
        if name is None:
            continue
        use = _use(gm, user, node, name, shapes, sid, path)
        if use is not None:
            uses.append(use)
            continue
        if not user.args or user.args[0] is not node:
            continue
        if name in _CASTS and not _integer_cast(user, name):
            continue
        if name in _KEEP:
            _follow(gm, user, path, shapes, sid, uses, seen)
        elif name in _PART:
            step = _step(user)
            _follow(gm, user, None if path is None or step is None else path + (step,), shapes, sid, uses, seen)


def _step(node: torch.fx.Node):
    """A part-taking op as plain data to replay (None when an argument is another node's value)."""
    args, kwargs = tuple(node.args[1:]), dict(node.kwargs)
    if any(isinstance(a, torch.fx.Node) for a in (*args, *kwargs.values())):
        return None
    return (node.op, node.target, args, kwargs)


def _use(gm, user, node, name, shapes, sid, path) -> IndexUse | None:
    """The IndexUse when `user` indexes a tensor with `node`, else None."""
    if name in ("embedding", "F.embedding"):
        weight, idx = ((_arg(user, 1, "weight"), _arg(user, 0, "input")) if name == "F.embedding"
                       else (_arg(user, 0, "weight"), _arg(user, 1, "indices")))
        if idx is not node:
            return None
        rows = _size(gm, weight, 0, shapes)
        return None if rows is None else IndexUse(0, rows, f"indices into an embedding of {rows} rows", sid, path)
    if name in ("index_select", "gather"):
        src = user.args[0] if user.args else user.kwargs.get("self", user.kwargs.get("input"))
        dim, idx = _arg(user, 1, "dim"), _arg(user, 2, "index")
        if idx is not node or not isinstance(dim, int):
            return None
        size = _size(gm, src, dim, shapes)
        return None if size is None else IndexUse(0, size, f"indices into dim {dim} of a tensor of size {size}", sid, path)
    if (name == "index" and isinstance(user.target, OpOverload)) or name == "getitem":
        src, indices = _arg(user, 0, "self"), _arg(user, 1, "indices")
        if name == "getitem" and indices is node:                   # w[x] in a torch-level graph
            indices = (node,)
        if not isinstance(indices, (list, tuple)) or any(x is Ellipsis or (x is None and name == "getitem")
                                                         for x in indices):
            return None                  # (a Python None adds a dim; aten.index's None takes a whole dim)
        for dim, x in enumerate(indices):
            if x is node:
                size = _size(gm, src, dim, shapes)
                if size is None:
                    return None
                return IndexUse(-size, size, f"indices into dim {dim} of a tensor of size {size}", sid, path)
    return None


_SAME_SHAPE = frozenset({"_to_copy", "to", "clone", "contiguous", "detach", "alias", "lift_fresh_copy", "type"})


def _size(gm, node, dim: int, shapes) -> int | None:
    """The size of `node` along `dim`, where it can be known without running the graph."""
    shape = _shape(gm, node, shapes)
    if shape is None:
        return None
    if dim < 0:
        dim += len(shape)
    if not 0 <= dim < len(shape) or not isinstance(shape[dim], int):
        return None
    return int(shape[dim])


def _shape(gm, node, shapes, depth: int = 0):
    if not isinstance(node, torch.fx.Node) or depth > 16:
        return None
    if node.op == "placeholder" and node.name in shapes:
        return tuple(shapes[node.name])
    if node.op == "get_attr":
        try:
            obj: Any = gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            return tuple(obj.shape)
        except AttributeError:
            pass
    if node.op in ("call_function", "call_method") and _name(node) in _SAME_SHAPE and node.args:
        return _shape(gm, node.args[0], shapes, depth + 1)
    return None


def index_bounds(p, graphs=None, options=None) -> dict[str, IndexBound]:
    """Pipeline input name -> IndexBound, for every integer pipeline input a compute supertask uses as
    indices (module docstring). `graphs`: supertask id -> DecodedGraph (a session's `checked.graphs`);
    None decodes only the payloads of the supertasks that read an integer input (LoadOptions
    `options` for their side files), on a pipeline not validated yet: a payload that cannot be read
    is skipped (loading it reports why)."""
    lenient = graphs is None
    if graphs is None:
        from fastpipe.validate.lazy_graphs import LazyGraphs

        graphs = LazyGraphs(p, options)
    ints = set()
    for name in p.input_names:
        info = p.tensors.get(name)
        try:
            if info is not None and _is_int(dtypes.to_torch(info.dtype)):
                ints.add(name)
        except (FastpipeError, KeyError, ValueError):
            continue
    found: dict[str, list[IndexUse]] = {}
    if not ints:
        return {}
    for sid, st in p.supertasks.items():
        if st.kind != "fx" or not ints.intersection(st.inputs):
            continue
        try:
            g = graphs.get(sid)
        except FastpipeError:
            if lenient:
                continue
            raise
        if g is None:
            continue
        placeholders = [n for n in g.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(st.inputs):
            continue
        # what is indexed: the pipeline's constants (weights) by their declared shapes; a table that is
        # itself a run-time tensor is data, not part of the model, and bounds nothing
        shapes = {ph.name: tuple(p.tensors[t].shape) for ph, t in zip(placeholders, st.inputs)
                  if t in p.tensors and p.tensors[t].value is not None}
        uses = graph_index_uses(g.gm, shapes, supertask=sid)
        for ph, t in zip(placeholders, st.inputs):
            if t in ints and ph.name in uses:
                found.setdefault(t, []).extend(uses[ph.name])
    return {name: IndexBound(tuple(sorted(u, key=lambda x: (x.high, -x.low)))) for name, u in found.items()}


# ------------------------------------------------------------------------------------------ the check
def check_index_bounds(inputs: Mapping[str, torch.Tensor], bounds: Mapping[str, IndexBound]) -> None:
    """InputError naming the input, the valid range and a value found outside it, for every bounded
    input that is a CPU tensor. Tensors on another device are not checked (it would synchronize)."""
    for name, bound in bounds.items():
        t = inputs.get(name)
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0 or not _is_int(t.dtype):
            continue
        whole = None
        for use in bound.uses:           # tightest first
            if use.path is None:
                continue
            if use.path:
                part = _replay(t, use.path)
                if part is None or part.numel() == 0:
                    continue
                lo, hi = torch.aminmax(part)
            else:
                if whole is None:
                    whole = torch.aminmax(t)
                lo, hi = whole
            lo, hi = int(lo), int(hi)
            if hi >= use.high or lo < use.low:
                bad = hi if hi >= use.high else lo
                raise InputError(f"inputs[\"{name}\"]: expected integers in [{use.low}, {use.high}) ({use.what}), found {bad}")


def _replay(t: torch.Tensor, path: tuple) -> torch.Tensor | None:
    """The part of `t` the ops of `path` take."""
    x: Any = t
    try:
        for op, target, args, kwargs in path:
            x = getattr(x, target)(*args, **kwargs) if op == "call_method" else target(x, *args, **kwargs)
    except Exception:     # noqa: BLE001 - a part that cannot be taken again is not checked
        return None
    return x if isinstance(x, torch.Tensor) else None


def random_bounds(bounds: Mapping[str, Any]) -> dict[str, int]:
    """name -> exclusive upper bound, from IndexBounds (or plain ints)."""
    return {k: int(getattr(b, "high", b)) for k, b in bounds.items()}


__all__ = ["IndexBound", "IndexUse", "check_index_bounds", "graph_index_uses", "index_bounds", "random_bounds"]
