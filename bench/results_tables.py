"""One markdown table per raw result file of bench/measured/, for the results page (bench/results_page.py).

Each renderer takes the file's name and its parsed JSON and returns the table's lines. Every ratio is
computed here from the rows measured in that one run, and every verdict from the targets the report
scripts define; nothing is copied from a verdict a file stored.
"""
from __future__ import annotations

import shlex

GIB = 2**30


class Malformed(ValueError):
    """A result file lacks a field the page needs: its name, the field's path, what was expected."""


def need(doc, path: str, kind=None, where: str = ""):
    """doc's value at a dotted path ('machine.date', 'cases.0.rows'), checked for its type."""
    cur = doc
    for key in path.split("."):
        try:
            cur = cur[int(key)] if isinstance(cur, list) else cur[key]
        except (KeyError, IndexError, ValueError, TypeError):
            raise Malformed(f"{where}: {path}: expected a value, found none") from None
    if kind is not None and not isinstance(cur, kind):
        raise Malformed(f"{where}: {path}: expected {getattr(kind, '__name__', kind)}, found {type(cur).__name__}")
    return cur


def ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 0.01 else f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def x(r: float) -> str:
    return f"{r:.2f}x"


def pct(f: float) -> str:
    return f"{f * 100:.0f}%"


def gib(b: float) -> str:
    return f"{b / GIB:.2f} GiB"


def speed(gain: float) -> str:
    """A speed ratio (baseline time over ours) in words: '1.37x faster', '1.22x slower'."""
    return f"{gain:.2f}x faster" if gain >= 1 else f"{1 / gain:.2f}x slower"


def met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


HEAD = [row("measure", "value", "baseline (same run)", "baseline value", "ratio", "target", "met"),
        "|---|---|---|---|---|---|---|"]


def provenance(name: str, doc: dict, command: str, model: str) -> list[str]:
    """The lines above a file's table: the file, the model, and the command that reproduces it (the device,
    date and versions head the file's group on the page)."""
    need(doc, "machine.date", str, name)
    return [f"`bench/measured/{name}`: {model}", f"`{command}`", ""]


def table(head: list[str], body: list[str]) -> list[str]:
    """head, the column names, then body; nothing where body has no row (a file with nothing to show)."""
    return head + HEAD + body if any(line.startswith("| ") for line in body) else []


def machine_line(name: str, doc: dict) -> str:
    """'NVIDIA H200, 2026-11-27; Python 3.12.3, torch 2.11.0+cu130, triton 3.6.0, fastpipe 0.1.0'."""
    m = need(doc, "machine", dict, name)
    dev = "CPU: " + m.get("cpu", "?") if m.get("device") == "cpu" else m.get("device", "?")
    return (f"{dev}, {need(doc, 'machine.date', str, name)}; Python {m.get('python')}, torch {m.get('torch')}, "
            f"triton {m.get('triton')}, fastpipe {m.get('fastpipe')}")


def flags(args: dict, keys: tuple[str, ...], defaults: dict | None = None) -> str:
    """`--key value` for each of keys that args holds with a value other than the script's default (lists
    comma-joined, True as a bare flag)."""
    out = []
    for k in keys:
        v = args.get(k)
        if v is None or v is False or v == "" or (defaults is not None and defaults.get(k) == v):
            continue
        out.append(f"--{k.replace('_', '-')}")
        if v is not True:
            out.append(",".join(map(str, v)) if isinstance(v, list) else str(v))
    return shlex.join(out)


# ------------------------------------------------------------------------------------- decode step
def unsplit(variant: str) -> str:
    """An unsplit row's name, saying which cache it ran on ('unsplit compiled' ran on a DynamicCache per call)."""
    return variant if "static cache" in variant else variant.replace("unsplit", "unsplit, DynamicCache per call,", 1)


