"""Setting up a multi-process run (the dist processor): which rank runs which slot, the
process group and its sub-groups (the launcher behind `fastpipe run --nproc N` is in
fastpipe.cli.dist).

    plan = make_plan(pipeline, slot_devices, slot_ranks)    # reads RANK / WORLD_SIZE / LOCAL_RANK
    init_process_group(plan.backend, timeout_s)             # torchrun's env:// rendezvous, finite timeout
    groups = make_subgroups(rank_sets, timeout_s)           # every rank, same order (new_group is collective)

Slot -> rank. By default the slots, in the pipeline's slot order, are cut into WORLD_SIZE
contiguous blocks, the first (slots % world) blocks one slot larger (ceil/floor sizes), so
consecutive slots (pipeline stages, tensor-parallel peers listed together) stay on one rank.
`slot_ranks={"0": 0, ...}` / `--slot-ranks 0=0,1=1` overrides it and must name every slot.

Devices. Each slot keeps its kind from the device map (cpu, or cuda when a GPU is there), the
same decision on every rank; a rank's CUDA slots run on cuda:LOCAL_RANK (one GPU per rank),
its CPU slots on the CPU. Slots of other ranks are bound to the CPU (nothing runs there).
A rank uses a GPU (rank_cuda_device: torch.cuda.set_device, NCCL) only when it holds a CUDA
slot, or when every slot of the pipeline is on CUDA (pure NCCL: an idle rank 0 still receives the
outputs over NCCL). A rank holding only CPU slots never touches CUDA, so it may run where its
LOCAL_RANK has no GPU (a one-GPU machine: rank 0 on cuda:0, rank 1 on the CPU). Two ranks on one
GPU are not supported: NCCL refuses a communicator with the same GPU twice, and LOCAL_RANK picks
the GPU, so a rank whose LOCAL_RANK has no GPU and that needs one is refused at load.

Backend. gloo when every slot is on the CPU, NCCL when every slot is on CUDA, and torch's
per-device-type backend "cpu:gloo,cuda:nccl" when both kinds occur. A comm group runs on
CUDA (NCCL) when every member slot is on CUDA, else its tensors go through the CPU (gloo).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Mapping

import torch

from fastpipe.errors import InputError

DEFAULT_TIMEOUT_S = 120.0
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


# ------------------------------------------------------------------------------ slot -> rank
def default_slot_ranks(slots, world: int) -> dict[str, int]:
    """Contiguous blocks of slots in slot order; the first (len % world) ranks get one slot more."""
    slots = list(slots)
    base, extra = divmod(len(slots), world)
    out, i = {}, 0
    for r in range(world):
        for _ in range(base + (1 if r < extra else 0)):
            out[slots[i]] = r
            i += 1
    return out


def check_slot_ranks(slot_ranks: Mapping | None, slots, world: int, name: str = "slot_ranks") -> dict[str, int]:
    """The slot -> rank map to use (default when None); InputError naming `name["slot"]` otherwise."""
    slots = [str(s) for s in slots]
    if slot_ranks is None:
        if world > len(slots):
            raise InputError(f"WORLD_SIZE: expected at most {len(slots)} ranks (one slot each at least) for a pipeline "
                             f"with {len(slots)} slots, found {world} (name the ranks with {name} to leave some idle)")
        return default_slot_ranks(slots, world)
    if not isinstance(slot_ranks, Mapping):
        raise InputError(f"{name}: expected a map slot -> rank, found {type(slot_ranks).__name__}")
    out: dict[str, int] = {}
    for slot, rank in slot_ranks.items():
        slot = str(slot)
        if slot not in slots:
            raise InputError(f"{name}[\"{slot}\"]: expected a slot of the pipeline ({', '.join(slots)}), found an unknown slot")
        r = rank
        if isinstance(r, str) and r.strip().lstrip("-").isdigit():
            r = int(r.strip())
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
            if isinstance(r, int) and not isinstance(r, bool):
                shown = r
            else:
                shown = f"\"{rank}\"" if isinstance(rank, str) else repr(rank)
            raise InputError(f"{name}[\"{slot}\"]: expected a rank 0..{world - 1}, found {shown}")
        out[slot] = r
    missing = [s for s in slots if s not in out]
    if missing:
        raise InputError(f"{name}: expected a rank for every slot, found none for slot \"{missing[0]}\"")
    return {s: out[s] for s in slots}


# ------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class RankPlan:
    rank: int
    world: int
    local_rank: int
    slot_ranks: dict[str, int]          # every slot -> its rank (identical on every rank)
    slot_types: dict[str, str]          # every slot -> "cpu" | "cuda" (identical on every rank)
    slot_devices: dict[str, torch.device]   # this rank's view: its slots' devices, others on the CPU
    backend: str

    @property
    def local_slots(self) -> tuple[str, ...]:
        return tuple(s for s, r in self.slot_ranks.items() if r == self.rank)


def env_world() -> tuple[int, int, int] | None:
    """(rank, world, local_rank) of an initialized process group or torchrun's environment; None outside both."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if "WORLD_SIZE" not in os.environ:
        return None
    vals = {}
    for k in ENV_VARS:
        v = os.environ.get(k, "0" if k == "LOCAL_RANK" else None)
        if v is None or not v.strip().isdigit():
            raise InputError(f"environment {k}: expected a non-negative integer (set by torchrun), found {v!r}")
        vals[k] = int(v)
    if vals["WORLD_SIZE"] < 1 or vals["RANK"] >= vals["WORLD_SIZE"]:
        raise InputError(f"environment RANK: expected 0..{vals['WORLD_SIZE'] - 1}, found {vals['RANK']}")
    return vals["RANK"], vals["WORLD_SIZE"], vals["LOCAL_RANK"]


