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
The scatter/gather tensor is a row-major view of the matmul's [M, N] result (or [M, K] operand),
and its chunks along the dim must be whole blocks of the matmul: row blocks (every dim before it
of size 1, M divisible by n) or column blocks (the dims from it on span exactly the N (K)
columns). Any other view (a [.., heads, hd] view of N = heads*hd split along hd, say) is refused
with the reason. The pass rewrites the bound Program before the checker runs: the fused
supertasks' steps get new graphs, reads and writes (`x#a`, `x#b`: the matmul's operands; `y#mm`:
the gathered product), the groups' callables become the kernels, and frees follow the renamed
tensors, so the checker proves the Program that really runs. Slots, steps and waits do not
change.

The rewritten graphs live on their step's device: they take their constants (get_attr buffers)
from the bound step's graph (fastpipe.runtime.binding.bind placed it there), never from the decoded CPU
graph; an all_gather->matmul group's weights are moved to the group's device.

Policy: "off"; "auto" (default): fuse when every member is on one CUDA device and the fused
kernel was measured faster at the shape on that GPU model (fastpipe.kernels.fusion_rule; the
reason quotes the measurement and says where this GPU was not measured); "always": fuse every
match whose members share one device (on CPU the Triton kernels need TRITON_INTERPRET=1 - tests
use that; where the kernels cannot run, loading refuses, naming the group, and "auto" leaves a
group it would fuse unfused with a RuntimeWarning). Every group that could be fused gets a
decision with its reason (Session.fusion, `fastpipe show --plan`).

