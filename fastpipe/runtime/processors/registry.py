"""Processor name -> the class that runs a bound Program, and the "auto" choice between them.

    register_processor("counting", CountingProcessor)    # a fastpipe.runtime.processors.base.Processor
    processor_class("region")                            # -> RegionProcessor (imported on first use)
    processor_names()                                    # ("reference", "region", "cpu", "cuda", "dist", ...)
    choose_processor("auto", slot_devices)               # -> "dist" | "region" | "cuda" | "cpu"

The built-in processors are named here by module path and imported only when asked for, so reading
the names (the CLI's choices, the check of a name) imports no torch. This module is the one place that
knows processors by name: the session, the options and the CLI ask it.
"""
from __future__ import annotations

import importlib
import os
from typing import Mapping

# name -> "module:Class" (built in, imported on first use) or the class itself (registered)
_PROCESSORS: dict[str, object] = {
    "reference": "fastpipe.runtime.processors.reference:ReferenceProcessor",
    "region": "fastpipe.runtime.processors.region:RegionProcessor",
    "cpu": "fastpipe.runtime.processors.cpu:ThreadedProcessor",
    "cuda": "fastpipe.runtime.processors.cuda:CudaProcessor",
    "dist": "fastpipe.runtime.processors.dist:DistProcessor",
}
AUTO = "auto"
BUILT_IN = tuple(_PROCESSORS)
_PER_RANK_BUILT_IN = frozenset({"dist"})    # one_process_per_rank of the built-ins, known without importing them


def processor_names(*, one_process: bool = False) -> tuple[str, ...]:
    """Every registered processor's name, built-ins first (the CLI's --processor choices, with "auto");
    one_process=True: only those that run in one process (not one process per rank)."""
    if not one_process:
        return tuple(_PROCESSORS)
    return tuple(n for n in _PROCESSORS if not _per_rank(n))


def _per_rank(name: str) -> bool:
    return name in _PER_RANK_BUILT_IN if name in BUILT_IN else _PROCESSORS[name].one_process_per_rank


def register_processor(name: str, cls, *, replace: bool = False) -> None:
    """Make `cls` (a fastpipe.runtime.processors.base.Processor subclass) loadable as processor=`name`:
    fastpipe.load(..., processor=name), RunOptions(processor=name), and the CLI's --processor choices in a
    process that registered it (fastpipe.cli.main.main called after the registration)."""
    from fastpipe.runtime.processors.base import Processor

    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"processor name: expected a non-empty name other than \"auto\", found {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Processor)):
        raise TypeError(f"processor \"{name}\": expected a subclass of fastpipe.runtime.processors.base.Processor, "
                        f"found {cls!r}")
    if name in BUILT_IN or (name in _PROCESSORS and not replace):
        raise ValueError(f"processor \"{name}\": already registered" + ("" if name in BUILT_IN else
                                                                        " (pass replace=True to replace it)"))
    _PROCESSORS[name] = cls
    cls.name = name


def unregister_processor(name: str) -> None:
    """Forget a registered processor (a test's, say). The built-ins cannot be removed."""
    if name in BUILT_IN:
        raise ValueError(f"processor \"{name}\": a built-in processor cannot be unregistered")
    _PROCESSORS.pop(name, None)


def processor_class(name: str):
    """The class registered as `name` (importing a built-in's module on first use)."""
    entry = _PROCESSORS.get(name)
    if entry is None:
        raise KeyError(name)
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = _PROCESSORS[name] = getattr(importlib.import_module(module), attr)
        entry.name = name
    return entry


def check_processor_name(name) -> None:
    """InputError unless `name` is "auto" or a registered processor's name."""
    if name != AUTO and name not in _PROCESSORS:
        from fastpipe.errors import InputError

        raise InputError(f"processor: expected one of {', '.join((AUTO,) + processor_names())}, found \"{name}\"")


