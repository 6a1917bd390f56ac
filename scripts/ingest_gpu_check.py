"""Bring the results of a ``scripts/gpu_check.sh`` call (the folder holding its $OUT) into the repository, in one step:

    python scripts/ingest_gpu_check.py gpu_out            # writes, and prints what it did
    python scripts/ingest_gpu_check.py gpu_out --dry-run  # prints only

- Archives (logs.tar.gz, all.tar.gz) are unpacked into a temporary copy (the folder itself is not written to).
- ``fused.json`` (the `fused` stage: fused kernels) -> ``bench/measured/fused_<gpu>_<date>.json`` (``<gpu>``: the
  GPU's model, "h100" for "NVIDIA H100 80GB HBM3"; ``_2``, ``_3`` for a later run of the same day), and the
  shipped rule, ``fastpipe/kernels/fusion_measured.json``, written again from every committed result file, oldest
  first (by its machine's date, then its name): what ``bench_fused_kernels.py --threshold ... --write-rule``
  makes, and what tests/test_fusion_rule.py checks it against.
- ``tuned_configs.json`` (the `tune` stage) -> merged into ``fastpipe/kernels/tuned_configs.json``: its entries
  replace those of the same GPU, launcher, dtype and shape; the others (another GPU's) stay.
- ``shapes.json`` (the `shapes` stage) -> ``bench/measured/shapes_<gpu>_<date>.json``.
- ``runtime.json`` (decode step), ``serving.json`` (greedy decode), ``memory.json`` (load and memory) ->
  ``bench/measured/<stage>_<gpu>_<date>.json``, with a line per case or section: the decode-step cases' verdicts
  against their targets, the cases --budget-s left out, the fastpipe rows that failed; the serving and memory
  sections, their rows and errors. The tables themselves are in the stage's log (``<stage>.log``, in
  logs.tar.gz).
- ``real.json`` (the `real` stage: real size, bench/report_real_size.py) ->
  ``bench/measured/real_size_<gpu>_<model>_<date>.json`` (``<model>``: its checkpoint's geometry), with a line
  per case: its logits check, and each fastpipe row's time against the faster baseline and its fraction of the
  device's copy bandwidth (decode) or matmul rate (prefill), each against its target; the rows that failed,
  the cases not started.
- ``scale.json`` (the `scale` stage: build and load at scale, bench/report_scale.py) ->
  ``bench/measured/scale_<gpu>_<model>_<date>.json``, with a line per section (build, serve, load) and its
  verdicts.
- ``summary.txt``: its count lines are printed.

Nothing else is touched: after a run that wrote, ``python -m bench.results_page`` renders BENCHMARKS.md from
bench/measured. Exit 2 where the folder holds none of these, or a file is not what its stage writes; then
nothing is written (every file is read and checked before the first write).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import gpu_slug  # noqa: E402
from fastpipe.atomic import write_text  # noqa: E402
from fastpipe.kernels.fusion_rule import dump_table, rows_of, table_from_rows  # noqa: E402


def unpacked(folder: Path, into: Path) -> Path:
    """A copy of ``folder`` in ``into`` with its .tar.gz archives unpacked beside the files (members with absolute
    paths or '..' are refused: the archive is ours, but the check is cheap)."""
    out = into / "out"
    shutil.copytree(folder, out)
    for archive in sorted(out.glob("*.tar.gz")):
        with tarfile.open(archive) as tar:
            for m in tar.getmembers():
                if m.name.startswith("/") or ".." in Path(m.name).parts or not (m.isfile() or m.isdir()):
                    raise ValueError(f"{archive.name}: member {m.name!r}: expected a plain relative file")
            if hasattr(tarfile, "data_filter"):        # Python >= 3.11.4, 3.12
                tar.extractall(out, filter="data")
            else:
                tar.extractall(out)
    return out


def model_name(doc: dict) -> str:
    """The checkpoint's geometry in a real-size result's file name: its "geometry", else its checkpoint folder's name."""
    name = doc.get("geometry") or Path(str(doc.get("checkpoint", "model"))).name
    return re.sub(r"[^A-Za-z0-9.-]+", "-", name) or "model"


def free_name(folder: Path, stem: str) -> Path:
    path, i = folder / f"{stem}.json", 2
    while path.exists():
        path, i = folder / f"{stem}_{i}.json", i + 1
    return path


