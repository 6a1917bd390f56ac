"""When the runtime fuses (policy "auto"): the fused kernel where it was measured faster than the
unfused path the runtime really runs, the unfused path (cuBLAS, then the collective) everywhere else.

The measurements ship as ``fusion_measured.json`` beside this file, written by
``bench/bench_fused_kernels.py --threshold RESULTS_JSON... --write-rule PATH`` from a GPU run of
that bench (``table_from_rows`` below; the raw rows of the shipped table are in
bench/measured/)::

    {"format": 1, "measured_on": [{"device": "NVIDIA H200", "date": ..., "torch": ..., "triton": ...}],
     "sources": ["fused_h200_2026-11-26.json", ...], "criterion": "...",
     "points": [{"device": "NVIDIA H200", "kernel": "matmul_reduce_scatter", "dim": 0, "dtype": "bfloat16",
                 "M": 16, "N": 4096, "K_total": 8192, "n": 2, "speedup": 1.294, "fused_wins": true,
                 "revision": 1, "date": "2026-11-27"}, ...]}

(``date``: the run the point comes from; a point without one names every date its GPU was measured.)

A point's ``fused_wins`` is true only where the win is outside the timing noise: the fused
kernel's 80th-percentile time below the unfused path's 20th percentile (``fused_wins(row)``).
A tie, or a win inside the noise, goes to the unfused path.

A call (kernel, M, N, K_total, n, dtype, dim, gpu) takes the decision of the measured point
nearest to it, distance being the sum of |log2| ratios of M, N, K_total and n, among the points
of the same kernel, dim and dtype (float16 and bfloat16 use each other's points: the same element
size and kernel) measured on this GPU (below); where several points are equally near, it fuses only if
all of them won. So between two measured M the nearer one (in log scale) decides, and beyond
the measured grid the edge does: M = 1 takes M = 16's decision. No point for the kernel, dim
and dtype (float32, say, or dim 1 before anyone measured it): not fused, and the reason says
what to measure.

A point also records the revision of the kernel it timed (``KERNEL_REVISIONS`` below, bumped by
any change to a kernel or its launch that can change its speed; a bench row without one predates
them: revision 1). ``REVISION_CHANGES`` says what each change was and which dims it touched: a point
is stale where a change since its revision touched its dim. A stale point still decides -- it is the
only measurement there is -- and its reason says that it is stale and what changed since.

Each point names the GPU that timed it (``device``, as ``torch.cuda.get_device_name`` gives it):
a crossover measured on one GPU model says little of another's. A call on a GPU with points of
its own (the exact name) uses only those; on a GPU with none, or with no GPU named, the points
of every GPU measured decide together (equally near points of two GPUs fuse only if both won),
and the reason says this GPU was not measured.

Points measured at a pipeline's own shapes join them: ``fastpipe tune`` writes them, with their times,
into the tuned-config table's "fusion" list (fastpipe.kernels.tuned; the table in use, so
``$FASTPIPE_TUNED_CONFIGS``). A point of the same GPU and shape replaces the shipped one, and the
reason names the file. A bad list is reported once and the shipped points decide.

The shape is the whole product's, as the bench measures it (``KernelCall.rule_shape``): M rows, N columns
(for all_gather_matmul every member's width summed) and K_total (for matmul_reduce_scatter every member's K
summed).

Every decision comes with its evidence (``estimate(...).reason``): the point it took, its speedup
and the GPU (and date) that measured it.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from fastpipe.kernels.measured_doc import check_choice, check_positive_ints, entries, read_cached

KERNELS = ("matmul_reduce_scatter", "all_gather_matmul")
PACKAGED = Path(__file__).with_name("fusion_measured.json")
CRITERION = ("fused_wins: the fused kernel's p80 time below the unfused path's p20 "
             "(bench/bench_fused_kernels.py, CUDA-graph replays); the nearest point in log2(M, N, K_total, n) decides, "
             "among the points of the GPU it runs on (every GPU's where that one was not measured)")
# The kernels' revisions, as bench rows record them (kernel_revision), and what each change did: (the dims whose
# speed it can change, what it was)
KERNEL_REVISIONS = {"matmul_reduce_scatter": 1, "all_gather_matmul": 3}
REVISION_CHANGES = {
    ("all_gather_matmul", 2): ((0,), "it computes dim 0's n outputs in one launch, not n one after "
                                     "another"),
    ("all_gather_matmul", 3): ((1,), "it computes dim 1's n outputs in one launch (gather_cols), "
                                     "not one mm_sum launch per output"),
}
# dtypes measured under another's name: the same element size and the same kernel code
_SAME_AS = {"float16": "bfloat16"}
_SHAPE_FIELDS = ("kernel", "dim", "dtype", "M", "N", "K_total", "n")
_KEY_FIELDS = ("device", *_SHAPE_FIELDS)            # one point per GPU and shape
_POINT_FIELDS = (*_KEY_FIELDS, "speedup", "fused_wins", "revision")
_MACHINE_FIELDS = ("device", "date", "torch", "triton", "python")   # of a bench result file's "machine"


@dataclass(frozen=True)
class Estimate:
    fused: bool
    reason: str


def fused_wins(row: dict) -> bool:
    """One bench row's verdict: the fused kernel faster than the unfused path beyond the noise."""
    return row["fused_p80"] < row["unfused_p20"]


