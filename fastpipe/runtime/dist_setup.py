"""Setting up a multi-process run (the dist processor): which rank runs which slot, the
process group and its sub-groups, and the launcher behind `fastpipe run --nproc N`.

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

from fastpipe.errors import FastpipeError, InputError

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


def parse_slot_ranks_option(text: str) -> dict[str, str]:
    """`0=0,1=1` -> {"0": "0", "1": "1"} (values are checked by check_slot_ranks)."""
    out: dict[str, str] = {}
    for i, part in enumerate(p for p in text.split(",") if p.strip()):
        slot, sep, rank = part.partition("=")
        if not sep or not slot.strip() or not rank.strip():
            raise InputError(f"--slot-ranks[{i}]: expected SLOT=RANK (e.g. 0=0,1=1), found \"{part}\"")
        if slot.strip() in out:
            raise InputError(f"--slot-ranks[\"{slot.strip()}\"]: expected each slot once, found it twice")
        out[slot.strip()] = rank.strip()
    if not out:
        raise InputError("--slot-ranks: expected SLOT=RANK pairs (e.g. 0=0,1=1), found none")
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
    devices = {}
    for s in pipeline.devices:
        if ranks[s] != rank or types[s] == "cpu":
            devices[s] = torch.device("cpu")
        else:
            if local_rank >= torch.cuda.device_count():
                raise InputError(f"environment LOCAL_RANK: expected 0..{torch.cuda.device_count() - 1} (one GPU per rank), "
                                 f"found {local_rank}")
            devices[s] = torch.device("cuda", local_rank)
    return RankPlan(rank, world, local_rank, ranks, types, devices, choose_backend(types))


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
    if "cuda" in plan.slot_types.values():
        torch.cuda.set_device(plan.local_rank)
        kwargs["device_id"] = torch.device("cuda", plan.local_rank)
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


# ------------------------------------------------------------------------------ `fastpipe run --nproc N`
def child_argv(argv: list[str]) -> list[str]:
    """The CLI's arguments without --nproc (and its value): what every launched worker runs."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        key = tok.split("=", 1)[0]
        if len(key) >= 4 and key.startswith("--np") and "--nproc".startswith(key):
            skip = "=" not in tok
            continue
        out.append(tok)
    return out


def launch(nproc: int, argv: list[str]) -> int:
    """Run `python -m fastpipe <argv>` in `nproc` workers through torch's elastic launcher (as
    `torchrun --standalone --nproc-per-node N -m fastpipe ...` would). Returns the exit status of the
    run: 2 when a worker found invalid input, 1 when one failed otherwise, 0 when every worker succeeded."""
    import sys

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if "OMP_NUM_THREADS" not in os.environ:    # share the cores instead of torchrun's warned default of 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    args = torchrun.parse_args(["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
                                "--monitor-interval", "0.1", "-m", "fastpipe", *child_argv(argv)])
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        # which rank failed first is not reliable (peers of a failed rank fail too, in the same
        # instant): name every failed rank; exit 2 if any found invalid input, else 1
        codes = {rank: f.exitcode for rank, f in sorted(e.failures.items())}
        shown = ", ".join(f"rank {r}: " + (f"exit status {c}" if c >= 0 else f"signal {-c}") for r, c in codes.items())
        print(f"fastpipe: error: --nproc {nproc}: {len(codes)} of {nproc} ranks failed ({shown}); their errors are above",
              file=sys.stderr)
        return 2 if 2 in codes.values() else 1
    return 0


# ------------------------------------------------------------------------------ `fastpipe run` on a rank
def wants_dist(args) -> bool:
    """`fastpipe run` goes multi-process with --nproc, --processor dist, or auto under torchrun."""
    multi = args.nproc is not None or args.processor == "dist" or (args.processor == "auto" and "WORLD_SIZE" in os.environ)
    if not multi and args.slot_ranks:
        raise InputError(f"--slot-ranks: expected a multi-process run (torchrun, --nproc N or --processor dist), "
                         f"found --processor {args.processor}")
    return multi


def _check_common(args) -> None:
    if args.repeat < 1 or args.warmup < 0:
        raise InputError(f"--repeat/--warmup: expected --repeat >= 1 and --warmup >= 0, found {args.repeat} and {args.warmup}")
    if args.chunks < 1:
        raise InputError(f"--chunks: expected >= 1, found {args.chunks}")
    if not args.dist_timeout > 0:
        raise InputError(f"--dist-timeout: expected seconds > 0, found {args.dist_timeout:g}")
    if args.processor not in ("auto", "dist"):
        raise InputError(f"--processor: expected auto or dist for a multi-process run, found {args.processor}")


def cli_run(args) -> int:
    """`fastpipe run` for the dist processor: launch (--nproc) or be one rank (torchrun-launched)."""
    _check_common(args)
    if args.nproc is not None:
        if "WORLD_SIZE" in os.environ:
            raise InputError("--nproc: expected a plain process, found one launched by torchrun (WORLD_SIZE is set); "
                             "drop --nproc")
        if args.nproc < 1:
            raise InputError(f"--nproc: expected >= 1, found {args.nproc}")
        _precheck(args, args.nproc)
        return launch(args.nproc, args.argv)
    if env_world() is None:
        raise InputError("--processor dist: expected a process launched by torchrun (WORLD_SIZE is not set), found a "
                         "plain process; use --nproc N to launch N processes")
    rank = env_world()[0]
    try:
        return _rank_main(args, rank)
    except FastpipeError as e:
        return _die(rank, str(e), e.exit_code, args)
    except Exception as e:  # noqa: BLE001 - a bug of ours: still one line unless --verbose
        msg = " ".join(str(e).split())
        return _die(rank, f"internal error: {type(e).__name__}: {msg} (rerun with --verbose for the traceback)", 1, args,
                    internal=True)


