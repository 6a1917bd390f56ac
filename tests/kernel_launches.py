"""A stand-in for a Triton kernel in tests: records the grid of each launch, then launches."""


class Launches:
    """Replaces a module's kernel (monkeypatch): ``kernel[grid](...)`` appends ``grid`` to ``grids`` and
    launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]
