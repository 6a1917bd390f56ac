"""Cold start: how soon fastpipe answers in a fresh process, with its compile caches empty and warm, and the
steady-state speed it reaches in the same run.

    python -m bench.cold_start                         # writes bench/measured/cold_start_<machine>_<date>.json
    python -m bench.cold_start --tokens 2000 --layers 4 --quick

Every figure comes from a fresh process (`subprocess`), its stdout read line by line as it is written:
- README main job: `fastpipe run graphs/tp_mlp/...  --check ...`, time to its first output line and to its
  exit; with the default `--compile background` and with `--compile wait` (the old behaviour: compile
  before the first run).
- `fastpipe generate` on a serving set of a random Llama (bench.generation_cases.make_model: 4 layers,
  hidden 512, vocabulary 8000, bfloat16, split tp=2): time to the first token on stdout; its tokens/s eager before
  the background compile was swapped in and compiled after (the CLI's closing lines), against the
  steady tokens/s of `--compile wait` (what "the compiled speed" is).
- A ready server: `fastpipe serve` on the same set, time to its "listening" line, then to the answer
  of a first request (16 tokens).
- The library's decode step: `fastpipe.load(path)` with its defaults on a builder-made decode step of the
  same model (tp=2, a static cache of 256 positions), run until its compile settled (in this process),
  then timed, against the unsplit model in transformers on a static cache compiled with torch.compile
  (bench.report_real_size.HFStatic), the same step at the same position: the ratio the targets name.

"Cold" is an empty FASTPIPE_CACHE_DIR (inductor's FX-graph and AOTAutograd caches start empty; the
machine's page cache is warm: the files were just written); "warm" is the same folder after the cold
run. TORCHINDUCTOR_CACHE_DIR is removed from the children's environment so that fastpipe's folder is used.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_JOB = ["run", "graphs/tp_mlp/pipeline.json", "--inputs", "graphs/tp_mlp/inputs.safetensors",
              "--check", "graphs/tp_mlp/expected.safetensors"]
FIRST_OUTPUT_TARGET_S = 10.0     # README job's first output, and generate's first token, cold
LIBRARY_RATIO_TARGET = 1.1       # fastpipe.load(path).run on the decode step vs the unsplit model compiled, warm
PROMPT = [5, 7, 9, 11, 13, 17, 19, 23]


def _env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(FASTPIPE_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return env


def timed_lines(cmd: list[str], cache: Path, timeout: float) -> dict:
    """Run cmd; (seconds since start, line) for each stdout line, stderr, exit code and total seconds."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append((time.perf_counter() - t0, line.rstrip("\n")))
    err = proc.stderr.read()
    code = proc.wait(timeout=timeout)
    return {"lines": lines, "stderr": err, "code": code, "total_s": time.perf_counter() - t0}