def runtime(name: str, doc: dict) -> list[str]:
    """bench/report_runtime.py: per case, the replayed fastpipe rows against the fastest unsplit compiled row."""
    from bench.report_runtime import (DEFAULTS, PER_TENSOR_COPIES, REPLAY, SERVING_PREFILL, STREAMS,
                                      TARGET_REPLAY_VS_STREAMS, TARGET_VS_UNSPLIT, UNSPLIT_COMPILED, parse_args)

    a = need(doc, "args", dict, name)
    defaults = {**vars(parse_args([])), **DEFAULTS.get(a.get("device"), {})}
    cmd = "python bench/report_runtime.py " + flags(a, ("device", "cases", "batches", "past", "prefill_len", "layers",
                                                        "hidden", "heads", "kv_heads", "vocab", "dtype", "repeat"),
                                                    defaults)
    model = (f"Llama-family, {a['layers']} layers, hidden {a['hidden']}, {a['heads']}/{a['kv_heads']} heads, vocab "
             f"{a['vocab']}, {a['dtype']}, tp=2 on one device.")
    head, lines = provenance(name, doc, cmd, model), []
    for i, case in enumerate(need(doc, "cases", list, name)):
        rows = {r["variant"]: r for r in need(case, "rows", list, f"{name}: cases.{i}")
                if r.get("median_ms") and not str(r.get("check", "")).startswith("MISMATCH")}
        ours = {v: r for v, r in rows.items() if v.startswith("fastpipe") and "replay" in v
                and v not in SERVING_PREFILL and v not in PER_TENSOR_COPIES}   # what processor="auto" runs on a GPU
        theirs = [r for v, r in rows.items() if v in UNSPLIT_COMPILED]
        if not ours or not theirs:
            continue
        base = min(theirs, key=lambda r: r["median_ms"])
        best = min(ours.values(), key=lambda r: r["median_ms"])
        what = f"{case['step']} b{case['batch']}"
        for v, r in sorted(ours.items(), key=lambda kv: kv[1]["median_ms"]):
            ratio = r["median_ms"] / base["median_ms"]
            verdict = (f"<= {TARGET_VS_UNSPLIT}x (best)", met(ratio <= TARGET_VS_UNSPLIT)) if r is best else ("", "")
            lines.append(row(f"{what}: {v.removeprefix('fastpipe ')}", ms(r["median_ms"] / 1e3),
                             unsplit(base["variant"]),
                             ms(base["median_ms"] / 1e3), x(ratio), *verdict))
        if REPLAY in rows and STREAMS in rows:
            gain = rows[STREAMS]["median_ms"] / rows[REPLAY]["median_ms"]
            lines.append(row(f"{what}: {REPLAY.removeprefix('fastpipe ')}", ms(rows[REPLAY]["median_ms"] / 1e3),
                             STREAMS.removeprefix("fastpipe "), ms(rows[STREAMS]["median_ms"] / 1e3), speed(gain),
                             f">= {TARGET_REPLAY_VS_STREAMS:.0f}x faster", met(gain >= TARGET_REPLAY_VS_STREAMS)))
    return table(head, lines)


# ------------------------------------------------------------------------------------- greedy decode
def serving(name: str, doc: dict) -> list[str]:
    """bench/report_serving.py section 1: the engine's tokens/s against transformers' generate, compiled."""
    from bench.report_serving import parse_args

    a = need(doc, "args", dict, name)
    cmd = "python bench/report_serving.py " + flags(a, ("device", "dtype", "sections", "layers", "hidden", "vocab",
                                                        "tokens", "prompt", "tp"), vars(parse_args([])))
    mdl = need(doc, "model", dict, name)
    model = (f"Llama-family, {mdl['layers']} layers, hidden {mdl['hidden']}, vocab {mdl['vocab']}, {doc.get('dtype')}; "
             f"batch 1, prompt {a['prompt']}, {a['tokens']} new tokens; tokens compared with transformers'.")
    head, lines = provenance(name, doc, cmd, model), []
    rows = need(doc, "sections", dict, name).get("1", {}).get("rows", [])
    base = next((r for r in rows if r.get("key") == "transformers compiled" and r.get("tokens_per_s")), None)
    if base is None:
        return []
    for r in rows:                              # the compiled engine rows; the target is the default's (replayed)
        if r.get("kind") != "engine" or not r.get("tokens_per_s") or not r.get("compile"):
            continue
        gain = r["tokens_per_s"] / base["tokens_per_s"]
        lines.append(row(r["variant"].removeprefix("fastpipe engine, batch 1, ") + f", tokens {r.get('tokens')}",
                         f"{r['tokens_per_s']:.0f} tok/s", base["variant"].removeprefix("transformers "),
                         f"{base['tokens_per_s']:.0f} tok/s", speed(gain),
                         *((">= 1.0x, same tokens", met(gain >= 1.0 and r.get("tokens") == "identical"))
                           if r.get("cuda_graph") is not False else ("", ""))))
    return table(head, lines)


