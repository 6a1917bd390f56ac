"""BENCHMARKS.md, rendered from the raw results under bench/measured/.

    python -m bench.results_page            # writes BENCHMARKS.md
    python -m bench.results_page --check    # exit 1 where BENCHMARKS.md is not what the results render

Every result file is named <report>_<device>_..._<date>.json; its report (runtime, serving, fused, memory,
real_size, scale, cold_start, serve_load) picks its table (bench/results_tables.py). A fused-kernel run supersedes an older one on
the same device (the grid is the same); every other file is a table of its own. Tables without a row to
show (a file of baseline rows only) are left out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import results_tables as tables  # noqa: E402

# (report prefix, section title, what the section measures, renderer); the page's order
SECTIONS = [
    ("real_size_", "Decode and prefill at real size",
     "Random weights in the models' geometries (`python -m bench.real_checkpoint <model> DIR`), tp=2, against "
     "the faster of transformers (static cache) and a gpt-fast-style model, both compiled.",
     tables.real_size),
    ("scale_", "Build and load at real size",
     "`fastpipe build` at each tp x pp, and `fastpipe.load` against safetensors' own load of the same files, "
     "each in a fresh process.",
     tables.scale),
    ("cold_start_", "Ready in seconds: cold start",
     "Fresh processes, compile cache empty (cold) and filled (warm): the first output, and the speed reached "
     "later in the same run.",
     tables.cold_start),
    ("serve_load_", "The OpenAI server under load",
     "`fastpipe serve` against the engine in-process, on the same requests.",
     tables.serve_load),
    ("runtime_", "The decode step on a GPU, at 4 layers",
     "A small Llama split tp=2 on one GPU against the fastest compiled unsplit row; at this size a step is "
     "launch-bound.",
     tables.runtime),
    ("serving_", "Greedy decode on a GPU, at 4 layers",
     "The engine's decode loop against transformers' `generate` (static cache, reduce-overhead).",
     tables.serving),
    ("fused_", "Fused matmul + collective kernels",
     "fastpipe's Triton kernels against the unfused path (the collective, then torch.mm) on the same GPU.",
     tables.fused),
    ("memory_", "Load and peak memory on a GPU",
     "Upload against safetensors' own load to the device; a run's peak allocation against the memory plan.",
     tables.memory),
]

INTRO = """# Benchmarks

Rendered from `bench/measured/` by `python -m bench.results_page`; do not edit. Ratios compare rows of one
run (below 1.0x: fastpipe takes less time); verdicts are computed from the rows against each script's
target (**no**: missed).
"""

HOW = """## How we measure

- **Timing.** GPU: each sample is the mean of back-to-back calls between two synchronizations; the value
  is the median of the samples. CPU: a case's rows are sampled in turn, round after round; the median.
- **Warm-up.** Compilation, CUDA-graph capture and a first call run before any timed sample.
- **Numerics.** fastpipe's logits are checked against the unsplit model in float32, within the unsplit
  model's own error in the benchmark's dtype; greedy decode compares tokens.
- **Baselines** run as their users run them: compiled (reduce-overhead on a GPU), on static caches.
  Hardware fractions are measured in the same rounds: a device copy for bandwidth, a bf16 matmul for
  FLOP/s.
- **The CPU rows** come from a 2-core virtual machine: compare ratios within a table, not times across
  tables.
"""


def discover(measured: Path) -> list[tuple[str, dict]]:
    """(file name, parsed JSON) of every result file, by name; an unreadable file stops the page."""
    out = []
    for path in sorted(measured.glob("*.json")):
        try:
            out.append((path.name, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as e:
            raise tables.Malformed(f"{path.name}: expected a JSON document, found {type(e).__name__}: {e}") from None
    return out


def newest_per_device(files: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Of several files of one report on one device, the one measured last (by machine.date, then name)."""
    keep: dict[str, tuple[str, dict]] = {}
    for name, doc in files:
        dev = tables.need(doc, "machine.device", str, name)
        if dev not in keep or (doc["machine"].get("date", ""), name) > (keep[dev][1]["machine"].get("date", ""),
                                                                          keep[dev][0]):
            keep[dev] = (name, doc)
    return sorted(keep.values())


