"""A pipeline as a flat list of steps: one per compute supertask, one per comm group.

Each step reads named tensors (or constants bound at load time) and writes
named tensors. Built once at load; running is a loop over it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from fastpipe import comm
from fastpipe.errors import key_path


@dataclass(frozen=True)
class Step:
    label: str                                     # "fp:<slot>:<supertask>" or "fp:group:<name>"
    supertasks: tuple[str, ...]                    # the supertask ids this step runs
    slots: tuple[str, ...]
    fn: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]
    reads: tuple[str | torch.Tensor, ...]          # tensor names, or a bound constant
    devices: tuple[torch.device, ...]              # device each read must be on
    writes: tuple[str, ...]


def compute_step(sid: str, slot: str, fn, inputs, constants: dict[str, torch.Tensor], device, outputs) -> Step:
    reads = tuple(constants.get(n, n) for n in inputs)
    return Step(f"fp:{slot}:{sid}", (sid,), (slot,), fn, reads, (device,) * len(reads), tuple(outputs))


def comm_step(group, supertasks, slot_devices, constants) -> Step:
    """One step for a whole comm group, calling the plain-torch reference."""
    members = [supertasks[s] for s in group.members]
    devices = [slot_devices[m.device] for m in members]
    reads = tuple(constants.get(n, n) for m in members for n in m.inputs)
    read_devs = tuple(devices[i] for i, m in enumerate(members) for _ in m.inputs)
    writes = tuple(n for m in members for n in m.outputs)
    kind, prm = group.kind, group.params
    if kind == "p2p":
        recv_dev = devices[1]
        fn = lambda xs: [comm.send_recv(xs[0], recv_dev)]  # noqa: E731
    elif kind == "all_reduce":
        fn = lambda xs: comm.all_reduce(xs, prm["reduce_op"], devices)  # noqa: E731
    elif kind == "all_gather":
        fn = lambda xs: comm.all_gather(xs, prm["dim"], devices)  # noqa: E731
    elif kind == "reduce_scatter":
        fn = lambda xs: comm.reduce_scatter(xs, prm["reduce_op"], prm["dim"], devices)  # noqa: E731
    elif kind == "all_to_all":
        fn = lambda xs: comm.all_to_all(xs, prm["src_dim"], prm["dst_dim"], devices)  # noqa: E731
    elif kind == "reduce":
        fn = lambda xs: [comm.reduce(xs, prm["reduce_op"], prm["dst"], devices)]  # noqa: E731
    elif kind == "gather":
        fn = lambda xs: [comm.gather(xs, prm["dim"], prm["dst"], devices)]  # noqa: E731
    elif kind == "broadcast":
        fn = lambda xs: comm.broadcast(xs[0], prm["src"], devices)  # noqa: E731
    else:  # pragma: no cover - the validator admits no other kind
        raise AssertionError(kind)
    return Step(f"fp:group:{group.name}", tuple(group.members), tuple(m.device for m in members), fn, reads, read_devs, writes)


def where(step: Step) -> str:
    if len(step.supertasks) == 1:
        return f"{key_path('supertasks', step.supertasks[0])} on slot \"{step.slots[0]}\""
    return f"{step.label[3:]} (supertasks {', '.join(step.supertasks)})"


def run_step(step: Step, env: dict) -> None:
    """Run one step on the tensors in `env` (moving reads to their devices); write its outputs into env.

    A failure is raised as RunError naming the supertask(s) and slot(s)."""
    from fastpipe.errors import FastpipeError, RunError

    args = [(env[r] if isinstance(r, str) else r) for r in step.reads]
    args = [a if a.device == d else a.to(d) for a, d in zip(args, step.devices)]
    try:
        with torch.profiler.record_function(step.label):
            outs = step.fn(args)
    except FastpipeError:
        raise
    except Exception as e:  # noqa: BLE001 - reported with the step that failed
        msg = " ".join(str(e).split()) or type(e).__name__
        raise RunError(f"{where(step)}: failed: {type(e).__name__}: {msg}") from e
    if len(outs) != len(step.writes):
        raise RunError(f"{where(step)}: expected {len(step.writes)} outputs, found {len(outs)}")
    env.update(zip(step.writes, outs))