# ------------------------------------------------------------------------------------- fused kernels
SHORT_KERNEL = {"matmul_reduce_scatter": "mm + reduce-scatter", "all_gather_matmul": "all-gather + mm"}


def fused(name: str, doc: dict) -> list[str]:
    """bench/bench_fused_kernels.py: fused against unfused (collective + torch.mm) at the largest N = K and n."""
    from bench.bench_fused_kernels import TARGET_FROM_M, TARGET_OF_MM, TARGET_SPEEDUP

    a = need(doc, "args", dict, name)
    cmd = "python bench/bench_fused_kernels.py " + flags(a, ("kernel", "ms", "nk", "ns", "dim", "dtype", "check"))
    rows = [r for r in need(doc, "rows", list, name) if r.get("fused_ms") and r.get("unfused_ms")]
    if not rows:
        return []
    nk, n = max(r["N=K"] for r in rows), max(r["n"] for r in rows)
    model = (f"{a.get('dtype')}; one GPU stands for n participants. Shown: N = K {nk}, n {n}, dim 0. Targets from M = "
             f"{TARGET_FROM_M}: >= {TARGET_SPEEDUP}x faster than unfused, and >= {pct(TARGET_OF_MM)} of torch.mm's "
             "TFLOP/s on the same work.")
    head, lines = provenance(name, doc, cmd, model), []

    def ok(r):
        return (r["unfused_ms"] / r["fused_ms"] >= TARGET_SPEEDUP and bool(r.get("torch.mm_tflops"))
                and r["fused_tflops"] / r["torch.mm_tflops"] >= TARGET_OF_MM)

    shown = [r for r in rows if r["N=K"] == nk and r["n"] == n and r["dim"] == 0]
    for r in sorted(shown, key=lambda r: (r["kernel"], r["M"])):
        of_mm = f", {pct(r['fused_tflops'] / r['torch.mm_tflops'])} of mm" if r.get("torch.mm_tflops") else ""
        big = r["M"] >= TARGET_FROM_M
        lines.append(row(f"{SHORT_KERNEL.get(r['kernel'], r['kernel'])}, M {r['M']} "
                         f"({r['fused_tflops']:.0f} TFLOP/s{of_mm})", ms(r["fused_ms"] / 1e3), "unfused",
                         ms(r["unfused_ms"] / 1e3), speed(r["unfused_ms"] / r["fused_ms"]),
                         f">= {TARGET_SPEEDUP}x faster" if big else "", met(ok(r)) if big else ""))
    big = [r for r in rows if r["M"] >= TARGET_FROM_M]
    wins = sum(r["fused_ms"] < r["unfused_ms"] for r in rows)
    lines += ["", f"The whole grid ({len(rows)} cases): fused faster in {wins}; both targets met in "
                  f"{sum(map(ok, big))} of the {len(big)} with M >= {TARGET_FROM_M}."]
    return table(head, lines)


# ------------------------------------------------------------------------------------- load and memory (GPU)
def memory(name: str, doc: dict) -> list[str]:
    """bench/report_memory.py: load time against safetensors' own load; peak memory against the plan."""
    a = need(doc, "args", dict, name)
    cmd = "python bench/report_memory.py " + flags(a, ("device", "sections", "mb", "dtype", "rounds", "layers",
                                                       "hidden", "vocab"))
    model = (f"Load: a {a.get('mb')} MiB {a.get('dtype')} file, medians of {a.get('rounds')}. Memory: Llama-family, "
             f"{a.get('layers')} layers, hidden {a.get('hidden')}, tp=2 on one device.")
    head, lines = provenance(name, doc, cmd, model), []
    for r in need(doc, "rows", list, name):
        if r.get("section") == "load" and r.get("fastpipe_s"):
            ratio = r["fastpipe_s"] / r["baseline_s"]
            lines.append(row(f"load, page cache {r['mode']}", ms(r["fastpipe_s"]), "safetensors load_file(device=)",
                             ms(r["baseline_s"]), x(ratio), "", ""))
        elif (r.get("section") == "memory" and r.get("peak_allocated_bytes")
              and "cuda_graph=False" not in r["processor"]):    # the replayed runs
            ratio = r["peak_allocated_bytes"] / r["predicted_peak_bytes"]
            lines.append(row(f"{r['shape'].split(' (')[0]}, {r['processor']}: peak allocated",
                             f"{r['peak_allocated_bytes'] / 2**20:.0f} MiB", "the plan's peak",
                             f"{r['predicted_peak_bytes'] / 2**20:.0f} MiB", x(ratio), "", ""))
    return table(head, lines)


