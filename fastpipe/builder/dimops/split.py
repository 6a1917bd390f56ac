"""The ``dim`` algorithm: split one identifier of an annotated op over n slots.

``split(anno, identifier, n, input_shapes, **kwargs) -> SplitPlan``

Refused (``AnnotationError``): a number, ``*`` or a name the annotation does
not have; a ``^`` identifier; an identifier that is not the outermost of a
group it is in (its pieces would not be contiguous); a size not divisible by
n.

Layouts, with dims counted after ``*`` is expanded:

* input holding the identifier: ``Shard(d)``, d its dimension (for a group
  ``(h d)`` split on h, the group's dimension: its outer factor is split);
* other tensor inputs: ``Replicate()``; ``?`` slots: ``None`` (or
  ``Replicate()`` when a shape was given for it: a tensor the annotation
  ignores must be whole everywhere);
* output holding the identifier: ``Shard(d)``; output lacking a ``+``
  identifier: ``Partial("sum")``; output lacking a spatial identifier:
  ``Replicate()`` (the annotation promises it does not depend on it).

Splitting a ``+`` identifier replicates the inputs that lack it, which is
right when the op is linear in the split pieces (``mm``: ``sum_i a_i @ b_i``).
An op that also adds a term independent of the identifier (``addmm``'s bias)
would count it n times; the registry marks such identifiers ``^``.

``SplitPlan.comms[i]`` is the step that follows output i by default
(``Partial -> all_reduce``, otherwise none); ``plan.comm_to(i, layout)`` is the
step to the layout a consumer wants (``reduce_scatter``, ``all_gather``, ...,
see :func:`comm_between`).
"""
from __future__ import annotations

from dataclasses import dataclass

from fastpipe.builder.dimops.errors import anno_error
from fastpipe.builder.dimops.grammar import Annotation, TensorAnno, format_annotation, parse
from fastpipe.builder.dimops.infer import Bindings, bind
from fastpipe.builder.dimops.layouts import Comm, Layout, Partial, Replicate, Shard, comm_between

Shape = tuple[int, ...]


@dataclass(frozen=True)
class SplitPlan:
    """The result of :func:`split` (see the module docstring)."""

    annotation: Annotation
    identifier: str
    n: int
    size: int  # the identifier's full size; each slot gets size // n
    inputs: tuple[Layout | None, ...]
    outputs: tuple[Layout, ...]
    input_shapes: tuple[Shape | None, ...]  # per-slot (local) shapes
    output_shapes: tuple[Shape, ...]  # per-slot (local) shapes
    local_sizes: tuple[tuple[str, int], ...]  # every identifier's per-slot size, sorted by name
    comms: tuple[Comm | None, ...]  # default step after each output

    def comm_to(self, output: int, consumer: Layout) -> Comm | None:
        """The step from output ``output``'s layout to ``consumer``'s."""
        return comm_between(self.outputs[output], consumer)


def _dim_of(tensor: TensorAnno, b: Bindings, name: str) -> int | None:
    for d_index, dim in enumerate(b.expand(tensor)):
        if dim is not None and any(i.name == name for i in dim.idents):
            return d_index
    return None


def split(anno: Annotation | str, identifier: str, n: int, input_shapes, /, **kwargs) -> SplitPlan:
    """Split ``identifier`` of ``anno`` over ``n`` slots (module docstring).
    The first four parameters are positional-only, so any identifier (``n``
    included) can be given as a keyword size."""
    anno = parse(anno)
    text = format_annotation(anno)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise anno_error(text, f"split over n slots: expected an int n >= 1, found {n!r}")
    reductions = anno.reductions()
    if identifier == "*":
        raise anno_error(text, "'*' cannot be split (name the dimensions to split them)")
    if isinstance(identifier, str) and identifier.isdigit():
        raise anno_error(text, f'"{identifier}" is a number (a fixed size), not partitionable')
    if identifier not in reductions:
        raise anno_error(text, f'no identifier "{identifier}" to split')
    reduce = reductions[identifier]
    if reduce == "^":
        raise anno_error(text, f'identifier "{identifier}" is marked \'^\' (not partitionable)')
    for side, tensors in (("input", anno.inputs), ("output", anno.outputs)):
        for idx, t in enumerate(tensors):
            for d in t.dims if t is not None else ():
                names = [i.name for i in d.idents]
                if identifier in names[1:]:
                    group = "(" + " ".join(names) + ")"
                    raise anno_error(
                        text,
                        f'identifier "{identifier}" is not the outermost of group {group} in {side} {idx}; '
                        f"only a group's first identifier can be split",
                    )
    shapes = list(input_shapes)
    b = bind(anno, shapes, **kwargs)
    size = b.sizes[identifier]
    if size % n:
        raise anno_error(text, f'identifier "{identifier}" has size {size}, not divisible by {n}')

    local = dict(b.sizes)
    local[identifier] = size // n
    lb = Bindings(local, b.star)

    in_layouts: list[Layout | None] = []
    in_shapes: list[Shape | None] = []
    for t, shape in zip(anno.inputs, shapes):
        if t is None:
            in_layouts.append(None if shape is None else Replicate())
            in_shapes.append(None if shape is None else tuple(shape))
            continue
        d = _dim_of(t, b, identifier)
        in_layouts.append(Replicate() if d is None else Shard(d))
        in_shapes.append(lb.shape_of(t))

    out_layouts: list[Layout] = []
    for t in anno.outputs:
        d = _dim_of(t, b, identifier)
        if d is not None:
            out_layouts.append(Shard(d))
        elif reduce == "+":
            out_layouts.append(Partial("sum"))
        else:
            out_layouts.append(Replicate())
    out_shapes = tuple(lb.shape_of(t) if isinstance(lay, Shard) else b.shape_of(t) for t, lay in zip(anno.outputs, out_layouts))
    comms = tuple(comm_between(lay, Replicate()) if isinstance(lay, Partial) else None for lay in out_layouts)
    return SplitPlan(
        annotation=anno,
        identifier=identifier,
        n=n,
        size=size,
        inputs=tuple(in_layouts),
        outputs=tuple(out_layouts),
        input_shapes=tuple(in_shapes),
        output_shapes=out_shapes,
        local_sizes=tuple(sorted(local.items())),
        comms=comms,
    )


__all__ = ["SplitPlan", "split"]