def _die(rank: int, msg: str, code: int, args, internal: bool = False) -> int:
    """Print this rank's one-line error and end the process at once: no teardown may wait on peers."""
    import sys
    import traceback

    import torch.distributed as dist

    if getattr(args, "verbose", False):
        traceback.print_exc()
    if not msg.startswith(f"[rank {rank}]"):
        msg = f"[rank {rank}] {msg}"
    print(f"fastpipe: {'' if internal else 'error: '}{msg}", file=sys.stderr)
    if dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _precheck(args, world: int) -> None:
    """What the parent of --nproc can refuse before starting any worker (exit 2, one line)."""
    from fastpipe.cli import _check_writable, _options
    from fastpipe.format import read_pipeline
    from fastpipe.runtime.device_map import parse_device_map_option, resolve_device_map
    from fastpipe.validate import validate_structure

    device_map = parse_device_map_option(args.device_map) if args.device_map else None
    for path, opt in ((args.outputs, "--outputs"), (args.trace, "--trace")):
        if path:
            _check_writable(path, opt)
    for path, opt in ((args.inputs, "--inputs"), (args.check, "--check")):
        if path and not os.path.isfile(path):
            raise InputError(f"{opt}: expected a safetensors file, found no file \"{path}\"")
    p = read_pipeline(args.pipeline)
    validate_structure(p)
    resolve_device_map(p, device_map)
    check_slot_ranks(parse_slot_ranks_option(args.slot_ranks) if args.slot_ranks else None, p.devices, world, "--slot-ranks")
    _options(args)
    if args.inputs:
        read_local_inputs(args.inputs, p, ())      # names only: no tensor data is read here


def read_local_inputs(path: str, p, names) -> dict[str, torch.Tensor]:
    """Open the --inputs file; check its names against the pipeline's; read only `names`."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
            for k in keys:
                if k not in p.input_names:
                    raise InputError(f"inputs[\"{k}\"]: expected one of the pipeline inputs ({', '.join(p.input_names)}), "
                                     "found an unknown name")
            for k in p.input_names:
                if k not in keys:
                    raise InputError(f"inputs[\"{k}\"]: expected a tensor for this pipeline input, found none")
            return {k: f.get_tensor(k) for k in names}
    except FileNotFoundError:
        raise InputError(f"--inputs: expected a safetensors file, found no file \"{path}\"") from None
    except (SafetensorError, OSError, ValueError) as e:
        why = " ".join(str(e).split())
        raise InputError(f"--inputs: expected a safetensors file, found \"{path}\" unreadable: {why}") from None


def _rank_main(args, rank: int) -> int:
    """One rank of `fastpipe run`: load this rank's slots, run with the others, rank 0 reports and writes."""
    import statistics
    import time

    from fastpipe.cli import _check_writable, _options, _read_tensors
    from fastpipe.format import read_pipeline
    from fastpipe.random_inputs import random_inputs
    from fastpipe.runtime.device_map import parse_device_map_option
    from fastpipe.session import Session

    lead = rank == 0
    device_map = parse_device_map_option(args.device_map) if args.device_map else None
    if lead and args.outputs:
        _check_writable(args.outputs, "--outputs")
    if lead and args.trace:
        _check_writable(args.trace, "--trace")
    p = read_pipeline(args.pipeline)
    world = env_world()[1]
    slot_ranks = (check_slot_ranks(parse_slot_ranks_option(args.slot_ranks), p.devices, world, "--slot-ranks")
                  if args.slot_ranks else check_slot_ranks(None, p.devices, world, "--slot-ranks"))
    t0 = time.perf_counter()
    sess = Session(p, device_map=device_map, options=_options(args), processor="dist", compile=not args.no_compile,
                   compile_policy=args.compile_errors, cuda_graph=not args.no_cuda_graph, slot_ranks=slot_ranks,
                   dist_timeout=args.dist_timeout)
    load_s = time.perf_counter() - t0
    runner = sess._runner
    if args.inputs:
        inputs = read_local_inputs(args.inputs, p, runner.needed_inputs)
    else:
        inputs = {k: v for k, v in random_inputs(p, args.seed).items() if k in runner.needed_inputs}
        if args.chunks > 1:
            inputs = {k: torch.cat([v] * args.chunks, dim=0) for k, v in inputs.items()}
    expected = _read_tensors(args.check, "--check") if lead and args.check else None
    compile_msg = ""
    if not args.no_compile:
        rep = sess.compile()
        compile_msg = (f"; compiled {rep.graphs} graphs on rank 0 in {rep.seconds:.1f} s"
                       + (f" ({len(rep.eager)} eager)" if rep.eager else ""))
    for _ in range(args.warmup):
        sess.run(inputs, chunks=args.chunks)
    times, outs = [], None
    cuda = any(d.type == "cuda" for d in sess.slot_devices.values())
    for i in range(args.repeat):
        t = time.perf_counter()
        outs = sess.run(inputs, chunks=args.chunks, trace=args.trace if args.trace and i == args.repeat - 1 else None)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    if not lead:
        runner.close()
        return 0
    plan = sess._dist_plan
    ms = sorted(x * 1e3 for x in times)
    print(f"{p.name}: dist processor, {plan.world} ranks ({plan.backend}); loaded in {load_s * 1e3:.1f} ms{compile_msg}; "
          f"{args.repeat} runs: median {statistics.median(ms):.3f} ms, min {ms[0]:.3f} ms, max {ms[-1]:.3f} ms")
    from fastpipe.cli import report_results

    try:
        return report_results(args, outs, expected)
    finally:
        runner.close()

