"""The one error class of :mod:`fastpipe.builder.dimops`.

Every refusal (a malformed annotation, shapes that disagree with one, a split
that is not allowed, an op call that does not match its annotation) raises
:class:`AnnotationError`, a :class:`fastpipe.errors.BuildError` (so an InvalidInput, exit 2),
with a one-line message that starts ``annotation "<text>": `` where an
annotation is involved.
"""
from __future__ import annotations

from fastpipe.errors import BuildError


class AnnotationError(BuildError):
    """A dimension annotation, or its use, is invalid (one-line message)."""


def anno_error(text: str, message: str) -> AnnotationError:
    """``AnnotationError(f'annotation "{text}": {message}')``."""
    return AnnotationError(f'annotation "{text}": {message}')
