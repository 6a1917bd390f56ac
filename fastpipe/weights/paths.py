"""Where a parameter file is, and whether the pipeline may read it.

``resolve_param_path`` turns a ParamValue ``path`` into an absolute, real path
and confines it to the pipeline's folder; ``stat_param_file`` checks that the
result is an existing regular file and returns its ``os.stat`` (whose identity
fields key the weight store's caches).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from fastpipe.errors import ParamError

OUTSIDE_HINT = "(pass --allow-outside-paths to permit)"


def _inside(real: str, base: str) -> bool:
    try:
        return os.path.commonpath([real, base]) == base
    except ValueError:  # different drives (Windows)
        return False


def resolve_param_path(pipeline_dir: Path, raw: str, *, where: str, allow_outside: bool = False) -> Path:
    """Resolve ``raw`` (a ParamValue ``path``) against ``pipeline_dir``.

    Relative paths are relative to the pipeline file's folder. Unless
    ``allow_outside`` is true, absolute paths are refused, and so is any path
    whose real location (after ``..`` and symlinks) is not inside the real
    location of ``pipeline_dir``. Returns the real (absolute, symlink-free)
    path; whether it exists is checked when it is opened.
    """
    field = f"{where}.path"
    if not isinstance(raw, str) or not raw:
        raise ParamError(f"{field}: expected a non-empty relative file path, found {raw!r}")
    if "\x00" in raw:
        raise ParamError(f"{field}: expected a file path without NUL characters, found {raw!r}")
    base = os.path.realpath(os.fspath(pipeline_dir))
    if os.path.isabs(raw):
        if not allow_outside:
            raise ParamError(f"{field}: expected a relative path to a file inside {base} {OUTSIDE_HINT}, found {raw!r}")
        return Path(os.path.realpath(raw))
    real = os.path.realpath(os.path.join(os.fspath(pipeline_dir), raw))
    if not allow_outside and not _inside(real, base):
        lexical = os.path.normpath(os.path.join(base, raw))
        note = "" if lexical == real else f" (resolves to {real})"
        raise ParamError(f"{field}: expected a file inside {base} {OUTSIDE_HINT}, found {raw!r}{note}")
    return Path(real)


def stat_param_file(path: Path, *, where: str) -> os.stat_result:
    """``os.stat(path)``, refusing anything that is not an existing regular file."""
    field = f"{where}.path"
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise ParamError(f"{field}: expected an existing file, found '{path}' (no such file)") from None
    except PermissionError:
        raise ParamError(f"{field}: expected a readable file, found '{path}' (permission denied)") from None
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise ParamError(f"{field}: expected an existing file, found '{path}' ({why})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ParamError(f"{field}: expected a regular file, found a directory '{path}'")
    if not stat.S_ISREG(st.st_mode):
        raise ParamError(f"{field}: expected a regular file, found '{path}' (not a regular file)")
    return st