def point_key(p: dict) -> tuple:
    """What one point measured: the GPU and the shape (device, kernel, dim, dtype, M, N, K_total, n)."""
    return tuple(p[f] for f in _KEY_FIELDS)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def gpu_name(device) -> str | None:
    """The name the table knows a CUDA torch.device by (``torch.cuda.get_device_name``); None for
    another device type or where CUDA is unavailable."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def table_device(device) -> str:
    """The name a measured table (tuned configs, fusion points) keys a device by: the GPU's (``gpu_name``),
    else the device type ("cpu": the interpreter's runs, in the tests)."""
    import torch

    return gpu_name(device) or torch.device(device).type


def rows_of(doc) -> list[dict]:
    """A bench_fused_kernels result document's rows, each naming the GPU that timed it and the date of
    the run (a row without ``device``, as the bench writes them, takes the file's machine.device;
    one without ``date``, machine.date)."""
    if not isinstance(doc, dict):
        return list(doc)
    machine = doc.get("machine") or {}
    tags = {k: machine[k] for k in ("device", "date") if machine.get(k) is not None}
    return [{**tags, **r} if tags.keys() - r.keys() else r for r in doc["rows"]]


def newest_rows(rows: list[dict]) -> list[dict]:
    """bench_fused_kernels rows, one per GPU and shape (device, kernel, dim, dtype, M, N, K_total, n):
    where a shape was measured with two revisions of its kernel on one GPU, the newer revision's row
    (so a new run of one kernel merges with an older file); at the same revision the later row in
    the list (results listed oldest first: a rerun replaces the earlier run). ValueError where a
    row names no GPU."""
    by_shape: dict[tuple, dict] = {}
    for r in rows:
        if not r.get("device"):
            raise ValueError(f"rows: {dict((f, r.get(f)) for f in _SHAPE_FIELDS)} names no GPU (device): the "
                             "result file's machine.device names it")
        key = point_key(r)
        had = by_shape.get(key)
        if had is None or row_revision(had) <= row_revision(r):
            by_shape[key] = r
    return list(by_shape.values())


def row_revision(row: dict) -> int:
    """The kernel revision a bench row timed (rows written before revisions existed: 1)."""
    return row.get("kernel_revision", 1)


def changes_since(kernel: str, dim: int, revision: int) -> list[str]:
    """What changed since that revision of the kernel that can change its speed at this dim (``REVISION_CHANGES``,
    oldest first); [] where that revision timed the kernel as it runs now at this dim."""
    return [text for (k, r), (dims, text) in sorted(REVISION_CHANGES.items())
            if k == kernel and revision < r <= KERNEL_REVISIONS[kernel] and dim in dims]


def stale_revisions(kernel: str, dim: int, revisions) -> list[int]:
    """Those of these revisions (of points at this dim) that timed the kernel before a change at that dim, sorted."""
    return sorted({r for r in revisions if changes_since(kernel, dim, r)})


def table_from_rows(rows: list[dict], machines: list[dict], sources: list[str]) -> dict:
    """The shipped table's document from bench_fused_kernels rows (rows that raised or failed their
    numerics check are left out; one per GPU and shape, the newest revision's: ``newest_rows``) and the result
    files' "machine" objects (the fields that identify the GPU and the versions are kept)."""
    timed = [r for r in rows if "error" not in r and r.get("check", "ok") == "ok"]
    points = [{"device": r["device"], "kernel": r["kernel"], "dim": r["dim"], "dtype": r["dtype"], "M": r["M"],
               "N": r["N"], "K_total": r["K_total"], "n": r["n"], "speedup": round(r["speedup"], 3),
               "fused_wins": fused_wins(r), "revision": row_revision(r), **({"date": r["date"]} if "date" in r else {})}
              for r in newest_rows(timed)]
    points.sort(key=lambda p: tuple(p[f] for f in _KEY_FIELDS))
    measured_on = [{k: m.get(k) for k in _MACHINE_FIELDS} for m in machines]
    return {"format": 1, "measured_on": measured_on, "sources": sources, "criterion": CRITERION, "points": points}


def dump_table(doc: dict) -> str:
    """The table as text: one point per line (diffs between two GPU runs stay readable)."""
    head = {k: v for k, v in doc.items() if k != "points"}
    body = ",\n".join("  " + json.dumps(p) for p in doc["points"])
    return json.dumps(head, indent=1)[:-2] + ',\n "points": [\n' + body + "\n ]\n}\n"


def parse_table(doc, where: str, key: str = "points") -> list[dict]:
    """The points of a table document (under ``key``: "points" in the shipped table, "fusion" in a tuned
    table); ValueError naming the field (its JSON path) on a bad one."""
    points = []
    for at, p in entries(doc, where, key, _POINT_FIELDS):
        check_choice(p, at, "kernel", KERNELS)
        if not isinstance(p["device"], str) or not p["device"]:
            raise ValueError(f"{at}.device: expected the GPU's name (NVIDIA H200, ...), found {p['device']!r}")
        check_positive_ints(p, at, ("M", "N", "K_total", "n", "revision"))
        if not isinstance(p["fused_wins"], bool):
            raise ValueError(f"{at}.fused_wins: expected true or false, found {p['fused_wins']!r}")
        if not isinstance(p.get("date", ""), str):
            raise ValueError(f"{at}.date: expected the date it was measured (YYYY-MM-DD), found {p['date']!r}")
        points.append(p)
    return points


def parse_tuned_points(doc, where: str) -> list[dict]:
    """The fused-vs-unfused points ``fastpipe tune`` measured, from a tuned-config table (its optional
    "fusion" list; fastpipe.kernels.tuned), each tagged with the file it came from (``from``)."""
    if isinstance(doc, dict) and "fusion" not in doc:
        return []
    return [{**p, "from": where} for p in parse_table(doc, where, "fusion")]


def _tuned_points() -> list[dict]:
    """Those of the tuned-config table in use ($FASTPIPE_TUNED_CONFIGS, else the packaged one), if any."""
    from fastpipe.kernels.tuned import table_path

    return read_cached(table_path(), parse_tuned_points, [], "the fusion points of the tuned-config table",
                       "fuse='auto' decides from the shipped measurements")


@functools.lru_cache(maxsize=None)
def _shipped() -> tuple[tuple[dict, ...], dict[str, str]]:
    """(points, {GPU: the dates its runs were measured}) of the packaged table."""
    doc = json.loads(PACKAGED.read_text())
    points = parse_table(doc, str(PACKAGED))
    dates: dict[str, list[str]] = {}
    for m in doc.get("measured_on") or []:
        dates.setdefault(m.get("device"), []).append(str(m.get("date")))
    return tuple(points), {d: ", ".join(sorted(set(ds))) for d, ds in dates.items()}


def _distance(p: dict, M: int, N: int, K_total: int, n: int) -> float:
    return sum(abs(math.log2(x / p[f])) for x, f in ((M, "M"), (N, "N"), (K_total, "K_total"), (n, "n")))


def _shape(p: dict) -> str:
    return f"M={p['M']} N={p['N']} K_total={p['K_total']} n={p['n']}"


def estimate(kernel: str, M: int, N: int, K_total: int, n: int, dtype, dim: int = 0,
             gpu: str | None = None) -> Estimate:
    """The decision for one fusable group and its reason (see the module docstring).
    kernel: "matmul_reduce_scatter" | "all_gather_matmul"; M: the matmul's rows; N: its columns (for
    all_gather_matmul the members' widths summed: the bench's [M, K] @ [K, N] of n [K, N/n] weights);
    K_total: the summed K (n * K_i for matmul_reduce_scatter, K for all_gather_matmul); n:
    participants; dtype: a torch dtype (or its name); dim: the kernel's scatter/gather dim (0: row
    blocks, 1: column blocks); gpu: the name of the GPU it runs on (``gpu_name``), None: any."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {', '.join(KERNELS)}, found {kernel!r}")
    for name, v in (("M", M), ("N", N), ("K_total", K_total), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an integer >= 1, found {v!r}")
    if n < 2:
        return Estimate(False, "one participant: there is nothing to reduce or gather")
    shipped, dates = _shipped()
    want = _dtype_name(dtype)
    as_dtype = _SAME_AS.get(want, want)

    def ours(p):
        return p["kernel"] == kernel and p["dim"] == dim and _SAME_AS.get(p["dtype"], p["dtype"]) == as_dtype

    tuned = [p for p in _tuned_points() if ours(p)]
    retuned = {point_key(p) for p in tuned}                   # a pipeline's own measurement replaces the bench's
    mine = tuned + [p for p in shipped if ours(p) and point_key(p) not in retuned]
    if not mine:
        return Estimate(False, f"{kernel} was not measured for {want}, dim {dim} (auto fuses only where measured "
                               f"faster; bench/bench_fused_kernels.py --dtype/--dim or `fastpipe tune` measures "
                               f"it; fuse='always' forces the kernel)")
    here = [p for p in mine if p["device"] == gpu]
    elsewhere = "" if here or gpu is None else (
        f"; this GPU ({gpu}) was not measured: another GPU's measurement decides until `scripts/gpu_check.sh "
        f"fused` or `fastpipe tune` measures this one")
    scored = [(_distance(p, M, N, K_total, n), p) for p in here or mine]
    best = min(d for d, _ in scored)
    near = [p for d, p in scored if d <= best + 1e-9]
    fused = all(p["fused_wins"] for p in near)

    def where(p):
        if "from" in p:
            return f"{p['device']} {p.get('date') or '(date unknown)'} by fastpipe tune ({p['from']})"
        return f"{p['device']} {p.get('date') or dates.get(p['device'], '(date unknown)')}"

    each = len({where(p) for p in near}) > 1         # points of several GPUs or sources: each item names its own
    evidence = "; ".join(f"{p['speedup']:.2f}x" + (" faster" if p["fused_wins"] else ", not faster") +
                         f" than unfused at {_shape(p)}" + (f" on {where(p)}" if each else "") for p in near)
    used = {p["dtype"] for p in near}
    others = sorted(used - {want})          # float16 and bfloat16 serve each other
    also = f" ({want} uses the {' and '.join(others)} measurement{' too' if want in used else ''})" if others else ""
    exact = best == 0.0
    at = "measured at this shape" if exact else f"the nearest measured shape{'s' if len(near) > 1 else ''}"
    on = "" if each else f", on {where(near[0])}"
    return Estimate(fused, f"{at}: {evidence}, {as_dtype} dim {dim}{on}{also}{_staleness(kernel, dim, near)}{elsewhere}")


def _staleness(kernel: str, dim: int, near: list[dict]) -> str:
    """'' where the points timed the kernel as it runs now at their dim; else what changed since they were
    measured."""
    old = stale_revisions(kernel, dim, (p["revision"] for p in near))
    if not old:
        return ""
    changes = "; ".join(changes_since(kernel, dim, min(old)))
    return (f"; stale: measured with revision {', '.join(map(str, old))} of the kernel, which is now "
            f"revision {KERNEL_REVISIONS[kernel]} ({changes}): `scripts/gpu_check.sh fused` measures it again")


def fused_is_faster(M: int, N: int, K_total: int, n: int, dtype, *, kernel: str, dim: int = 0,
                    gpu: str | None = None) -> bool:
    """Whether ``fuse="auto"`` replaces the unfused path by ``kernel`` at this shape on this GPU (its
    name, ``gpu_name(device)``; None: any measured GPU): ``estimate``'s decision (the nearest point of
    the measured table; its reason says which)."""
    return estimate(kernel, M, N, K_total, n, dtype, dim, gpu).fused
