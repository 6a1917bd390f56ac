"""The `fastpipe` command line; `fastpipe.cli.main(argv)` runs it (exit status returned)."""
from fastpipe.cli.main import entry, main

__all__ = ["entry", "main"]