def choose_processor(requested: str, slot_devices: Mapping, environ: Mapping[str, str] | None = None) -> str:
    """The processor to run: `requested` unless "auto"; auto is "dist" in a torchrun-launched process
    (WORLD_SIZE set), else "region" when every slot is on one device (the split costs nothing there:
    one compiled graph), else "cuda" when every slot is on a CUDA device, else "cpu"."""
    check_processor_name(requested)
    if requested != AUTO:
        return requested
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env:
        return "dist"
    devices = list(slot_devices.values())
    if len({str(d) for d in devices}) == 1:
        return "region"
    return "cuda" if devices and all(d.type == "cuda" for d in devices) else "cpu"


def runs_per_rank(requested: str, environ: Mapping[str, str]) -> bool:
    """Whether `requested` (a name or "auto") runs one process per rank (torchrun-launched): a processor
    with one_process_per_rank, or "auto" in a process torchrun launched (WORLD_SIZE set)."""
    check_processor_name(requested)
    if requested == AUTO:
        return "WORLD_SIZE" in environ
    return _per_rank(requested)


def per_rank_processors() -> tuple[str, ...]:
    """The registered processors that run one process per rank."""
    return tuple(n for n in _PROCESSORS if _per_rank(n))


def option_types() -> tuple[type, ...]:
    """Every option dataclass some registered processor takes (each once, in registration order)."""
    out: list[type] = []
    for name in _PROCESSORS:
        for t in processor_class(name).options:
            if t not in out:
                out.append(t)
    return tuple(out)


def with_fields(run_options=None, /, **fields):
    """`run_options` (default RunOptions()) with `fields` replaced, each routed to the dataclass that has
    it: RunOptions' own fields, else the option type of a registered processor that declares it (its
    instance in processor_options replaced or added). What fastpipe.load's keywords and the CLI's flags
    go through. A name no dataclass has: TypeError, as for an unknown keyword argument."""
    import dataclasses

    from fastpipe.options import RunOptions

    ro = RunOptions() if run_options is None else run_options
    if "processor" in fields:
        check_processor_name(fields["processor"])
    if "processor_options" in fields:
        ro = dataclasses.replace(ro, processor_options=fields.pop("processor_options"))
    own = {f.name for f in dataclasses.fields(RunOptions)} - {"processor_options"}
    common = {k: v for k, v in fields.items() if k in own}
    by_type: dict[type, dict] = {}
    for k, v in fields.items():
        if k in own:
            continue
        owner = next((t for t in option_types() if k in {f.name for f in dataclasses.fields(t)}), None)
        if owner is None:
            raise TypeError(f"unexpected keyword argument {k!r}; expected one of {', '.join(option_names())}")
        by_type.setdefault(owner, {})[k] = v
    given = list(ro.processor_options)
    for t, changes in by_type.items():
        i = next((j for j, o in enumerate(given) if type(o) is t), None)
        if i is None:
            given.append(t(**changes))
        else:
            given[i] = dataclasses.replace(given[i], **changes)
    return dataclasses.replace(ro, **common, processor_options=tuple(given))


def option_names() -> tuple[str, ...]:
    """Every keyword with_fields takes: RunOptions' fields, then every processor option type's."""
    import dataclasses

    from fastpipe.options import RunOptions

    names = [f.name for f in dataclasses.fields(RunOptions) if f.name != "processor_options"]
    for t in option_types():
        names += [f.name for f in dataclasses.fields(t) if f.name not in names]
    return tuple(names)


def check_options_taken(run_options, cls) -> None:
    """Options of a type that refuses other processors (`only_for_its_processors = True`: the dist
    processor's ranks and timeout) given to a processor that does not take them: InputError naming the
    first field set."""
    import dataclasses

    from fastpipe.errors import InputError

    for o in run_options.processor_options:
        t = type(o)
        if t in cls.options or not getattr(t, "only_for_its_processors", False) or o == t():
            continue
        takers = [n for n in processor_names() if t in processor_class(n).options]
        name = next(f.name for f in dataclasses.fields(o) if getattr(o, f.name) != getattr(t(), f.name))
        raise InputError(f"{name}: expected processor=\"{' or '.join(takers)}\", found processor=\"{cls.name}\"")

