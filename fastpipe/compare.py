"""Compare outputs with expected tensors, with tolerances suited to each dtype."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

# (rtol, atol) per dtype; a split model reassociates sums, so f32 is not bit-exact.
TOLERANCES = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float8_e4m3fn: (1.25e-1, 1e-1),
}


@dataclass(frozen=True)
class Comparison:
    name: str
    max_abs: float
    max_rel: float
    ok: bool
    why: str = ""


def compare(outputs: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
            rtol: float | None = None, atol: float | None = None) -> list[Comparison]:
    rows = []
    for name, exp in expected.items():
        if name not in outputs:
            rows.append(Comparison(name, float("nan"), float("nan"), False, "not an output of the pipeline"))
            continue
        got = outputs[name].detach().cpu()
        if got.shape != exp.shape or got.dtype != exp.dtype:
            rows.append(Comparison(name, float("nan"), float("nan"), False,
                                   f"expected {exp.dtype} {list(exp.shape)}, found {got.dtype} {list(got.shape)}"))
            continue
        if not got.dtype.is_floating_point:
            diff = (got.to(torch.int64) - exp.to(torch.int64)).abs() if got.numel() else torch.zeros(1)
            m = float(diff.max()) if got.numel() else 0.0
            rows.append(Comparison(name, m, m, m == 0))
            continue
        r, a = TOLERANCES.get(got.dtype, (1e-4, 1e-5))
        r, a = rtol if rtol is not None else r, atol if atol is not None else a
        g, e = got.double(), exp.double()
        if got.numel() == 0:
            rows.append(Comparison(name, 0.0, 0.0, True))
            continue
        diff = (g - e).abs()
        finite = torch.isfinite(g) == torch.isfinite(e)
        same_nonfinite = torch.where(torch.isfinite(e), torch.ones_like(diff, dtype=torch.bool), (g == e) | (g.isnan() & e.isnan()))
        diff = torch.where(torch.isfinite(e) & torch.isfinite(g), diff, torch.zeros_like(diff))
        max_abs = float(diff.max())
        max_rel = float((diff / e.abs().clamp_min(a)).max())
        ok = bool((diff <= a + r * e.abs()).all() and finite.all() and same_nonfinite.all())
        rows.append(Comparison(name, max_abs, max_rel, ok))
    return rows
