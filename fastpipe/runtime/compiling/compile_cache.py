"""Where compiled graphs persist between processes: inductor's caches in a per-torch-version folder.

    folder = use_persistent_cache()   # before the first compile; idempotent

torch.compile keeps what it compiled (the FX-graph cache: generated code and built kernels; the
AOTAutograd cache) under TORCHINDUCTOR_CACHE_DIR, by default in /tmp/torchinductor_<user>, which a
reboot or a tmp cleaner empties. fastpipe points it at a folder that lasts:

    $FASTPIPE_CACHE_DIR, else $XDG_CACHE_HOME/fastpipe, else ~/.cache/fastpipe
        + /torch-<torch version>/inductor

so that a second process on the same machine reuses the first one's compiled regions (the compile of
a region it has seen becomes a cache hit: loading the built code, not generating and building it).
Staleness: inductor keys every entry by the graph's code, its inputs' shapes, strides and dtypes,
its config and the torch build, so a changed pipeline (another graph, other shapes) misses rather
than reuses; the folder per torch version keeps versions apart on disk as well. A TORCHINDUCTOR_CACHE_DIR
the user set is left alone (one equal to inductor's default, which importing torch._dynamo writes
there, is not the user's), and so is a folder that cannot be created (a warning says so; inductor's
default is used). Dynamo's tracing is not cached: a second process still traces each graph (a
fraction of the compile time), then hits the cache.
"""
from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch

_LOCK = threading.Lock()


def persistent_cache_dir() -> Path:
    root = os.environ.get("FASTPIPE_CACHE_DIR")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "fastpipe"
    version = torch.__version__.replace("+", "_")
    return base / f"torch-{version}" / "inductor"


def use_persistent_cache() -> str:
    """Point inductor's cache at persistent_cache_dir() unless TORCHINDUCTOR_CACHE_DIR is set already.
    Returns the folder inductor will use."""
    from fastpipe.torch_compat import inductor_default_cache_dir

    with _LOCK:
        given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        # importing torch._dynamo writes inductor's default there: only another value is the user's choice
        if given and os.path.abspath(given) != inductor_default_cache_dir():
            return given
        folder = persistent_cache_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            warnings.warn(f"fastpipe: cannot create the compile cache folder {folder} ({e}); compiled graphs are "
                          "cached in inductor's default folder", RuntimeWarning, stacklevel=2)
            return ""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
        return str(folder)