Loading with check_payloads=False: checked.graphs decodes each payload at its first use, once per
distinct payload, for binding and this pass alike (fastpipe.validate.lazy_graphs; nothing from the
file executes).
"""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fastpipe.runtime.binding.graph_device import constants_on, retarget_devices

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

    def label(self) -> str:
        return f"group \"{self.group}\" ({self.pattern}, supertasks {', '.join(self.supertasks)})"

    def line(self) -> str:
        return f"{self.label()}: {'fused' if self.fused else 'not fused'}: {self.reason}"


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


def _kernel_dim(shape: tuple[int, ...], dim: int, rows: int, cols: int, n: int) -> int | None:
    """Map the scatter/gather dim of `shape`, a row-major view of a [rows, cols] matrix, onto the
    matrix: 0 when chunk j (of n) along dim is exactly row block j, 1 when it is exactly column
    block j, None when it is neither (then no 2-D kernel can produce the chunks).

    Rows: the dims before `dim` have size 1, so chunk j is the j-th contiguous n-th of the memory,
    which is row block j iff n divides `rows`. Columns: the dims from `dim` on span one matrix row
    (their product is `cols`), so for each matrix row chunk j takes the j-th n-th of it, which is
    column block j. A [.., heads, hd] view of cols = heads*hd split along hd (heads > 1) is neither:
    its chunks interleave the heads."""
    dim = dim % len(shape)
    if math.prod(shape) != rows * cols or shape[dim] % n:
        return None
    if math.prod(shape[:dim]) == 1 and rows % n == 0:
        return 0
    if math.prod(shape[dim:]) == cols and cols % n == 0:
        return 1
    return None


def _meta_shape(p, name: str) -> tuple[int, ...]:
    return tuple(p.tensors[name].shape)


FUSION_OFF = "fusion is off"
DIST_OFF = ("the dist processor runs no fused kernels (a group's members may sit on different ranks, and a fused "
            "kernel needs every member in one process, on one device)")


def check_fuse_for_dist(policy: str) -> None:
    """The dist processor fuses nothing (DIST_OFF): fuse="always" asks for what it cannot do, and is refused
    (InputError) before any rank loads."""
    from fastpipe.errors import InputError

    if policy == "always":
        raise InputError(f'fuse: "always" cannot fuse under the dist processor: {DIST_OFF} (fuse="auto" or "off")')


def analyze(checked, slot_devices, policy: str, *, region: bool = False,
            off_reason: str = FUSION_OFF) -> list[Decision]:
    """A decision for every reduce_scatter / all_gather group (``off_reason``: why, under policy "off").

    The graphs come from checked.graphs (decoded at their first use where payloads were not
    checked at load: LoadOptions check_payloads=False).
    `region`: the region processor runs the Program (policy "auto" then leaves the group to the
    compiler, which sees the matmul and the comm as one graph)."""
    from fastpipe.errors import FastpipeError, InputError

    p = checked.pipeline
    graphs = checked.graphs
    flow = checked.flow
    out: list[Decision] = []
    for gname, g in checked.groups.items():
        if g.kind not in ("reduce_scatter", "all_gather"):
            continue
        members = [p.supertasks[m] for m in g.members]
        pattern = "matmul->reduce_scatter" if g.kind == "reduce_scatter" else "all_gather->matmul"
        d = Decision(gname, pattern, False, "", tuple(g.members))
        out.append(d)
        try:
            reason = _match(p, flow, graphs, g, members, d)
        except FastpipeError as e:     # a payload not readable with these options (bind read it with its own)
            d.plan.clear()
            reason = f"a payload it needs could not be decoded here: {e}"
        if reason:
            d.reason = reason
            continue
        devices = {slot_devices[m.device] for m in members}
        device = next(iter(devices))
        if policy == "off":
            d.reason = off_reason
        elif len(devices) != 1:
            d.reason = ("members on " + ", ".join(sorted(str(x) for x in devices)) +
                        ": the fused kernels run on one device")
        elif policy == "auto" and region:
            d.reason = ("the region processor compiles the matmul and the comm as one graph on one device "
                        "(fuse='always' forces the kernels)")
        elif policy == "auto" and device.type != "cuda":
            d.reason = ("members on " + ", ".join(sorted(str(x) for x in devices)) +
                        ": the fused kernels run on one CUDA device (fuse='always' forces them)")
        elif policy == "auto" and not (est := _measured(d, device)).fused:
            d.reason = f"the unfused path, faster here (fastpipe.kernels.fusion_rule): {est.reason}"
        elif why := _cannot_launch(device):
            if policy == "always":
                raise InputError(f"fuse: \"always\" cannot fuse {d.label()} on {device}: {why} "
                                 f"(fuse=\"auto\" or \"off\" runs it unfused)")
            d.reason = f"the fused kernel is faster here (fastpipe.kernels.fusion_rule), but cannot run: {why}"
            warnings.warn(f"fastpipe: fusion: {d.line()}", RuntimeWarning, stacklevel=2)
        else:
            d.fused = True
            d.reason = ("all members match (forced)" if policy == "always" else
                        f"all members match, and the fused kernel is faster here (fastpipe.kernels.fusion_rule): "
                        f"{est.reason}")
    return out


def _cannot_launch(device) -> str | None:
    """Why the fused kernels cannot run on this device here (fastpipe.kernels' launch_problem)."""
    from fastpipe.kernels.mm_reduce_scatter_kernel import launch_problem

    return launch_problem(device)


def _measured(d: Decision, device):
    """fastpipe.kernels.fusion_rule's estimate for the group's shape on the GPU its members share (its
    measurements where that GPU model was measured), in the bench's terms: matmul->reduce_scatter, the
    first member's [M, K] @ [K, N] with K_total = n * K; all_gather->matmul, the gathered [M, K] times
    every member's weight, N their widths summed (each member computes [M, N/n])."""
    from fastpipe import dtypes
    from fastpipe.kernels.fusion_rule import estimate, gpu_name

    m = d.plan[0]
    M, K = m["a_shape"]
    mrs = d.pattern == "matmul->reduce_scatter"
    N = m["b_shape"][1] if mrs else sum(x["b_shape"][1] for x in d.plan)
    k_total = K * (len(d.plan) if mrs else 1)
    return estimate("matmul_reduce_scatter" if mrs else "all_gather_matmul", M, N, k_total, len(d.plan),
                    dtypes.to_torch(m["dtype"]), m["dim"], gpu_name(device))


def _match(p, flow, graphs, g, members, d: Decision) -> str:
    n = len(members)
    for rank, st in enumerate(members):
        if g.kind == "reduce_scatter":
            x = st.inputs[0]
            prods = flow.producers.get(x, [])
            if len(prods) != 1 or p.supertasks[prods[0]].kind != "fx":
                return f"the input of supertask \"{g.members[rank]}\" is not produced by an fx supertask"
            if flow.consumers.get(x) != [g.members[rank]]:
                return f"\"{x}\" is also consumed elsewhere, so the matmul's result must exist"
            sid = prods[0]
            dg = graphs[sid]
            _annotate(dg)
            gm = dg.gm
            k = p.supertasks[sid].outputs.index(x)
            found = _chain_to_mm(_output_nodes(gm)[k])
            if found is None:
                return f"supertask \"{sid}\" does not end in a matmul (aten.mm, through views) for \"{x}\""
            mm, chain = found
            a_shape, b_shape = _shape2(mm.args[0], dg, p, sid), _shape2(mm.args[1], dg, p, sid)
            M, N = a_shape[0], b_shape[1]
            shape, dim = _meta_shape(p, x), g.params["dim"]
            kd = _kernel_dim(shape, dim, M, N, n)
            if kd is None:
                return (f"the scatter dim {dim} of {list(shape)} is neither the matmul's rows nor its columns: "
                        f"its {n} chunks of the [{M}, {N}] matmul result are not whole row blocks (every dim "
                        f"before it of size 1, {M} rows divisible by {n}) nor whole column blocks (the dims "
                        f"from it on spanning the {N} columns)")
            if g.params["reduce_op"] not in ("sum", "avg"):
                return f"reduce_op {g.params['reduce_op']} cannot be fused into a matmul"
            d.plan.append({"sid": sid, "graph": dg, "out_index": k, "mm": mm, "chain": chain, "dim": kd, "x": x,
                           "y": st.outputs[0], "a_shape": a_shape, "b_shape": b_shape, "dtype": p.tensors[x].dtype})
        else:
            y = st.outputs[0]
            cons = flow.consumers.get(y, [])
            if len(cons) != 1 or p.supertasks[cons[0]].kind != "fx":
                return f"\"{y}\" is not consumed by exactly one fx supertask"
            sid = cons[0]
            dg = graphs[sid]
            _annotate(dg)
            gm = dg.gm
            idx = p.supertasks[sid].inputs.index(y)
            ph = [n_ for n_ in gm.graph.nodes if n_.op == "placeholder"][idx]
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
            a_shape = _shape2(node, dg, p, sid)
            M, K = a_shape
            shape, dim = _meta_shape(p, y), g.params["dim"]
            kd = _kernel_dim(shape, dim, M, K, n)
            if kd is None:
                return (f"the gather dim {dim} of {list(shape)} is neither the matmul's rows nor its K: "
                        f"its {n} shards of the matmul's [{M}, {K}] operand are not whole row blocks (every dim "
                        f"before it of size 1, {M} rows divisible by {n}) nor whole column blocks (the dims "
                        f"from it on spanning the {K} columns)")
            shard = (M // n, K) if kd == 0 else (M, K // n)
            d.plan.append({"sid": sid, "graph": dg, "in_index": idx, "mm": mm, "chain": chain, "dim": kd,
                           "x": st.inputs[0], "y": y, "b": b, "a_shape": a_shape, "shard_shape": shard,
                           "b_shape": b[2], "dtype": p.tensors[y].dtype})
    return ""


def _annotate(g) -> None:
    """Give every node of a decoded graph its fake value (meta["val"]), once. Constants are faked
    from their shape and dtype (fastpipe.payload.fake.run_fake), so a graph whose external
    constants are not bound yet (decoded here, check_payloads=False) works too."""
    gm = g.gm
    if getattr(gm, "_fastpipe_annotated", False):
        return
    from fastpipe.errors import PayloadError
    from fastpipe.payload.fake import FakeRunError, run_fake

    cpu = torch.device("cpu")
    try:
        _, values = run_fake(gm, [(tuple(m.shape), m.dtype, None, cpu) for m in g.input_metas], constant_device=cpu)
    except FakeRunError as err:
        raise PayloadError(f"{g.where}: shape propagation failed at {err.node}: {err.cause}") from None
    for node, value in values.items():
        node.meta["val"] = value
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
def _rewrite_graph(gm: fx.GraphModule, *, suffix=None, prefix=None, root=None) -> fx.GraphModule:
    """One supertask's graph with its fused ends removed (both may apply to one supertask).

    suffix=(in_index, mm): placeholder `in_index` (the gathered input) and its views are dropped;
        the matmul's result becomes a new last placeholder (plus the bias, for addmm).
    prefix=(out_index, mm): output `out_index` (the matmul's result) is dropped and the matmul's
        operands are appended to the outputs.
    root: the module the new graph's get_attr targets are taken from (default `gm`): the bound
        step's graph, whose constants are on the step's device (same payload, same attribute names).
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
    return fx.GraphModule(gm if root is None else root, g)


def _graph_fn(gm: fx.GraphModule, binder, sid: str, device):
    if binder.compile:
        from fastpipe.runtime.compiling.compile import compiled_graph

        gm = compiled_graph(gm.code, gm, device, f"supertasks[\"{sid}\"] (fused rest)", binder.compile_policy,
                            binder.background)
        binder.compiled[sid] = gm

    def run(xs, gm=gm):
        out = gm(*xs)
        return out if isinstance(out, (tuple, list)) else (out,)
    return run


def _renamed(names: tuple[str, ...], old: str, new: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(x for n in names for x in ((*new,) if n == old else (n,)))


def _placed_graph(gm: fx.GraphModule, device) -> fx.GraphModule:
    """The rewritten graph with its constants on the step's device. Its root was the bound step's
    graph (fastpipe.runtime.binding.bind put that on the device), so this is normally `gm` itself; anything
    still elsewhere is moved on a deep copy, as bind does: `.to()` on the graph itself would move
    the tensors it shares with the decoded graph. Its nodes are its own (copied from the decoded
    graph's, arange(device=cpu) and all), so their device arguments are retargeted in place."""
    if device is not None:
        if not constants_on(gm, device):
            gm = copy.deepcopy(gm).to(device)
        retarget_devices(gm, device)
    gm.eval()
    return gm


def apply(program, decisions: list[Decision], checked, binder):
    """The bound Program with every fused decision applied (see the module docstring)."""
    import dataclasses

    from fastpipe import kernels

    steps = {slot: list(ss) for slot, ss in program.steps.items()}
    at = {st.supertask: (slot, i) for slot, ss in program.steps.items() for i, st in enumerate(ss)}
    group_fns = dict(program.group_fns)
    renames: dict[str, tuple[str, ...]] = {}      # old tensor name -> the names that replace it (for frees)

    def edit(sid, **changes):
        slot, i = at[sid]
        steps[slot][i] = dataclasses.replace(steps[slot][i], **changes)

    edits: dict[str, dict] = {}          # supertask id -> {"prefix": ..., "suffix": ..., "graph": DecodedGraph}
    for d in decisions:
        if not d.fused:
            continue
        if d.pattern == "matmul->reduce_scatter":
            for m, member in zip(d.plan, d.supertasks):
                a_name, b_name = f"{m['x']}#a", f"{m['x']}#b"
                e = edits.setdefault(m["sid"], {"graph": m["graph"]})
                e["prefix"] = (m["out_index"], m["mm"], m["x"], a_name, b_name)
                edit(member, reads=(a_name, b_name))
                renames[m["x"]] = (a_name, b_name)
            y_shapes = [tuple(checked.pipeline.tensors[m["y"]].shape) for m in d.plan]
            dim, op = d.plan[0]["dim"], checked.groups[d.group].params["reduce_op"]

            def fn(xs, dim=dim, op=op, y_shapes=y_shapes):
                outs = kernels.matmul_reduce_scatter(xs[0::2], xs[1::2], dim=dim, op=op)
                return [o.reshape(s) for o, s in zip(outs, y_shapes)]
        else:
            consts, shards = [], []
            for m, member in zip(d.plan, d.supertasks):
                slot, i = at[m["sid"]]
                st = steps[slot][i]
                b_idx, transform, _ = m["b"]
                b = st.constants[st.reads[b_idx]]
                group_device = steps[at[member][0]][at[member][1]].device
                if group_device is not None and b.device != group_device:
                    b = b.to(group_device)     # the kernel runs where the group's members are
                for target, args in transform:
                    b = target(b, *args)
                consts.append(b)
                shards.append(m["shard_shape"])
                z = f"{m['y']}#mm"
                edit(member, writes=(z,))
                renames[m["y"]] = (z,)
                e = edits.setdefault(m["sid"], {"graph": m["graph"]})
                e["suffix"] = (m["in_index"], m["mm"], z)
            dim = d.plan[0]["dim"]

            def fn(xs, dim=dim, consts=consts, shards=shards):
                return kernels.all_gather_matmul([x.reshape(s) for x, s in zip(xs, shards)], consts, dim=dim)
            fn.weights = consts          # the b[j] it multiplies by (on the group's device)
        group_fns[d.group] = fn
    for sid, e in edits.items():
        slot, i = at[sid]
        st = steps[slot][i]
        suffix, prefix = e.get("suffix"), e.get("prefix")
        dg = e["graph"]
        if st.graph is not None:
            root = st.graph           # bound: on st.device, external constants bound
        else:                         # not bound here (not expected for an fx step): the decoded graph
            from fastpipe.payload import unbound_external

            if dg.external_constants and unbound_external(dg):
                binder._bind_external(sid, dg)
            root = dg.gm
        gm = _rewrite_graph(dg.gm, suffix=suffix and suffix[:2], prefix=prefix and prefix[:2], root=root)
        gm = _placed_graph(gm, st.device)
        if binder.fold_gemms:             # as bind made the unfused step (fastpipe.runtime.binding.gemm_layout)
            from fastpipe.runtime.binding.gemm_layout import fold_batched_linears

            fold_batched_linears(gm)
        reads, writes = st.reads, st.writes
        if suffix is not None:
            k, _, z = suffix
            reads = tuple(r for j, r in enumerate(reads) if j != k) + (z,)
        if prefix is not None:
            _, _, x, a_name, b_name = prefix
            writes = tuple(w for w in writes if w != x) + (a_name, b_name)
        state = [(reads.index(a), writes.index(b)) for a, b in binder.in_place_of.get(sid, ()) if a in reads and b in writes]
        if state:                         # as bind made the unfused step: state updates written in place
            from fastpipe.runtime.passes.region_state import write_in_place

            write_in_place(gm, state, copy_rest=False)
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
