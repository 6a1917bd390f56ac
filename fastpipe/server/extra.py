"""The `[serve]` extra, checked: Starlette and uvicorn importable, or one InputError line naming it."""
from __future__ import annotations


def require_extra() -> None:
    """Import Starlette and uvicorn, or raise one InputError line naming the `[serve]` extra."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        from fastpipe.errors import InputError

        raise InputError(f"serve: needs starlette and uvicorn (pip install 'fastpipe[serve]'), found: {e}") from None