def rule_from(measured: dict[str, Path]) -> dict:
    """The shipped rule's table from result files by their names in bench/measured/, oldest first: by their
    machine's date, then their name."""
    docs = {name: json.loads(p.read_text()) for name, p in measured.items()}
    names = sorted(docs, key=lambda name: (str((docs[name].get("machine") or {}).get("date", "")), name))
    rows = [r for name in names for r in rows_of(docs[name])]
    return table_from_rows(rows, [docs[name]["machine"] for name in names], names)


def ingest(folder: Path, root: Path, dry_run: bool) -> list[str]:
    """What was (or, dry, would be) written, a line each; ValueError where a file is not its stage's."""
    from fastpipe.kernels.tuned import entry_key, parse_table, with_entries

    lines: list[str] = []
    writes: list[tuple[Path, str]] = []          # (where, what): written at the end, all or nothing
    measured_dir = root / "bench" / "measured"
    with tempfile.TemporaryDirectory(prefix="fastpipe-ingest-") as tmp:
        out = unpacked(folder, Path(tmp))
        summary = out / "summary.txt"
        if summary.exists():
            counts = [ln for ln in summary.read_text().splitlines()
                      if re.match(r"(run finished|all: |cuda: |\w+: rc=)", ln)]
            lines += [f"summary.txt: {ln.strip()}" for ln in counts] or ["summary.txt: no count lines"]
        fused = out / "fused.json"
        if fused.exists():
            doc = json.loads(fused.read_text())
            machine = doc.get("machine") if isinstance(doc, dict) else None
            rows = rows_of(doc) if machine else []
            if not machine or not machine.get("device") or not machine.get("date") or not rows:
                raise ValueError("fused.json: expected bench_fused_kernels' result (machine.device, machine.date, "
                                 "rows), found " + str(doc)[:80])
            dest = free_name(measured_dir, f"fused_{gpu_slug(machine['device'])}_{machine['date']}")
            table = rule_from({**{p.name: p for p in measured_dir.glob("fused_*.json")}, dest.name: fused})
            rule = root / "fastpipe" / "kernels" / "fusion_measured.json"
            lines.append(f"fused.json -> {dest.relative_to(root)} ({len(rows)} rows, {machine['device']} "
                         f"{machine['date']})")
            lines.append(f"{rule.relative_to(root)}: {len(table['points'])} points from "
                         f"{', '.join(table['sources'])}")
            writes += [(dest, fused.read_text()), (rule, dump_table(table))]
        tuned_new = out / "tuned_configs.json"
        if tuned_new.exists():
            new = json.loads(tuned_new.read_text())
            parse_table(new, "tuned_configs.json")
            shipped = root / "fastpipe" / "kernels" / "tuned_configs.json"
            old = json.loads(shipped.read_text()) if shipped.exists() else None
            # old's entries less the keys new has, then new's (gpu_check's tune stage writes no "fusion" points)
            doc = with_entries(old, new["entries"], {entry_key(e) for e in new["entries"]})
            parse_table(doc, str(shipped))
            lines.append(f"tuned_configs.json -> {shipped.relative_to(root)}: {len(new['entries'])} new entries, "
                         f"{len(doc['entries'])} in all")
            if new["entries"]:
                writes.append((shipped, json.dumps(doc, indent=1) + "\n"))
        shapes = out / "shapes.json"
        if shapes.exists():
            doc = json.loads(shapes.read_text())
            machine = doc.get("machine") or {}
            if "points" not in doc or not machine.get("device"):
                raise ValueError("shapes.json: expected tune_model_shapes' result (machine.device, points), found "
                                 + str(doc)[:80])
            dest = free_name(measured_dir, f"shapes_{gpu_slug(machine['device'])}_{machine.get('date', 'undated')}")
            lines.append(f"shapes.json -> {dest.relative_to(root)} ({len(doc['points'])} points)")
            writes.append((dest, shapes.read_text()))
        for stage, (script, stem, describe) in REPORTS.items():
            path = out / f"{stage}.json"
            if not path.exists():
                continue
            doc = json.loads(path.read_text())
            machine = (doc.get("machine") or {}) if isinstance(doc, dict) else {}
            if not machine.get("device") or not machine.get("date"):
                raise ValueError(f"{stage}.json: expected bench/{script}.py's result (machine.device, "
                                 f"machine.date), found {str(doc)[:80]}")
            said = describe(doc)
            model = f"_{model_name(doc)}" if stem in ("real_size", "scale") else ""   # the results page reads it
            dest = free_name(measured_dir, f"{stem}_{gpu_slug(machine['device'])}{model}_{machine['date']}")
            lines.append(f"{stage}.json -> {dest.relative_to(root)} ({machine['device']} {machine['date']})")
            lines += [f"{stage}.json: {ln}" for ln in said]
            writes.append((dest, path.read_text()))
    if not any("->" in ln for ln in lines):
        raise ValueError(f"{folder}: expected fused.json, tuned_configs.json, shapes.json, runtime.json, "
                         "serving.json, memory.json, real.json or scale.json (or archives holding them), found none")
    if not dry_run:                     # only once every file was read and checked: a bad one writes nothing
        for dest, text in writes:
            write_text(dest, text)
    return lines


