"""The one place that touches private torch APIs (torch 2.11 - 2.13).

``make_graph_module`` builds a GraphModule without generating and exec-ing
its Python code yet. torch.fx compiles a GraphModule's ``forward`` by
generating source from the graph and calling ``exec`` on it; with the lazy
variant that happens on the first call (or ``.code`` access), not while a
payload is decoded. The generated code comes from a graph whose targets,
names and constants decoding has validated; nothing from the file is
executed as code either way.
"""
from __future__ import annotations

import torch

try:  # private since torch 2.3; present in 2.11 - 2.13
    from torch.fx._lazy_graph_module import _LazyGraphModule as _Lazy
except ImportError:  # pragma: no cover - fallback for a torch without it
    _Lazy = None


def make_graph_module(root: torch.nn.Module, graph: torch.fx.Graph, class_name: str) -> torch.fx.GraphModule:
    if _Lazy is not None:
        return _Lazy(root, graph, class_name)
    return torch.fx.GraphModule(root, graph, class_name)  # pragma: no cover
