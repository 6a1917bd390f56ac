"""Bring a GPU call's results (``scripts/gpu_check.sh``'s $OUT, as the device tool hands it back) into the repository,
as BENCHMARKS.md's plan says to, in one step:

    python scripts/ingest_gpu_check.py /work/.device/3/out            # writes, and prints what it did
    python scripts/ingest_gpu_check.py /work/.device/3/out --dry-run  # prints only

- Archives (logs.tar.gz, all.tar.gz) are unpacked into a temporary copy (the folder handed back is read-only).
- ``fused.json`` (the `fused` stage, table 3) -> ``bench/measured/fused_<gpu>_<date>.json`` (``<gpu>``: the GPU's
  model, "h100" for "NVIDIA H100 80GB HBM3"; ``_2``, ``_3`` for a later run of the same day), and the shipped
  rule, ``fastpipe/kernels/fusion_measured.json``, written again from every committed result file, oldest
  first (by its machine's date, then its name): what ``bench_fused_kernels.py --threshold ... --write-rule``
  makes, and what tests/test_fusion_rule.py checks it against.
- ``tuned_configs.json`` (the `tune` stage) -> merged into ``fastpipe/kernels/tuned_configs.json``: its entries
  replace those of the same GPU, launcher, dtype and shape; the others (another GPU's) stay.
- ``shapes.json`` (the `shapes` stage) -> ``bench/measured/shapes_<gpu>_<date>.json``.
- ``summary.txt``: its count lines are printed, for BENCHMARKS.md's "The suite on a GPU".

Nothing else is touched: the BENCHMARKS.md prose and the tests that quote a GPU's numbers are a person's to
write. Exit 2 where the folder holds none of these, or a file is not what its stage writes.
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

from fastpipe.atomic import write_text  # noqa: E402
from fastpipe.kernels.fusion_rule import dump_table, rows_of, table_from_rows  # noqa: E402


def gpu_slug(device: str) -> str:
    """The GPU's model in a file name: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200"."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", device) if w and w.upper() != "NVIDIA"]
    return words[0].lower() if words else "gpu"


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

    lines = []
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
            if not dry_run:
                shutil.copyfile(fused, dest)
                write_text(rule, dump_table(table))
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
            if not dry_run and new["entries"]:
                write_text(shipped, json.dumps(doc, indent=1) + "\n")
        shapes = out / "shapes.json"
        if shapes.exists():
            doc = json.loads(shapes.read_text())
            machine = doc.get("machine") or {}
            if "points" not in doc or not machine.get("device"):
                raise ValueError("shapes.json: expected tune_model_shapes' result (machine.device, points), found "
                                 + str(doc)[:80])
            dest = free_name(measured_dir, f"shapes_{gpu_slug(machine['device'])}_{machine.get('date', 'undated')}")
            lines.append(f"shapes.json -> {dest.relative_to(root)} ({len(doc['points'])} points)")
            if not dry_run:
                shutil.copyfile(shapes, dest)
    if not any("->" in ln for ln in lines):
        raise ValueError(f"{folder}: expected fused.json, tuned_configs.json or shapes.json (or archives holding "
                         "them), found none")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="the folder a gpu_check.sh call's $OUT came back in (the device tool's files_at)")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
