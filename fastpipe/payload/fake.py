"""Shape/dtype propagation through a graph under FakeTensorMode (no real compute).

Runs the graph node by node with ``torch.fx.Interpreter`` (no generated code),
on fake tensors built from (shape, dtype, stride, device) descriptions.
Constants (``get_attr``) are replaced by fakes of the same shape and dtype,
so unbound external constants work too.
"""
from __future__ import annotations

from typing import Any, Sequence

import contextlib
import logging
import torch

from fastpipe.errors import PayloadError
from fastpipe.payload.decoded import DecodedGraph, TensorMeta
from fastpipe.torch_compat import FAKE_TENSOR_LOGGER, FakeTensorMode

Spec = tuple[tuple[int, ...], torch.dtype, "tuple[int, ...] | None", torch.device]


def _fake(spec: Spec) -> torch.Tensor:
    shape, dtype, stride, device = spec
    if stride is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def spec_of(t: torch.Tensor, device: torch.device | None = None) -> Spec:
    return (tuple(t.shape), t.dtype, tuple(t.stride()), device if device is not None else t.device)


class _FakeInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, constant_device: torch.device | None):
        super().__init__(gm, garbage_collect_values=False)
        self._constant_device = constant_device
        self._constants: dict[str, torch.Tensor] = {}
        self.current: torch.fx.Node | None = None

    def run_node(self, node: torch.fx.Node) -> Any:
        self.current = node
        return super().run_node(node)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target not in self._constants:
            real = self.fetch_attr(target)
            if not isinstance(real, torch.Tensor):
                return real
            device = self._constant_device
            if device is None:
                device = real.device if real.device.type != "meta" else torch.device("cpu")
            self._constants[target] = _fake(spec_of(real, device))
        return self._constants[target]


class FakeRunError(Exception):
    """Propagation failed at ``node`` with ``cause``."""

    def __init__(self, node: torch.fx.Node | None, cause: BaseException):
        super().__init__(str(cause))
        self.node = node
        self.cause = cause


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """torch's fake_tensor logger prints a traceback for an op that fails on fake inputs; the
    failure is ours to report (one line, with the payload path), so keep that logger quiet."""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    old = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = old


def run_fake(
    gm: torch.fx.GraphModule, inputs: Sequence[Spec], constant_device: torch.device | None = None
) -> tuple[Any, dict[torch.fx.Node, Any]]:
    """(graph output, {node: fake value}); raises FakeRunError."""
    interp = _FakeInterpreter(gm, constant_device)
    try:
        with _quiet_fake_tensor_log(), FakeTensorMode(allow_non_fake_inputs=False):
            fakes = [_fake(s) for s in inputs]
            out = interp.run(*fakes)
    except Exception as exc:
        raise FakeRunError(interp.current, exc) from exc
    return out, dict(interp.env)


def propagate_metas(
    decoded: DecodedGraph, input_metas: Sequence[TensorMeta], *, device: str | torch.device = "cpu"
) -> tuple[TensorMeta, ...]:
    """Output metas of ``decoded`` for inputs of ``input_metas`` (fake run, no compute)."""
    where = decoded.where
    placeholders = [n for n in decoded.gm.graph.nodes if n.op == "placeholder"]
    if len(input_metas) != len(placeholders):
        raise PayloadError(f"{where}: inputs: expected {len(placeholders)} input metas, found {len(input_metas)}")
    device = torch.device(device)
    specs = [(tuple(m.shape), m.dtype, None, device) for m in input_metas]
    try:
        out, _values = run_fake(decoded.gm, specs, constant_device=device)
    except FakeRunError as err:
        node = err.node
        place = f"node {node.name!r} ({node.target})" if node is not None else "graph"
        detail = " ".join(f"{type(err.cause).__name__}: {err.cause}".split())[:240]
        raise PayloadError(f"{where}: {place}: expected inputs the graph accepts, found {detail}") from None
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    metas = []
    for i, value in enumerate(outputs):
        if not isinstance(value, torch.Tensor):
            raise PayloadError(f"{where}: outputs[{i}]: expected a tensor, found {type(value).__name__}")
        metas.append(TensorMeta(shape=tuple(int(s) for s in value.shape), dtype=value.dtype))
    return tuple(metas)