def groups(files: list[tuple[str, dict]]) -> list[list[tuple[str, dict]]]:
    """Files measured on one machine on one day with the same versions, in name order."""
    out: dict[str, list] = {}
    for name, doc in files:
        out.setdefault(tables.machine_line(name, doc), []).append((name, doc))
    return list(out.values())


def not_measured(files: list[tuple[str, dict]]) -> list[str]:
    """Facts about what no committed result covers, read off the results themselves."""
    def on_gpu(prefix):
        return [d for n, d in files if n.startswith(prefix) and d.get("machine", {}).get("device") != "cpu"]

    out = ["Several GPUs: peer copies, NCCL, a stream per GPU, torch.distributed on GPUs; every GPU row above "
           "holds all slots on one GPU."]
    if not on_gpu("real_size_"):
        out.append("Real-size models (1B and up) on a GPU: decode at batch 1, 8 and 32, prefill at 512 and 2048 "
                   "tokens.")
    if not any(d.get("device", "cpu") != "cpu" for d in on_gpu("scale_")):
        out.append("Device memory after loading a real-size model, against weights + KV cache + activations.")
    batches = {c.get("batch") for d in on_gpu("runtime_") for c in d.get("cases", [])}
    steps = {c.get("step") for d in on_gpu("runtime_") for c in d.get("cases", [])}
    if batches <= {1} or "prefill" not in steps:
        out.append("The 4-layer decode step on a GPU at batch 8 and 32, and its prefill step.")
    sections = {k for d in on_gpu("serving_") for k in d.get("sections", {})}
    if not {"2", "3", "4"} <= sections:
        out.append("Serving on a GPU: batching against one request at a time, memory over a long generation, "
                   "shared weights.")
    if not on_gpu("serve_load_"):
        out.append("`fastpipe serve` on a GPU.")
    if not any(r.get("section") == "pool" for d in on_gpu("memory_") for r in d.get("rows", [])):
        out.append("Buckets' CUDA graphs sharing one memory pool.")
    out.append("Models of 70B parameters, at any degree of parallelism.")
    return out


def table_of(renderer, name: str, doc: dict) -> list[str]:
    """renderer's lines for one file; a field it lacks is named as a Malformed error, not a traceback."""
    try:
        return renderer(name, doc)
    except (KeyError, IndexError, TypeError) as e:
        raise tables.Malformed(f"{name}: expected a field {e} of its report's result, found none or another "
                               f"type ({type(e).__name__})") from None


def render(measured: Path) -> str:
    files = discover(measured)
    known = tuple(p for p, *_ in SECTIONS)
    stray = [n for n, _ in files if not n.startswith(known)]
    if stray:
        raise tables.Malformed(f"{stray[0]}: expected a name starting with one of {', '.join(known)}")
    parts = [INTRO]
    for prefix, title, what, renderer in SECTIONS:
        mine = [(n, d) for n, d in files if n.startswith(prefix)]
        if prefix == "fused_":
            mine = newest_per_device(mine)
        section = []
        for group in groups(mine):
            rendered = ["\n".join(lines) + "\n" for lines in (table_of(renderer, n, d) for n, d in group) if lines]
            if rendered:
                section.append(f"### {tables.machine_line(*group[0])}\n\n" + "\n".join(rendered))
        if section:
            parts.append(f"## {title}\n\n{what}\n")
            parts += section
    parts.append(HOW)
    parts.append("## Not measured yet\n\n" + "\n".join(f"- {line}" for line in not_measured(files)) + "\n")
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", type=Path, default=ROOT / "bench" / "measured")
    ap.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 where --out differs")
    args = ap.parse_args(argv)
    try:
        page = render(args.measured)
    except tables.Malformed as e:
        print(f"results_page: {e}", file=sys.stderr)
        return 2
    if args.check:
        if not args.out.exists() or args.out.read_text() != page:
            print(f"results_page: {args.out} is not what {args.measured} renders; run python -m bench.results_page",
                  file=sys.stderr)
            return 1
        return 0
    from fastpipe.atomic import write_text

    write_text(args.out, page)
    print(f"wrote {args.out} ({len(page.encode())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
