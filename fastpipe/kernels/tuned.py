"""Launch configurations measured per GPU and shape, consulted before the heuristic (pick_config).

A table is JSON written by ``bench/bench_fused_kernels.py --write-tuned`` from a ``--tune`` run (the
benchmark's grid), or by ``fastpipe tune`` for a pipeline's own shapes (fastpipe.kernels.autotune)::

    {"format": 1, "entries": [{"launcher": "mm_sum", "device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16",
                               "M": 1024, "N": 4096, "K": 4096, "n": 2,
                               "config": {"block_m": 128, "block_n": 256, "block_k": 64, "group_m": 8,
                                          "num_warps": 8, "num_stages": 3},
                               "ms": 0.21, "heuristic_ms": 0.25}, ...]}

launcher: the kernel launched, ``mm_sum`` (matmul_reduce_scatter), ``gather_rows`` (all_gather_matmul
with dim 0) or ``gather_cols`` (all_gather_matmul with dim 1); M, N, K, n: what that launcher sees: rows;
columns (the gather launchers, which compute the n outputs in one launch: the widest output's); K
(mm_sum: the longest participant's; the gather launchers: the gathered product's); participants.
An entry applies to the GPU whose name it records (a config
tuned on one GPU says nothing of another's), the same dtype, N, K and n, and to calls whose M is within
a factor of two of its own (M/2 < call's M <= 2M; the nearest entry wins, a tie the larger), and above
the largest measured M, to every M -- but a split-K config (``config.split_k`` > 1) only within its
factor of two: a larger M fills the GPU with its own tiles. A
config with ``"tma": true`` runs the launcher's persistent TMA kernel (``mm_sum_tma``, for gather_cols
once per output; ``gather_rows_tma``); where a call's operands do not suit TMA its tiles run with pointer loads, with a
warning.
Elsewhere the heuristic picks: a config's fitness depends on how many tiles the grid has
(ceil(M / BLOCK_M) x ceil(N / BLOCK_N) against the SMs), so one tuned at M 1024 (a 128x256 tile, 128
tiles at N 4096) would leave most of an H100 idle at a decode's M 16 (16 tiles).

``fastpipe tune``'s table may also hold a "fusion" list: the fused-vs-unfused points it measured at the
pipeline's shapes, which fastpipe.kernels.fusion_rule reads (and checks) from the same file.

Where: ``$FASTPIPE_TUNED_CONFIGS`` if set, else ``tuned_configs.json`` beside this file (shipped
where one was measured). No table: the heuristic. A table that cannot be read or
has a bad entry is reported once (a warning naming the file and the field) and not used.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from fastpipe.kernels.launch_config import LAUNCHERS, KernelConfig
from fastpipe.kernels.measured_doc import check_choice, check_positive_ints, entries, read_cached

PACKAGED = Path(__file__).with_name("tuned_configs.json")
_FIELDS = ("launcher", "device", "dtype", "M", "N", "K", "n", "config")


def table_path() -> Path:
    env = os.environ.get("FASTPIPE_TUNED_CONFIGS")
    return Path(env) if env else PACKAGED


def parse_table(doc, where: str) -> dict[tuple, list[tuple[int, object]]]:
    """(launcher, device, dtype, N, K, n) -> [(M, KernelConfig)] sorted by M; ValueError naming the
    field (its JSON path) on a bad entry."""
    out: dict[tuple, list] = {}
    for at, e in entries(doc, where, "entries", _FIELDS):
        check_choice(e, at, "launcher", LAUNCHERS)
        check_positive_ints(e, at, ("M", "N", "K", "n"))
        if not isinstance(e["dtype"], str) or not isinstance(getattr(torch, e["dtype"], None), torch.dtype):
            raise ValueError(f"{at}.dtype: expected a torch dtype name (bfloat16, ...), found {e['dtype']!r}")
        try:
            cfg = KernelConfig(**e["config"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"{at}.config: expected KernelConfig fields, found {e['config']!r} ({err})") from None
        key = (e["launcher"], e["device"], e["dtype"], e["N"], e["K"], e["n"])
        out.setdefault(key, []).append((e["M"], cfg))
    for rows in out.values():
        rows.sort(key=lambda r: r[0])
    return out


def entry_key(e: dict) -> tuple:
    """What one entry of a table document was tuned for: (launcher, device, dtype, N, K, n, M)."""
    return e["launcher"], e["device"], e["dtype"], e["N"], e["K"], e["n"], e["M"]


def with_entries(base: dict | None, new: list[dict], replacing: set[tuple]) -> dict:
    """A table document: ``base``'s entries less those whose ``entry_key`` is in ``replacing``, then ``new``; base's
    "fusion" points (fastpipe.kernels.fusion_rule) kept as they were. base: a document, or None."""
    doc = {"format": 1, "entries": [e for e in (base or {}).get("entries", []) if entry_key(e) not in replacing]
           + list(new)}
    if (base or {}).get("fusion"):
        doc["fusion"] = base["fusion"]
    return doc


def _table(path: Path) -> dict:
    return read_cached(path, parse_table, {}, "tuned kernel configs", "the heuristic picks the launch configs")


def lookup(launcher: str, M: int, N: int, K: int, n: int, dtype: torch.dtype, device_name: str):
    """The measured KernelConfig for this call, or None (no table, or no entry for it)."""
    return lookup_in(_table(table_path()), launcher, M, N, K, n, dtype, device_name)


def lookup_in(table: dict, launcher: str, M: int, N: int, K: int, n: int, dtype, device_name: str):
    """``lookup`` in a parsed table (``parse_table``'s)."""
    rows = table.get((launcher, device_name, str(dtype).replace("torch.", ""), N, K, n))
    if not rows:
        return None
    near = [(abs(math.log2(M / m)), -m, cfg) for m, cfg in rows if m / 2 < M <= 2 * m]
    if near:
        return min(near, key=lambda t: t[:2])[2]
    top = rows[-1][1]
    # above the largest measured M its config, unless split-K: more rows bring their own tiles, and
    # the shares' workspace grows with M
    return top if M > rows[-1][0] and top.split_k == 1 else None
