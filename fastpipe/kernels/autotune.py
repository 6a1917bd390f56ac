"""Launch configs tuned on this GPU for the fused-kernel calls a pipeline makes (``fastpipe tune``).

pick_config consults a table of configs measured per GPU and shape (fastpipe.kernels.tuned) before
its heuristic. A table that ``bench/bench_fused_kernels.py --tune`` writes covers the benchmark grid
(N = K 4096 and 8192, n 2 and 4); an entry serves only its own N, K and n. A model's
own shapes (a Llama's hidden 4096 against its MLP's 14336, split n ways) are tuned here:

    calls = recorded calls (fastpipe.kernels.calls.recording, around one run of the pipeline)
    results = [tune(call, kernel_timing.time_config) for call in calls]
    doc, kept = merged_table(base_doc, results)               # -> FASTPIPE_TUNED_CONFIGS

``tune`` times the call under every candidate (``tune_candidates``, the bench's own) and under the
heuristic's config, with the timer it is given (fastpipe.runtime.tuning.kernel_timing's: each a replayed CUDA
graph as the runtime runs it; a call whose capture fails is timed eagerly, and says so). It ranks
them with short runs, times the best and the heuristic's again in full, and checks the best one's
outputs against the heuristic's. ``merged_table`` keeps a config
where it beat the heuristic by more than ``min_gain`` (3%) and its check passed, replacing the
entries of the same key; where the heuristic was as good, an older entry of that key is dropped.
Under the Triton interpreter (CPU tensors: the tests) the candidates are interpreter-sized and the
timings meaningless.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from fastpipe.kernels.calls import KernelCall
from fastpipe.kernels.launch_config import KernelConfig, outputs_per_launch

MIN_GAIN = 0.03


def tune_candidates(M: int, N: int, dtype: torch.dtype, smoke: bool, launcher: str = "mm_sum",
                    sms: int = 132, tma: bool = False, n: int = 1) -> list[KernelConfig]:
    """The configs a tuning times (``fastpipe tune``; ``bench/bench_fused_kernels.py --tune``): block_m
    around M's power of two (16..128), block_n 64/128/256 (not past N), block_k 64/128, (4 warps, 4 stages) or (8 warps, 3 stages); at most ~200 KiB of shared
    memory (an H100 has 227 KiB a block) and at most 128 fp32 accumulators a thread (128x256 on 4
    warps needs 256 and spills kilobytes of registers on sm_90: scripts/compile_kernels.py
    --tune-candidates). Also split-K (``split_k_candidates``) where a config's tiles would leave most of
    the GPU's ``sms`` SMs idle (gather_rows, gather_cols: the tiles of its ``n`` outputs together, one launch); with
    ``tma`` (a GPU of compute capability 9.0 or newer) the persistent TMA kernel (``tma_candidates``).
    smoke: interpreter-sized ones (one split-K; with ``tma`` one TMA)."""
    if smoke:
        tiny = KernelConfig(16, 16, 16, group_m=4, num_warps=4, num_stages=1)
        small = [tiny, dataclasses.replace(tiny, block_m=32, block_n=32, block_k=32)]
        return small + [dataclasses.replace(tiny, split_k=2)] + ([dataclasses.replace(tiny, tma=True)] if tma else [])
    p = 16
    while p < M and p < 128:
        p *= 2
    bms = sorted({max(16, p // 2), p, min(128, p * 2)})
    elt = torch.finfo(dtype).bits // 8
    out = []
    for bm in bms:
        for bn in (64, 128, 256):
            if bn > max(64, N):
                continue
            for bk in (64, 128):
                for warps, stages in ((4, 4), (8, 3)):
                    if stages * (bm * bk + bk * bn) * elt > 200 * 1024 or bm * bn > 128 * 32 * warps:
                        continue
                    out.append(KernelConfig(bm, bn, bk, group_m=8, num_warps=warps, num_stages=stages))
    split = split_k_candidates(M, N, out, sms, outputs=outputs_per_launch(launcher, n))
    return out + split + (tma_candidates(out) if tma else [])


def tma_candidates(configs: list[KernelConfig]) -> list[KernelConfig]:
    """The persistent TMA kernels (``fastpipe.kernels.mm_sum_tma``, ``gather_rows_tma``) with the tiles of
    those configs that have at least 64 rows and 8 warps and 3 stages: Hopper's warpgroup MMA takes 64 rows
    at a time, and TMA loads need no registers, so the deeper 4-warp pipelines add little but compile time."""
    return [dataclasses.replace(c, tma=True) for c in configs
            if c.block_m >= 64 and (c.num_warps, c.num_stages) == (8, 3)]


def split_k_candidates(M: int, N: int, configs: list[KernelConfig], sms: int, outputs: int = 1) -> list[KernelConfig]:
    """Split-K versions of those block_k 64 configs whose ``outputs`` M x N outputs (one launch) have at most
    half as many tiles as the GPU has SMs: split_k the power of two (2..16) that brings tiles x split_k
    nearest to ``sms``."""
    out = []
    for c in configs:
        tiles = outputs * -(-M // c.block_m) * -(-N // c.block_n)
        if c.block_k != 64 or 2 * tiles > sms:
            continue
        sk = min((2 ** e for e in range(1, 5)), key=lambda k: abs(math.log2(tiles * k / sms)))
        out.append(dataclasses.replace(c, split_k=sk))
    return out


@dataclass
class Tuned:
    """One call's tuning: the best config and the heuristic's, their times (ms), how they were timed."""

    call: KernelCall
    launcher: str
    M: int
    N: int
    K: int
    n: int
    device: str                      # the GPU's name (torch.cuda.get_device_name), the table's key
    best: KernelConfig
    ms: float
    heuristic: KernelConfig
    heuristic_ms: float
    candidates: int                  # configs that ran
    timing: str                      # "graph" (replays), or "eager: <why the capture failed>"
    check: bool                      # the best config's outputs match the heuristic's
    skipped: list = field(default_factory=list)    # "<config>: <error>" for configs that could not run

    def gain(self) -> float:
        return self.heuristic_ms / self.ms if self.ms > 0 else 1.0

    def kept(self, min_gain: float = MIN_GAIN) -> bool:
        return self.check and self.best != self.heuristic and self.ms < (1 - min_gain) * self.heuristic_ms

    def line(self, min_gain: float = MIN_GAIN) -> str:
        verdict = ("kept" if self.kept(min_gain) else
                   "MISMATCH against the heuristic's outputs: not kept" if not self.check else
                   "the heuristic's config is the fastest" if self.best == self.heuristic else
                   f"within {min_gain:.0%}: the heuristic stays")
        return (f"{self.call.text()}: {self.best.text()} {self.ms:.4f} ms vs the heuristic's {self.heuristic.text()} "
                f"{self.heuristic_ms:.4f} ms ({self.gain():.2f}x, {self.candidates} configs, {self.timing}): {verdict}"
                + (f"; {len(self.skipped)} could not run" if self.skipped else ""))


def candidates_for(call: KernelCall, smoke: bool | None = None) -> list[KernelConfig]:
    """tune_candidates for the call's launch on its device: interpreter-sized ones where ``smoke`` (default:
    on CPU tensors); TMA ones on a GPU that has TMA, and in smoke runs (the interpreter runs them)."""
    from fastpipe.kernels import mm_sum_tma
    from fastpipe.kernels.mm_reduce_scatter_kernel import _num_sms

    launcher, M, N, _, n = call.launch()
    device = torch.device(call.device)
    smoke = device.type != "cuda" if smoke is None else smoke
    tma = mm_sum_tma.device_problem(device) is None if device.type == "cuda" else smoke
    return tune_candidates(M, N, getattr(torch, call.dtype), smoke, launcher, _num_sms(device), tma=tma, n=n)


def heuristic(call: KernelCall) -> KernelConfig:
    """pick_config's own choice for the call, without any tuned table."""
    from fastpipe.kernels.mm_reduce_scatter_kernel import pick_config

    launcher, M, N, K, n = call.launch()
    return pick_config(M, N, K, getattr(torch, call.dtype), torch.device(call.device), launcher=launcher, n=n,
                       use_tuned=False)


