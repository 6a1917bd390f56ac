"""Test helpers for the Triton kernels: a stand-in that records each launch's grid, and a launch replayed
from a captured CUDA graph (the runtime's way)."""


class Launches:
    """Replaces a module's kernel (monkeypatch): ``kernel[grid](...)`` appends ``grid`` to ``grids`` and
    launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def replayed(launch):
    """``launch()`` (returning a list of tensors) captured in a CUDA graph, after one warm-up off the
    capture, then replayed once into outputs zeroed first: the replay's outputs (a CUDA device needed)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()                                                # compile and warm up off the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = launch()
    for x in captured:
        x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return captured
