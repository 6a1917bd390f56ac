"""fastpipe.kernels: Triton kernels, each beside its torch reference and launcher.

The package is installed as ``fastpipe.kernels`` (see pyproject.toml). The
fused matmul/collective kernels land with the kernel issue.
"""
