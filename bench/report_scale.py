"""Build and load at real size: time and peak memory of `fastpipe build` (a decode step, a serving set)
at each tp x pp, and of loading a decode step, against safetensors' own load of the same files.

    python bench/report_scale.py --geometry llama-3.1-8b --tp 1,2,4,8 --pp 1,2 --json scale.json
    python bench/report_scale.py --checkpoint /data/l8b --sections load --device cuda

Every measurement runs in a fresh process, so its peak RSS (VmHWM: the process's own peak, which a
forked parent's ru_maxrss would blur) is its own; "over imports" subtracts the peak after importing
torch, transformers and fastpipe.

build       build_hf(tp, pp) of the serving engine's decode step (batch 1, a static cache of --max-len
            positions) and save(): time, peak RSS over imports, and the bytes written that are not
            the checkpoint's own (the weights are hard-linked, never copied: "weight bytes copied" counts
            any output file over 1 MiB that is not a link to a checkpoint file).
serve       build_serving_set (batches 1,8; prompt lengths 128, 512; --max-len): the same measures.
load        fastpipe.load(decode step, processor="auto", compile=False) on --device, the page cache
            warm, then one read of every page of its weights (a weight that is a view of the file is
            read at first touch; safetensors' clones are read in full): time, peak host RSS over imports, and the memory held after (device memory on a GPU,
            else the process RSS), against safetensors in a process of its own: load_file of every
            shard onto the device (on the CPU each tensor cloned into process memory, as a model's
            load_state_dict copies it; safetensors' CPU tensors are views of a file mapping, read at
            first touch). Targets: time at most 1.2x safetensors'; peak host RSS at most the weights
            plus the largest merged group; on a GPU, device memory held within 5 % of the weights + the
            KV cache (on the CPU the RSS after the load is reported: it holds the runtime's own memory too).

Targets for build (Llama-3.1-8B): under 60 s, under 2 GiB peak RSS, no weight bytes copied.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, os, sys, time

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

t0 = time.perf_counter()
import torch, transformers, fastpipe, safetensors.torch
imports_s, imports_peak = time.perf_counter() - t0, status("VmHWM")
a = json.loads(sys.argv[1])
res = {"imports_peak": imports_peak, "imports_s": imports_s}
t = time.perf_counter()
if a["what"] == "build":
    from fastpipe.builder.hf.build import build_hf
    build_hf(a["ckpt"], tp=a["tp"], pp=a["pp"], batch=1, seq_len=1, max_len=a["max_len"]).save(a["out"])
elif a["what"] == "serve":
    from fastpipe.serving.build import build_serving_set
    build_serving_set(a["ckpt"], a["out"], max_len=a["max_len"], batches=(1, 8), prompt_lens=(128, 512),
                      tp=a["tp"], pp=a["pp"])
elif a["what"] == "load":
    dev = a["device"]
    from fastpipe.format import read_pipeline
    slots = read_pipeline(a["pipeline"]).devices
    sess = fastpipe.load(a["pipeline"], processor="auto", compile=False, device_map={s: dev for s in slots})
    # every weight resident, as safetensors' clones are: a view of the file is read at first touch
    held = {t.data_ptr(): t for ss in sess.program.steps.values() for st in ss for t in st.constants.values()}
    for run in getattr(sess._processor, "runs", ()):
        if run.gm is not None:
            held.update((b.data_ptr(), b) for b in run.gm.buffers())
    touched = sum(float(t.reshape(-1)[::2048].float().sum()) for t in held.values() if t.numel())
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    res["describe"] = sess.describe()
elif a["what"] == "safetensors":
    dev = a["device"]
    held = []
    for f in a["files"]:
        ts = safetensors.torch.load_file(f, device=dev)
        held.append({k: v.clone() for k, v in ts.items()} if dev == "cpu" else ts)
        del ts
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
res["s"] = time.perf_counter() - t
res["peak"], res["rss_after"] = status("VmHWM"), status("VmRSS")
if torch.cuda.is_available():
    res["device_allocated"] = torch.cuda.memory_allocated()
print(json.dumps(res))
"""


