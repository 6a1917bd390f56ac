"""Checks shared by the tables that GPU runs write and fastpipe.kernels reads (tuned.py's launch
configs, fusion_rule.py's fused-vs-unfused points): a ``{"format": 1, "<list>": [...]}`` document
whose entries are objects; every error names the field by its JSON path. ``read_cached`` reads one
such file once per version (path, mtime, size) and reports a bad one once."""
from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

_lock = threading.Lock()
_cache: dict[tuple, tuple] = {}          # (path, mtime_ns, size, parse) -> (value, error)
_warned: set[tuple] = set()


def read_cached(path: Path, parse, default, what: str, then: str):
    """parse(the file's JSON, str(path)) -- cached until the file changes -- or ``default`` where there is
    no file, or where it cannot be read or parse raises ValueError: then a RuntimeWarning, once per file
    version and parse, says "fastpipe: <what> not used: <error>; <then>"."""
    try:
        st = path.stat()
    except OSError:
        return default
    key = (str(path), st.st_mtime_ns, st.st_size, parse)
    with _lock:
        hit = _cache.get(key)
    if hit is None:
        try:
            hit = (parse(json.loads(path.read_text()), str(path)), None)
        except (OSError, ValueError) as e:            # json.JSONDecodeError is a ValueError
            hit = (default, " ".join(str(e).split())[:300])
        with _lock:
            _cache[key] = hit
    value, error = hit
    if error is not None:
        with _lock:
            first = key not in _warned
            _warned.add(key)
        if first:
            warnings.warn(f"fastpipe: {what} not used: {error}; {then}", RuntimeWarning, stacklevel=4)
    return value


def entries(doc, where: str, key: str, fields: tuple[str, ...]):
    """Yield (JSON path, entry) for each entry of ``doc[key]``, each checked to be an object with `fields`."""
    if not isinstance(doc, dict) or doc.get("format") != 1 or not isinstance(doc.get(key), list):
        raise ValueError(f"{where}: expected {{\"format\": 1, \"{key}\": [...]}}, found {str(doc)[:80]}")
    for i, e in enumerate(doc[key]):
        at = f"{where}: {key}[{i}]"
        if not isinstance(e, dict) or any(f not in e for f in fields):
            raise ValueError(f"{at}: expected an object with {', '.join(fields)}, found {str(e)[:80]}")
        yield at, e


def check_choice(e: dict, at: str, field: str, choices: tuple[str, ...]) -> None:
    if e[field] not in choices:
        raise ValueError(f"{at}.{field}: expected one of {', '.join(choices)}, found {e[field]!r}")


def check_positive_ints(e: dict, at: str, names: tuple[str, ...]) -> None:
    for f in names:
        if isinstance(e[f], bool) or not isinstance(e[f], int) or e[f] < 1:
            raise ValueError(f"{at}.{f}: expected an integer >= 1, found {e[f]!r}")
