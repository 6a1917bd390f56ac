"""Interop with the format's real producer, furiosa-llm, both directions, from its own code.

    python scripts/producer_interop.py                      # every release 2024.1.0 .. 2026.3.0
    python scripts/producer_interop.py --versions 2026.2.1 --work /tmp/fp-interop --keep

For each release it
1. downloads the furiosa-llm wheel (`pip download --no-deps`) and unzips it into a
   throwaway folder (--work);
2. makes a venv with the torch, pydantic and transformers the release pins (one per
   distinct pin set, reused across releases and runs when --keep) and installs the
   release's furiosa-* dependencies with --no-deps into a per-release folder; what can
   not be installed or imported on a CPU machine is stood in for (see STANDINS) and said;
3. runs scripts/producer_side.py in that venv: pipelines built with the producer's own
   classes, comm ops and serialize_gm, saved as its artifact builder saves them, checked
   by its own loader, written to tests/data/producer/<release>/ (--out) with inputs and
   expected outputs from the unsplit torch module (`generate`);
4. writes fastpipe's example and builder pipelines in the producer's spelling
   (`write_pipeline(..., style="producer")`) and reads every one with the release's
   Pipeline.load and get_gms (`load`); any rejection fails the run.

At the end it prints a table (release x what happened) for docs/format.md and exits 1
if any case was refused in either direction. The venvs take several GB: this runs by
hand, not in CI; CI runs the committed files (tests/test_producer_interop.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDE = Path(__file__).resolve().parent / "producer_side.py"

VERSIONS = ["2024.1.0", "2024.1.1", "2024.2.0", "2024.2.1", "2025.1.0", "2025.1.1", "2025.1.2", "2025.2.0",
            "2025.2.1", "2025.3.0", "2025.3.1", "2025.3.2", "2025.3.3", "2025.3.4", "2026.1.0", "2026.2.0",
            "2026.2.1", "2026.3.0"]

# 2026.3.0's Pipeline.load fails on every file under Python < 3.14: its annotations moved to
# `X | Y` unions, which its own _dict_to_dataclass does not recognise as typing.Union. 2026.2.1
# reads the same schema; its loader checks the files written with 2026.3.0's classes.
LOADER_OF = {"2026.3.0": "2026.2.1"}

# Requirements of furiosa-llm that only its serving stack or tooling imports; the pipeline
# modules (parallelize.pipeline.types, parallelize.export, model_rewriter ops) never do.
NOT_NEEDED = {"fastapi", "uvicorn", "openai", "openai-harmony", "ray", "datasets", "prometheus-client",
              "partial-json-parser", "orjson", "tabulate", "tqdm", "pillow", "torchvision", "gitpython",
              "pyjson5", "types-regex", "types-tabulate", "types-tqdm", "huggingface-hub"}
PINNED = ("torch", "pydantic", "transformers")

# What a CPU machine cannot provide, stood in for by a module that raises if it is used.
STANDINS = {
    "furiosa_smi_py": "NPU device management (native, talks to the NPU driver)",
    "model_compressor": "NPU quantization toolkit (its implementation package is NPU-only)",
    "model_compressor_impl": "NPU quantization toolkit implementation",
}


def sh(cmd: list[str], **kw) -> None:
    r = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if r.returncode != 0:
        noise = "WARNING: Location"
        err = "\n".join(line for line in r.stderr.splitlines() if noise not in line)
        raise SystemExit(f"producer_interop: {' '.join(cmd[:6])} ... failed:\n{err[-3000:]}")


def pip_env() -> dict:
    """pip as on a clean machine: the index only (no local wheel folders or mirrors, which carry
    no upload times for --uploaded-prior-to, and no machine-wide constraints)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


# ----------------------------------------------------------------------------- wheels and pins
def download(req: str, dest: Path) -> Path | None:
    """The wheel pip picks for req (for CPython 3.11 on this platform), or None."""
    dest.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--python-version", "3.11",
                        "--only-binary=:all:", "-d", str(dest), req], text=True, capture_output=True, env=pip_env())
    if r.returncode != 0:
        return None
    found = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", r.stdout)
    return Path(found[-1]) if found else None


