"""Slots that share a device: the region processor against the other processors and the unsplit model,
in one run (CPU).

    python bench/report_region.py                  # every example in graphs/ and the Llama-512 steps
    python bench/report_region.py --quick          # fewer rounds: a check that it runs end to end
    python bench/report_region.py --cases llama    # only the Llama decode and prefill steps

Cases: each example in graphs/ (the pipeline's own inputs; the unsplit module from tests/examples.py),
and a random Llama-family model (4 layers, hidden 512, 8 q / 4 kv heads, intermediate 1408, vocab
8000) built with tp=2: a decode step (1 new token over 128 cached, batch 1) and a prefill step
(batch 1, seq 64). The Llama rows call `session.run_model` with the model's own inputs (slicing onto
the slots and assembling the logits included), the unsplit rows call the HF model with a fresh
DynamicCache; every fastpipe row's outputs are checked (examples: expected.safetensors; Llama: the
unsplit model's logits).

Variants per case: the region processor compiled (shard matmuls merged), compiled with the shards
kept (merge_shards=False) and eager; the threaded cpu processor eager and compiled (per supertask);
the reference processor; the unsplit model eager and under torch.compile (dynamic=False), both under
torch.inference_mode. Every session compiles (Session.compile: one warm-up run) before it is timed;
the compile seconds are a column of their own, and the unsplit model's compile is its first call.
The first real call after that is made apart too: a recompile there (a guard the warm-up inputs
did not exercise) is reported in the notes with that call's time.

Timing: after --warmup calls each, the variants of one case are timed in interleaved rounds (round
r times every variant once), so load drifting on the machine hits them alike. A sample is the mean
of enough back-to-back calls to last about 2 ms; the table gives the median and p10/p90 of --repeat
samples, and the ratio of the median to the unsplit compiled model's median measured in the same
run (time / unsplit compiled: lower is faster). Compile seconds are cold by default: inductor's
on-disk cache goes to a fresh temporary folder (--warm-cache keeps the usual one). Graphs a process
already compiled are shared: two sessions with identical region graphs (nothing to merge) compile
once, which the notes say.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BASELINE = "unsplit compiled"
LLAMA = dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1408, vocab_size=8000)
LLAMA_STEPS = {"decode": dict(batch=1, seq_len=1, past_len=128), "prefill": dict(batch=1, seq_len=64, past_len=None)}
# label, load keywords (None: the unsplit model)
VARIANTS = [
    ("region compiled (shards merged)", dict(processor="region", compile=True)),
    ("region compiled, shards kept", dict(processor="region", compile=True, merge_shards=False)),
    ("region eager", dict(processor="region")),
    ("cpu processor compiled", dict(processor="cpu", compile=True)),
    ("cpu processor eager", dict(processor="cpu")),
    ("reference processor", dict(processor="reference")),
    ("unsplit eager", None),
    (BASELINE, None),
]


@dataclass
class Row:
    variant: str
    fn: Callable | None = None          # one call, as timed
    compile_s: float | None = None
    recompile_s: float | None = None     # the first real call, when it recompiled
    shared: bool = False                  # its compiled graph is another row's
    check: str = ""
    notes: list[str] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)   # ms per call
    inner: int = 1
    error: str = ""


def first_call(fn) -> tuple[float, list[str]]:
    """One call, timed, with the fastpipe warnings it raised (a recompile after warm-up)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
    return dt, [" ".join(str(w.message).split()) for w in caught if "fastpipe" in str(w.message)]


