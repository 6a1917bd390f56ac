"""fastpipe: load and run split model pipelines (pipeline.json).

    sess = fastpipe.load("pipeline.json", device_map=None)
    outs = sess.run({"x0": tensor, ...})
"""
from fastpipe.compute_handlers import register_compute_handler, unregister_compute_handler
from fastpipe.errors import FastpipeError

__version__ = "0.1.0"


def load(*args, **kwargs):
    """Load, validate and bind a pipeline; see fastpipe.session.load."""
    from fastpipe.session import load as _load

    return _load(*args, **kwargs)


__all__ = ["FastpipeError", "load", "register_compute_handler", "unregister_compute_handler", "__version__"]