def requires(wheel: Path) -> list[str]:
    """Requires-Dist of a wheel, without extras-only ones."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = line.split(":", 1)[1].strip()
            if "extra ==" not in req:
                out.append(req.split(";")[0].strip())
    return out


def req_name(req: str) -> str:
    return re.split(r"[<>=~! \[(]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def pin_of(reqs: list[str], name: str) -> str | None:
    for r in reqs:
        if req_name(r) == name:
            m = re.search(r"==\s*([\w.*]+)", r)
            return m.group(1) if m else None
    return None


class Release:
    def __init__(self, version: str, work: Path):
        self.version, self.work = version, work
        self.src = work / "src" / version
        self.site = work / "site" / version
        self.wheel: Path | None = None
        self.furiosa_missing: list[str] = []

    def fetch(self) -> None:
        self.wheel = download(f"furiosa-llm=={self.version}", self.work / "wheels")
        if self.wheel is None:
            raise SystemExit(f"producer_interop: cannot download furiosa-llm=={self.version}")
        if not self.src.exists():
            with zipfile.ZipFile(self.wheel) as z:
                z.extractall(self.src)

    def released(self) -> str:
        """The newest file date inside the release's wheel (ISO), to resolve its unpinned
        dependencies as they were then (pip --uploaded-prior-to)."""
        with zipfile.ZipFile(self.wheel) as z:
            newest = max(i.date_time for i in z.infolist())
        return (datetime.datetime(*newest) + datetime.timedelta(days=2)).strftime("%Y-%m-%dT00:00:00Z")

    def reqs(self) -> list[str]:
        return requires(self.wheel)

    def venv_key(self) -> str:
        r = self.reqs()
        return "-".join(f"{n}{pin_of(r, n) or 'any'}" for n in PINNED)

    def install_furiosa_deps(self, python: Path) -> list[str]:
        """The release's furiosa-* dependencies (transitively), --no-deps, into its own folder;
        returns their non-furiosa requirements (for the venv)."""
        wheels, others, todo, seen = [], [], [r for r in self.reqs()], set()
        while todo:
            req = todo.pop()
            name = req_name(req)
            if not name.startswith("furiosa-"):
                others.append(req)
                continue
            if name in seen:
                continue
            seen.add(name)
            w = download(req, self.work / "wheels")
            if w is None:
                self.furiosa_missing.append(req)
                continue
            wheels.append(w)
            todo.extend(requires(w))
        if not self.site.exists():
            sh([str(python), "-m", "pip", "install", "-q", "--no-deps", "--target", str(self.site), *map(str, wheels)],
               env=pip_env())
        return others


def ensure_venv(work: Path, key: str, reqs: list[str], released: str) -> Path:
    """A venv per pin set; its unpinned dependencies as of the release date of the first
    release that made it (later releases sharing the pins reuse it)."""
    venv = work / "venvs" / key
    python = venv / "bin" / "python"
    if not python.exists():
        sh([sys.executable, "-m", "venv", str(venv)])
    sh([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip>=26"], env=pip_env())  # for --uploaded-prior-to
    wanted = [r.replace(" ", "") for r in reqs if req_name(r) not in NOT_NEEDED]
    torch_pin = next((r for r in wanted if req_name(r) == "torch"), "torch")
    old_numpy = re.search(r"==\s*2\.[0-2]\b", torch_pin) is not None   # torch < 2.3 predates numpy 2
    wanted += ["safetensors", "numpy<2" if old_numpy else "numpy", "Deprecated", "requests", "huggingface-hub"]
    sh([str(python), "-m", "pip", "install", "-q", "--uploaded-prior-to", released, *sorted(set(wanted))],
       env=pip_env())
    return python


STANDIN_TEXT = '''"""Stand-in for {mod}: {why}.

Written by fastpipe's scripts/producer_interop.py. Any attribute is a placeholder class (so
`class X({mod}.a.B)` at import time works); creating or calling one raises ImportError."""


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (_Unavailable,), {{}})


class _Unavailable(metaclass=_Placeholder):
    def __init__(self, *args, **kwargs):
        raise ImportError("{mod} is not installed (stood in for): " + type(self).__name__)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name, (_Unavailable,), {{}})
'''


def write_standins(release: Release) -> list[str]:
    """Stand-ins for the modules in STANDINS that the release's installed dependencies lack."""
    folder = release.work / "standins" / release.version
    folder.mkdir(parents=True, exist_ok=True)
    used = []
    for mod, why in STANDINS.items():
        if (release.site / mod).exists() or (release.site / f"{mod}.py").exists():
            continue
        used.append(mod)
        (folder / f"{mod}.py").write_text(STANDIN_TEXT.format(mod=mod, why=why))
    return used


def side_env(release: Release) -> dict:
    env = pip_env()
    env["PYTHONPATH"] = os.pathsep.join([str(release.site), str(release.work / "standins" / release.version)])
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env["PYTHONWARNINGS"] = "ignore"
    return env


