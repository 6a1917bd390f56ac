"""Every comm kind as one specification (SPEC §1 "Comm semantics"), in one table.

    COMM_KINDS["reduce_scatter"]      # its CommKindSpec: parameters, who holds inputs and outputs, output shape
    register_comm_kind(spec)          # a new kind; unregister_comm_kind(name), or `with comm_kind(spec):`
    group_kinds()                     # the kinds of group the specs form: every backend implements these

What the format knows about a comm kind lives here: the parser reads the names, the validator
(fastpipe.validate.comm_groups) the parameters, arity and output shape, the builders the shape.
A kind's implementations live with each backend, in a KindTable keyed by the group kind:

    fastpipe.comm.reference.REFERENCE_KINDS    (xs, params, devices) -> outputs   plain torch, the oracle
    fastpipe.comm.local.LOCAL_KINDS            (params, n) -> LocalComm           one device, region graphs
    fastpipe.runtime.execute.EXECUTE_KINDS     (params, devices) -> fn(xs)        one process (reference, cpu, cuda)
    fastpipe.runtime.processors.dist.DIST_KINDS  (group, me, x, nccl) -> outputs  torch.distributed, one rank each

A group kind is the spec's `group` (send and recv form a "p2p" pair) or its name. Every
member has at most one input and one output (`inputs`/`outputs`: which members hold one), and
every input has the same shape and dtype. Params arrive canonical: a reduce_op as sum/avg/max/
min, a dim as 0 <= dim < rank, a slot as the member index of that slot.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

PARAM_TYPES = ("reduce_op", "dim", "slot")
HOLDERS = ("all", "root", "none")
# The other supertask kinds and spellings (fastpipe.format.model: COMPUTE_KINDS, IO_KINDS): never a comm kind.
RESERVED = frozenset({"fx", "dfg", "edf", "FX", "DFG", "EDF", "input", "output"})

ShapeRule = Callable[[Sequence[int], int, Mapping[str, Any]], tuple[int, ...]]


@dataclass(frozen=True)
class Param:
    """One metadata key of a comm kind."""
    name: str
    type: str                 # reduce_op: one of sum/avg/max/min (any spelling) | dim: of the input | slot: a member's slot
    required: bool = True
    split: bool = False       # a dim split into group-size equal chunks: its size must divide by the group size


def same_shape(shape: Sequence[int], n: int, params: Mapping[str, Any]) -> tuple[int, ...]:
    return tuple(shape)


def resized(shape: Sequence[int], n: int, *, grow: Sequence[int] = (), shrink: Sequence[int] = ()) -> tuple[int, ...]:
    """`shape` with the dims in `shrink` divided by n, then those in `grow` multiplied by n."""
    out = list(shape)
    for d in shrink:
        out[d] //= n
    for d in grow:
        out[d] *= n
    return tuple(out)


# Why a member holds the inputs/outputs it does, by (inputs, outputs) holders; {kind}, {root} filled in.
_WHY = {
    ("all", "all"): ("{kind} takes one input per participant", "{kind} gives one output per participant"),
    ("all", "root"): ("every {kind} participant gives one", "only the {root} participant of {kind} has an output"),
    ("root", "all"): ("only the {root} participant of {kind} gives an input", "every {kind} participant gets one"),
    ("all", "none"): ("{kind} takes one input", "{kind} has no outputs"),
    ("none", "all"): ("{kind} has no inputs", "{kind} gives one output"),
}


@dataclass(frozen=True)
class CommKindSpec:
    """A comm kind as the format defines it.

    name      the supertask kind as written in the file
    params    its metadata keys (a file must write exactly the required ones, and may write the others)
    inputs    which members give one input: "all", the "root" member only, or "none"
    outputs   which members get one output, the same way
    root      the slot param naming the root member (when inputs or outputs is "root")
    shape     (input shape, group size, params) -> every output's shape
    group     the kind of group it forms, when not a group of its own kind ("p2p": a send and a recv)
    partner   the kind it pairs with in such a group
    why       the explanations of the input and output counts, where not the default for the holders
    producer_op  how the producer writes its reduce_op: "int" (RedOpType integer) or "name" ("RedOpType.SUM")
    """
    name: str
    params: tuple[Param, ...] = ()
    inputs: str = "all"
    outputs: str = "all"
    root: str | None = None
    shape: ShapeRule = same_shape
    group: str | None = None
    partner: str | None = None
    why: tuple[str | None, str | None] = (None, None)
    producer_op: str = "int"

    @property
    def group_kind(self) -> str:
        return self.group or self.name

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    def of_type(self, type_: str) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.type == type_)

    def count(self, side: str, member: int, params: Mapping[str, Any]) -> int:
        """How many tensors member `member` has on `side` ("inputs" | "outputs"); params canonical."""
        holders = getattr(self, side)
        if holders == "root":
            return int(member == params[self.root])
        return int(holders == "all")

    def explain(self, side: str) -> str:
        """Why members hold the tensors they do on `side`, for messages."""
        given = self.why[0 if side == "inputs" else 1]
        text = given or _WHY[(self.inputs, self.outputs)][0 if side == "inputs" else 1]
        return text.format(kind=self.name, root=self.root)


def _check_spec(s: CommKindSpec) -> None:
    if not s.name.isidentifier() or s.name in RESERVED:
        raise ValueError(f"comm kind {s.name!r}: expected a new identifier, not a compute or io kind")
    for p in s.params:
        if p.type not in PARAM_TYPES:
            raise ValueError(f"comm kind {s.name!r}: param {p.name!r}: expected a type in {PARAM_TYPES}, found {p.type!r}")
    if (s.inputs, s.outputs) not in _WHY:
        raise ValueError(f"comm kind {s.name!r}: expected (inputs, outputs) holders in {sorted(_WHY)}, "
                         f"found {(s.inputs, s.outputs)}")
    root = s.param(s.root) if s.root is not None else None
    if "root" in (s.inputs, s.outputs) and (root is None or root.type != "slot" or not root.required):
        raise ValueError(f"comm kind {s.name!r}: expected root to name a required slot param, found {s.root!r}")
    if s.group is not None or s.partner is not None:
        raise ValueError(f"comm kind {s.name!r}: expected a collective (no group, no partner): only send and "
                         "recv form pairs")
    if s.inputs == "none":
        raise ValueError(f"comm kind {s.name!r}: expected inputs all or root, found none")
    if s.producer_op not in ("int", "name"):
        raise ValueError(f"comm kind {s.name!r}: expected producer_op int or name, found {s.producer_op!r}")


_OP, _DST, _SRC = Param("reduce_op", "reduce_op"), Param("dst", "slot"), Param("src", "slot")

BUILTIN: tuple[CommKindSpec, ...] = (
    CommKindSpec("send", outputs="none", group="p2p", partner="recv"),
    CommKindSpec("recv", inputs="none", group="p2p", partner="send"),
    CommKindSpec("reduce", (_OP, _DST), outputs="root", root="dst"),
    CommKindSpec("all_gather", (Param("dim", "dim"),),                     # [.., d, ..] -> [.., n*d, ..]
                 shape=lambda s, n, p: resized(s, n, grow=[p["dim"]])),
    CommKindSpec("all_reduce", (_OP,)),
    CommKindSpec("reduce_scatter", (_OP, Param("dim", "dim", split=True)),  # [.., d, ..] -> [.., d/n, ..]
                 shape=lambda s, n, p: resized(s, n, shrink=[p["dim"]]), producer_op="name"),
    CommKindSpec("all_to_all", (Param("src_dim", "dim", split=True), Param("dst_dim", "dim")),
                 shape=lambda s, n, p: resized(s, n, shrink=[p["src_dim"]], grow=[p["dst_dim"]])),
    CommKindSpec("broadcast", (_SRC,), inputs="root", root="src", why=(None, "every {kind} participant outputs a copy")),
    CommKindSpec("gather", (Param("dim", "dim"), _DST), outputs="root", root="dst",   # dst: [.., n*d, ..]
                 shape=lambda s, n, p: resized(s, n, grow=[p["dim"]])),
)

# kind name -> spec, in the order the format lists them (then registered ones)
COMM_KINDS: dict[str, CommKindSpec] = {s.name: s for s in BUILTIN}


def register_comm_kind(spec: CommKindSpec) -> None:
    """Add a comm kind, a collective: files may then use it, and the validator checks it by its spec.
    Each backend needs an implementation too (KindTable.register on each backend's table)."""
    _check_spec(spec)
    if spec.name in COMM_KINDS:
        raise ValueError(f"comm kind {spec.name!r}: already registered")
    COMM_KINDS[spec.name] = spec


def unregister_comm_kind(name: str) -> None:
    if any(s.name == name for s in BUILTIN):
        raise ValueError(f"comm kind {name!r}: a kind of the format, not a registered one")
    COMM_KINDS.pop(name, None)


@contextmanager
def comm_kind(spec: CommKindSpec) -> Iterator[CommKindSpec]:
    """`spec` registered for the with block."""
    register_comm_kind(spec)
    try:
        yield spec
    finally:
        unregister_comm_kind(spec.name)


def group_kinds() -> tuple[str, ...]:
    """The group kinds of every registered spec, in table order ("p2p" for send and recv)."""
    return tuple(dict.fromkeys(s.group_kind for s in COMM_KINDS.values()))


T = TypeVar("T")


@dataclass
class KindTable(Generic[T]):
    """One backend's implementations of the group kinds, keyed by group kind."""
    backend: str
    entries: dict[str, T] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.builtin = frozenset(self.entries)

    def __getitem__(self, kind: str) -> T:
        try:
            return self.entries[kind]
        except KeyError:
            raise KeyError(f"{self.backend}: no implementation of comm kind {kind!r} "
                           f"(register one with {self.backend}.register)") from None

    def __contains__(self, kind: object) -> bool:
        return kind in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def register(self, kind: str, impl: T) -> None:
        """Add `kind`'s implementation; its spec must be registered first (register_comm_kind)."""
        if kind not in group_kinds():
            raise ValueError(f"{self.backend}: comm kind {kind!r} has no spec (register_comm_kind first)")
        if kind in self.entries:
            raise ValueError(f"{self.backend}: comm kind {kind!r} already has an implementation")
        self.entries[kind] = impl

    def unregister(self, kind: str) -> None:
        if kind in self.builtin:
            raise ValueError(f"{self.backend}: comm kind {kind!r} is built in, not a registered one")
        self.entries.pop(kind, None)

    @contextmanager
    def registered(self, kind: str, impl: T) -> Iterator[None]:
        """`impl` registered for the with block."""
        self.register(kind, impl)
        try:
            yield
        finally:
            self.unregister(kind)


__all__ = ["COMM_KINDS", "BUILTIN", "CommKindSpec", "KindTable", "Param", "comm_kind", "group_kinds",
           "register_comm_kind", "resized", "same_shape", "unregister_comm_kind"]
