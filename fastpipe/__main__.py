from fastpipe.cli import entry

entry()