# ------------------------------------------------------------------------------------- real size
def geometry(name: str, doc: dict) -> str:
    """The checkpoint's geometry: the result's own "geometry", else the model field of its file name
    ('real_size_cpu_llama-3.1-8b_fastpipe_2026-11-28.json' -> 'llama-3.1-8b')."""
    if doc.get("geometry"):
        return doc["geometry"]
    parts = name.split("_")
    return parts[3] if name.startswith("real_size_") else parts[2]


def real_size(name: str, doc: dict) -> list[str]:
    """bench/report_real_size.py: each fastpipe row against the faster baseline of its case, and its fraction of
    the device's copy bandwidth (decode) or matmul rate (prefill); files without a fastpipe row add nothing."""
    from bench.report_real_size import verdicts

    cases = need(doc, "cases", list, name)
    tp = ",".join(map(str, need(doc, "tp", list, name)))
    batches = sorted({c["batch"] for c in cases if c.get("case") == "decode"})
    lens = sorted({c["prompt_len"] for c in cases if c.get("case") == "prefill"})
    cmd = (f"python bench/report_real_size.py --checkpoint DIR --tp {tp}"
           + (f" --batches {','.join(map(str, batches))}" if batches else "")
           + (f" --prompt-lens {','.join(map(str, lens))}" if lens else ""))
    model = (f"**{geometry(name, doc)}**, {doc.get('layers')} layers, {doc.get('weight_bytes', 0) / GIB:.2f} GiB of "
             f"{doc.get('dtype')}.")
    body = []
    for i, case in enumerate(cases):
        docs = need(case, "rows", list, f"{name}: cases.{i}")
        v = verdicts(docs, case["case"])
        what = (f"decode b{case['batch']} at {case['positions']}" if case["case"] == "decode"
                else f"prefill {case['prompt_len']} tokens")
        for d in docs:
            if not d["label"].startswith("fastpipe") or not d.get("median_s"):
                continue
            mine = v["rows"][d["label"]]
            logits = f"logits {d.get('logits_check') or 'not checked'}"
            vs = mine.get("vs_faster_baseline")
            if vs is not None:
                base = next(b for b in docs if b["label"] == vs["baseline"])
                body.append(row(f"{what}: {d['label']} ({logits})", ms(d["median_s"]), vs["baseline"],
                                ms(base["median_s"]), x(vs["ratio"]), f"<= {vs['target']}x", met(vs["met"])))
            else:
                body.append(row(f"{what}: {d['label']} ({logits})", ms(d["median_s"]), "none in this run", "", "",
                                "", ""))
            if case["case"] == "decode":
                frac = mine["bandwidth_fraction"]
                body.append(row(f"{what}: weights + KV cache read", f"{d['gb_per_s']:.1f} GB/s",
                                "a device copy, same rounds", f"{case['copy_bandwidth_gb_s']:.1f} GB/s",
                                pct(frac["value"]), f">= {pct(frac['target'])}", met(frac["met"])))
            else:
                frac = mine["matmul_fraction"]
                body.append(row(f"{what}: the model's FLOP/s", f"{d['tflop_per_s']:.2f} TFLOP/s",
                                "one bf16 matmul, same rounds", f"{case['matmul_tflop_s']:.2f} TFLOP/s",
                                pct(frac["value"]), f">= {pct(frac['target'])}", met(frac["met"])))
    return table(provenance(name, doc, cmd, model), body)


