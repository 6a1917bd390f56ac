"""One comparison of computed tensors with their expected values, for tests/ and bench/.

    from tests.tensor_compare import assert_close, error_ratio, tolerance

``assert_close(actual, expected, mag)`` passes when, element by element,

    |actual - expected| <= rtol * |expected| + atol * mag

computed in float64. ``mag`` is the scale of the accumulation error: for a matmul
``sum_k a[m, k] * b[k, n]`` it is ``|a| @ |b|`` (the classic float error bound is
K * u * mag). Without ``mag`` (None) ``atol`` is absolute; a whole-tensor relative bound
(``max |err| <= r * max |expected|``, as the model-level tests use) is
``rtol=0, atol=r * expected.abs().max()``. A pure elementwise relative test would not do:
sums of random products cancel, and an element near 0 has an arbitrarily large relative
error from a tiny absolute one.

Per-dtype tolerances (``tolerance(dtype)``), for results accumulated in float32 and rounded
once to the output dtype, with ``mag`` given. Measured on the kernel tests' shapes
(Triton interpreter, numpy fp32 dots): the float32 accumulation error is <= 1.7e-7 * mag;
beyond that, a 16-bit output carries its one final rounding: fp16 at most half an ulp,
2^-11 = 4.9e-4 relative; bf16 at most ONE ulp, 2^-7 = 7.8e-3, because the interpreter casts
fp32 -> bf16 by truncation (a GPU rounds to nearest: half that). Chosen:

    float32   rtol 1e-5    atol 2e-6 * mag   (10x the measured accumulation error)
    float16   rtol 1e-3    atol 1e-6 * mag   (2x half an ulp)
    bfloat16  rtol 1.6e-2  atol 1e-6 * mag   (2x the interpreter's one-ulp truncation)

A failure names what was compared, how many elements are off, the tolerance and the first
few offending elements with their values.
"""
from __future__ import annotations

import torch

TOLERANCES = {
    torch.float64: (1e-12, 1e-15),
    torch.float32: (1e-5, 2e-6),
    torch.float16: (1e-3, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-6),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for results of this dtype accumulated in float32 (atol scales ``mag``)."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no default tolerance for {dtype}; give rtol= and atol=") from None


def _allowed(expected: torch.Tensor, mag: torch.Tensor | None, rtol: float, atol: float,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    e = expected.to(device=device, dtype=torch.float64)
    scale = 1.0 if mag is None else mag.to(device=device, dtype=torch.float64)
    return e, rtol * e.abs() + atol * scale


def error_ratio(actual: torch.Tensor, expected: torch.Tensor, mag: torch.Tensor | None = None, *,
                rtol: float, atol: float) -> float:
    """max(|actual - expected| / allowed) over all elements: <= 1 passes; inf if ``actual`` is not finite."""
    if not torch.isfinite(actual).all():
        return float("inf")
    if actual.numel() == 0:
        return 0.0
    e, allowed = _allowed(expected, mag, rtol, atol, actual.device)
    err = (actual.double() - e).abs()
    return (err / (allowed + 1e-300)).max().item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, mag: torch.Tensor | None = None, *,
                 rtol: float | None = None, atol: float | None = None, dtype: torch.dtype | None = None,
                 what: str = "output") -> None:
    """Assert ``actual`` matches ``expected`` (see the module docstring); ``dtype`` is the dtype
    ``actual`` must have (default: keep whatever it is). rtol/atol default to ``tolerance(dtype
    of actual)``."""
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if dtype is not None:
        assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype}"
    if rtol is None or atol is None:
        r, a = tolerance(actual.dtype)
        rtol, atol = (r if rtol is None else rtol), (a if atol is None else atol)
    finite = torch.isfinite(actual)
    assert finite.all(), f"{what}: {(~finite).sum().item()} of {actual.numel()} elements are not finite"
    e, allowed = _allowed(expected, mag, rtol, atol, actual.device)
    err = (actual.double() - e).abs()
    bad = err > allowed
    if bad.any():
        idx = [tuple(i) for i in bad.nonzero()[:8].tolist()]
        rows = "; ".join(f"{i}: got {actual[i].item():.6g}, expected {e[i].item():.6g}, "
                         f"|err| {err[i].item():.3g} > {allowed[i].item():.3g}" for i in idx)
        scale = "" if mag is None else " * mag"
        raise AssertionError(f"{what}: {bad.sum().item()} of {actual.numel()} elements mismatch "
                             f"(rtol {rtol}, atol {atol}{scale}); first: {rows}")