def choose_backend(slot_types: Mapping[str, str]) -> str:
    kinds = set(slot_types.values())
    if kinds <= {"cpu"}:
        return "gloo"
    if kinds == {"cuda"}:
        return "nccl"
    return "cpu:gloo,cuda:nccl"


def make_plan(pipeline, slot_devices: Mapping[str, torch.device], slot_ranks: Mapping | None,
              name: str = "slot_ranks") -> RankPlan:
    world_info = env_world()
    if world_info is None:
        raise InputError("processor \"dist\": expected a process launched by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, "
                         "MASTER_PORT in the environment) or an initialized torch.distributed process group, found "
                         "neither (use `torchrun --nproc-per-node N -m fastpipe run ...` or `fastpipe run --nproc N`)")
    rank, world, local_rank = world_info
    ranks = check_slot_ranks(slot_ranks, pipeline.devices, world, name)
    types = {s: slot_devices[s].type for s in pipeline.devices}
    backend = choose_backend(types)
    mine_on_cuda = any(ranks[s] == rank and types[s] == "cuda" for s in pipeline.devices)
    if (mine_on_cuda or backend == "nccl") and local_rank >= torch.cuda.device_count():
        raise InputError(f"environment LOCAL_RANK: expected 0..{torch.cuda.device_count() - 1} (one GPU per rank), "
                         f"found {local_rank}")
    devices = {s: torch.device("cuda", local_rank) if ranks[s] == rank and types[s] == "cuda" else torch.device("cpu")
               for s in pipeline.devices}
    return RankPlan(rank, world, local_rank, ranks, types, devices, backend)


def rank_cuda_device(plan: RankPlan) -> torch.device | None:
    """The GPU this rank uses, or None when it uses none: the device of its CUDA slots; with NCCL
    alone (every slot on CUDA) cuda:LOCAL_RANK on every rank, an idle one too (rank 0 receives the
    outputs over NCCL); a rank holding only CPU slots next to CUDA ones (cpu:gloo,cuda:nccl) none."""
    mine = {d for s, d in plan.slot_devices.items() if plan.slot_ranks[s] == plan.rank and d.type == "cuda"}
    if len(mine) > 1:
        raise InputError(f"rank {plan.rank}: expected its CUDA slots on one GPU, found {', '.join(sorted(map(str, mine)))}")
    if mine:
        return mine.pop()
    return torch.device("cuda", plan.local_rank) if plan.backend == "nccl" else None


# ------------------------------------------------------------------------------ process groups
def timeout_of(timeout_s: float | None) -> datetime.timedelta:
    t = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        raise InputError(f"dist_timeout: expected a number of seconds > 0, found {timeout_s!r}")
    return datetime.timedelta(seconds=float(t))


def init_process_group(plan: RankPlan, timeout_s: float | None = None) -> bool:
    """Initialise the default group from torchrun's env:// variables, unless the caller already did.
    Returns whether this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != plan.world:
            raise InputError(f"torch.distributed: expected world size {plan.world}, found {dist.get_world_size()}")
        return False
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise InputError(f"environment {missing[0]}: expected the rendezvous address set by torchrun, found none")
    kwargs = {}
    dev = rank_cuda_device(plan)
    if dev is not None:
        torch.cuda.set_device(dev)
    if plan.backend == "nccl":
        # eager NCCL init (device_id) is a collective over the world: only when every rank passes it.
        # A mixed world (cpu:gloo,cuda:nccl) creates each sub-group's communicator at its first use,
        # among its members only, so a CPU-only rank never joins one.
        kwargs["device_id"] = dev
    dist.init_process_group(plan.backend, rank=plan.rank, world_size=plan.world, timeout=timeout_of(timeout_s), **kwargs)
    return True


def make_subgroups(rank_sets, timeout_s: float | None = None) -> dict[tuple[int, ...], object]:
    """One process group per distinct rank set (sorted tuples, >= 2 ranks), created by every rank in the
    given order (dist.new_group is collective over the world). The whole world reuses the default group."""
    import torch.distributed as dist

    world = dist.get_world_size()
    out: dict[tuple[int, ...], object] = {}
    for ranks in rank_sets:
        if ranks in out or len(ranks) < 2:
            continue
        out[ranks] = dist.group.WORLD if len(ranks) == world else dist.new_group(list(ranks), timeout=timeout_of(timeout_s))
    return out
