"""What the caller chooses when loading and running a pipeline: two frozen, validated dataclasses.

    LoadOptions(allow_outside_paths=False, trust_export_archives=False, check_payloads=True, upload="pinned")
    RunOptions(processor="auto", compile="background", compile_policy="warn", fuse="auto",
               state_in_place=False, processor_options=())

RunOptions holds what every processor reads; what only some processors read is in their own option
dataclasses, given in `processor_options` (ReplayOptions for the cuda and region processors' CUDA
graphs, RegionOptions, DistOptions: fastpipe.runtime.processors; a registered processor declares its
own). Every option dataclass checks its fields on construction and raises InputError, one line naming
the field (`fuse: expected auto, off or always, found "yes"`). `fastpipe.load(...)` takes every field of
all of them as keywords (fastpipe.runtime.processors.registry.with_fields routes each to its
dataclass); the CLI builds them from its flags the same way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastpipe.errors import InputError

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
    """auto, or a registered processor's name (fastpipe.runtime.processors.registry, which refuses any other
    when the session is made, or when options are made from keywords): reference | region | cpu | cuda | dist
    built in. "auto" (the default): dist under torchrun (WORLD_SIZE set), else region when every
    slot is on one device, else cuda when every slot is on a GPU, else cpu (registry.choose_processor).
    "reference" runs one step at a time, eagerly: the oracle, chosen explicitly."""
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
    fuse: str = "auto"
    """matmul->reduce_scatter and all_gather->matmul as fused Triton kernels: "auto" (one CUDA device,
    where the fused kernel was measured faster: fastpipe.kernels.fusion_rule), "always", "off"
    (fastpipe.runtime.passes.fuse)."""
    state_in_place: bool = False
    """Outputs that are an input's updated version (a KV cache; fastpipe.runtime.binding.state) are written into
    the tensor given as that input, which run() returns as the output: the caller hands those inputs over."""
    processor_options: tuple = ()
    """Options only some processors read: instances of the option dataclasses the processors declare
    (`Processor.options`), at most one of each type; a type not given takes its defaults (`of`)."""

    def __post_init__(self):
        if not isinstance(self.processor, str) or not self.processor:    # which names exist: the registry, at load
            raise InputError(f"processor: expected a processor's name, found {self.processor!r}")
        if self.compile is True or self.compile is False:
            object.__setattr__(self, "compile", "wait" if self.compile else "off")
        if self.compile not in COMPILE_MODES:
            raise InputError(f"compile: expected background, wait or off (or true / false), found {self.compile!r}")
        if self.compile_policy not in ("warn", "raise"):
            raise InputError(f"compile_policy: expected warn or raise, found \"{self.compile_policy}\"")
        _flag("state_in_place", self.state_in_place)
        if self.fuse not in ("auto", "off", "always"):
            raise InputError(f"fuse: expected auto, off or always, found \"{self.fuse}\"")
        given = self.processor_options
        if not isinstance(given, (tuple, list)):
            raise InputError(f"processor_options: expected a tuple of option dataclasses, found {type(given).__name__}")
        object.__setattr__(self, "processor_options", tuple(given))
        seen = set()
        for o in self.processor_options:
            if not dataclasses.is_dataclass(o) or isinstance(o, type):
                raise InputError(f"processor_options: expected option dataclass instances, found {type(o).__name__}")
            if type(o) in seen:
                raise InputError(f"processor_options: expected one {type(o).__name__}, found two")
            seen.add(type(o))

    def of(self, cls):
        """The `cls` options given in processor_options, else cls() (its defaults)."""
        given = next((o for o in self.processor_options if type(o) is cls), None)
        return cls() if given is None else given