def child(**a) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(a)], capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        return {"error": lines[-1][:300] if lines else f"exit {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def copied_bytes(out: Path, ckpt: Path) -> tuple[int, int]:
    """(bytes written, weight bytes copied): every file under out; a file over 1 MiB that is not a hard
    link to a checkpoint file counts as copied weights."""
    inodes = {f.stat().st_ino for f in ckpt.glob("*.safetensors")}
    written = copied = 0
    for f in out.rglob("*"):
        if f.is_file() and not f.is_symlink():
            st = f.stat()
            if st.st_ino in inodes:
                continue
            written += st.st_size
            if st.st_size > 2**20 and f.suffix == ".safetensors":
                copied += st.st_size
    return written, copied


def largest_group_bytes(ckpt: Path) -> int:
    """The largest set of tensors the region processor merges into one (q/k/v, gate/up, the head, or
    one projection): what a load may hold twice."""
    cfg = json.loads((ckpt / "config.json").read_text())
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd * h
    return 2 * max(qkv, 2 * i * h, v * h)


def weight_bytes(ckpt: Path) -> int:
    return sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))


def warm(ckpt: Path) -> None:
    for f in ckpt.glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def section_build(args, ckpt: Path, tmp: Path, what: str) -> list[dict]:
    rows = []
    for tp in args.tp:
        for pp in args.pp:
            out = tmp / f"{what}_tp{tp}_pp{pp}"
            r = child(what=what, ckpt=str(ckpt), out=str(out), tp=tp, pp=pp, max_len=args.max_len)
            row = {"section": what, "tp": tp, "pp": pp, **r}
            if "error" not in r:
                row["bytes_written"], row["weight_bytes_copied"] = copied_bytes(out, ckpt)
                row["over_imports"] = r["peak"] - r["imports_peak"]
            rows.append(row)
            print(line(row), flush=True)
            if what == "build" and tp == args.load_tp and pp == 1:
                args.decode_path = out / "pipeline.json"
    return rows


def section_load(args, ckpt: Path, tmp: Path) -> list[dict]:
    if getattr(args, "decode_path", None) is None:
        out = tmp / "load_decode"
        r = child(what="build", ckpt=str(ckpt), out=str(out), tp=args.load_tp, pp=1, max_len=args.max_len)
        if "error" in r:
            return [{"section": "load", "error": r["error"]}]
        args.decode_path = out / "pipeline.json"
    files = sorted(str(f) for f in ckpt.glob("*.safetensors"))
    rows = []
    for rnd in range(args.rounds):
        warm(ckpt)
        st = child(what="safetensors", files=files, device=args.device)
        warm(ckpt)
        fp = child(what="load", pipeline=str(args.decode_path), device=args.device)
        for label, r in (("safetensors load_file", st), (f"fastpipe.load tp={args.load_tp}", fp)):
            row = {"section": "load", "round": rnd, "label": label, **r}
            if "error" not in r:
                row["over_imports"] = r["peak"] - r["imports_peak"]
            rows.append(row)
            print(line(row), flush=True)
    return rows


BUILD_MAX_S = 60               # a build's wall time, under
BUILD_MAX_PEAK = 2 * 2**30     # a build's peak RSS, under
LOAD_MAX_RATIO = 1.2           # load time over safetensors' own load of the same files, at most
HELD_TOLERANCE = 0.05          # device memory after load within this fraction of weights + KV cache


