"""Serving benchmark, one run, printed as tables (ratios against baselines measured in the same run), on the
CPU or one GPU (first of all: greedy decode tokens/s for 128 new tokens vs transformers' generate, eager and
compiled static cache, tokens identical):

1. greedy decode tokens/s at batch 1, --tokens (128) new tokens after a --prompt (16) token prompt: the
   generation Engine (serving set, tp=2 on one device, region processor), compiled and eager, and on a
   GPU each both with its CUDA graph replayed (the default) and with cuda_graph=False, so the table shows
   what replay buys; plus a tp=1 set; vs transformers' generate with its static cache (as many positions
   as the engine's, max_len), eager and under torch.compile (on a GPU in transformers' own default mode,
   reduce-overhead = CUDA graphs; on a CPU mode "default"; --hf-mode). Ratios: vs compiled transformers;
2. continuous batching: --requests (64) requests of random prompt lengths (8-64 tokens, 16-64 new tokens)
   from 8 threads through a batch-8 engine (the whole set) vs one at a time through a batch-1 engine;
3. memory: RSS, and on a GPU torch.cuda.memory_allocated(), after each token of one --rss-tokens (256)
   token generation (flat after the first 16 tokens? target within 5%);
4. 3 exact-size buckets (ModelSet) hold the weights of one (target <= 1.1x).

Tokens: every row's are compared with transformers' greedy tokens for the same prompt ("identical", or
"DIFFER at token k"; section 2: per request), transformers run with no EOS (plain argmax, as the
engine's ignore_eos=True). A difference is reported, not fatal: bf16, or float32 on a GPU whose kernels
sum in another order, can flip a near-tie. Each engine row says on which device it ran and how its
decode step ran (Session.describe(): compiled or eager, replayed or not, or why a capture failed) and
its warm-up seconds (compile and capture, never timed). Batch-1 engines load only the set's batch-1
pipelines (decode_b1, prefill_b1_s*: all a batch-1 engine uses), so they warm up 3 pipelines, not 6.
Timing: median of --repeat (3) calls after one untimed call; on a GPU each timer starts and stops after
torch.cuda.synchronize() (the calls return host ints, which already waited for the GPU). A failing row
or section is printed (traceback) and kept in the JSON with its error; the run goes on and exits 1.

    python bench/report_serving.py [--device auto|cpu|cuda] [--dtype float32|bfloat16] [--sections 1,2,3,4]
        [--json out.json] [--no-compile] [--hf-mode auto|default|reduce-overhead] [--quick]
        [--layers 4] [--hidden 512] [--vocab 8000] [--tokens 128] [--requests 64] [--rss-tokens 256] [--tp 2]

--device: auto is cuda when torch.cuda.is_available(). Every slot of every pipeline goes to that one
  device (an explicit device_map, the same for all pipelines of the set: they share their slot names),
  so --device cpu runs the engine on the CPU on a GPU machine too; transformers' model and ids go there.
--dtype: the random checkpoint's dtype (its config.json), which the serving set is built in. Should the
  builder refuse the tp set in that dtype, the run says so (JSON "notes") and goes on with tp=1.
--sections: run only these (a GPU call has a time limit: e.g. --sections 1, then --sections 2,3,4).
--json PATH: the arguments, bench.machine.machine_info() and every row of every section run (variant,
  tokens/s, ratio, tokens verdict, how it ran), rewritten atomically (tmp file + os.replace) after each
  row of sections 1 and 2 and after each section: a run killed at its time limit keeps the rows it
  measured ("status": "running"; an unfinished section has "partial": true).
--no-compile: no compiled rows (transformers eager, engines eager only): a fast smoke run.
--quick: a tiny model, few tokens and requests (tests/test_bench_report_serving.py runs --quick
  --no-compile --device cpu).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SECTIONS = ("1", "2", "3", "4")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def table(rows, header) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths)] + rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")


def verdict(toks: list[int], ref: list[int]) -> str:
    """"identical", or where the first difference is (0-based index of the new token)."""
    if toks == ref:
        return "identical"
    k = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
    return f"DIFFER at token {k}"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="the random checkpoint's dtype")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of 1,2,3,4 (default all)")
    ap.add_argument("--json", default=None, help="write every row here (rewritten after each section)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled rows (transformers and engine)")
    ap.add_argument("--hf-mode", choices=("auto", "default", "reduce-overhead"), default="auto",
                    help="torch.compile mode of transformers' compiled row (auto: reduce-overhead on cuda, "
                         "default on cpu)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens of the batch-1 decode rows")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rss-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a small model and few tokens (a smoke run)")
    args = ap.parse_args(argv)
    args.new_range = (16, 64)               # section 2: new tokens per request
    if args.quick:
        args.new_range = (8, 24)
        args.layers, args.hidden, args.vocab, args.tokens, args.requests, args.rss_tokens, args.repeat = \
            2, 64, 100, 8, 8, 24, 1
    secs = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in secs if s not in SECTIONS]
    if bad or not secs:
        ap.error(f"--sections: expected a comma list of {', '.join(SECTIONS)}, found \"{args.sections}\"")
    args.sections = [s for s in SECTIONS if s in secs]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available on this machine")
    args.compile = not args.no_compile
    return args


class Report:
    """The JSON document: rewritten atomically (fastpipe.atomic) whenever a section or row is added."""

    def __init__(self, path: str | None, doc: dict):
        self.path, self.doc = path, doc
        self.doc.setdefault("sections", {})
        self.write()

    def add(self, key: str, section: dict) -> None:
        self.doc["sections"][key] = section
        self.write()

    def partial(self, key: str, rows: list) -> None:
        """A section's rows so far, written as they come ("partial": true until the section ends), so a
        run killed at its time limit keeps the rows it measured."""
        self.add(key, {"title": f"section {key} (unfinished)", "rows": list(rows), "partial": True})

    def write(self) -> None:
        if not self.path:
            return
        from fastpipe.atomic import write_text

        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(self.doc, indent=1, default=str) + "\n")


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        self.cuda = self.device.type == "cuda"

    # ------------------------------------------------------------------ timing
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, fn, repeat: int | None = None) -> tuple[float, object]:
        """Median seconds of `repeat` calls, and the last call's result. The GPU is synchronized before
        each timer starts and before it stops: every function timed here returns host ints (transformers'
        .tolist(), the engine's sampled tokens .tolist()), which already waited for the GPU, so the second
        synchronize only makes sure."""
        times, out = [], None
        for _ in range(repeat or self.args.repeat):
            self.sync()
            t = time.perf_counter()
            out = fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times), out

    # ------------------------------------------------------------------ engines
    def device_map(self, paths) -> dict[str, str]:
        """Every slot on self.device. Engine/ServingBuckets (and ModelSet) hand the same load keywords to
        fastpipe.load for every pipeline, and resolve_device_map refuses a slot a pipeline lacks, so the
        pipelines must share their slot names (a serving set's do: one tp/pp for all)."""
        from fastpipe.format import read_pipeline
        from fastpipe.serving.buckets import pipeline_paths

        slots = {p: tuple(sorted(read_pipeline(p).devices)) for p in pipeline_paths(paths)}
        names = set(slots.values())
        if len(names) != 1:
            raise RuntimeError("device_map: the pipelines have different slots ("
                               + "; ".join(f"{p.parent.name}: {s}" for p, s in slots.items())
                               + "); one device_map cannot place them all")
        return {s: str(self.device) for s in names.pop()}

    def engine(self, folder, *, batch: int, compile: bool, cuda_graph: bool | None = None, only_batch: bool = True):
        """An Engine on `folder`'s pipelines on self.device. only_batch: only the decode and prefill
        pipelines of this batch (what a batch-1 engine runs anyway: prefill_for picks the smallest batch
        >= the newcomers), so its warm-up compiles (and captures) 3 pipelines, not the set's 6."""
        from fastpipe.serving.buckets import pipeline_paths
        from fastpipe.serving.engine import Engine

        source = folder
        if only_batch:
            source = [p for p in pipeline_paths(folder) if p.parent.name == f"decode_b{batch}"
                      or p.parent.name.startswith(f"prefill_b{batch}_s")]
        kw = dict(compile=compile, device_map=self.device_map(source))
        if cuda_graph is not None:
            kw["cuda_graph"] = cuda_graph
        return Engine(source, batch=batch, eos_token_id=None, **kw)

    @staticmethod
    def how(eng) -> dict:
        devs = sorted({str(d) for s in eng.buckets.sessions() for d in s.slot_devices.values()})
        return {"device": ", ".join(devs), "decode": eng.decode.describe(), "warmup_s": round(eng.warmup_seconds, 2),
                "buckets": f"decode batches {sorted(eng.buckets.decodes)}, prefill (batch, length) "
                           f"{sorted(eng.buckets.prefills)}", "pipelines": len(eng.buckets.sessions())}


def error_row(variant: str, kind: str, e: BaseException) -> dict:
    traceback.print_exc()
    return {"variant": variant, "kind": kind, "tokens_per_s": None, "ratio": None, "tokens": "not run",
            "error": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"}


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_rows(rows: list[dict], ratio_name: str) -> None:
    table([(r["variant"], fmt(r["tokens_per_s"], ".1f"), fmt(r["ratio"], ".2f") + ("x" if r["ratio"] else ""),
            r["tokens"] if not r.get("error") else "FAILED: " + r["error"][:120]) for r in rows],
          ("variant", "tokens/s", ratio_name, "tokens"))
    hows = [r for r in rows if r.get("how")]
    for r in hows:
        h = r["how"]
        extra = f"; warm-up {h['warmup_s']:.1f} s, not timed" if "warmup_s" in h else ""
        print(f"  - {r['variant']}: on {h['device']}" + (f"; decode: {h['decode']}" if "decode" in h else "")
              + (f"; {h['run']}" if "run" in h else "") + extra)


def main(argv=None) -> int:
    args = parse_args(argv)

    from bench.generation_cases import hf_generate, load_requests, make_model, make_set
    from bench.machine import machine_info

    b = Bench(args)
    dtype = DTYPES[args.dtype]
    hf_mode = None if args.hf_mode == "auto" else args.hf_mode
    hf_mode_name = hf_mode or ("reduce-overhead" if b.cuda else "default")
    torch.manual_seed(0)
    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(f"run: device {b.device}, dtype {args.dtype}, sections {','.join(args.sections)}, "
          f"{'compiled and eager' if args.compile else 'eager only (--no-compile)'}")
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        mdir, model = make_model(tmp, layers=args.layers, hidden=args.hidden, vocab=args.vocab, dtype=dtype)
        model.to(b.device)
        max_len = max(args.prompt + args.tokens, 64 + 64, 16 + args.rss_tokens)
        tp, notes = args.tp, []
        folder = None
        if set(args.sections) & {"1", "2", "3"}:
            t = time.perf_counter()
            try:
                folder = make_set(mdir, tmp / "set", max_len=max_len, batches=(1, 8), prompt_lens=(16, 64), tp=tp)
            except Exception as e:  # noqa: BLE001 - e.g. a tp>1 bf16 set the builder refuses: go on with tp=1
                if tp == 1:
                    raise
                notes.append(f"the tp={tp} serving set failed to build ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:300]}); tp=1 instead")
                print("NOTE: " + notes[-1])
                tp = 1
                folder = make_set(mdir, tmp / "set", max_len=max_len, batches=(1, 8), prompt_lens=(16, 64), tp=tp)
            build_s = time.perf_counter() - t
            print(f"model: Llama-family, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {args.dtype}; "
                  f"serving set tp={tp}, max_len {max_len}, batches 1 and 8, prompt buckets 16 and 64 (6 pipelines, "
                  f"built in {build_s:.1f} s)")
        report = Report(args.json, {
            "machine": info, "args": {k: v for k, v in vars(args).items()}, "device": str(b.device),
            "dtype": args.dtype, "tp": tp, "max_len": max_len, "notes": notes, "status": "running",
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "model": {"family": "llama", "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab}})
        prompt = torch.randint(3, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()

        def ref_tokens(p, n):
            return hf_generate(model, p, n, compiled=False, max_cache_len=max_len)

        def section1():
            n = args.tokens
            rows = []
            base = "transformers compiled" if args.compile else "transformers eager"
            ref = None
            for compiled in ([False, True] if args.compile else [False]):
                name = ("transformers generate, static cache, "
                        + (f"torch.compile ({hf_mode_name})" if compiled else "eager"))
                try:
                    hf_generate(model, prompt, n, compiled=compiled, max_cache_len=max_len, compile_mode=hf_mode)  # warm / compile, untimed
                    t, toks = b.timed(lambda: hf_generate(model, prompt, n, compiled=compiled, max_cache_len=max_len,
                                                          compile_mode=hf_mode))
                    if ref is None:
                        ref = toks
                    rows.append({"variant": name, "kind": "transformers", "key": "transformers " +
                                 ("compiled" if compiled else "eager"), "seconds": t, "tokens_per_s": n / t,
                                 "tokens": "reference" if toks is ref else verdict(toks, ref),
                                 "how": {"device": str(b.device), "run": f"{args.dtype}, " + (
                                     f"torch.compile mode {hf_mode_name}, fullgraph" if compiled else "eager")}})
                except Exception as e:  # noqa: BLE001 - reported, the run goes on
                    rows.append(error_row(name, "transformers", e))
                report.partial("1", rows)
            if ref is None:
                ref = ref_tokens(prompt, n)
            variants = []                     # (label, folder, tp, compile, cuda_graph)
            for comp in ([True, False] if args.compile else [False]):
                for graph in ([True, False] if b.cuda else [None]):
                    label = (f"fastpipe engine, batch 1, tp={tp} set, {'compiled' if comp else 'eager'}"
                             + {True: ", CUDA graph replayed", False: ", cuda_graph=False", None: ""}[graph])
                    variants.append((label, "set", comp, graph))
            if tp != 1:
                variants.append((f"fastpipe engine, batch 1, tp=1 set, {'compiled' if args.compile else 'eager'}"
                                 + (", CUDA graph replayed" if b.cuda else ""), "set_tp1", args.compile, None))
            one = None
            for label, which, comp, graph in variants:
                try:
                    if which == "set_tp1" and one is None:
                        one = make_set(mdir, tmp / "set_tp1", max_len=max_len, batches=(1,), prompt_lens=(16,), tp=1)
                    with b.engine(folder if which == "set" else one, batch=1, compile=comp, cuda_graph=graph) as eng:
                        eng.generate([prompt], max_new_tokens=n, ignore_eos=True)          # one untimed request
                        t, toks = b.timed(lambda: eng.generate([prompt], max_new_tokens=n, ignore_eos=True)[0])
                        how = b.how(eng)
                    rows.append({"variant": label, "kind": "engine", "compile": comp, "cuda_graph": graph,
                                 "seconds": t, "tokens_per_s": n / t, "tokens": verdict(toks, ref), "how": how})
                except Exception as e:  # noqa: BLE001 - reported, the run goes on
                    rows.append(error_row(label, "engine", e))
                report.partial("1", rows)
            ok = {r["key"]: r["seconds"] for r in rows if r.get("key") and not r.get("error")}
            base = next((k for k in (base, "transformers eager") if k in ok), base)   # compiled failed: vs eager
            t_base = ok.get(base)
            for r in rows:
                r["ratio"] = t_base / r["seconds"] if t_base and r.get("seconds") else None
            title = (f"greedy decode, batch 1, prompt {args.prompt}, {n} new tokens, static caches of {max_len} "
                     f"positions on both sides (median of {args.repeat}, after one untimed run)")
            print(f"\n1. {title}")
            print_rows(rows, f"vs {base}")
            return {"title": title, "ratio_vs": base, "rows": rows}

        def section2():
            from bench.generation_cases import one_at_a_time, serve

            lo, hi = args.new_range
            prompts, news = load_requests(args.requests, args.vocab, prompt=(8, 64), new=(lo, hi))
            refs = [ref_tokens(p, k) for p, k in zip(prompts, news)]

            def check(outs):
                bad = [(i, verdict(o, r)) for i, (o, r) in enumerate(zip(outs, refs)) if o != r]
                if not bad:
                    return "identical"
                return f"DIFFER in {len(bad)}/{len(refs)} requests (first: request {bad[0][0]}, {bad[0][1][7:]})"

            rows = []
            total = sum(news)
            res = {}
            for label, batch, run in (("one at a time, batch-1 engine", 1, one_at_a_time),
                                      ("continuous batching, batch-8 engine, 8 threads", 8, serve)):
                try:
                    with b.engine(folder, batch=batch, compile=args.compile, only_batch=batch == 1) as eng:
                        run(eng, prompts[:2], news[:2])                    # untimed
                        steps0 = eng.steps
                        b.sync()
                        outs, t = run(eng, prompts, news)
                        b.sync()
                        how = b.how(eng)
                        how["decode_steps"] = eng.steps - steps0
                    res[batch] = outs
                    rows.append({"variant": label, "kind": "engine", "batch": batch, "seconds": t,
                                 "tokens_per_s": total / t, "tokens": check(outs), "how": how})
                except Exception as e:  # noqa: BLE001 - reported, the run goes on
                    rows.append(error_row(label, "engine", e))
                report.partial("2", rows)
            t_solo = rows[0].get("seconds")
            for r in rows:
                r["ratio"] = t_solo / r["seconds"] if t_solo and r.get("seconds") else None
            same = sum(a == c for a, c in zip(res.get(1, []), res.get(8, []))) if len(res) == 2 else None
            title = (f"{args.requests} requests (prompts 8-64 tokens, {lo}-{hi} new tokens each, {total} tokens), greedy, "
                     "tokens vs transformers' per request")
            print(f"\n2. {title}" + (f"; batched: {rows[1]['how']['decode_steps']} decode steps; {same}/"
                                    f"{len(prompts)} batched requests equal their solo run" if same is not None else ""))
            print_rows(rows, "speed-up")
            return {"title": title, "ratio_vs": "one at a time", "rows": rows, "batched_equal_solo": same}

        def section3():
            from bench.generation_cases import memory_per_token

            n, p = args.rss_tokens, prompt[:16]
            ref = ref_tokens(p, n)
            label = f"batch-1 engine, one streamed {n}-token request"
            try:
                with b.engine(folder, batch=1, compile=args.compile) as eng:
                    toks, rss, gpu, t = memory_per_token(eng, p, n, cuda=b.cuda)
                    how = b.how(eng)
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                row = error_row(label, "engine", e)
                print(f"\n3. RSS per token: FAILED: {row['error']}")
                return {"title": "memory per token", "rows": [row]}
            k = min(15, len(rss) - 1)

            def growth(xs):
                return (max(xs[k + 1:] or xs) - xs[k]) / xs[k] if xs[k] else 0.0

            row = {"variant": label, "kind": "engine", "seconds": t, "tokens_per_s": n / t, "ratio": None,
                   "tokens": verdict(toks, ref), "how": how, "rss_after_16_bytes": rss[k], "rss_max_bytes": max(rss),
                   "rss_last_bytes": rss[-1], "rss_growth": growth(rss)}
            line = (f"RSS {rss[k] / 2**20:.1f} MiB after token {k + 1}, max {max(rss) / 2**20:.1f} MiB, last "
                    f"{rss[-1] / 2**20:.1f} MiB: {growth(rss) * 100:+.2f}%")
            if gpu is not None:
                row.update(cuda_allocated_after_16_bytes=gpu[k], cuda_allocated_max_bytes=max(gpu),
                           cuda_allocated_last_bytes=gpu[-1], cuda_allocated_growth=growth(gpu))
                line += (f"; GPU memory allocated {gpu[k] / 2**20:.1f} MiB after token {k + 1}, max "
                         f"{max(gpu) / 2**20:.1f} MiB, last {gpu[-1] / 2**20:.1f} MiB: {growth(gpu) * 100:+.2f}%")
            title = f"memory over one {n}-token generation (batch 1), after the first {k + 1} tokens (target within 5%)"
            print(f"\n3. {title}: {line}")
            print_rows([row], "-")
            return {"title": title, "rows": [row], "rss_bytes": rss, "cuda_allocated_bytes": gpu}

        def section4():
            from fastpipe.builder.hf.build import build_hf
            from fastpipe.serving import ModelSet

            b3 = [build_hf(mdir, tp=tp, batch=k, seq_len=args.prompt).save(tmp / f"b{k}") for k in (1, 2, 4)]
            dm = b.device_map(b3)
            with ModelSet(b3[:1], device_map=dm) as one, ModelSet(b3, device_map=dm) as three:
                w1, w3 = one.weight_bytes(), three.weight_bytes()
            title = "3 exact-size buckets (batch 1, 2, 4) vs one bucket: weight bytes held (target <= 1.1x)"
            print(f"\n4. 3 exact-size buckets (batch 1, 2, 4), tp={tp}, on {b.device}, hold {w3 / 2**20:.2f} MiB of "
                  f"weights, one bucket {w1 / 2**20:.2f} MiB: {w3 / w1:.2f}x (target <= 1.1x)")
            return {"title": title, "rows": [
                {"variant": "ModelSet, 1 bucket", "kind": "memory", "weight_bytes": w1, "ratio": 1.0},
                {"variant": "ModelSet, 3 buckets", "kind": "memory", "weight_bytes": w3, "ratio": w3 / w1}]}

        for key, fn in (("1", section1), ("2", section2), ("3", section3), ("4", section4)):
            if key not in args.sections:
                continue
            t = time.perf_counter()
            try:
                sec = fn()
            except Exception as e:  # noqa: BLE001 - reported, the next section runs
                traceback.print_exc()
                sec = {"title": f"section {key}", "error": f"{type(e).__name__}: {e}",
                       "rows": report.doc["sections"].get(key, {}).get("rows", [])}   # the rows it had measured
            sec["seconds"] = round(time.perf_counter() - t, 1)
            if sec.get("error") or any(r.get("error") for r in sec["rows"]):
                failed.append(key)
            report.add(key, sec)
        report.doc["status"] = "done"
        report.doc["failed_sections"] = failed
        report.write()
    if failed:
        print(f"\nsections with failures: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    from bench.sigint import stop_on_sigint

    stop_on_sigint()            # even where started with SIGINT ignored (gpu_check's stage limit)
    sys.exit(main())
