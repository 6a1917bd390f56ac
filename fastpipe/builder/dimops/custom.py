"""``@dimop(annotation)``: register a custom op together with its annotation.

On a Python function it defines a torch custom op (``torch.library.custom_op``
as ``"<namespace>::<name>"``, namespace ``"fastpipe_user"`` and the function's
name by default; the function needs the type hints custom_op requires),
registers a fake (meta) kernel that produces outputs of the shapes the
annotation infers (dtype and device of the first tensor input; pass
``fake=`` for anything else), and records the annotation, so that
``annotation_for(op, args, kwargs)`` and :func:`split` work on its calls.
It returns the custom op (call it like the function; ``op._opoverload`` is
what FX graphs hold).

Group sizes: an ``int`` argument of the op whose name is an identifier used
in a group of the annotation gives that identifier's size, e.g.::

    @dimop("b s (h d) -> b h s d")
    def heads(x: torch.Tensor, h: int) -> torch.Tensor:
        ...

Applied to an existing op (an ``OpOverload``, a packet, a
``torch.library.custom_op`` object) it only records the annotation and
returns the op unchanged: ``dimop("a b -> b a")(torch.ops.aten.t.default)``.

``annotation`` may also be a factory ``fn(*args, **kwargs) -> str`` (see the
registry), called with each call's arguments.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

from fastpipe.builder.dimops.errors import AnnotationError
from fastpipe.builder.dimops.grammar import Annotation, parse
from fastpipe.builder.dimops.infer import infer_shapes
from fastpipe.builder.dimops.registry import annotation_for, input_shapes_for, register_annotation
from fastpipe.torch_compat import OpOverload, OpOverloadPacket

DEFAULT_NAMESPACE = "fastpipe_user"


def _is_torch_op(obj: object) -> bool:
    return isinstance(obj, (OpOverload, OpOverloadPacket)) or isinstance(getattr(obj, "_opoverload", None), OpOverload)


def _group_names(anno: Annotation) -> set[str]:
    return {
        i.name
        for t in anno.inputs + anno.outputs
        if t is not None
        for d in t.dims
        if d.is_group
        for i in d.idents
        if i.is_name
    }


def dimop(
    annotation: str | Annotation | Callable[..., object],
    *,
    namespace: str = DEFAULT_NAMESPACE,
    name: str | None = None,
    mutates_args=(),
    device_types=None,
    fake: Callable[..., object] | None = None,
):
    """Decorator: see the module docstring."""
    static = None
    if isinstance(annotation, (str, Annotation)):
        static = parse(annotation)  # a malformed annotation fails at decoration time
    elif not callable(annotation):
        raise AnnotationError(f"dimop: expected an annotation string or a factory, found {annotation!r}")

    def decorate(target):
        if _is_torch_op(target):
            register_annotation(target, annotation if static is None else static)
            return target
        if not callable(target):
            raise AnnotationError(f"dimop: expected a function or a torch op to decorate, found {target!r}")
        opname = name or target.__name__
        if not namespace.isidentifier() or not opname.isidentifier():
            raise AnnotationError(f'dimop: "{namespace}::{opname}": namespace and name must be identifiers')
        op = torch.library.custom_op(f"{namespace}::{opname}", target, mutates_args=mutates_args, device_types=device_types)
        sig = inspect.signature(target)

        def factory(*args, **kwargs):
            anno = static if static is not None else annotation(*args, **kwargs)
            if anno is None:
                return None
            anno = parse(anno)
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            groups = _group_names(anno)
            sizes = {
                k: v
                for k, v in bound.arguments.items()
                if k in groups and isinstance(v, int) and not isinstance(v, bool)
            }
            return anno.with_sizes(**{**dict(anno.sizes), **sizes}) if sizes else anno

        register_annotation(op, factory)
        op.register_fake(fake if fake is not None else _fake_kernel(op))
        return op

    return decorate


def _fake_kernel(op):
    returns = op._opoverload._schema.returns
    single = len(returns) == 1 and str(returns[0].type) == "Tensor"

    def fake_impl(*args, **kwargs):
        anno = annotation_for(op, args, kwargs)
        if anno is None:
            raise AnnotationError(f"{op._opoverload}: its annotation factory gave no annotation for this call")
        shapes = infer_shapes(anno, input_shapes_for(anno, op, args, kwargs))
        like = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if like is None:
            raise AnnotationError(f"{op._opoverload}: no tensor input to take dtype/device from; pass dimop(..., fake=fn)")
        outs = [like.new_empty(s) for s in shapes]
        return outs[0] if single else tuple(outs)

    return fake_impl


__all__ = ["dimop", "DEFAULT_NAMESPACE"]
