"""What the caller chooses when loading and running a pipeline: two frozen, validated dataclasses.

    LoadOptions(allow_outside_paths=False, trust_export_archives=False, check_payloads=True, upload="pinned")
    RunOptions(processor="auto", compile="background", compile_policy="warn", cuda_graph=True,
               fuse="auto", merge_shards=True, slot_ranks=None, dist_timeout=None, state_in_place=False,
               graph_pool=None)

Both check their fields on construction and raise InputError, one line naming the field
(`fuse: expected auto, off or always, found "yes"`). `fastpipe.load(...)` takes the same
names as keywords and builds these; the CLI builds them from its flags.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from fastpipe.errors import InputError

PROCESSORS = ("auto", "reference", "region", "cpu", "cuda", "dist")
COMPILE_MODES = ("background", "wait", "off")


def _flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise InputError(f"{name}: expected true or false, found {value!r}")


@dataclass(frozen=True)
class LoadOptions:
    allow_outside_paths: bool = False
    """Allow param files / payload side files by absolute path or outside the pipeline's folder."""
    trust_export_archives: bool = False
    """Allow torch.export archives, whose loader can unpickle (i.e. run code from the file)."""
    check_payloads: bool = True
    """Decode every graph payload and propagate shapes with fake tensors during validation."""
    upload: str = "pinned"
    """How weights reach a GPU at load: "pinned" (all of a device's weights through a few pinned staging
    buffers, reading the file while the copy engine copies: fastpipe.weights.upload; a RuntimeWarning
    where pinned memory cannot be had) or "pageable" (``.to(device)`` per tensor, as
    ``safetensors.torch.load_file(device=...)`` does)."""

    def __post_init__(self):
        for name in ("allow_outside_paths", "trust_export_archives", "check_payloads"):
            _flag(name, getattr(self, name))
        if self.upload not in ("pinned", "pageable"):
            raise InputError(f"upload: expected pinned or pageable, found {self.upload!r}")


@dataclass(frozen=True)
class RunOptions:
    processor: str = "auto"
    """auto | reference | region | cpu | cuda | dist. "auto" (the default): dist under torchrun (WORLD_SIZE
    set), else region when every slot is on one device, else cuda when every slot is on a GPU, else cpu
    (see choose_processor). "reference" runs one step at a time, eagerly: the oracle, chosen explicitly."""
    compile: str = "background"
    """How fx supertasks (region processor: whole regions) go through torch.compile (inductor):
    "background" (tiered, the default): each graph runs eagerly from its first call while one background
    thread compiles it; the compiled graph is swapped in between calls once ready and, on the CPU,
    measured faster on real calls (the faster is kept); on the CPU a cheap estimate first skips graphs
    whose compile cannot pay (fastpipe.runtime.compiling.compile_estimate). A CUDA graph is captured once every
    compile has settled. (The dist processor compiles at warm-up, every rank together; the reference
    processor, the oracle, stays eager.)
    "wait": compile at warm-up, before the first run returns (Session.compile; benchmarks).
    "off": never compile. True and False are taken as "wait" and "off"."""
    compile_policy: str = "warn"
    """A graph (or CUDA-graph capture) that cannot be compiled: "warn" runs it eagerly with a warning; "raise"."""
    cuda_graph: bool = True
    """cuda and region processors on one GPU: capture the whole run as one CUDA graph and replay it
    (captured by Session.compile at warm-up, else at the second run; fastpipe.runtime.cuda.graph_replay)."""
    fuse: str = "auto"
    """matmul->reduce_scatter and all_gather->matmul as fused Triton kernels: "auto" (one CUDA device,
    where the fused kernel was measured faster: fastpipe.kernels.fusion_rule), "always", "off"
    (fastpipe.runtime.passes.fuse)."""
    merge_shards: bool = True
    """region processor: matmuls the split cut into shards run as one GEMM again on one device
    (fastpipe.runtime.passes.region_passes)."""
    slot_ranks: Mapping[str, int] | None = None
    """dist processor: slot -> rank (default: contiguous blocks of slots)."""
    dist_timeout: float | None = None
    """dist processor: seconds any collective may wait (default 120)."""
    state_in_place: bool = False
    """Outputs that are an input's updated version (a KV cache; fastpipe.runtime.binding.state) are written into
    the tensor given as that input, which run() returns as the output: the caller hands those inputs over."""
    alias_outputs: bool = False
    """A replayed run (cuda_graph) returns the graph's own output buffers, not clones: no copy out, and no
    memory for the copies, but each output is valid only until the next run of this session (in a shared
    graph_pool: of any session in the pool), which overwrites it. For a caller that consumes each run's
    outputs before the next (the serving engine's buckets). State outputs are the state buffers either way."""
    graph_pool: object = None
    """A fastpipe.runtime.cuda.graph_replay.GraphPool: the CUDA graph shares this memory pool with the other
    sessions' graphs in it (a serving set's buckets: capture the largest first). Their replays take turns
    (one lock), so give sessions meant to run in parallel pools of their own. None: a private pool."""

    def __post_init__(self):
        if self.processor not in PROCESSORS:
            raise InputError(f"processor: expected one of {', '.join(PROCESSORS)}, found \"{self.processor}\"")
        if self.compile is True or self.compile is False:
            object.__setattr__(self, "compile", "wait" if self.compile else "off")
        if self.compile not in COMPILE_MODES:
            raise InputError(f"compile: expected background, wait or off (or true / false), found {self.compile!r}")
        if self.compile_policy not in ("warn", "raise"):
            raise InputError(f"compile_policy: expected warn or raise, found \"{self.compile_policy}\"")
        _flag("cuda_graph", self.cuda_graph)
        _flag("merge_shards", self.merge_shards)
        _flag("state_in_place", self.state_in_place)
        _flag("alias_outputs", self.alias_outputs)
        if self.state_in_place and self.processor == "dist":
            raise InputError("state_in_place: expected a one-process processor (outputs of dist live on rank 0), "
                             "found processor=\"dist\"")
        if self.fuse not in ("auto", "off", "always"):
            raise InputError(f"fuse: expected auto, off or always, found \"{self.fuse}\"")
        if self.slot_ranks is not None and self.processor not in ("dist", "auto"):
            raise InputError(f"slot_ranks: expected processor=\"dist\", found processor=\"{self.processor}\"")
        pool = self.graph_pool      # a GraphPool (layer 5: known here by what it has, not imported)
        if pool is not None and not (callable(getattr(pool, "handle", None)) and hasattr(pool, "turns")):
            raise InputError(f"graph_pool: expected a fastpipe.runtime.cuda.graph_replay.GraphPool or None, found "
                             f"{type(pool).__name__}")
        t = self.dist_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise InputError(f"dist_timeout: expected a number of seconds > 0, found {t!r}")


def choose_processor(requested: str, slot_devices: Mapping, environ: Mapping[str, str] | None = None) -> str:
    """The processor to run: `requested` unless "auto"; auto is "dist" in a torchrun-launched process
    (WORLD_SIZE set), else "region" when every slot is on one device (the split costs nothing there:
    one compiled graph), else "cuda" when every slot is on a CUDA device, else "cpu"."""
    if requested != "auto":
        return requested
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env:
        return "dist"
    devices = list(slot_devices.values())
    if len({str(d) for d in devices}) == 1:
        return "region"
    return "cuda" if devices and all(d.type == "cuda" for d in devices) else "cpu"
