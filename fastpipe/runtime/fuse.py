"""The fusion pass: a matmul feeding a reduce_scatter, and an all_gather feeding a matmul,
become one fused kernel (fastpipe.kernels) over all the group's participants.

Patterns (every member of the group must match):
  matmul -> reduce_scatter   the member's input is produced by a compute supertask whose
                             graph ends (through views) in aten.mm(a, b) and is consumed by
                             nothing else. The supertask keeps its prefix and now outputs a
                             and b; the group's step runs matmul_reduce_scatter([a_i], [b_i]).
  all_gather -> matmul       the member's output is consumed only by a compute supertask whose
                             graph reads it only as the first operand of aten.mm(y, b) or
                             aten.addmm(bias, y, b) (through views), b being a constant (or a
                             transpose of one). The group's step runs all_gather_matmul([x_i], [b_j])
                             and the supertask starts after the matmul (adding the bias, if any).
The scatter/gather dim must be the matmul's rows (all dims before it of size 1) or its columns
(the last dim). The pass rewrites the bound Program before the checker runs: the fused
supertasks' steps get new graphs, reads and writes (`x#a`, `x#b`: the matmul's operands; `y#mm`:
the gathered product), the groups' callables become the kernels, and frees follow the renamed
tensors, so the checker proves the Program that really runs. Slots, steps and waits do not
change.

Policy: "off"; "auto" (default): fuse when every member is on one CUDA device and the shape is
above the measured threshold (fastpipe.kernels.fused_is_faster); "always": fuse every match
(on CPU the Triton kernels need TRITON_INTERPRET=1 - tests use that). Every group that could be
fused gets a decision with its reason (Session.fusion, `fastpipe show --plan`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

aten = torch.ops.aten
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}


@dataclass
class Decision:
    group: str
    pattern: str                       # "matmul->reduce_scatter" | "all_gather->matmul"
    fused: bool
    reason: str
    supertasks: tuple[str, ...] = ()
    plan: list = field(default_factory=list, repr=False)   # per member, what to rewrite

    def line(self) -> str:
        what = "fused" if self.fused else "not fused"
        return f"group \"{self.group}\" ({self.pattern}, supertasks {', '.join(self.supertasks)}): {what}: {self.reason}"


def _output_nodes(gm: fx.GraphModule) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    args = out.args[0]
    return list(args) if isinstance(args, (tuple, list)) else [args]


def _chain_to_mm(node: fx.Node):
    """Walk back from `node` through single-user views to an aten.mm; returns (mm, chain) or None."""
    chain = []
    while node.op == "call_function" and node.target in VIEWS:
        chain.append(node)
        node = node.args[0]
        if len(node.users) != 1:
            return None
    if node.op == "call_function" and node.target is aten.mm.default and len(node.users) == 1:
        return node, chain
    return None


def _kernel_dim(shape: tuple[int, ...], dim: int) -> int | None:
    """Map a scatter/gather dim of the (viewed) tensor onto the 2-D matmul: 0 rows, 1 columns."""
    if dim == len(shape) - 1:
        return 1
    if math.prod(shape[:dim]) == 1:
        return 0
    return None


def _meta_shape(p, name: str) -> tuple[int, ...]:
    return tuple(p.tensors[name].shape)


def analyze(checked, slot_devices, policy: str, *, region: bool = False) -> list[Decision]:
    """A decision for every reduce_scatter / all_gather group (checked.graphs must hold the decoded graphs).
    `region`: the region processor runs the Program (policy "auto" then leaves the group to the
    compiler, which sees the matmul and the comm as one graph)."""
    p = checked.pipeline
    graphs = checked.graphs or {}
    flow = checked.flow
    out: list[Decision] = []
    for gname, g in checked.groups.items():
        if g.kind not in ("reduce_scatter", "all_gather"):
            continue
        members = [p.supertasks[m] for m in g.members]
        pattern = "matmul->reduce_scatter" if g.kind == "reduce_scatter" else "all_gather->matmul"
        d = Decision(gname, pattern, False, "", tuple(g.members))
        out.append(d)
        reason = _match(p, flow, graphs, g, members, d)
        if reason:
            d.reason = reason
            continue
        devices = {slot_devices[m.device] for m in members}
        if policy == "off":
            d.reason = "fusion is off"
        elif policy == "auto" and region and len(devices) == 1:
            d.reason = ("the region processor compiles the matmul and the comm as one graph on one device "
                        "(fuse='always' forces the kernels)")
        elif policy == "auto" and (len(devices) != 1 or next(iter(devices)).type != "cuda"):
            d.reason = ("members on " + ", ".join(sorted(str(x) for x in devices)) +
                        ": the fused kernels run on one CUDA device (fuse='always' forces them)")
        elif policy == "auto" and not _big_enough(d, p):
            d.reason = "below the size threshold (fastpipe.kernels.fused_is_faster): the unfused path is faster there"
        else:
            d.fused = True
            d.reason = "all members match" + (" (forced)" if policy == "always" else "")
    return out


def _big_enough(d: Decision, p) -> bool:
    from fastpipe.kernels import fused_is_faster

    m = d.plan[0]
    M, K = m["a_shape"]
    N = m["b_shape"][1]
    k_total = K * (len(d.plan) if d.pattern == "matmul->reduce_scatter" else 1)
    return fused_is_faster(M, N, k_total, len(d.plan), m["dtype"])


def _match(p, flow, graphs, g, members, d: Decision) -> str:
    for rank, st in enumerate(members):
        if g.kind == "reduce_scatter":
            x = st.inputs[0]
            prods = flow.producers.get(x, [])
            if len(prods) != 1 or p.supertasks[prods[0]].kind != "fx":
                return f"the input of supertask \"{g.members[rank]}\" is not produced by an fx supertask"
            if flow.consumers.get(x) != [g.members[rank]]:
                return f"\"{x}\" is also consumed elsewhere, so the matmul's result must exist"
            sid = prods[0]
            _annotate(graphs[sid])
            gm = graphs[sid].gm
            k = p.supertasks[sid].outputs.index(x)
            found = _chain_to_mm(_output_nodes(gm)[k])
            if found is None:
                return f"supertask \"{sid}\" does not end in a matmul (aten.mm, through views) for \"{x}\""
            mm, chain = found
            kd = _kernel_dim(_meta_shape(p, x), g.params["dim"])
            if kd is None:
                return f"the scatter dim {g.params['dim']} of {list(_meta_shape(p, x))} is neither the matmul's rows nor its columns"
            if g.params["reduce_op"] not in ("sum", "avg"):
                return f"reduce_op {g.params['reduce_op']} cannot be fused into a matmul"
            d.plan.append({"sid": sid, "out_index": k, "mm": mm, "chain": chain, "dim": kd, "x": x,
                           "y": st.outputs[0], "a_shape": _shape2(mm.args[0], graphs[sid], p, sid),
                           "b_shape": _shape2(mm.args[1], graphs[sid], p, sid), "dtype": p.tensors[x].dtype})
        else:
            y = st.outputs[0]
            cons = flow.consumers.get(y, [])
            if len(cons) != 1 or p.supertasks[cons[0]].kind != "fx":
                return f"\"{y}\" is not consumed by exactly one fx supertask"
            sid = cons[0]
            _annotate(graphs[sid])
            gm = graphs[sid].gm
            idx = p.supertasks[sid].inputs.index(y)
            ph = [n for n in gm.graph.nodes if n.op == "placeholder"][idx]
            node, chain = ph, []
            while len(node.users) == 1 and next(iter(node.users)).target in VIEWS:
                node = next(iter(node.users))
                chain.append(node)
            users = list(node.users)
            mm = users[0] if len(users) == 1 else None
            is_mm = mm is not None and mm.target is aten.mm.default and mm.args[0] is node
            is_addmm = (mm is not None and mm.target is aten.addmm.default and mm.args[1] is node and not mm.kwargs)
            if not (is_mm or is_addmm):
                return f"supertask \"{sid}\" uses \"{y}\" other than as the first operand of one matmul"
            b = _constant_operand(mm.args[2 if is_addmm else 1], gm, p, sid)
            if b is None:
                return f"the matmul's second operand in supertask \"{sid}\" is not a constant (or its transpose)"
            kd = _kernel_dim(_meta_shape(p, y), g.params["dim"])
            if kd is None:
                return f"the gather dim {g.params['dim']} of {list(_meta_shape(p, y))} is neither the matmul's rows nor its K"
            d.plan.append({"sid": sid, "in_index": idx, "mm": mm, "chain": chain, "dim": kd, "x": st.inputs[0], "y": y,
                           "b": b, "a_shape": _shape2(mm.args[1] if is_addmm else mm.args[0], graphs[sid], p, sid),
                           "b_shape": b[2], "dtype": p.tensors[y].dtype})
    return ""


def _annotate(g) -> None:
    """Give every node of a decoded graph its fake value (meta["val"]), once."""
    gm = g.gm
    if getattr(gm, "_fastpipe_annotated", False):
        return
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from fastpipe.torch_compat import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty(m.shape, dtype=m.dtype) for m in g.input_metas]
    FakeTensorProp(gm, mode).propagate(*fakes)
    gm._fastpipe_annotated = True


def _shape2(node, g, p, sid) -> tuple[int, int]:
    """2-D shape of a matmul operand (from fake-tensor propagation over the decoded graph)."""
    _annotate(g)
    return tuple(node.meta["val"].shape)


def _constant_operand(node, gm, p, sid):
    """(placeholder index, transform, 2-D shape) when node is a constant placeholder, maybe transposed."""
    transform = []
    while node.op == "call_function" and node.target in TRANSPOSES:
        transform.append((node.target, node.args[1:]))
        node = node.args[0]
    if node.op != "placeholder":
        return None
    idx = [n for n in gm.graph.nodes if n.op == "placeholder"].index(node)
    name = p.supertasks[sid].inputs[idx]
    if not p.tensors[name].is_constant:
        return None
    shape = list(p.tensors[name].shape)
    for target, args in reversed(transform):
        if target is aten.t.default:
            shape = shape[::-1]
        elif target is aten.transpose.int:
            i, j = args
            shape[i], shape[j] = shape[j], shape[i]
        else:
            shape = [shape[k] for k in args[0]]
    if len(shape) != 2:
        return None
    return idx, list(reversed(transform)), tuple(shape)


# ---------------------------------------------------------------------------- rewriting the steps
def _rewrite_graph(gm: fx.GraphModule, *, suffix=None, prefix=None) -> fx.GraphModule:
    """One supertask's graph with its fused ends removed (both may apply to one supertask).

    suffix=(in_index, mm): placeholder `in_index` (the gathered input) and its views are dropped;
        the matmul's result becomes a new last placeholder (plus the bias, for addmm).
    prefix=(out_index, mm): output `out_index` (the matmul's result) is dropped and the matmul's
        operands are appended to the outputs.
    """
    g = fx.Graph()
    env: dict = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(placeholders):
        if suffix is None or i != suffix[0]:
            env[n] = g.node_copy(n, lambda a: env[a])
    if suffix is not None:
        z = g.placeholder("fused_matmul_out")
        mm_g = suffix[1]
        if mm_g.target is not aten.addmm.default:
            env[mm_g] = z
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in env:
            continue
        if suffix is not None and n is suffix[1]:     # addmm(bias, y, w): the bias joins the fused result
            env[n] = g.call_function(aten.add.Tensor, (z, env[n.args[0]]))
            continue
        if n.op == "output":
            outs = _output_nodes(gm)
            if prefix is None:
                g.output(tuple(env[o] for o in outs))
            else:
                k, mm_r = prefix
                kept = tuple(env[o] for i, o in enumerate(outs) if i != k)
                g.output(kept + (env[mm_r.args[0]], env[mm_r.args[1]]))
            continue
        try:
            env[n] = g.node_copy(n, lambda a: env[a])
        except KeyError:      # depends on the dropped gathered input (its views, the matmul): not needed
            continue
    g.eliminate_dead_code()
    return fx.GraphModule(gm, g)


def _graph_fn(gm: fx.GraphModule, binder, sid: str, device):
    if binder.compile:
        from fastpipe.runtime.compile import compiled_graph

        gm = compiled_graph(gm.code, gm, device, f"supertasks[\"{sid}\"] (fused rest)", binder.compile_policy)
        binder.compiled[sid] = gm

    def run(xs, gm=gm):
        out = gm(*xs)
        return out if isinstance(out, (tuple, list)) else (out,)
    return run


def _renamed(names: tuple[str, ...], old: str, new: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(x for n in names for x in ((*new,) if n == old else (n,)))


def apply(program, decisions: list[Decision], checked, binder):
    """The bound Program with every fused decision applied (see the module docstring)."""
    import dataclasses

    from fastpipe import kernels

    p, graphs = checked.pipeline, checked.graphs
    steps = {slot: list(ss) for slot, ss in program.steps.items()}
    at = {st.supertask: (slot, i) for slot, ss in program.steps.items() for i, st in enumerate(ss)}
    group_fns = dict(program.group_fns)
    renames: dict[str, tuple[str, ...]] = {}      # old tensor name -> the names that replace it (for frees)

    def edit(sid, **changes):
        slot, i = at[sid]
        steps[slot][i] = dataclasses.replace(steps[slot][i], **changes)

    edits: dict[str, dict] = {}          # supertask id -> {"prefix": ..., "suffix": ...}
    for d in decisions:
        if not d.fused:
            continue
        if d.pattern == "matmul->reduce_scatter":
            for m, member in zip(d.plan, d.supertasks):
                a_name, b_name = f"{m['x']}#a", f"{m['x']}#b"
                edits.setdefault(m["sid"], {})["prefix"] = (m["out_index"], m["mm"], m["x"], a_name, b_name)
                edit(member, reads=(a_name, b_name))
                renames[m["x"]] = (a_name, b_name)
            y_shapes = [tuple(p.tensors[m["y"]].shape) for m in d.plan]
            dim, op = d.plan[0]["dim"], checked.groups[d.group].params["reduce_op"]

            def fn(xs, dim=dim, op=op, y_shapes=y_shapes):
                outs = kernels.matmul_reduce_scatter(xs[0::2], xs[1::2], dim=dim, op=op)
                return [o.reshape(s) for o, s in zip(outs, y_shapes)]
        else:
            consts = []
            for m, member in zip(d.plan, d.supertasks):
                slot, i = at[m["sid"]]
                st = steps[slot][i]
                b_idx, transform, _ = m["b"]
                b = st.constants[st.reads[b_idx]]
                for target, args in transform:
                    b = target(b, *args)
                consts.append(b)
                z = f"{m['y']}#mm"
                edit(member, writes=(z,))
                renames[m["y"]] = (z,)
                edits.setdefault(m["sid"], {})["suffix"] = (m["in_index"], m["mm"], z)
            dim = d.plan[0]["dim"]

            def fn(xs, dim=dim, consts=consts):
                return kernels.all_gather_matmul([x.reshape(-1, x.shape[-1]) for x in xs], consts, dim=dim)
        group_fns[d.group] = fn
    for sid, e in edits.items():
        slot, i = at[sid]
        st = steps[slot][i]
        suffix, prefix = e.get("suffix"), e.get("prefix")
        gm = _rewrite_graph(graphs[sid].gm, suffix=suffix and suffix[:2], prefix=prefix and prefix[:2])
        reads, writes = st.reads, st.writes
        if suffix is not None:
            k, _, z = suffix
            reads = tuple(r for j, r in enumerate(reads) if j != k) + (z,)
        if prefix is not None:
            _, _, x, a_name, b_name = prefix
            writes = tuple(w for w in writes if w != x) + (a_name, b_name)
        steps[slot][i] = dataclasses.replace(st, fn=_graph_fn(gm, binder, sid, st.device), graph=gm, reads=reads,
                                             writes=writes)
    for slot, ss in steps.items():
        for i, st in enumerate(ss):
            frees = st.frees
            for old, new in renames.items():
                if old in frees:
                    frees = _renamed(frees, old, new)
            if frees != st.frees:
                ss[i] = dataclasses.replace(st, frees=frees)
    return dataclasses.replace(program, steps={s: tuple(ss) for s, ss in steps.items()}, group_fns=group_fns)
