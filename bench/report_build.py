"""Build time and peak memory for a >= 100M-parameter model against its checkpoint size.

    python bench/report_build.py [--config small|medium] [--tp 2] [--pp 2]

A random GPT-2 checkpoint is written once (safetensors). Then, each in a fresh process:
  * imports only: python + torch + transformers + fastpipe (the floor every build pays);
  * fastpipe build: the same imports, then build_hf(..., tp, pp) and save.
Peak RSS (VmHWM, which is per address space; ru_maxrss would inherit the forked parent's) of each, the build's increment over the imports, and build time.
Target: the build never loads all weights: peak RSS < 0.5 x checkpoint bytes.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {"small": dict(n_layer=12, n_embd=768, n_head=12), "medium": dict(n_layer=24, n_embd=1024, n_head=16)}

CHILD = r"""
import json, sys, time

def vm_hwm_kib():
    # peak RSS of this address space; unlike ru_maxrss it is not inherited from the forked parent
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

t0 = time.perf_counter()
import torch, transformers, fastpipe
from fastpipe.builder.hf.build import build_hf
imports = time.perf_counter() - t0
rss_imports = vm_hwm_kib()
mode, model, out, tp, pp = sys.argv[1:6]
built_s = 0.0
if mode == "build":
    t = time.perf_counter()
    build_hf(model, tp=int(tp), pp=int(pp), batch=1, seq_len=128).save(out)
    built_s = time.perf_counter() - t
print(json.dumps({"peak_kib": vm_hwm_kib(), "imports_kib": rss_imports,
                  "build_s": built_s, "imports_s": imports}))
"""


def child(mode: str, model: Path, out: Path, tp: int, pp: int) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(model), str(out), str(tp), str(pp)],
                       capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=CONFIGS, default="small")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    args = ap.parse_args()
    from transformers import GPT2Config

    from bench.machine import machine_info
    from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "gpt2"
        t = time.perf_counter()
        m = save_random_checkpoint(GPT2Config(**CONFIGS[args.config]), model, seed=0)
        params = sum(p.numel() for p in m.parameters())
        del m
        ckpt = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"checkpoint: GPT-2 {args.config}, {params / 1e6:.0f}M parameters, {ckpt / 2**20:.0f} MiB "
              f"(written in {time.perf_counter() - t:.0f} s)")
        base = child("imports", model, Path(tmp) / "o0", args.tp, args.pp)
        run = child("build", model, Path(tmp) / "out", args.tp, args.pp)
    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    peak, floor = run["peak_kib"] * 1024, base["peak_kib"] * 1024
    rows = [
        ("imports only (baseline)", f"{floor / 2**20:.0f} MiB", f"{floor / ckpt:.2f}x", "-", f"{base['imports_s']:.1f} s"),
        (f"fastpipe build tp={args.tp} pp={args.pp}", f"{peak / 2**20:.0f} MiB", f"{peak / ckpt:.2f}x",
         f"+{(peak - floor) / 2**20:.0f} MiB ({(peak - floor) / ckpt:.2f}x)", f"{run['build_s']:.1f} s"),
    ]
    header = ("process", "peak RSS", "RSS / checkpoint", "over imports", "time")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths)] + rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    print(f"target peak RSS < 0.5 x checkpoint: {'met' if peak < 0.5 * ckpt else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
