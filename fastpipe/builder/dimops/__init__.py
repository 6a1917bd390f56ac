"""Dimension-annotated operators (nnScaler style), SPEC §2.

An annotation such as ``"m k+, k+ n -> m n"`` says, per operator, how it may
be split over n devices and which communication the split implies:

    from fastpipe.builder import dimops
    anno = dimops.annotation_for(torch.ops.aten.mm.default, (a, b), {})
    plan = dimops.split(anno, "k", 2, [a.shape, b.shape])
    plan.inputs   # (Shard(1), Shard(0))
    plan.outputs  # (Partial('sum'),)
    plan.comms    # (Comm('all_reduce', {'op': 'sum'}),)

Modules: ``grammar`` (parse/format), ``infer`` (shapes), ``layouts``
(Replicate/Shard/Partial, comm_between), ``split`` (the dim algorithm),
``registry`` (lookup/registration), ``aten`` (the built-in aten rules),
``custom`` (the ``@dimop`` decorator), ``errors`` (AnnotationError).
"""
from fastpipe.builder.dimops.errors import AnnotationError
from fastpipe.builder.dimops.grammar import Annotation, Dim, Ident, TensorAnno, format_annotation, parse
from fastpipe.builder.dimops.infer import bind, infer_shapes
from fastpipe.builder.dimops.layouts import Comm, Partial, Replicate, Shard, comm_between
from fastpipe.builder.dimops.registry import (
    annotation_for,
    call_slots,
    input_shapes_for,
    register_annotation,
    unregister_annotation,
)
from fastpipe.builder.dimops.split import SplitPlan, split
from fastpipe.builder.dimops.custom import dimop

__all__ = [
    "AnnotationError",
    "Annotation",
    "TensorAnno",
    "Dim",
    "Ident",
    "parse",
    "format_annotation",
    "infer_shapes",
    "bind",
    "annotation_for",
    "register_annotation",
    "unregister_annotation",
    "call_slots",
    "input_shapes_for",
    "dimop",
    "split",
    "SplitPlan",
    "Replicate",
    "Shard",
    "Partial",
    "Comm",
    "comm_between",
]
