"""The registry of model families: ``FamilySpec`` and the functions that register and find them.

A family is everything the Hugging Face builder needs to know about one transformers
architecture; the machinery (loading a skeleton, tensor-parallel plans, tracing, building)
is generic and asks the spec. fastpipe.builder.hf.families imports every module of its
folder, and each built-in family module registers its spec; a family defined elsewhere is
registered the same way (``register_family(spec)``, or ``with registered(spec): ...``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastpipe.builder.hf.tp_rules import AttrUpdate, Rule
from fastpipe.errors import BuildError

Dims = tuple[int, int, int]            # (query heads, key/value heads, head_dim) of the unsplit model
SP_HOOKS = ("pre", "post")


def mha_dims(config) -> Dims:
    """Multi-head attention without grouped keys/values: every head has hidden_size // heads features."""
    heads = config.num_attention_heads
    return heads, heads, config.hidden_size // heads


def accept_all(config) -> None:
    """A family whose every config of its model types traces as it is."""


def no_load_kwargs(model_dir: Path | None) -> dict[str, Any]:
    return {}


def refuse(field_name: str, expected: str, found: object) -> BuildError:
    """The one-line refusal of a config field: ``config.json.<field>: expected ..., found ...``."""
    return BuildError(f"config.json.{field_name}: expected {expected}, found {found!r}")


@dataclass(frozen=True)
class FamilySpec:
    """What is specific to one model family (module paths are those of ``model_class``'s modules).

    name            the family's name (``FlatSignature.family``, ``TPPlan.family``, ``load_skeleton``'s third value)
    model_types     the ``config.json`` ``model_type`` values it builds
    model_class     the class instantiated: a name in ``transformers`` ("LlamaForCausalLM"), or a
                    callable config -> class
    layers          the module holding the list of blocks; pipeline stages are cut at its items
    tp_rules        config -> ((regex over parameter names, Rule), ...): every parameter (tied aliases
                    included) must fullmatch one (first match wins); see fastpipe.builder.hf.plans
    tp_attrs        module attributes a rank-local copy changes (AttrUpdate)
    dims            config -> (query heads, key/value heads, head_dim)
    check           config -> None; raises a BuildError naming the config field (``refuse``) for a
                    variant the trace does not reproduce
    load_kwargs     model folder (None: building from a config alone) -> extra keyword arguments
                    of ``model_class._from_config`` (BERT: whether the checkpoint has a pooler)
    decoder         True: a causal LM, traced with a KV cache, logits out; False: an encoder,
                    ``last_hidden_state`` (and ``pooler_output`` when the model has a pooler) out
    encoder_inputs  an encoder's int64 [B, S] inputs after input_ids, by forward keyword
    sp_scatter      sequence parallelism: (hook, module) where the hidden states become sequence
                    shards: "post" slices the module's output, "pre" its hidden_states input; None:
                    the family does not support sequence parallelism
    sp_gather       with sequence parallelism: regexes of the modules whose hidden_states input is
                    gathered first (HF attention takes its output shape from its input's)
    notes           free text carried into the TPPlan
    """

    name: str
    model_types: tuple[str, ...]
    model_class: str | Callable[[Any], type]
    layers: str
    tp_rules: Callable[[Any], tuple[tuple[str, Rule], ...]]
    tp_attrs: tuple[AttrUpdate, ...] = ()
    dims: Callable[[Any], Dims] = mha_dims
    check: Callable[[Any], None] = accept_all
    load_kwargs: Callable[[Path | None], dict[str, Any]] = no_load_kwargs
    decoder: bool = True
    encoder_inputs: tuple[str, ...] = ()
    sp_scatter: tuple[str, str] | None = None
    sp_gather: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("model_types", "tp_attrs", "encoder_inputs", "sp_gather", "notes"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (tuple, list)):
                raise BuildError(f"FamilySpec.{name}: expected a tuple, found {type(value).__name__}")
            object.__setattr__(self, name, tuple(value))
        if not isinstance(self.name, str) or not self.name:
            raise BuildError(f"FamilySpec.name: expected a non-empty string, found {self.name!r}")
        if not self.model_types or not all(isinstance(t, str) and t for t in self.model_types):
            raise BuildError(f"FamilySpec.model_types ({self.name}): expected non-empty strings, "
                             f"found {list(self.model_types)}")
        if not (isinstance(self.model_class, str) and self.model_class) and not callable(self.model_class):
            raise BuildError(f"FamilySpec.model_class ({self.name}): expected a transformers class name or a "
                             f"callable, found {self.model_class!r}")
        if not isinstance(self.layers, str) or not self.layers:
            raise BuildError(f"FamilySpec.layers ({self.name}): expected a module name, found {self.layers!r}")
        for fn in ("tp_rules", "dims", "check", "load_kwargs"):
            if not callable(getattr(self, fn)):
                raise BuildError(f"FamilySpec.{fn} ({self.name}): expected a callable, found "
                                 f"{type(getattr(self, fn)).__name__}")
        if not all(isinstance(u, AttrUpdate) for u in self.tp_attrs):
            raise BuildError(f"FamilySpec.tp_attrs ({self.name}): expected AttrUpdate values")
        if self.decoder and self.encoder_inputs:
            raise BuildError(f"FamilySpec.encoder_inputs ({self.name}): expected none for a decoder, "
                             f"found {list(self.encoder_inputs)}")
        if self.sp_scatter is not None:
            if (not isinstance(self.sp_scatter, tuple) or len(self.sp_scatter) != 2
                    or self.sp_scatter[0] not in SP_HOOKS or not isinstance(self.sp_scatter[1], str)):
                raise BuildError(f"FamilySpec.sp_scatter ({self.name}): expected (\"pre\" | \"post\", module name), "
                                 f"found {self.sp_scatter!r}")
            if not self.sp_gather:
                raise BuildError(f"FamilySpec.sp_gather ({self.name}): expected the modules that gather the "
                                 "sequence shards (sp_scatter is set), found none")

    def resolve_model_class(self, config) -> type:
        """The class ``model_class`` names (imports transformers)."""
        if not isinstance(self.model_class, str):
            return self.model_class(config)
        import transformers

        cls = getattr(transformers, self.model_class, None)
        if cls is None:
            raise BuildError(f"FamilySpec.model_class ({self.name}): expected a class of transformers "
                             f"{transformers.__version__}, found {self.model_class!r}")
        return cls