def median_of(rows: list[dict], key: str):
    """The rows' median of ``key`` (the upper middle one of an even count: a value measured, not a mean)."""
    return sorted(r[key] for r in rows)[len(rows) // 2]


def verdicts(rows: list[dict], ckpt: Path, args) -> dict:
    w, grp = weight_bytes(ckpt), largest_group_bytes(ckpt)
    v = {"weights": w, "largest_group": grp}
    for sec in ("build", "serve"):             # the decode step; the serving set (6 pipelines)
        builds = [r for r in rows if r["section"] == sec and "error" not in r]
        if builds:
            b = {"max_s": max(r["s"] for r in builds), "max_peak": max(r["peak"] for r in builds),
                 "max_over_imports": max(r["over_imports"] for r in builds),
                 "weight_bytes_copied": sum(r["weight_bytes_copied"] for r in builds),
                 "refused": sorted(f"tp={r['tp']} pp={r['pp']}" for r in rows if r["section"] == sec and "error" in r)}
            b["met"] = b["max_s"] < BUILD_MAX_S and b["max_peak"] < BUILD_MAX_PEAK and b["weight_bytes_copied"] == 0
            v[sec] = b
    loads = [r for r in rows if r["section"] == "load" and "error" not in r]
    fp = [r for r in loads if r["label"].startswith("fastpipe")]
    st = [r for r in loads if r["label"].startswith("safetensors")]
    if fp and st:
        v["load_time_ratio"] = median_of(fp, "s") / median_of(st, "s")
        v["load_time_met"] = v["load_time_ratio"] <= LOAD_MAX_RATIO
        v["load_peak_over_imports"] = median_of(fp, "over_imports")
        v["load_peak_met"] = v["load_peak_over_imports"] <= w + grp
        kv = kv_bytes(ckpt, args.max_len)
        v["load_held_expected"] = w + kv
        if args.device.startswith("cuda"):      # device memory: what the weights and the cache should take
            v["load_held"] = median_of(fp, "device_allocated")
            v["load_held_met"] = abs(v["load_held"] - (w + kv)) <= HELD_TOLERANCE * (w + kv)
        else:                                   # the CPU: the process's RSS over its imports (the runtime's own too)
            v["load_rss_after_over_imports"] = median_of(fp, "rss_after") - fp[0]["imports_peak"]
    return v


def kv_bytes(ckpt: Path, positions: int, batch: int = 1) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * batch * cfg["num_key_value_heads"] * positions * hd * 2


def line(r: dict) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    what = r.get("label") or f"{r['section']} tp={r['tp']} pp={r['pp']}"
    if "error" in r:
        return f"  {what}: refused/failed: {r['error']}"
    extra = f", {gib(r['weight_bytes_copied'])} weights copied" if "weight_bytes_copied" in r else ""
    dev = f", device {gib(r['device_allocated'])}" if r.get("device_allocated") else ""
    return (f"  {what}: {r['s']:.1f} s, peak RSS {gib(r['peak'])} ({gib(r['over_imports'])} over imports), "
            f"RSS after {gib(r['rss_after'])}{dev}{extra}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path)
    src.add_argument("--geometry")
    ap.add_argument("--tp", default="1,2,4,8")
    ap.add_argument("--pp", default="1,2")
    ap.add_argument("--sections", default="build,serve,load")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load-tp", type=int, default=2, help="the decode step the load section loads")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.tp = [int(x) for x in args.tp.split(",")]
    args.pp = [int(x) for x in args.pp.split(",")]
    args.decode_path = None
    from bench.machine import machine_info

    with tempfile.TemporaryDirectory(dir=os.environ.get("FASTPIPE_BENCH_TMP")) as t:
        tmp = Path(t)
        ckpt = args.checkpoint
        if ckpt is None:
            from bench.real_checkpoint import write_checkpoint

            ckpt = write_checkpoint(args.geometry, tmp / "ckpt")
        print(f"checkpoint {ckpt}: {weight_bytes(ckpt) / 2**30:.2f} GiB", flush=True)
        rows: list[dict] = []
        for sec in args.sections.split(","):
            rows += section_load(args, ckpt, tmp) if sec == "load" else section_build(args, ckpt, tmp, sec)
        v = verdicts(rows, ckpt, args)
    print(json.dumps(v, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "checkpoint": str(args.checkpoint or args.geometry),
                                               "geometry": args.geometry or ckpt.name,
                                               "max_len": args.max_len, "device": args.device, "rows": rows,
                                               "verdicts": v}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
