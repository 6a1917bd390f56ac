"""The reduce operations of comm supertasks and every spelling producers wrote.

A rule of the format (pure data, no torch): the validator reads ``metadata.reduce_op``
with it, the producer-style writer respells it, and the comm implementations
(``fastpipe.comm``, which re-exports these names) accept the same spellings.

fastpipe implements four reduce ops, named by their canonical spelling::

    REDUCE_OPS = ("sum", "avg", "max", "min")

``metadata.reduce_op`` has been written three ways by real producers (SPEC
"Extra top-level fields seen from the producer"), all accepted by
:func:`canonical_reduce_op`:

* a name, any case: ``"sum"``, ``"AVG"``, ``"Max"``, ...;
* ``str()`` of torch's reduce-op enum: ``"RedOpType.SUM"`` (torch >= 2.0) or
  ``"ReduceOp.SUM"`` (older torch), any case;
* the enum's integer value: ``0``.

Where the integers come from: furiosa-llm's
``furiosa_llm/parallelize/model_rewriter/mppp_config.py`` defines
``RedOpType = c10d.ReduceOp.RedOpType``, i.e. it *is* torch's
``torch.distributed.ReduceOp.RedOpType`` (C++ ``c10d::ReduceOp::RedOpType``).
Its single-device comm ops (the module of ``furiosa_llm.parallelize.
model_rewriter.ops`` that defines ``ReduceSingle``, ``AllReduceSingle``,
``ReduceScatterSingle``, ...) build the comm metadata: reduce and all_reduce
write ``reduce_op.value`` -- the integer -- and reduce_scatter writes
``str(reduce_op)`` -- ``"RedOpType.SUM"``; all three assert the op is SUM. torch numbers that enum
SUM=0, AVG=1, PRODUCT=2, MIN=3, MAX=4, BAND=5, BOR=6, BXOR=7, PREMUL_SUM=8
(checked against torch 2.13's ``ReduceOp.RedOpType.__members__``), so the
integers fastpipe accepts are 0 (sum), 1 (avg), 3 (min) and 4 (max). The
other values name real torch ops that fastpipe does not implement; they are
refused, and the message says which op they are.

Anything else (``True``, ``"0"``, ``"mean"``, ``"prod"``, ``None``) is refused
with a ``ValueError`` whose message lists the allowed spellings; the
validator wraps it with the JSON path (``REDUCE_OP_SPELLINGS`` is the
"expected" text to use with :func:`fastpipe.errors.at`).
"""
from __future__ import annotations

REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")

# torch.distributed.ReduceOp.RedOpType, value -> member name (torch 2.x).
TORCH_REDOPTYPE_NAMES: dict[int, str] = {
    0: "SUM",
    1: "AVG",
    2: "PRODUCT",
    3: "MIN",
    4: "MAX",
    5: "BAND",
    6: "BOR",
    7: "BXOR",
    8: "PREMUL_SUM",
}

# The integers fastpipe accepts, and the op each one means.
REDOPTYPE_INT_TO_OP: dict[int, str] = {0: "sum", 1: "avg", 3: "min", 4: "max"}

# Prefixes of str(torch reduce-op enum member), lower-cased.
_ENUM_PREFIXES = ("redoptype.", "reduceop.")

REDUCE_OP_SPELLINGS = (
    "a reduce op: 'sum', 'avg', 'max' or 'min' (any case), "
    "'RedOpType.SUM', 'RedOpType.AVG', 'RedOpType.MAX' or 'RedOpType.MIN' "
    "(also 'ReduceOp.<NAME>'), or torch's RedOpType integer 0 (sum), 1 (avg), "
    "3 (min) or 4 (max)"
)


def canonical_reduce_op(value: object) -> str:
    """Return the canonical name ("sum", "avg", "max" or "min") of ``value``.

    Raises ``ValueError`` (one line, listing the allowed spellings) for
    anything that is not one of the spellings in the module docstring.
    """
    if isinstance(value, bool):  # bool is an int subclass; True is not AVG
        raise ValueError(f"expected {REDUCE_OP_SPELLINGS}, found {value!r}")
    if isinstance(value, int):
        if value in REDOPTYPE_INT_TO_OP:
            return REDOPTYPE_INT_TO_OP[value]
        name = TORCH_REDOPTYPE_NAMES.get(value)
        note = f" (RedOpType.{name}, not supported)" if name else ""
        raise ValueError(f"expected {REDUCE_OP_SPELLINGS}, found {value!r}{note}")
    if isinstance(value, str):
        lowered = value.lower()
        for prefix in _ENUM_PREFIXES:
            if lowered.startswith(prefix):
                lowered = lowered[len(prefix):]
                break
        if lowered in REDUCE_OPS:
            return lowered
        raise ValueError(f"expected {REDUCE_OP_SPELLINGS}, found {value!r}")
    raise ValueError(f"expected {REDUCE_OP_SPELLINGS}, found {value!r} ({type(value).__name__})")
