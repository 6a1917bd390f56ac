"""Running one step of a bound Program (fastpipe.lower.program) on a tensor environment.

    run_compute(step, env)          # a compute step: its reads from env (or its constants), fn, writes into env
    run_group(program, group, env)  # a whole comm group at once: every member's reads -> group_fns[group]
    group_fn(group, devices)        # the callable of a comm group: EXECUTE_KINDS[group.kind](params, devices)

Every processor that runs steps in one address space (reference, cpu, cuda, and the dist
processor for groups local to a rank) goes through these, so a failure is reported the
same way everywhere: a RunError naming the supertask and slot, or the group and its
supertasks.

EXECUTE_KINDS maps each group kind (fastpipe.format.comm_kinds) to `(params, devices) -> fn`,
fn(the members' inputs in member order) -> their outputs in member order. Every built-in kind
binds the plain-torch reference (fastpipe.comm.reference.REFERENCE_KINDS); a new kind registers
with `EXECUTE_KINDS.register(kind, bind_reference(kind))` or a factory of its own. The cuda
processor's streams (fastpipe.runtime.cuda.stream_issue) and the dist processor's local and
generic groups run these callables too (Program.group_fns), and the fusion pass
(fastpipe.runtime.passes.fuse) replaces some reduce_scatter and all_gather ones by kernels.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from fastpipe.comm.reference import REFERENCE_KINDS
from fastpipe.errors import FastpipeError, RunError, key_path
from fastpipe.format.comm_kinds import KindTable
from fastpipe.lower.program import Program, Step
from fastpipe.runtime.binding.inputs import to_device
from fastpipe.torch_compat import profiler_enabled

GroupCall = Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]
GroupFactory = Callable[[dict, list[torch.device]], GroupCall]


def bind_reference(kind: str) -> GroupFactory:
    """The factory that runs `kind` as the reference does (fastpipe.comm.reference.REFERENCE_KINDS),
    with the group's params and devices bound."""
    def factory(params: dict, devices: list[torch.device]) -> GroupCall:
        ref = REFERENCE_KINDS[kind]
        return lambda xs: ref(xs, params, devices)
    return factory


# group kind -> (params, devices) -> the group's callable; every built-in kind runs the reference
EXECUTE_KINDS: KindTable[GroupFactory] = KindTable(
    "fastpipe.runtime.execute.EXECUTE_KINDS", {kind: bind_reference(kind) for kind in sorted(REFERENCE_KINDS.builtin)})


def group_fn(group, devices: Sequence[torch.device]) -> GroupCall:
    """The comm group's callable (a validated CommGroup; `devices`: each member's, in member order):
    the members' inputs concatenated in member order -> their outputs concatenated."""
    return EXECUTE_KINDS[group.kind](group.params, list(devices))


def step_where(step: Step) -> str:
    return f"{key_path('supertasks', step.supertask)} on slot \"{step.slot}\""


def group_where(program: Program, group: str) -> str:
    return f"group:{group} (supertasks {', '.join(st.supertask for st in program.members(group))})"


def step_args(step: Step, env: dict) -> list[torch.Tensor]:
    """The step's read tensors, on its device (bound constants in place of their names)."""
    args = [step.constants[n] if n in step.constants else env[n] for n in step.reads]
    dev = step.device
    return [a if dev is None or a.device == dev else to_device(a, dev) for a in args]


def labelled(label: str, fn, *args):
    """fn(*args), under torch.profiler.record_function(label) while a profiler records (only then:
    the label costs ~6 us a call on the hot path)."""
    if profiler_enabled():
        with torch.profiler.record_function(label):
            return fn(*args)
    return fn(*args)


def call(fn, args: list, n_writes: int, where: Callable[[], str], label: str) -> Sequence[torch.Tensor]:
    """fn(args), failures raised as RunError naming `where()` (formatted only on failure: this is the hot path)."""
    try:
        outs = labelled(label, fn, args)
    except FastpipeError:
        raise
    except Exception as e:  # noqa: BLE001 - reported with the step that failed
        msg = " ".join(str(e).split()) or type(e).__name__
        raise RunError(f"{where()}: failed: {type(e).__name__}: {msg}") from e
    if len(outs) != n_writes:
        raise RunError(f"{where()}: expected {n_writes} outputs, found {len(outs)}")
    return outs


def run_compute(step: Step, env: dict) -> None:
    outs = call(step.fn, step_args(step, env), len(step.writes), lambda: step_where(step), step.label)
    env.update(zip(step.writes, outs))


def run_group(program: Program, group: str, env: dict) -> None:
    """Run the whole group (every member's step) on the tensors in env; write every member's outputs."""
    members = program.members(group)
    writes = [n for st in members for n in st.writes]
    outs = call(program.group_fns[group], [a for st in members for a in step_args(st, env)], len(writes),
                lambda: group_where(program, group), f"fp:group:{group}")
    env.update(zip(writes, outs))