def first_token_run(cmd: list[str], cache: Path, timeout: float) -> dict:
    """Run `fastpipe generate ... --ids`: the time its first token reaches stdout (read a character at a time)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=0)
    first, out = None, []
    while True:
        ch = proc.stdout.read(1)
        if not ch:
            break
        if first is None and ch.strip():
            first = time.perf_counter() - t0
        out.append(ch)
    err = proc.stderr.read()
    code = proc.wait(timeout=timeout)
    return {"first_token_s": first, "tokens": len("".join(out).split()), "stderr": err, "code": code,
            "total_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------ cases
def readme_job(cache: Path, mode: str) -> dict:
    r = timed_lines([sys.executable, "-m", "fastpipe", *README_JOB, "--compile", mode], cache, 900)
    assert r["code"] == 0, r["stderr"][-2000:]
    first_s, first_line = r["lines"][0]
    return {"mode": mode, "first_output_s": round(first_s, 3), "exit_s": round(r["total_s"], 3),
            "first_line": first_line, "check": r["lines"][-1][1]}


_SWAP = re.compile(r"swapped in at token (\d+) \(([\d.]+) s\): ([\d.na]+) tokens/s eager before, ([\d.na]+) tokens/s "
                   r"compiled after")
_STATS = re.compile(r"^(\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s, first token after (\d+) ms\)")


def generate(serving_set: Path, cache: Path, mode: str, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "fastpipe", "generate", str(serving_set), "--prompt-ids", ",".join(map(str, PROMPT)),
           "--max-new-tokens", str(tokens), "--ignore-eos", "--ids", "--batch", "1", "--compile", mode]
    r = first_token_run(cmd, cache, 3600)
    assert r["code"] == 0, r["stderr"][-2000:]
    doc = {"mode": mode, "first_token_s": round(r["first_token_s"], 3), "exit_s": round(r["total_s"], 3),
           "tokens": r["tokens"]}
    for line in r["stderr"].splitlines():
        if (m := _STATS.match(line)) is not None:
            doc["tokens_per_s"] = float(m.group(3))
        if (m := _SWAP.search(line)) is not None:
            doc.update(swapped_at_token=int(m.group(1)), swapped_at_s=float(m.group(2)),
                       eager_tokens_per_s=float(m.group(3)), compiled_tokens_per_s=float(m.group(4)))
        if line.startswith("decode step:"):
            doc["decode_step"] = line
    return doc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server(serving_set: Path, cache: Path) -> dict:
    port = _free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fastpipe", "serve", str(serving_set), "--port", str(port),
                             "--batch", "1"],
                            cwd=ROOT, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        ready = time.perf_counter() - t0
        assert line.startswith("listening on"), line + proc.stderr.read()
        body = json.dumps({"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "temperature": 0}).encode()
        t = time.perf_counter()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as resp:
            answer = json.loads(resp.read())
        first_answer = time.perf_counter() - t
        assert answer["usage"]["completion_tokens"] == 16, answer
        return {"ready_s": round(ready, 3), "first_answer_s": round(first_answer, 3), "line": line.strip()}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def library_decode_step(model_dir: Path, out: Path, repeat: int, max_len: int = 256) -> dict:
    """fastpipe.load(path) with its defaults on a builder-made decode step (tp=2, a static cache of max_len
    positions), run until its compile settled, against transformers compiled on the same static cache."""
    import torch

    import fastpipe
    from bench.report_real_size import HFStatic
    from fastpipe import dtypes
    from fastpipe.builder.hf.build import build_hf
    from fastpipe.model_io import assemble_outputs, to_pipeline_inputs

    path = build_hf(model_dir, tp=2, batch=1, seq_len=1, max_len=max_len).save(out)
    sess = fastpipe.load(path)
    p = sess.pipeline
    meta = p.metadata.tensors_inputs
    caches = {n: torch.zeros(o.shape, dtype=dtypes.to_torch(o.dtype))
              for n, o in meta.items() if n.startswith("past_key_values_")}
    pos = 0     # a static cache: the step attends over all max_len positions (masked) wherever it is
    ins = to_pipeline_inputs(p, {"input_ids": torch.tensor([[PROMPT[0]]]), "cache_position": torch.tensor([pos]),
                                 **caches}, partial=True)

    def ours():
        return assemble_outputs(p, sess.run(ins), only=("logits",))["logits"][:, -1]

    t = time.perf_counter()
    calls = 0
    while not sess.compile_settled() and calls < 10_000:
        ours()
        calls += 1
        if not sess.compile_settled():
            sess.wait_compiled(1.0)
    settle_s = time.perf_counter() - t
    hf = HFStatic(model_dir, 1, max_len, torch.device("cpu"))
    tokens = torch.tensor([[PROMPT[0]]])
    ref = hf(tokens, pos)
    err = (ours().float() - ref.float()).abs().max().item()

    def per_call(fn) -> float:
        samples = []
        for _ in range(repeat):
            t = time.perf_counter()
            for _ in range(10):
                fn()
            samples.append((time.perf_counter() - t) / 10)
        return statistics.median(samples)

    for _ in range(2):                   # interleaved twice: the second round counts
        ours_s, hf_s = per_call(ours), per_call(lambda: hf(tokens, pos))
    return {"describe": sess.describe(), "max_len": max_len, "settled_after_s": round(settle_s, 2),
            "settled_after_calls": calls, "fastpipe_ms": round(ours_s * 1e3, 4),
            "transformers_compiled_ms": round(hf_s * 1e3, 4), "ratio": round(ours_s / hf_s, 3),
            "target_ratio": LIBRARY_RATIO_TARGET, "max_abs_logit_diff": err, "max_abs_logit": ref.abs().max().item()}


# ------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON result path (default bench/measured/cold_start_<machine>_<date>.json)")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens generate makes (long enough to see the swap)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=2048, help="the model allows 2048 positions")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="skip the --compile wait generate row and the server")
    args = ap.parse_args(argv)
    from bench.generation_cases import make_model, make_set
    from bench.machine import machine_info, write_result

    work = Path(tempfile.mkdtemp(prefix="fastpipe_cold_"))
    try:
        import torch

        model_dir, _ = make_model(work, layers=args.layers, dtype=torch.bfloat16)   # as users run it, and HFStatic
        serving_set = make_set(model_dir, work / "set", max_len=args.max_len, batches=(1,), prompt_lens=(16,), tp=2)
        doc = {"machine": machine_info(), "model": {"layers": args.layers, "hidden": 512, "vocab": 8000, "tp": 2,
                                                     "max_len": args.max_len, "dtype": "bfloat16"}, "targets": {
            "first_output_s": FIRST_OUTPUT_TARGET_S, "library_ratio": LIBRARY_RATIO_TARGET}}
        rows = {}
        for mode in ("background", "wait"):
            cache = work / f"cache_readme_{mode}"
            rows[f"readme_{mode}"] = {"cold": readme_job(cache, mode), "warm": readme_job(cache, mode)}
            print(mode, rows[f"readme_{mode}"], flush=True)
        cache = work / "cache_generate"
        rows["generate_background"] = {"cold": generate(serving_set, cache, "background", args.tokens),
                                       "warm": generate(serving_set, cache, "background", args.tokens)}
        print(rows["generate_background"], flush=True)
        if not args.quick:
            rows["generate_wait"] = {"warm": generate(serving_set, cache, "wait", min(args.tokens, 1000))}
            rows["server"] = {"cold": server(serving_set, work / "cache_server"),
                              "warm": server(serving_set, work / "cache_server")}
            print(rows["generate_wait"], rows["server"], flush=True)
        os.environ["FASTPIPE_CACHE_DIR"] = str(cache)       # warm: the generate runs compiled this decode step
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        rows["library_decode_step"] = library_decode_step(model_dir, work / "decode", args.repeat)
        print(rows["library_decode_step"], flush=True)
        doc["rows"] = rows
        print(f"wrote {write_result('cold_start', doc, args.out)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