# ----------------------------------------------------------------------------- fastpipe's pipelines
def write_ours(folder: Path, style: str = "producer") -> list[Path]:
    """fastpipe's examples and builder pipelines, written in the producer's spelling (style
    "producer", or "producer-2024.1" for the torch 2.1 payloads of furiosa-llm 2024.1.x)."""
    import torch
    import transformers

    from fastpipe.builder.api import build
    from fastpipe.builder.hf.build import build_hf
    from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint
    from fastpipe.format import read_pipeline, write_pipeline
    from fastpipe.payload import to_torch21

    out = []
    for example in sorted(p for p in (ROOT / "graphs").iterdir() if (p / "pipeline.json").exists()):
        dest = folder / f"example_{example.name}"
        shutil.copytree(example, dest, dirs_exist_ok=True)
        write_pipeline(read_pipeline(dest / "pipeline.json"), dest / "pipeline.json", style=style,
                       rewrite_payload=to_torch21 if style == "producer-2024.1" else None)
        out.append(dest / "pipeline.json")
    configs = {
        "llama": transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=100),
        "gpt2": transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=99, n_positions=64),
    }
    for family, config in configs.items():
        ckpt = folder / f"{family}_checkpoint"
        save_random_checkpoint(config, ckpt, seed=0)
        for tp, pp, past in ((2, 1, None), (2, 2, None), (2, 1, 4)):
            dest = folder / (f"build_{family}_tp{tp}_pp{pp}" + (f"_past{past}" if past is not None else ""))
            build_hf(ckpt, tp=tp, pp=pp, batch=1, seq_len=8 if past is None else 1, past_len=past).save(
                dest, style=style)
            out.append(dest / "pipeline.json")
        dest = folder / f"build_{family}_tp2_static16"       # a serving set's decode step (static KV cache)
        build_hf(ckpt, tp=2, batch=2, seq_len=1, max_len=16).save(dest, style=style)
        out.append(dest / "pipeline.json")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    dest = folder / "build_module_tp2"
    build(Block(), (torch.randn(4, 16),), tp=2, plan={"fc1": "column", "fc2": "row"}).save(dest, style=style)
    out.append(dest / "pipeline.json")
    return out


def fastpipe_runs(folder: Path) -> list[str]:
    """`fastpipe run --check` (reference processor) on every case the producer made; what failed."""
    import contextlib
    import io

    from fastpipe.cli import main as fastpipe_main

    bad = []
    for case in sorted(p for p in folder.iterdir() if (p / "pipeline.json").is_file()):
        out, err = io.StringIO(), io.StringIO()
        cwd = os.getcwd()
        try:
            os.chdir(case)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = fastpipe_main(["run", "pipeline.json", "--inputs", "inputs.safetensors", "--check",
                                      "expected.safetensors", "--processor", "reference", "--warmup", "0", "--repeat", "1"])
        finally:
            os.chdir(cwd)
        if code != 0:
            bad.append(f"{case.name}: {err.getvalue().strip()}")
    return bad


