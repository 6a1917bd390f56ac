"""fastpipe: load and run split model pipelines (pipeline.json).

    sess = fastpipe.load("pipeline.json", device_map=None)
    outs = sess.run({"x0": tensor, ...})
"""
from fastpipe.compute_handlers import register_compute_handler, unregister_compute_handler
from fastpipe.errors import BuildError, FastpipeError

__version__ = "0.1.0"


def load(*args, **kwargs):
    """Load, validate and bind a pipeline; see fastpipe.session.load."""
    from fastpipe.session import load as _load

    return _load(*args, **kwargs)


def build(model, example_inputs=None, **kwargs):
    """Split a model into a tensor-/pipeline-parallel pipeline; returns a Built (``.pipeline``, ``.save(dir)``).

    ``model`` is an ``nn.Module`` (with ``example_inputs`` and a ``plan``; see fastpipe.builder.api.build)
    or the path of a local Hugging Face checkpoint folder (see fastpipe.builder.hf.build.build_hf).
    """
    import os

    if isinstance(model, (str, os.PathLike)):
        from fastpipe.builder.hf.build import build_hf

        if example_inputs is not None:
            raise BuildError("build(path, ...): example_inputs are for nn.Module models; give batch= and seq_len=")
        return build_hf(model, **kwargs)
    from fastpipe.builder.api import build as _build

    return _build(model, example_inputs, **kwargs)


__all__ = ["FastpipeError", "build", "load", "register_compute_handler", "unregister_compute_handler", "__version__"]