def config_in(table: dict, call: KernelCall) -> KernelConfig:
    """The config pick_config takes for the call from a parsed tuned table (fastpipe.kernels.tuned.parse_table:
    its entry for the call's launch on this GPU), else the heuristic's."""
    from fastpipe.kernels.fusion_rule import table_device
    from fastpipe.kernels.tuned import lookup_in

    launcher, M, N, K, n = call.launch()
    return lookup_in(table, launcher, M, N, K, n, call.dtype, table_device(call.device)) or heuristic(call)


def configs_for(call: KernelCall, configs: list[KernelConfig] | None = None) -> list[KernelConfig]:
    """What ``tune`` times: the heuristic's config first, then ``configs`` (default ``candidates_for``)."""
    return list(dict.fromkeys([heuristic(call), *(configs if configs is not None else candidates_for(call))]))


def tune(call: KernelCall, timer, *, configs: list[KernelConfig] | None = None) -> Tuned:
    """Time ``call`` (fresh operands of its shapes and strides, on its device) under each config (default
    ``candidates_for``) and the heuristic's; ``timer(config, fn, device, quick) -> (ms, timing)``
    (fastpipe.runtime.tuning.kernel_timing.time_config: replayed CUDA graphs). ValueError where the call cannot
    be tuned (``KernelCall.launch``) or the heuristic's config could not run."""
    from fastpipe.kernels.fusion_rule import table_device

    launcher, M, N, K, n = call.launch()
    dtype = getattr(torch, call.dtype)
    device = torch.device(call.device)
    a, b = call.operands()
    configs = configs_for(call, configs)
    heuristic = configs[0]
    ranked, skipped = [], []
    for cfg in configs:
        try:
            ranked.append((timer(cfg, lambda cfg=cfg: call.run(a, b, cfg), device, True)[0], cfg))
        except Exception as e:  # noqa: BLE001 - a config this GPU cannot run (resources): skipped, and said
            skipped.append(f"{cfg.text()}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    if heuristic not in {c for _, c in ranked}:
        raise ValueError(f"the heuristic's config {heuristic.text()} could not run: {skipped[0]}")
    best = min(ranked, key=lambda t: t[0])[1]
    heuristic_ms, timing = timer(heuristic, lambda: call.run(a, b, heuristic), device, False)
    ms = timer(best, lambda: call.run(a, b, best), device, False)[0] if best != heuristic else heuristic_ms
    return Tuned(call, launcher, M, N, K, n, table_device(device), best, ms, heuristic, heuristic_ms,
                 len(ranked), timing, _same_outputs(call.run(a, b, best), call.run(a, b, heuristic), dtype, n * K),
                 skipped)


def _same_outputs(got, want, dtype, k_total: int) -> bool:
    """Two configs' outputs agree: each sums k_total products in float32, in its own order (the tiles,
    split-K), and rounds once to ``dtype``. So within two roundings of each value, plus one rounding of
    the mean magnitude and a float32 accumulation bound (k_total units of 2^-23) of the largest one
    (cancellation). A broken config is off by the values' own size."""
    eps = torch.finfo(dtype).eps
    for g, w in zip(got, want, strict=True):
        g, w = g.float(), w.float()
        slack = eps * w.abs().mean() + k_total * 2.0 ** -23 * w.abs().max()
        if not torch.all((g - w).abs() <= 2 * eps * w.abs() + slack):
            return False
    return True


def merged_table(base: dict | None, results: list[Tuned], min_gain: float = MIN_GAIN) -> tuple[dict, int]:
    """(fastpipe.kernels.tuned's table: base's entries, less those of the keys tuned now, plus the kept
    results, number kept). base: a table document (validated by the caller) or None."""
    from fastpipe.kernels.tuned import entry_key, with_entries

    entries = [{"launcher": r.launcher, "device": r.device, "dtype": r.call.dtype, "M": r.M, "N": r.N, "K": r.K,
                "n": r.n, "config": dataclasses.asdict(r.best), "ms": round(r.ms, 5),
                "heuristic_ms": round(r.heuristic_ms, 5)} for r in results]
    kept = [e for e, r in zip(entries, results) if r.kept(min_gain)]
    return with_entries(base, kept, {entry_key(e) for e in entries}), len(kept)


def with_fusion_points(doc: dict, points: list[dict]) -> dict:
    """The table with ``points`` (fastpipe.runtime.tuning.kernel_timing.fusion_point's) in its "fusion" list, in place
    of the points it had for the same GPU and shape (fastpipe.kernels.fusion_rule.point_key), sorted."""
    from fastpipe.kernels.fusion_rule import point_key

    now = {point_key(p) for p in points}
    fusion = [p for p in doc.get("fusion", []) if point_key(p) not in now] + list(points)
    return {**doc, "fusion": sorted(fusion, key=point_key)} if fusion else doc
