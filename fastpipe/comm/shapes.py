"""Re-exports :func:`fastpipe.format.comm_shapes.comm_output_shape`: each comm kind's
output shape is a rule of the format, kept there so the validator needs no comm code."""
from fastpipe.format.comm_shapes import comm_output_shape

__all__ = ["comm_output_shape"]
