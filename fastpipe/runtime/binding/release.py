"""Free a session's weights when its last reference goes, not at the next garbage collection.

Every torch.fx GraphModule is a reference cycle (its Graph points back at it: Graph._owning_module,
and every Node at the Graph), so the constants it holds as buffers (a stitched region's weights,
the merged shards) outlive their owner until Python's cycle collector runs, which for long-lived
objects can be minutes or never in a server that allocates few Python objects. A processor dropped
with its Session would keep gigabytes of device memory.

    release_with(owner, gms)     # when `owner` is freed: drop each GraphModule's own constants
    fn = weak_method(obj.method) # a callable that does not keep `obj` alive (no owner <-> helper cycle)

`owner` must not itself be in a cycle (it is freed by reference counting; a cyclic owner is freed,
and its GraphModules' constants dropped, at the next collection, as before). Only the top-level
module's buffers and parameters are dropped: the owner must be their only user (a GraphModule it
built, not one shared with another session).
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch


def drop_constants(gms: list) -> None:
    """Forget the tensors each module holds as its own buffers and parameters (a module called after
    this fails: its get_attr targets are gone)."""
    for gm in gms:
        gm._buffers.clear()
        gm._parameters.clear()


def release_with(owner: object, gms: Iterable[torch.nn.Module]) -> None:
    """drop_constants(gms) when `owner` is freed (not at interpreter exit: the process frees everything)."""
    gms = [gm for gm in gms if isinstance(gm, torch.nn.Module)]
    if gms:
        weakref.finalize(owner, drop_constants, gms).atexit = False


def weak_method(method) -> Callable:
    """`method` (a bound method) as a callable holding its object weakly: a helper the object holds
    (a GraphReplay given its processor's run function) then makes no cycle back to it."""
    ref = weakref.WeakMethod(method)
    name = method.__qualname__

    def call(*args, **kwargs):
        m = ref()
        if m is None:
            raise RuntimeError(f"{name}: its object was freed (the processor of a closed or dropped session)")
        return m(*args, **kwargs)

    call.__qualname__ = call.__name__ = f"weak {name}"
    return call
