"""One error hierarchy for everything fastpipe refuses or fails at.

Every message is one line. Errors about a file name the place with a JSON path
in SPEC spelling, e.g. ``supertasks["7"].metadata.dim: expected 0 <= dim < 2,
found 3``. The CLI maps ``exit_code`` to its exit status: 2 for anything the
user gave that is invalid (pipeline, param files, payloads, inputs, options),
1 for a valid run that failed or a ``--check`` mismatch.
"""
from __future__ import annotations


class FastpipeError(Exception):
    """Base class. ``str(err)`` is the one-line message."""

    exit_code = 2

    def __init__(self, message: str):
        message = " ".join(str(message).split("\n"))
        super().__init__(message)


class InvalidInput(FastpipeError):
    """Something the user gave is invalid (exit 2)."""


class FormatError(InvalidInput):
    """pipeline.json does not follow the format (types, fields, JSON itself)."""


class ValidationError(InvalidInput):
    """pipeline.json is well formed but breaks a rule (graph, comm groups, metadata)."""


class ParamError(InvalidInput):
    """A parameter file is missing, unsafe, corrupt or disagrees with the pipeline."""


class PayloadError(InvalidInput):
    """A compute supertask's graph payload is malformed or not allowed."""


class InputError(InvalidInput):
    """Run-time inputs (names, shapes, dtypes, devices) or options are wrong."""


class BuildError(InvalidInput, ValueError):
    """The builder (``fastpipe.build``, fastpipe.builder) was given something it cannot build:
    a model, plan, split points, tp/pp, names, a checkpoint's config or options (exit 2).
    Also a ``ValueError``, which is what the builder raised before it had its own class."""


class RunError(FastpipeError):
    """A valid pipeline failed while running (exit 1)."""

    exit_code = 1


class CompileError(RunError):
    """torch.compile or CUDA-graph capture failed and the caller asked for failure, not a warned fallback."""


class CheckMismatch(FastpipeError):
    """``--check`` found outputs that differ from the expected ones (exit 1)."""

    exit_code = 1


def at(path: str, expected: str, found: object, cls: type[FastpipeError] = ValidationError) -> FastpipeError:
    """Build ``cls(f"{path}: expected {expected}, found {found}")``."""
    return cls(f"{path}: expected {expected}, found {found}")


def key_path(base: str, key: str | int) -> str:
    """``key_path('supertasks', '7') -> 'supertasks["7"]'`` (ints render bare: ``inputs[0]``)."""
    if isinstance(key, int):
        return f"{base}[{key}]"
    return f'{base}["{key}"]'


def described(e: BaseException) -> str:
    """An exception as one line: its type, then its message with runs of whitespace made one space."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
