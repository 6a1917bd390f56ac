"""Shape inference for an annotation: bind identifiers to sizes, check, and
compute the output shapes.

``infer_shapes(anno, input_shapes, **kwargs)``:

* ``input_shapes[i]`` is the shape of input ``i`` (``None`` allowed, and
  ignored, for a ``?`` slot; a ``?`` slot's shape is ignored in any case).
* ``*`` expands to the dimensions the shape has beyond the annotation's other
  dimensions; every ``*`` must expand to the same sizes.
* A group ``(h d)`` binds the product of its identifiers to the tensor
  dimension. Its identifiers' sizes come from keyword arguments of the same
  name, from ``anno.sizes``, from numbers, or from elsewhere in the
  annotation; exactly one may be left unknown and is inferred (it must divide).
* Keyword arguments must name identifiers of the annotation and be positive
  integers; they are checked like any other binding.

Every inconsistency raises :class:`AnnotationError`, e.g. ``annotation "m k+,
k+ n -> m n": identifier "k" is 5 (input 0 dim 1) but 6 (input 1 dim 0)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fastpipe.builder.dimops.errors import AnnotationError, anno_error
from fastpipe.builder.dimops.grammar import Annotation, Dim, TensorAnno, format_annotation, parse

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Bindings:
    """What :func:`bind` found: ``sizes`` per name, ``star`` (the sizes ``*``
    expands to, ``None`` if the annotation has no ``*``)."""

    sizes: dict
    star: Shape | None

    def dim_size(self, dim: Dim) -> int:
        """Size of a non-``*`` dimension (product of a group)."""
        return math.prod(int(i.name) if i.is_number else self.sizes[i.name] for i in dim.idents)

    def expand(self, tensor: TensorAnno) -> list[Dim | None]:
        """The tensor's dimensions with ``*`` expanded: one entry per real
        dimension, ``None`` for each dimension that ``*`` covers."""
        out: list[Dim | None] = []
        for d in tensor.dims:
            if d.is_star:
                out.extend([None] * len(self.star or ()))
            else:
                out.append(d)
        return out

    def shape_of(self, tensor: TensorAnno) -> Shape:
        shape: list[int] = []
        for d in tensor.dims:
            shape.extend((self.star or ()) if d.is_star else (self.dim_size(d),))
        return tuple(shape)


def _as_shape(shape: object, where: str, text: str) -> Shape:
    try:
        dims = tuple(shape)  # torch.Size, list, tuple
    except TypeError:
        raise anno_error(text, f"{where}: expected a shape (a sequence of ints), found {shape!r}") from None
    for s in dims:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise anno_error(text, f"{where}: expected a shape of non-negative ints, found {list(dims)!r}")
    return dims


def bind(anno: Annotation | str, input_shapes, /, **kwargs) -> Bindings:
    """Bind every identifier of ``anno`` to a size (see the module docstring)."""
    anno = parse(anno)
    text = format_annotation(anno)
    shapes = list(input_shapes)
    if len(shapes) != len(anno.inputs):
        raise anno_error(text, f"expected {len(anno.inputs)} input shapes, found {len(shapes)}")
    names = set(anno.reductions())

    sizes: dict[str, int] = {}
    source: dict[str, str] = {}

    def put(name: str, size: int, where: str) -> None:
        if name in sizes:
            if sizes[name] != size:
                raise anno_error(text, f'identifier "{name}" is {sizes[name]} ({source[name]}) but {size} ({where})')
            return
        sizes[name], source[name] = size, where

    given = dict(anno.sizes)
    for k, v in kwargs.items():
        if k in given and given[k] != v:
            raise anno_error(text, f"keyword argument {k}={v!r} disagrees with the annotation's size {k}={given[k]}")
        given[k] = v
    for k, v in given.items():
        if k not in names:
            raise anno_error(text, f'keyword argument "{k}" names no identifier of the annotation')
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise anno_error(text, f"keyword argument {k}: expected a positive int, found {v!r}")
        put(k, v, f"keyword argument {k}={v}")

    star: Shape | None = None
    star_where = ""
    pending: list[tuple[Dim, int, str]] = []
    for idx, (t, shape) in enumerate(zip(anno.inputs, shapes)):
        if t is None:
            continue
        where_t = f"input {idx}"
        if shape is None:
            raise anno_error(text, f"{where_t} is annotated as a tensor but has no shape")
        shape = _as_shape(shape, where_t, text)
        fixed = sum(1 for d in t.dims if not d.is_star)
        if t.has_star:
            if len(shape) < fixed:
                raise anno_error(text, f"{where_t}: expected at least {fixed} dims, found shape {list(shape)}")
        elif len(shape) != fixed:
            raise anno_error(text, f"{where_t}: expected {fixed} dims, found shape {list(shape)}")
        pos = 0
        for d in t.dims:
            if d.is_star:
                n_star = len(shape) - fixed
                got = shape[pos:pos + n_star]
                if star is None:
                    star, star_where = got, f"{where_t} dims {pos}..{pos + n_star - 1}"
                elif got != star:
                    raise anno_error(text, f"'*' is {list(star)} ({star_where}) but {list(got)} ({where_t} dims {pos}..{pos + n_star - 1})")
                pos += n_star
                continue
            where = f"{where_t} dim {pos}"
            size = shape[pos]
            if d.is_group:
                pending.append((d, size, where))
            else:
                i = d.idents[0]
                if i.is_number:
                    if int(i.name) != size:
                        raise anno_error(text, f"{where}: expected {i.name} (a fixed size), found {size}")
                else:
                    put(i.name, size, where)
            pos += 1

    _solve_groups(pending, sizes, put, text)
    # Every name is now bound: names appear in inputs (outputs' names too, by
    # the grammar), and a group that could not be resolved raised above.
    return Bindings(sizes, star)


def _solve_groups(pending, sizes, put, text) -> None:
    """Resolve group constraints until none is left; each pass must bind at
    least one unknown (a group with one unknown identifier fixes it)."""
    while pending:
        left = []
        for d, size, where in pending:
            known, unknown = 1, []
            for i in d.idents:
                if i.is_number:
                    known *= int(i.name)
                elif i.name in sizes:
                    known *= sizes[i.name]
                else:
                    unknown.append(i.name)
            group = "(" + " ".join(i.name for i in d.idents) + ")"
            if not unknown:
                if known != size:
                    raise anno_error(text, f"{where}: group {group} is {known} but the dimension is {size}")
            elif len(unknown) == 1:
                if known == 0 or size % known:
                    raise anno_error(text, f"{where}: group {group} cannot be {size} (not a multiple of the known part {known})")
                put(unknown[0], size // known, f"{where}, group {group}")
            else:
                left.append((d, size, where))
        if len(left) == len(pending):
            d, size, where = left[0]
            group = "(" + " ".join(i.name for i in d.idents) + ")"
            unknown = [i.name for i in d.idents if not i.is_number and i.name not in sizes]
            raise anno_error(
                text,
                f"{where}: group {group} has unknown sizes {', '.join(unknown)}; give all but one as keyword "
                f"arguments (e.g. {unknown[0]}=...)",
            )
        pending = left


def infer_shapes(anno: Annotation | str, input_shapes, /, **kwargs) -> list[Shape]:
    """The output shapes of ``anno`` for these input shapes (see module docstring)."""
    anno = parse(anno)
    b = bind(anno, input_shapes, **kwargs)
    return [b.shape_of(t) for t in anno.outputs]


__all__ = ["Bindings", "bind", "infer_shapes", "AnnotationError"]