def runtime_lines(doc: dict) -> list[str]:
    """The decode-step table (bench/report_runtime.py): per case its verdicts, then the cases not run and the rows
    that failed."""
    from bench.report_runtime import verdict_lines

    if not isinstance(doc.get("cases"), list):
        raise ValueError(f"runtime.json: expected report_runtime's cases (a list), found {str(doc)[:80]}")
    lines = []
    for case in doc["cases"]:
        said = verdict_lines(case.get("verdicts") or {}) or ["no verdict (a baseline row is missing)"]
        title = case["title"] + (f" ({case['partial']}, {len(case['rows'])} rows)" if case.get("partial") else "")
        lines += [f"{title}: {ln}" for ln in said]
    if doc.get("interrupted"):
        lines.append(f"INTERRUPTED: {doc['interrupted']}")
    if doc.get("not_run"):
        lines.append(f"not run (the budget): {', '.join(doc['not_run'])}")
    if doc.get("failed"):
        lines.append(f"FAILED: {'; '.join(doc['failed'])}")
    if "failed" not in doc and not doc.get("interrupted"):
        lines.append("the run did not finish (no 'failed' list): the cases above are those it wrote")
    return lines


def sections_lines(doc: dict, stage: str) -> list[str]:
    """The serving and memory tables (bench/report_serving.py, bench/report_memory.py): a line per section, its rows
    and errors."""
    sections = doc.get("sections")
    if not isinstance(sections, dict):
        raise ValueError(f"{stage}.json: expected report_{stage}'s sections (an object), found {str(doc)[:80]}")
    lines = []
    for key, sec in sections.items():
        rows = sec.get("rows") or []
        errors = [r["error"] for r in rows if isinstance(r, dict) and r.get("error")]
        errors += [f"{r.get('variant', '?')}: tokens {r['tokens']}" for r in rows   # serving: tokens vs the reference
                   if isinstance(r, dict) and str(r.get("tokens", "")).startswith("DIFFER")]
        if sec.get("error"):
            errors.insert(0, sec["error"])
        what = f"section {key}" + (f" ({sec['title']})" if sec.get("title") and sec["title"] != f"section {key}"
                                   else "")
        lines.append(f"{what}: {len(rows)} rows" + (", unfinished" if sec.get("partial") else "")
                     + (f", errors: {'; '.join(errors)}" if errors else ""))
    if doc.get("failed_sections"):
        lines.append(f"FAILED sections: {', '.join(map(str, doc['failed_sections']))}")
    if doc.get("status", "done") != "done":
        lines.append(f"the run did not finish (status {doc['status']!r}): the sections above are those it wrote")
    return lines or ["no section finished"]


def _met(met) -> str:
    return "met" if met else "NOT met"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def real_lines(doc: dict) -> list[str]:
    """Real size (bench/report_real_size.py): a line per case, its logits check and each fastpipe row's verdicts
    against their targets, the rows that failed; then the cases not started."""
    if not isinstance(doc.get("cases"), list):
        raise ValueError(f"real.json: expected report_real_size's cases (a list), found {str(doc)[:80]}")
    lines = []
    for case in doc["cases"]:
        title = (f"decode, batch {case.get('batch')}, {case.get('positions')} cache positions"
                 if case.get("case") == "decode" else f"prefill, batch {case.get('batch', 1)}, prompt "
                 f"{case.get('prompt_len')}")
        v = case.get("verdicts")
        if not isinstance(v, dict):
            lines.append(f"{title}: no verdicts")
            continue
        said = [f"logits {'ok' if v.get('logits_ok') else 'NOT ok'}"]
        for label, mine in (v.get("rows") or {}).items():
            parts = []
            if "vs_faster_baseline" in mine:
                b = mine["vs_faster_baseline"]
                parts.append(f"{b['ratio']:.2f}x the faster baseline's time ({b['baseline']}; target <= "
                             f"{b['target']:g}x: {_met(b['met'])})")
            for key, what in (("bandwidth_fraction", "the device's copy bandwidth"),
                              ("matmul_fraction", "the bf16 matmul rate")):
                if key in mine:
                    f = mine[key]
                    parts.append(f"{100 * f['value']:.0f}% of {what} (target >= {100 * f['target']:.0f}%: "
                                 f"{_met(f['met'])})")
            said.append(f"{label}: {', '.join(parts) or 'no verdict'}")
        if not v.get("rows"):
            said.append("no fastpipe row timed")
        failed = [f"{r.get('label', '?')}: {r['error']}" for r in case.get("rows") or []
                  if isinstance(r, dict) and r.get("error")]
        if failed:
            said.append(f"FAILED: {'; '.join(failed)}")
        lines.append(f"{title}: {'; '.join(said)}")
    if doc.get("not_started"):
        lines.append(f"not started (the budget): {', '.join(doc['not_started'])}")
    return lines or ["no case finished"]


