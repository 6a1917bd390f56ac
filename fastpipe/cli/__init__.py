"""The `fastpipe` command line; `fastpipe.cli.main(argv)` runs it (exit status returned)."""
from fastpipe.cli.main import main

__all__ = ["main"]