# ------------------------------------------------------------------------------------- build and load at scale
def scale(name: str, doc: dict) -> list[str]:
    """bench/report_scale.py: build time and peak RSS over every tp x pp; load time against safetensors."""
    from bench.report_scale import BUILD_MAX_PEAK, BUILD_MAX_S, HELD_TOLERANCE, LOAD_MAX_RATIO, median_of

    rows = need(doc, "rows", list, name)
    facts = need(doc, "verdicts", dict, name)          # the checkpoint's sizes, measured when the file was written
    weights, group = need(facts, "weights", int, name), need(facts, "largest_group", int, name)
    secs = sorted({r["section"] for r in rows}, key=("build", "serve", "load").index)
    cmd = (f"python bench/report_scale.py --checkpoint DIR --sections {','.join(secs)}"
           + (" --device " + doc["device"] if doc.get("device", "cpu") != "cpu" else ""))
    grid = sorted({(r["tp"], r["pp"]) for r in rows if "tp" in r})
    model = (f"**{geometry(name, doc)}**, {gib(weights)} of weights" +
             (f"; tp x pp: {', '.join(f'{t}x{p}' for t, p in grid)}" if grid else "") + ".")
    head, lines = provenance(name, doc, cmd, model), []
    what = {"build": "build the decode step", "serve": "build the serving set (6 pipelines)"}
    for sec in ("build", "serve"):
        ok = [r for r in rows if r["section"] == sec and "error" not in r]
        if not ok:
            continue
        worst = max(ok, key=lambda r: r["s"])
        peak = max(r["peak"] for r in ok)
        copied = sum(r["weight_bytes_copied"] for r in ok)
        refused = [f"tp={r['tp']} pp={r['pp']}" for r in rows if r["section"] == sec and "error" in r]
        label = f"{what[sec]}, slowest (tp={worst['tp']} pp={worst['pp']})" + (f"; refused {', '.join(refused)}"
                                                                               if refused else "")
        lines.append(row(label, f"{worst['s']:.1f} s; peak {gib(peak)}; {copied} bytes copied", "", "", "",
                         f"< {BUILD_MAX_S} s; < {gib(BUILD_MAX_PEAK)}; 0",
                         met(worst["s"] < BUILD_MAX_S and peak < BUILD_MAX_PEAK and copied == 0)))
    loads = [r for r in rows if r["section"] == "load" and "error" not in r]
    fp = [r for r in loads if r["label"].startswith("fastpipe")]
    st = [r for r in loads if r["label"].startswith("safetensors")]
    if fp and st:
        t_fp, t_st, over = median_of(fp, "s"), median_of(st, "s"), median_of(fp, "over_imports")
        lines.append(row(f"load ({fp[0]['label']}), every weight page read", f"{t_fp:.1f} s",
                         "safetensors load_file + clone", f"{t_st:.1f} s", x(t_fp / t_st), f"<= {LOAD_MAX_RATIO}x",
                         met(t_fp / t_st <= LOAD_MAX_RATIO)))
        lines.append(row("load: peak RSS over the imports", gib(over), "weights + the largest merged group",
                         gib(weights + group), x(over / (weights + group)), "<= 1.0x", met(over <= weights + group)))
    held = [r for r in fp if r.get("device_allocated")]
    if held and facts.get("load_held_expected"):
        want, got = facts["load_held_expected"], median_of(held, "device_allocated")
        lines.append(row("load: device memory allocated", gib(got), "weights + KV cache", gib(want), x(got / want),
                         f"within {pct(HELD_TOLERANCE)}", met(abs(got - want) <= HELD_TOLERANCE * want)))
    return table(head, lines)


