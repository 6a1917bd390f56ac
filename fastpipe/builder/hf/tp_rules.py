"""The data a tensor-parallel plan is made of: ``Rule`` (how one parameter is split) and
``AttrUpdate`` (a module attribute a rank-local copy must change). The rule kinds and the
attribute formulas are described in fastpipe.builder.hf.plans, which turns a family's rules
(fastpipe.builder.hf.families) into a ``TPPlan``. Kept apart from plans.py so that the family
modules can state their rules without importing the registry's users.
"""
from __future__ import annotations

from dataclasses import dataclass

from fastpipe.errors import BuildError

KINDS = ("column", "column_packed", "kv_column", "row", "row_bias", "vocab_embedding", "lm_head", "replicate")
# the formulas an AttrUpdate.value may name (plans.attribute_updates computes them)
FORMULAS = ("q_local", "q_local * head_dim", "3 * q_local * head_dim", "inner // tp", "q_local // kv_local")


@dataclass(frozen=True)
class Rule:
    kind: str
    dim: int | None = None
    parts: tuple[int, ...] | None = None   # column_packed: sizes of the packed parts along dim
    unit: int = 1                          # shard boundaries are multiples of this (per part)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise BuildError(f"Rule.kind: expected one of {KINDS}, found {self.kind!r}")


@dataclass(frozen=True)
class AttrUpdate:
    module: str        # regex over module names (fullmatch)
    attr: str
    value: str         # one of FORMULAS: in q_local, kv_local, head_dim, tp and the MLP width
    required: bool     # False: forward does not read it (set for consistency only)

    def __post_init__(self):
        if self.value not in FORMULAS:
            raise BuildError(f"AttrUpdate.value: expected one of {list(FORMULAS)}, found {self.value!r}")


REPLICATE = Rule("replicate")