_FAMILIES: dict[str, FamilySpec] = {}       # name -> spec
_MODEL_TYPES: dict[str, FamilySpec] = {}    # config.json model_type -> spec


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add ``spec``; its name and model types must not be registered already. Returns ``spec``."""
    if not isinstance(spec, FamilySpec):
        raise BuildError(f"family: expected a FamilySpec, found {type(spec).__name__}")
    if spec.name in _FAMILIES:
        raise BuildError(f"family {spec.name!r}: expected a name not registered yet, found it registered")
    taken = [t for t in spec.model_types if t in _MODEL_TYPES]
    if taken:
        raise BuildError(f"family {spec.name!r}: expected model types no family builds yet, found {taken[0]!r} "
                         f"built by {_MODEL_TYPES[taken[0]].name!r}")
    _FAMILIES[spec.name] = spec
    for t in spec.model_types:
        _MODEL_TYPES[t] = spec
    return spec


def unregister_family(name: str) -> FamilySpec:
    """Remove the family ``name`` (and its model types); returns its spec."""
    spec = get_family(name)
    del _FAMILIES[spec.name]
    for t in spec.model_types:
        _MODEL_TYPES.pop(t, None)
    return spec


@contextlib.contextmanager
def registered(spec: FamilySpec) -> Iterator[FamilySpec]:
    """``spec`` registered for the ``with`` block, unregistered after."""
    register_family(spec)
    try:
        yield spec
    finally:
        unregister_family(spec.name)


def registered_families() -> tuple[FamilySpec, ...]:
    """Every registered spec, by name."""
    return tuple(_FAMILIES[n] for n in sorted(_FAMILIES))


def get_family(family: str | FamilySpec) -> FamilySpec:
    """The spec of ``family``: a registered name, or a spec (returned as it is)."""
    if isinstance(family, FamilySpec):
        return family
    spec = _FAMILIES.get(family)
    if spec is None:
        raise BuildError(f"family: expected one of {sorted(_FAMILIES)}, found {family!r}")
    return spec


def supported_model_types() -> list[str]:
    """The ``model_type`` values some registered family builds, sorted."""
    return sorted(_MODEL_TYPES)


def family_for_model_type(model_type: object) -> FamilySpec:
    """The family building ``model_type`` (no check of the rest of the config)."""
    spec = _MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if spec is None:
        raise BuildError(f"config.json.model_type: expected one of {supported_model_types()}, found {model_type!r}")
    return spec


def family_for(config) -> FamilySpec:
    """The family of a transformers config: by ``config.model_type``, then its ``check``
    (a BuildError naming the field of a variant the trace does not reproduce)."""
    spec = family_for_model_type(getattr(config, "model_type", None))
    spec.check(config)
    return spec