# ------------------------------------------------------------------------------------- cold start
def cold_start(name: str, doc: dict) -> list[str]:
    """bench/cold_start.py: time to the first output in a fresh process (compile caches empty and warm), the
    steady speed reached in the same run, and the library's decode step once warm."""
    from bench.cold_start import FIRST_OUTPUT_TARGET_S, LIBRARY_RATIO_TARGET

    rows = need(doc, "rows", dict, name)
    m = need(doc, "model", dict, name)
    model = (f"**README main job** (graphs/tp_mlp) and a random Llama ({m['layers']} layers, hidden {m['hidden']}, "
             f"vocabulary {m['vocab']}, tp={m['tp']}, max_len {m['max_len']}) served by `fastpipe generate`; cold: an "
             "empty FASTPIPE_CACHE_DIR.")
    head, lines = provenance(name, doc, "python -m bench.cold_start", model), []
    for mode in ("background", "wait"):
        r = rows.get(f"readme_{mode}")
        if r is not None:
            cold, warm = r["cold"]["first_output_s"], r["warm"]["first_output_s"]
            on = mode == "background"
            lines.append(row(f"README job, first output, `--compile {mode}`, cold / warm", f"{cold:.1f} s / {warm:.1f} s",
                             "", "", "", f"< {FIRST_OUTPUT_TARGET_S:.0f} s cold" if on else "",
                             met(cold < FIRST_OUTPUT_TARGET_S) if on else ""))
    gen, wait = rows.get("generate_background"), rows.get("generate_wait", {}).get("warm")
    if gen:
        cold, warm = gen["cold"]["first_token_s"], gen["warm"]["first_token_s"]
        lines.append(row("`fastpipe generate`, first token, cold / warm", f"{cold:.1f} s / {warm:.1f} s", "", "", "",
                         f"< {FIRST_OUTPUT_TARGET_S:.0f} s cold", met(cold < FIRST_OUTPUT_TARGET_S)))
    for temp in ("cold", "warm") if gen else ():
        g = gen[temp]
        if "compiled_tokens_per_s" in g:
            after = g["compiled_tokens_per_s"]
            base = wait["tokens_per_s"] if wait else None
            lines.append(row(f"generate, {temp}: tokens/s once swapped in (token {g['swapped_at_token']}, "
                             f"{g['swapped_at_s']:.0f} s; eager before: {g['eager_tokens_per_s']:.0f})", f"{after:.0f}",
                             "`--compile wait`, warm" if base else "", f"{base:.0f}" if base else "",
                             x(base / after) if base else "", "", ""))
        else:
            lines.append(row(f"generate, {temp}: {g.get('decode_step', 'no decode-step line')}", "", "", "", "", "", ""))
    srv = rows.get("server")
    if srv:
        lines.append(row(f"server ready, cold / warm (then a 16-token answer in {srv['cold']['first_answer_s']:.1f} s)",
                         f"{srv['cold']['ready_s']:.1f} s / {srv['warm']['ready_s']:.1f} s", "", "", "", "", ""))
    lib = rows.get("library_decode_step")
    if lib:
        lines.append(row(f"`fastpipe.load(path).run` on a decode step (max_len {lib['max_len']}), defaults, settled in "
                         f"{lib['settled_after_s']:.0f} s", f"{lib['fastpipe_ms']:.3f} ms",
                         "transformers, static cache, torch.compile", f"{lib['transformers_compiled_ms']:.3f} ms",
                         x(lib["ratio"]), f"<= {LIBRARY_RATIO_TARGET}x", met(lib["ratio"] <= LIBRARY_RATIO_TARGET)))
    return head + table([], lines)


# ------------------------------------------------------------------------------------ HTTP server
def serve_load(name: str, doc: dict) -> list[str]:
    """bench/serve_load.py: the same streamed requests through `fastpipe serve` (HTTP) and through the engine
    in-process: throughput, time to first token and inter-token latency, medians over rounds."""
    from bench.serve_load import THROUGHPUT_KEPT_TARGET, TTFT_ADDED_TARGET_S

    a, m = need(doc, "args", dict, name), need(doc, "model", dict, name)
    http, base = need(doc, "rows.http", dict, name), need(doc, "rows.in_process", dict, name)
    model = (f"{a['requests']} streams from {a['clients']} clients, {a['output_lens']} tokens each; random Llama "
             f"({m['layers']} layers, hidden {m['hidden']}), batch {m['batch']}, eager, {a['rounds']} rounds.")
    cmd = "python -m bench.serve_load"
    kept = http["tokens_per_s"] / base["tokens_per_s"]
    added = http["ttft_p50_s"] - base["ttft_p50_s"]
    inproc = "engine"

    def both(r, key):                    # "p50 / p99"
        return f"{r[key + '_p50_s'] * 1e3:.1f} / {r[key + '_p99_s'] * 1e3:.1f} ms"

    lines = [row("throughput", f"{http['tokens_per_s']:.0f} tok/s", inproc, f"{base['tokens_per_s']:.0f} tok/s",
                 x(kept), f">= {THROUGHPUT_KEPT_TARGET:.2f}x", met(kept >= THROUGHPUT_KEPT_TARGET)),
             row("time to first token, p50 / p99", both(http, "ttft"), inproc, both(base, "ttft"),
                 f"{added * 1e3:+.1f} ms", f"<= +{TTFT_ADDED_TARGET_S * 1e3:.0f} ms", met(added <= TTFT_ADDED_TARGET_S)),
             row("inter-token latency, p50 / p99", both(http, "itl"), inproc, both(base, "itl"),
                 x(http["itl_p50_s"] / base["itl_p50_s"]), "", "")]
    rows = doc["rows"]
    for load, what in (("_solo", "one at a time"), ("_waves", "one length, in waves")):
        h, b = rows.get("http" + load), rows.get("in_process" + load)
        if h and b:
            lines.append(row(f"{what}: first token, p50", ms(h["ttft_p50_s"]), inproc, ms(b["ttft_p50_s"]),
                             f"{(h['ttft_p50_s'] - b['ttft_p50_s']) * 1e3:+.1f} ms", "", ""))
    return provenance(name, doc, cmd, model) + table([], lines)
