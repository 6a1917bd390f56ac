"""fastpipe: load and run split model pipelines (pipeline.json)."""
from fastpipe.errors import FastpipeError

__version__ = "0.1.0"

__all__ = ["FastpipeError", "__version__"]