def measure(rows: list[Row], repeat: int, warmup: int, sample_ms: float, stop=lambda: False) -> None:
    """Time each live row: warm-up calls, then `repeat` interleaved samples (round r samples every row
    once). stop(): checked after each sample; true raises KeyboardInterrupt (the samples taken are kept)."""
    live = [r for r in rows if r.fn is not None and not r.error]
    for r in live:
        for _ in range(warmup):
            r.fn()
        t = time.perf_counter()
        r.fn()
        one = (time.perf_counter() - t) * 1e3
        r.inner = max(1, min(1000, int(sample_ms / max(one, 1e-3))))
    for _ in range(repeat):
        for r in live:
            t = time.perf_counter()
            for _ in range(r.inner):
                r.fn()
            r.samples.append((time.perf_counter() - t) * 1e3 / r.inner)
            if stop():
                raise KeyboardInterrupt


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def table(rows: list[Row], base: float | None = None, base_label: str = BASELINE, outputs: str = "outputs") -> list[str]:
    """The markdown table of one case; ratios are time / `base` (default: the BASELINE row's median)."""
    if base is None:
        base = next((statistics.median(r.samples) for r in rows if r.variant == BASELINE and r.samples), None)
    out = [f"| variant | median ms | p10 ms | p90 ms | time / {base_label} | compile s | {outputs} |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        comp = "-" if r.compile_s is None else "shared" if r.shared else f"{r.compile_s:.2f}"
        if r.recompile_s is not None:
            comp += f" + {r.recompile_s:.2f} recompiling at the first call"
        if not r.samples:
            out.append(f"| {r.variant} | FAILED | | | | {comp} | {r.error or r.check} |")
            continue
        med = statistics.median(r.samples)
        ratio = f"{med / base:.2f}x" if base else "-"
        out.append(f"| {r.variant} | {med:.3f} | {pct(r.samples, 0.1):.3f} | {pct(r.samples, 0.9):.3f} | {ratio} | "
                   f"{comp} | {r.check or '-'} |")
    return out


def fastpipe_row(label: str, kw: dict, path: Path, call: Callable, check: Callable, shared: dict) -> Row:
    """Load, compile (warm-up), one first call apart, the check; `call(sess)` runs it once."""
    import fastpipe

    row = Row(label)
    try:
        sess = fastpipe.load(path, **kw)
        rep = sess.compile()
        if kw.get("compile"):
            row.compile_s = rep.seconds
            if rep.eager:
                row.notes.append(f"left eager by a failed compile: {', '.join(map(str, rep.eager))}")
            if sess.processor == "region":
                graphs = tuple(id(cg) for cg in sess.runner.compiled_graphs().values())
                if graphs in shared:
                    row.shared = True
                    row.notes.append(f"the same region graph as \"{shared[graphs]}\" (nothing to merge): "
                                     "compiled once, for that row")
                shared.setdefault(graphs, label)
        if sess.processor == "region":
            row.notes.append(sess.describe())
        dt, warned = first_call(lambda: call(sess))
        if warned:
            row.recompile_s = dt
            row.notes.append(f"the first call after warm-up took {dt * 1e3:.0f} ms: " + " | ".join(sorted(set(warned))))
        row.check = check(call(sess))
        row.fn = lambda: call(sess)
        row.session = sess                     # kept alive until the case is done
    except Exception as e:  # noqa: BLE001 - a failing variant is a row of the table, not the end of the run
        row.error = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        traceback.print_exc()
    return row


def unsplit_rows(fn_eager: Callable, fn_compiled: Callable) -> list[Row]:
    import torch

    eager = Row("unsplit eager", fn=lambda: _inference(fn_eager))
    comp = Row(BASELINE)
    t = time.perf_counter()
    with torch.inference_mode():
        fn_compiled()
    comp.compile_s = time.perf_counter() - t
    comp.fn = lambda: _inference(fn_compiled)
    return [eager, comp]


def _inference(fn):
    import torch

    with torch.inference_mode():
        return fn()


def example_case(name: str) -> list[Row]:
    import torch
    from safetensors.torch import load_file

    from bench.test_bench_examples import _model_inputs
    from tests.examples import GRAPHS, unsplit_module

    path = GRAPHS / name / "pipeline.json"
    ins = load_file(str(GRAPHS / name / "inputs.safetensors"))
    expected = load_file(str(GRAPHS / name / "expected.safetensors"))

    def check(out) -> str:
        err = max((out[k] - v).abs().max().item() for k, v in expected.items())
        ok = all(torch.allclose(out[k], v, rtol=1e-4, atol=1e-5) for k, v in expected.items())
        return ("ok" if ok else "MISMATCH") + f" (max err {err:.1e})"

    rows, shared = [], {}
    m = unsplit_module(name)
    args = _model_inputs(name, ins)
    cm = torch.compile(m, dynamic=False)
    for label, kw in VARIANTS:
        if kw is not None:
            rows.append(fastpipe_row(label, kw, path, lambda s: s.run(ins), check, shared))
    rows += unsplit_rows(lambda: m(*args), lambda: cm(*args))
    return rows


def llama_case(step: str, folder: Path, model, out: Path) -> list[Row]:
    import torch

    from bench.unsplit_calls import hf_call
    from fastpipe.builder.hf.build import build_hf
    from tests.tensor_compare import assert_close

    shape = LLAMA_STEPS[step]
    path = build_hf(folder, tp=2, **shape).save(out)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (shape["batch"], shape["seq_len"]), generator=g)
    hd = cfg.hidden_size // cfg.num_attention_heads
    past = None
    if shape["past_len"]:
        past = [[torch.randn(shape["batch"], cfg.num_key_value_heads, shape["past_len"], hd, generator=g)
                 for _ in range(2)] for _ in range(cfg.num_hidden_layers)]
    kwargs = {"input_ids": ids} if past is None else {"input_ids": ids, "past_key_values": past}

    ref = _inference(lambda: hf_call(model, ids, past))
    tol = 1e-4 * ref.abs().max().item()

    def check(res) -> str:
        err = (res["logits"] - ref).abs().max().item()
        try:
            assert_close(res["logits"], ref, rtol=0.0, atol=tol, what="logits")
            return f"ok (max err {err:.1e})"
        except AssertionError:
            return f"MISMATCH (max err {err:.1e} > {tol:.1e})"

    rows, shared = [], {}
    cm = torch.compile(model, dynamic=False)
    for label, kw in VARIANTS:
        if kw is not None:
            rows.append(fastpipe_row(label, kw, path, lambda s: s.run_model(**kwargs), check, shared))
    rows += unsplit_rows(lambda: hf_call(model, ids, past), lambda: hf_call(cm, ids, past))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="examples,llama", help="examples, llama, or both (comma-separated)")
    ap.add_argument("--repeat", type=int, default=40, help="timed samples per variant (default 40)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per variant before timing (default 3)")
    ap.add_argument("--sample-ms", type=float, default=2.0, help="a sample lasts about this long (default 2)")
    ap.add_argument("--quick", action="store_true", help="--repeat 5 --warmup 1: a check that it runs")
    ap.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache (compile s: warm)")
    args = ap.parse_args()
    if args.quick:
        args.repeat, args.warmup = 5, 1
    if args.repeat < 1 or args.warmup < 0:
        ap.error("--repeat must be >= 1 and --warmup >= 0")
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    if not cases or cases - {"examples", "llama"}:
        ap.error(f"--cases: expected examples and/or llama, found {args.cases!r}")
    tmp = tempfile.TemporaryDirectory()
    if not args.warm_cache:           # before torch is imported: compile seconds are cold ones
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp.name) / "inductor")
    t_start = time.perf_counter()

    import torch

    from bench.machine import machine_info
    from tests.examples import EXAMPLES

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    results: list[tuple[str, list[Row]]] = []
    if "examples" in cases:
        for name in EXAMPLES:
            rows = example_case(name)
            measure(rows, args.repeat, args.warmup, args.sample_ms)
            results.append((f"example {name}", rows))
            print(f"... example {name} done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
    if "llama" in cases:
        import transformers

        from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint

        folder = Path(tmp.name) / "llama"
        model = save_random_checkpoint(transformers.LlamaConfig(**LLAMA), folder, seed=0).eval()
        titles = {"decode": "Llama decode step (4 layers, hidden 512, tp=2, 128 cached tokens, batch 1)",
                  "prefill": "Llama prefill step (4 layers, hidden 512, tp=2, batch 1, seq 64)"}
        for step in ("decode", "prefill"):
            rows = llama_case(step, folder, model, Path(tmp.name) / step)
            measure(rows, args.repeat, args.warmup, args.sample_ms)
            results.append((titles[step], rows))
            print(f"... llama {step} done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
    tmp.cleanup()

    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()) + f", torch threads {torch.get_num_threads()}")
    print(f"command: python bench/{Path(__file__).name} " + " ".join(sys.argv[1:]))
    print(f"timing: median and p10/p90 of {args.repeat} samples per variant (each the mean of back-to-back calls "
          f"lasting ~{args.sample_ms:g} ms), after {args.warmup} warm-up calls, variants interleaved; "
          f"compile s {'warm' if args.warm_cache else 'cold'} (inductor cache)")
    for title, rows in results:
        print(f"\n### {title}\n")
        print("\n".join(table(rows)))
        notes = [(r.variant, n) for r in rows for n in r.notes]
        if notes:
            print()
            for variant, n in notes:
                print(f"- {variant}: {n}")
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    failed = [r.variant for _, rows in results for r in rows if r.error or r.check.startswith("MISMATCH")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