def _scale_row(r: dict) -> str:
    if r.get("label"):
        return r["label"]
    return f"tp={r['tp']} pp={r.get('pp')}" if "tp" in r else r.get("section", "?")


def scale_lines(doc: dict) -> list[str]:
    """Build and load at scale (bench/report_scale.py): a line per section (build, serve, load) with its verdicts
    against their targets, and the rows refused or failed."""
    from bench.report_scale import BUILD_MAX_PEAK, BUILD_MAX_S, HELD_TOLERANCE, LOAD_MAX_RATIO

    v = doc.get("verdicts")
    if not isinstance(v, dict):
        raise ValueError(f"scale.json: expected report_scale's verdicts (an object), found {str(doc)[:80]}")
    rows = [r for r in doc.get("rows") or [] if isinstance(r, dict)]
    lines = []
    for sec in ("build", "serve", "load"):
        errors = [f"{_scale_row(r)}: {r['error']}" for r in rows if r.get("section") == sec and r.get("error")]
        said = []
        if sec in ("build", "serve") and isinstance(v.get(sec), dict):
            b = v[sec]
            said.append(f"at most {b['max_s']:.1f} s, peak RSS at most {_gib(b['max_peak'])} "
                        f"({_gib(b['max_over_imports'])} over imports), {_gib(b['weight_bytes_copied'])} of weights "
                        f"copied (targets < {BUILD_MAX_S} s, < {BUILD_MAX_PEAK / 2**30:g} GiB, none copied: "
                        f"{_met(b['met'])})")
        if sec == "load" and "load_time_ratio" in v:
            said.append(f"{v['load_time_ratio']:.2f}x safetensors' time (target <= {LOAD_MAX_RATIO}x: "
                        f"{_met(v['load_time_met'])})")
            limit = _gib(v["weights"] + v["largest_group"])
            said.append(f"peak RSS {_gib(v['load_peak_over_imports'])} over imports (target <= the weights + the "
                        f"largest merged group, {limit}: {_met(v['load_peak_met'])})")
            if "load_held" in v:
                said.append(f"device memory held {_gib(v['load_held'])} (target within {100 * HELD_TOLERANCE:.0f}% of the "
                            f"weights + the KV cache, {_gib(v['load_held_expected'])}: {_met(v['load_held_met'])})")
            elif "load_rss_after_over_imports" in v:
                said.append(f"RSS after the load {_gib(v['load_rss_after_over_imports'])} over imports (the weights + "
                            f"the KV cache: {_gib(v['load_held_expected'])})")
        if errors:
            said.append(f"refused or failed: {'; '.join(errors)}")
        if said:
            lines.append(f"{sec}: {'; '.join(said)}")
    return lines or ["no section finished"]


REPORTS = {          # stage: (its bench script, its files' stem in bench/measured, its lines)
    "runtime": ("report_runtime", "runtime", runtime_lines),
    "serving": ("report_serving", "serving", lambda doc: sections_lines(doc, "serving")),
    "memory": ("report_memory", "memory", lambda doc: sections_lines(doc, "memory")),
    "real": ("report_real_size", "real_size", real_lines),
    "scale": ("report_scale", "scale", scale_lines)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="the folder holding a gpu_check.sh call's $OUT")
    ap.add_argument("--root", default=str(ROOT), help="the repository to write into (default: this one)")
    ap.add_argument("--dry-run", action="store_true", help="print what would be written, write nothing")
    args = ap.parse_args(argv)
    try:
        lines = ingest(Path(args.folder), Path(args.root), args.dry_run)
    except (OSError, ValueError, KeyError, tarfile.TarError) as e:
        print(f"ingest_gpu_check: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for ln in lines:
        print(("(dry run) " if args.dry_run else "") + ln)
    if not args.dry_run:
        print("then: python -m bench.results_page (renders BENCHMARKS.md from bench/measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