def same_results(pipeline_json: Path, record: Path) -> str | None:
    """Run fastpipe's decoding of each payload on the inputs the producer's decoding ran on;
    None when every output agrees, else what differs."""
    import torch
    from safetensors.torch import load_file

    from fastpipe.format import read_pipeline
    from fastpipe.options import LoadOptions
    from fastpipe.payload import decode_payload
    from fastpipe.validate.sources import payload_text

    p = read_pipeline(pipeline_json)
    for f in sorted(record.glob("*.safetensors")):
        sid = f.stem
        saved = load_file(str(f))
        text, where = payload_text(p, sid, LoadOptions())
        g = decode_payload(text, where=where)
        ins = [saved[f"in{i}"] for i in range(sum(k.startswith("in") for k in saved))]
        with torch.no_grad():
            out = g.gm(*ins)
        out = out if isinstance(out, (tuple, list)) else (out,)
        for i, o in enumerate(out):
            ref = saved[f"out{i}"]
            if o.shape != ref.shape or o.dtype != ref.dtype:
                return f"supertask {sid} output {i}: {o.dtype}{list(o.shape)} from fastpipe, {ref.dtype}{list(ref.shape)} from the producer"
            if not ref.is_floating_point():
                if not torch.equal(o, ref):
                    return f"supertask {sid} output {i}: fastpipe's decoding differs from the producer's"
                continue
            # the producer's get_gms decomposes ops (furiosa_torch_ext.preprocess): float rounding
            # differs, so the error is taken relative to the output's scale
            err = ((o.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
            if err > (2e-2 if ref.dtype in (torch.bfloat16, torch.float16) else 1e-5):
                return f"supertask {sid} output {i}: fastpipe's decoding differs from the producer's (error {err:.1e})"
    return None


def style_for(version: str) -> str:
    """The write_pipeline style a release reads: 2024.1.x deserializes payloads with torch 2.1."""
    return "producer-2024.1" if version.startswith("2024.1.") else "producer"


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", nargs="+", default=VERSIONS)
    ap.add_argument("--work", type=Path, help="throwaway folder (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep --work (venvs are reused by later runs)")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "producer")
    ap.add_argument("--steps", default="generate,load", help="comma-separated: generate, load")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="fastpipe-interop-"))
    work.mkdir(parents=True, exist_ok=True)
    steps = set(args.steps.split(","))
    releases = {v: Release(v, work) for v in set(args.versions) | {LOADER_OF[v] for v in args.versions if v in LOADER_OF}}
    rows, failed = [], False
    ours = {}
    if "load" in steps:
        for style in ("producer", "producer-2024.1"):
            shutil.rmtree(work / "ours" / style, ignore_errors=True)
            ours[style] = write_ours(work / "ours" / style, style)
    try:
        for v in sorted(releases):
            rel = releases[v]
            rel.fetch()
        for v in args.versions:
            rel = releases[v]
            loader = releases.get(LOADER_OF.get(v, v))
            others = rel.install_furiosa_deps(Path(sys.executable))
            python = ensure_venv(work, rel.venv_key(), others, rel.released())
            if loader is not rel:
                loader.install_furiosa_deps(python)
                write_standins(loader)
            env = side_env(rel)
            row = {"version": v, "venv": rel.venv_key(), "furiosa_missing": rel.furiosa_missing, "style": style_for(v),
                   "standins_written": write_standins(rel)}
            if "generate" in steps:
                cmd = [str(python), str(SIDE), "generate", "--src", str(rel.src), "--version", v, "--out", str(args.out / v)]
                if loader is not rel:
                    cmd += ["--loader-src", str(loader.src)]
                r = subprocess.run(cmd, env=env, text=True, capture_output=True)
                row["generate"] = "ok" if r.returncode == 0 else "FAILED"
                if r.returncode != 0:
                    failed = True
                    print(f"--- {v} generate:\n{r.stderr[-4000:]}", file=sys.stderr)
                else:
                    bad = fastpipe_runs(args.out / v)
                    row["fastpipe_ran"] = not bad
                    if bad:
                        failed = True
                        row["generate"] = "fastpipe refused: " + "; ".join(bad)
            if "load" in steps:
                report = work / f"load-{v}.json"
                lenv = side_env(loader)
                record = work / "record" / v
                shutil.rmtree(record, ignore_errors=True)
                r = subprocess.run([str(python), str(SIDE), "load", "--src", str(loader.src), "--version", loader.version,
                                    "--report", str(report), "--record", str(record), *map(str, ours[style_for(loader.version)])],
                                   env=lenv, text=True, capture_output=True)
                if r.returncode != 0:
                    failed = True
                    row["load"] = "FAILED"
                    print(f"--- {v} load:\n{r.stderr[-4000:]}", file=sys.stderr)
                else:
                    res = json.loads(report.read_text())
                    bad = {Path(k).parent.name: x["error"] for k, x in res["results"].items() if not x["ok"]}
                    for k, x in res["results"].items():
                        if x["ok"]:
                            mismatch = same_results(Path(k), Path(x["record"]))
                            if mismatch:
                                bad[Path(k).parent.name] = mismatch
                    row["load"] = "ok" if not bad else bad
                    row["load_notes"] = sorted({n for x in res["results"].values() for n in x["notes"]} | set(res["notes"]))
                    row["standins_used"] = sorted(n.rsplit(" ", 1)[-1] for n in res["notes"] if "stand-in" in n)
                    failed |= bool(bad)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n# producer interop, {datetime.date.today()}, python {sys.version.split()[0]}")
    print("| release | its environment | its files in fastpipe's corpus | fastpipe's pipelines in its loader | stood in for |")
    print("|---|---|---|---|---|")
    for row in rows:
        load = row.get("load", "-")
        load = load if isinstance(load, str) else "refused: " + "; ".join(f"{k}: {e}" for k, e in load.items())
        if load == "ok":
            load = f"{len(ours[row['style']])} of {len(ours[row['style']])} load and decode alike ({row['style']})"
            if row["version"] in LOADER_OF:
                load += f", read with {LOADER_OF[row['version']]}'s loader"
        gen = row.get("generate", "-")
        if gen == "ok":
            n = len([p for p in (args.out / row["version"]).iterdir() if p.is_dir()])
            gen = f"{n} of {n} run to the expected outputs" if row.get("fastpipe_ran") else f"{n} of {n} made and self-checked"
        print(f"| {row['version']} | {row['venv'].replace('-', ', ')} | {gen} | {load} | "
              f"{', '.join(row.get('standins_used', [])) or '-'} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
