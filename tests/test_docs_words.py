"""The repository speaks of the software: its docs say how things work now (no dated history), and no
tracked file talks about how the work on it is organised (runs planned, budgets, issue numbers)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the words split so that this file does not match them itself
ORGANISATION = re.compile("|".join([r"device" r" session", r"next" r" session", r"give" r"_back", r"files" r"_at",
                                    r"device" r" budget", r"\b[Ii]ssue [0-9]+\b", r"BENCHMARKS\.md's plan"]))
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        names = out.splitlines()
    except (OSError, subprocess.CalledProcessError):        # not a git checkout: every file under the root
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    return [ROOT / n for n in names if not n.startswith("tests/data/") and (ROOT / n).is_file()]


def text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def test_no_file_talks_about_how_the_work_is_organised():
    hits = []
    for path in tracked():
        body = text(path)
        if body is None or path == Path(__file__):
            continue
        hits += [f"{path.relative_to(ROOT)}:{i}: {m.group(0)}" for i, line in enumerate(body.splitlines(), 1)
                 for m in [ORGANISATION.search(line)] if m]
    assert not hits, "\n".join(hits[:20])


def test_docs_carry_no_dates():
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "docs").glob("*.md"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if DATE.search(line)]
    assert not hits, hits


def test_readme_status_is_short_and_links_the_results_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Status"))
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    status = lines[start:end]
    assert len(status) < 15 and "(BENCHMARKS.md)" in status[0]
