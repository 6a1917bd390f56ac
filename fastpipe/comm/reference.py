"""Plain-torch reference for every communication kind (SPEC "Comm semantics").

This module is the oracle: the CPU runtime runs it, and every faster
implementation (CUDA streams, NCCL, torch.distributed, fused kernels) is
tested against it. It favours being obviously right over being fast.

Conventions shared by every function
------------------------------------
* A group has ``n >= 1`` participants, given in ``device_idx`` order
  ``0..n-1``. ``xs[i]`` is participant i's input and ``devices[i]`` the device
  participant i's output must live on.
* Every input of one call must have the same shape and dtype (the validator
  checks this from the pipeline's tensor infos; here it is a ``ValueError``).
* Every returned tensor is a fresh, contiguous copy on its participant's
  device: it never shares memory with an input or with another output, so
  callers may reuse or mutate buffers freely. Outputs keep the inputs' dtype.
* ``dim``/``src_dim``/``dst_dim`` may be negative (counted from the end, as in
  torch) and are normalized against the inputs' rank. ``dst``/``src`` are
  participant indices (``device_idx``), not slot ids; the caller maps slots.
* Splits must be exact: a dimension split into n chunks must have a size
  divisible by n (``ValueError`` otherwise; the validator refuses it earlier,
  with a JSON path).
* Invalid arguments raise ``ValueError`` with a one-line message.

Reductions (all_reduce, reduce, reduce_scatter)
-----------------------------------------------
``op`` is any spelling :func:`fastpipe.format.reduce_ops.canonical_reduce_op`
accepts; the four ops are ``sum``, ``avg``, ``max``, ``min``. Precisely:

1. Every input is moved to one working device, the device of participant 0's
   input, and -- for floating dtypes narrower than 32 bits (f16, bf16, the f8
   types) -- converted to float32. Wider dtypes (f32, f64, integers, bool) are
   reduced in their own dtype.
2. The inputs are folded left to right in participant order:
   ``acc = x_0; acc = acc (op) x_1; ...; acc = acc (op) x_{n-1}``.
   sum is ``+``; max/min are ``torch.maximum``/``torch.minimum`` (a NaN in any
   input gives NaN).
3. avg is that sum divided by n, in the same accumulation dtype.
4. The result is cast back to the input dtype once, at the end (round to
   nearest even). So an f16/bf16/f8 reduction rounds exactly once; this is
   what makes the reference a good oracle for kernels that accumulate in
   float32, and it is at least as accurate as any fold in the narrow dtype.

Each step is an IEEE-754 correctly rounded elementwise operation (no
reduction trees, no fused multiply-add), so the result is expected to be
bit-identical whichever device the fold runs on.

dtype rules:

* avg of integer or bool inputs is refused (``ValueError``): there is no
  exact integer mean, and a silent floor would hide bugs.
* integer sums are computed in the input dtype and wrap around on overflow
  (two's complement), as torch's ``+`` and NCCL do.
* bool: ``sum`` is logical OR (a saturating add, so the result stays a
  bool), ``max`` is OR and ``min`` is AND.

The table
---------
``REFERENCE_KINDS`` holds every group kind (fastpipe.format.comm_kinds) in one shape:
``fn(xs, params, devices) -> outputs``, where ``xs`` are the inputs of the members that hold
one, in member order, ``params`` the group's canonical params (fastpipe.validate.comm_groups:
slots as member indices) and ``outputs`` every member's outputs, in member order,
concatenated. A new kind registers its reference with ``REFERENCE_KINDS.register(kind, fn)``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fastpipe.format.comm_kinds import KindTable
from fastpipe.format.reduce_ops import canonical_reduce_op

__all__ = [
    "REFERENCE_KINDS",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "reduce",
    "gather",
    "broadcast",
    "send_recv",
]

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def _deliver(t: Tensor, device) -> Tensor:
    """A fresh contiguous copy of ``t`` on ``device`` (never an alias)."""
    return t.to(device=torch.device(device), memory_format=torch.contiguous_format, copy=True)


def _check_group(xs: Sequence[Tensor], devices: Sequence) -> int:
    """Check the participants and return n."""
    n = len(xs)
    if n < 1:
        raise ValueError("a comm group needs at least one participant, found 0 inputs")
    if len(devices) != n:
        raise ValueError(f"expected one device per participant ({n}), found {len(devices)} devices")
    first = xs[0]
    for i, x in enumerate(xs):
        if not isinstance(x, Tensor):
            raise ValueError(f"participant {i}: expected a torch.Tensor, found {type(x).__name__}")
        if x.shape != first.shape or x.dtype != first.dtype:
            raise ValueError(
                f"participant {i}: expected shape {tuple(first.shape)} and dtype {first.dtype} "
                f"like participant 0, found shape {tuple(x.shape)} and dtype {x.dtype}"
            )
    return n


def _norm_dim(dim: int, ndim: int, what: str = "dim") -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"{what}: expected an integer, found {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{what}: expected {-ndim} <= {what} < {ndim} for a rank-{ndim} tensor, found {dim}")
    return dim % ndim


def _check_index(idx: int, n: int, what: str) -> int:
    if isinstance(idx, bool) or not isinstance(idx, int):
        raise ValueError(f"{what}: expected a participant index, found {idx!r}")
    if not 0 <= idx < n:
        raise ValueError(f"{what}: expected 0 <= {what} < {n} (participant index), found {idx}")
    return idx


def _equal_chunks(x: Tensor, n: int, dim: int, what: str) -> list[Tensor]:
    """Split ``x`` into n equal chunks along ``dim`` (views)."""
    size = x.shape[dim]
    if size % n != 0:
        raise ValueError(
            f"{what}: expected the size of dimension {dim} ({size}) to be divisible by the group size {n}"
        )
    return list(torch.split(x, size // n, dim=dim))


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype.is_floating_point and dtype.itemsize < 4:
        return torch.float32
    return dtype


def _reduce_values(xs: Sequence[Tensor], op: str) -> Tensor:
    """op(x_0, ..., x_{n-1}) by the rules in the module docstring.

    The result is a new tensor on the device of ``xs[0]``, in the input dtype.
    """
    op = canonical_reduce_op(op)
    dtype = xs[0].dtype
    work_device = xs[0].device
    n = len(xs)
    is_bool = dtype == torch.bool
    if op == "avg" and (is_bool or not (dtype.is_floating_point or dtype.is_complex)):
        raise ValueError(f"reduce_op 'avg' needs a floating dtype, found {dtype}")

    acc_dtype = _accumulation_dtype(dtype)
    values = [x.to(device=work_device, dtype=acc_dtype) for x in xs]

    acc = values[0].clone()
    for v in values[1:]:
        if is_bool:
            acc = torch.logical_and(acc, v) if op == "min" else torch.logical_or(acc, v)
        elif op in ("sum", "avg"):
            acc = acc + v
        elif op == "max":
            acc = torch.maximum(acc, v)
        else:  # "min"
            acc = torch.minimum(acc, v)
    if op == "avg":
        acc = acc / n
    return acc.to(dtype)


# ---------------------------------------------------------------------------
# the comm kinds
# ---------------------------------------------------------------------------

def all_reduce(xs: Sequence[Tensor], op: str, devices: Sequence) -> list[Tensor]:
    """y_i = op(x_0, ..., x_{n-1}) elementwise, on ``devices[i]``."""
    _check_group(xs, devices)
    result = _reduce_values(xs, op)
    return [_deliver(result, d) for d in devices]


def all_gather(xs: Sequence[Tensor], dim: int, devices: Sequence) -> list[Tensor]:
    """y_i = cat(x_0, ..., x_{n-1}; dim), on ``devices[i]``."""
    _check_group(xs, devices)
    dim = _norm_dim(dim, xs[0].dim())
    return [_deliver(torch.cat([x.to(torch.device(d)) for x in xs], dim=dim), d) for d in devices]


def reduce_scatter(xs: Sequence[Tensor], op: str, dim: int, devices: Sequence) -> list[Tensor]:
    """y_i = the i-th of n equal chunks, along ``dim``, of op(x_0, ..., x_{n-1})."""
    n = _check_group(xs, devices)
    dim = _norm_dim(dim, xs[0].dim())
    _equal_chunks(xs[0], n, dim, "reduce_scatter")  # refuse uneven splits before reducing
    chunks = _equal_chunks(_reduce_values(xs, op), n, dim, "reduce_scatter")
    return [_deliver(chunk, d) for chunk, d in zip(chunks, devices)]


def all_to_all(xs: Sequence[Tensor], src_dim: int, dst_dim: int, devices: Sequence) -> list[Tensor]:
    """Split each x_j into n equal chunks along ``src_dim``; chunk i goes to
    participant i, which concatenates what it receives in participant order:
    y_i = cat(chunk_i(x_0), ..., chunk_i(x_{n-1}); dst_dim)."""
    n = _check_group(xs, devices)
    ndim = xs[0].dim()
    src_dim = _norm_dim(src_dim, ndim, "src_dim")
    dst_dim = _norm_dim(dst_dim, ndim, "dst_dim")
    chunks = [_equal_chunks(x, n, src_dim, "all_to_all") for x in xs]  # chunks[j][i]
    outputs = []
    for i, d in enumerate(devices):
        received = [chunks[j][i].to(torch.device(d)) for j in range(n)]
        outputs.append(_deliver(torch.cat(received, dim=dst_dim), d))
    return outputs


def reduce(xs: Sequence[Tensor], op: str, dst: int, devices: Sequence) -> Tensor:
    """op(x_0, ..., x_{n-1}), for participant ``dst`` only, on ``devices[dst]``."""
    n = _check_group(xs, devices)
    dst = _check_index(dst, n, "dst")
    return _deliver(_reduce_values(xs, op), devices[dst])


def gather(xs: Sequence[Tensor], dim: int, dst: int, devices: Sequence) -> Tensor:
    """cat(x_0, ..., x_{n-1}; dim), for participant ``dst`` only, on ``devices[dst]``."""
    n = _check_group(xs, devices)
    dst = _check_index(dst, n, "dst")
    dim = _norm_dim(dim, xs[0].dim())
    target = torch.device(devices[dst])
    return _deliver(torch.cat([x.to(target) for x in xs], dim=dim), target)


def broadcast(x: Tensor, src: int, devices: Sequence) -> list[Tensor]:
    """A copy of ``x`` (participant ``src``'s input) for every participant,
    ``src`` included, each on its own device."""
    if not isinstance(x, Tensor):
        raise ValueError(f"broadcast: expected a torch.Tensor, found {type(x).__name__}")
    n = len(devices)
    if n < 1:
        raise ValueError("a comm group needs at least one participant, found 0 devices")
    _check_index(src, n, "src")
    return [_deliver(x, d) for d in devices]


def send_recv(x: Tensor, device) -> Tensor:
    """The sender's ``x``, as the receiver's output on ``device`` (a copy)."""
    if not isinstance(x, Tensor):
        raise ValueError(f"send_recv: expected a torch.Tensor, found {type(x).__name__}")
    return _deliver(x, device)


# ---------------------------------------------------------------------------
# the table: group kind -> (xs, params, devices) -> every member's outputs
# ---------------------------------------------------------------------------

REFERENCE_KINDS: KindTable = KindTable("fastpipe.comm.reference.REFERENCE_KINDS", {
    "p2p": lambda xs, prm, devs: [send_recv(xs[0], devs[1])],        # members: the send (0), the recv (1)
    "all_reduce": lambda xs, prm, devs: all_reduce(xs, prm["reduce_op"], devs),
    "all_gather": lambda xs, prm, devs: all_gather(xs, prm["dim"], devs),
    "reduce_scatter": lambda xs, prm, devs: reduce_scatter(xs, prm["reduce_op"], prm["dim"], devs),
    "all_to_all": lambda xs, prm, devs: all_to_all(xs, prm["src_dim"], prm["dst_dim"], devs),
    "reduce": lambda xs, prm, devs: [reduce(xs, prm["reduce_op"], prm["dst"], devs)],
    "gather": lambda xs, prm, devs: [gather(xs, prm["dim"], prm["dst"], devs)],
    "broadcast": lambda xs, prm, devs: broadcast(xs[0], prm["src"], devs),
})
