"""Open a parameter file of one format, describe its tensors, read slices.

Each opened file answers ``stored(name, where)`` from metadata alone (dtype and
shape, or None if the name is absent) and ``read(name, placements, where)``
returns the slice. Everything that can go wrong becomes a one-line ParamError.

Slices are returned as they come from the format (views where possible);
the store then applies its contiguity policy.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from fastpipe.dtypes import SAFETENSORS_TO_TORCH
from fastpipe.errors import ParamError

from .checks import Placements, dtype_label
from .safetensors_header import CorruptHeader, Header, read_header

ZIP_MAGIC = b"PK\x03\x04"


class Stored(NamedTuple):
    dtype: torch.dtype | None      # None: a dtype torch cannot represent
    dtype_label: str
    shape: tuple[int, ...]


def one_line(e: BaseException | str, limit: int = 300) -> str:
    """``e`` as one line of at most ``limit`` characters, without torch's zip-reader boilerplate."""
    text = " ".join(str(e).split()) or type(e).__name__
    text = text.split(" This is an internal miniz error.")[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _index(placements: Placements) -> tuple[slice, ...]:
    return tuple(slice(s, e) for s, e in placements)


class SafetensorsFile:
    """A safetensors file: our bounds-checked header plus one ``safe_open`` handle.

    ``safe_open(...).get_slice(name)[...]`` reads only the slice's bytes (with
    safetensors >= 0.6 it is a view into a private, copy-on-write mmap of the
    file, so pages are read when first touched).
    """

    kind = "safetensors file"

    def __init__(self, path: Path, size: int, *, where: str):
        self.label = f"'{path.name}'"
        try:
            self.header: Header = read_header(path, size)
        except CorruptHeader as e:
            raise ParamError(f"{where}.path: corrupt safetensors file {self.label}: {e}") from None
        except OSError as e:
            raise ParamError(f"{where}.path: cannot read safetensors file {self.label}: {e.strerror or e}") from None
        try:
            self.handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001 - the library's own refusal, whatever its type
            raise ParamError(f"{where}.path: corrupt safetensors file {self.label}: {one_line(e)}") from None

    def names(self) -> list[str]:
        return sorted(self.header.tensors)

    def stored(self, name: str, *, where: str) -> Stored | None:
        entry = self.header.tensors.get(name)
        if entry is None:
            return None
        dtype = SAFETENSORS_TO_TORCH.get(entry.dtype)
        return Stored(dtype, dtype_label(dtype) if dtype is not None else entry.dtype, entry.shape)

    def read(self, name: str, placements: Placements, *, where: str) -> torch.Tensor:
        try:
            return self.handle.get_slice(name)[_index(placements)]
        except Exception as e:  # noqa: BLE001
            raise ParamError(f"{where}.path: cannot read tensor {name!r} from safetensors file {self.label}: "
                             f"{one_line(e)}") from None


def _lookup(d: Mapping, name: str):
    """``d[name]``, or a dotted walk into nested dicts: ``model.layer.w`` finds
    ``d["model"]["layer.w"]`` (and ``d["model"]["layer"]["w"]``)."""
    if name in d:
        return d[name]
    for k, v in d.items():
        if isinstance(k, str) and isinstance(v, Mapping) and name.startswith(k + "."):
            found = _lookup(v, name[len(k) + 1:])
            if found is not None:
                return found
    return None


class TensorDictFile:
    """A file that loads to a (possibly nested) dict of tensors: torch.save, torch.export."""

    kind = "file"

    def __init__(self, path: Path, tensors: Mapping):
        self.label = f"'{path.name}'"
        self.tensors = tensors

    def names(self) -> list[str]:
        return sorted(str(k) for k in self.tensors)

    def _get(self, name: str, where: str) -> torch.Tensor | None:
        v = _lookup(self.tensors, name)
        if v is None:
            return None
        if not isinstance(v, torch.Tensor):
            raise ParamError(f"{where}.name: expected a tensor under {name!r} in {self.kind} {self.label}, "
                             f"found {type(v).__name__}")
        if v.layout != torch.strided or v.is_quantized or v.device.type != "cpu":
            raise ParamError(f"{where}.name: expected a dense CPU tensor under {name!r} in {self.kind} "
                             f"{self.label}, found layout {v.layout} on {v.device}")
        return v

    def stored(self, name: str, *, where: str) -> Stored | None:
        v = self._get(name, where)
        return None if v is None else Stored(v.dtype, dtype_label(v.dtype), tuple(v.shape))

    def read(self, name: str, placements: Placements, *, where: str) -> torch.Tensor:
        v = self._get(name, where)
        return v.detach()[_index(placements)]


class TorchSaveFile(TensorDictFile):
    """``torch.load(weights_only=True, map_location="cpu")``; memory-mapped (lazy)
    for zip files, fully read for legacy (non-zip) files, which cannot be mmapped."""

    kind = "torch.save file"

    def __init__(self, path: Path, size: int, *, where: str):
        label = f"'{path.name}'"
        try:
            with open(path, "rb") as f:
                is_zip = f.read(4) == ZIP_MAGIC
            obj = torch.load(str(path), weights_only=True, mmap=is_zip, map_location="cpu")
        except pickle.UnpicklingError as e:
            if "Weights only load failed" not in str(e):  # a damaged pickle, not a refused one
                raise ParamError(f"{where}.path: corrupt torch.save file {label}: {one_line(e)}") from None
            raise ParamError(f"{where}.path: expected a torch.save file of plain tensors (weights_only=True), "
                             f"found objects it refuses to unpickle in {label}: {_weights_only_reason(e)}") from None
        except Exception as e:  # noqa: BLE001 - corrupt zip, bad pickle, I/O: all the same to the user
            raise ParamError(f"{where}.path: corrupt torch.save file {label}: {one_line(e)}") from None
        if not isinstance(obj, Mapping):
            raise ParamError(f"{where}.path: expected a torch.save file holding a dict of tensors, "
                             f"found {type(obj).__name__} in {label}")
        super().__init__(path, obj)


def _weights_only_reason(e: BaseException) -> str:
    """The informative part of torch's long weights_only message (which global it
    refused), without its advice to retry unsafely or to allowlist the global."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if "WeightsUnpickler error:" in ln:
            reason = ln.split("WeightsUnpickler error:", 1)[1].strip()
            return one_line(reason.split(" Please use ")[0], 200)
    for ln in lines:
        if not ln.startswith(("Weights only load failed", "Check the documentation", "(1)", "(2)", "Please ")):
            return one_line(ln, 200)
    return one_line(text, 200)


class ExportFile(TensorDictFile):
    """A torch.export archive (.pt2): ``ep.state_dict`` then ``ep.constants``.
    Only opened when the caller trusts it (its loader can unpickle)."""

    kind = "torch.export archive"

    def __init__(self, path: Path, size: int, *, where: str):
        label = f"'{path.name}'"
        with _captured("torch.export") as logged:
            try:
                if path.suffix == ".pt2":
                    ep = torch.export.load(str(path))
                else:  # torch.export.load insists on the suffix for paths, not for open files
                    with open(path, "rb") as f:
                        ep = torch.export.load(f)
                tensors = dict(ep.constants)
                tensors.update(ep.state_dict)
            except Exception as e:  # noqa: BLE001
                reason = one_line(e)
                if logged and "warnings above" in reason:
                    reason = one_line(logged[0])
                raise ParamError(f"{where}.path: corrupt torch.export archive {label}: {reason}") from None
        super().__init__(path, tensors)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                message = one_line(record.exc_info[1])  # "error when deserializing" + traceback: keep the error
            self.messages.append(message)
        except Exception:  # noqa: BLE001
            pass


@contextlib.contextmanager
def _captured(logger_name: str):
    """Collect (instead of printing) what ``logger_name`` and its children log in the block:
    torch.export logs tracebacks and hints before raising; our error says it in one line."""
    logger = logging.getLogger(logger_name)
    handler, saved, propagate = _Capture(), logger.handlers, logger.propagate
    logger.handlers = [handler]  # torch attaches its own stderr handler to this logger
    logger.propagate = False
    try:
        yield handler.messages
    finally:
        logger.handlers = saved
        logger.propagate = propagate


OPENERS = {"safetensors": SafetensorsFile, "torch.save": TorchSaveFile, "torch.export": ExportFile}
