"""Tiny Llama LLM pipelines built by furiosa-llm 2026.3.0's own PipelineBuilder, with reference
results from its own eager model, for fastpipe's tests (tests/data/producer_llm/).

    python scripts/producer_llm.py                        # venv etc. under /tmp/fastpipe-producer-llm
    python scripts/producer_llm.py --work DIR --out tests/data/producer_llm --cases f32 bf16

Run by hand, never by CI (the environment is several GB; CI reads the committed files). It
1. downloads the furiosa-llm 2026.3.0 wheel (the builder) and 2026.2.1 (whose loader reads
   2026.3.0's files: 2026.3.0's own Pipeline.load fails on them under Python < 3.14) with
   `pip download --no-deps` and unzips them (their furiosa_llm/__init__.py is never run);
2. makes a Python 3.11 venv with what furiosa-llm 2026.3.0 pins and what its pipeline code
   imports (VENV_REQS), and installs FURIOSA_DEPS with --no-deps into DIR/site: furiosa-models
   2026.2.0 with the furiosa-torch it pins (2026.2.0: furiosa-torch 2026.3.0 lacks the
   TacticKernelModule furiosa-models 2026.2.0 imports), furiosa-native-llm-common and
   furiosa-torch-ext 2026.3.0. Their NPU-only requirements (furiosa-kernels, furiosa-tcc,
   furiosa-llm-native, furiosa-smi-py, model_compressor) are neither installed nor imported;
3. writes a stand-in for `ray` (STANDINS): furiosa-llm's artifact builder module, whose save
   step is used, imports it at the top for its parallel compile workers, which never start;
4. runs scripts/producer_llm_side.py `generate` in that venv (TORCH_DEVICE_BACKEND_AUTOLOAD=0:
   furiosa-torch registers an NPU backend), then `check` per case with 2026.2.1's loader;
5. writes DIR/../MANIFEST.json (--out's parent gets one per run) with versions, notes and the
   results of both checks.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from producer_interop import download, pip_env, sh  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIDE = Path(__file__).resolve().parent / "producer_llm_side.py"

BUILDER, LOADER = "2026.3.0", "2026.2.1"
VENV_REQS = ["torch==2.10.0", "transformers==5.1.0", "pydantic==2.12.5", "optimum", "accelerate", "safetensors",
             "numpy", "Deprecated", "pyyaml", "ml_dtypes", "blake3", "cachetools", "more-itertools", "mpmath<1.4",
             "huggingface_hub", "requests"]
FURIOSA_DEPS = ["furiosa-models==2026.2.0", "furiosa-torch==2026.2.0", "furiosa-native-llm-common==2026.3.0",
                "furiosa-torch-ext==2026.3.0"]

STANDINS = {
    "ray/__init__.py": '''"""Stand-in for ray, written by fastpipe's scripts/producer_llm.py: furiosa-llm's
artifact builder imports it at module level (parallel compile workers); the save step used
here never starts ray. `remote` leaves what it decorates unchanged; anything else raises."""


def remote(*args, **kwargs):
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda obj: obj


class ObjectRef:
    pass


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _unavailable(*a, **k):
        raise ImportError(f"ray is not installed (stood in for): ray.{name}")
    return _unavailable
''',
    "ray/actor.py": '''"""Stand-in for ray.actor (see ray/__init__.py)."""


class ActorHandle:
    def __class_getitem__(cls, item):
        return cls
''',
    "ray/exceptions.py": '''"""Stand-in for ray.exceptions (see ray/__init__.py)."""


class RayError(Exception):
    pass
''',
}


def unpacked(version: str, work: Path) -> Path:
    wheel = download(f"furiosa-llm=={version}", work / "wheels")
    if wheel is None:
        raise SystemExit(f"producer_llm: cannot download furiosa-llm=={version}")
    src = work / "src" / version
    if not src.exists():
        with zipfile.ZipFile(wheel) as z:
            z.extractall(src)
    return src


def environment(work: Path) -> tuple[Path, dict]:
    venv = work / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        sh([sys.executable, "-m", "venv", str(venv)])
        sh([str(python), "-m", "pip", "install", "-q", *VENV_REQS], env=pip_env())
    site = work / "site"
    if not site.exists():
        wheels = []
        for req in FURIOSA_DEPS:
            w = download(req, work / "wheels")
            if w is None:
                raise SystemExit(f"producer_llm: cannot download {req}")
            wheels.append(str(w))
        sh([str(python), "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), *wheels], env=pip_env())
    standins = work / "standins"
    for rel, text in STANDINS.items():
        (standins / rel).parent.mkdir(parents=True, exist_ok=True)
        (standins / rel).write_text(text)
    env = pip_env()
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(standins)]), TORCH_DEVICE_BACKEND_AUTOLOAD="0",
               PYTHONWARNINGS="ignore", FURIOSA_DISABLE_PIPELINE_CACHE="1")
    return python, env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fastpipe-producer-llm"))
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "producer_llm")
    ap.add_argument("--cases", nargs="+", default=["f32", "bf16"])
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    builder, loader = unpacked(BUILDER, args.work), unpacked(LOADER, args.work)
    python, env = environment(args.work)
    report = args.work / "generate.json"
    r = subprocess.run([str(python), str(SIDE), "generate", "--src", str(builder), "--out", str(args.out),
                        "--cases", *args.cases, "--report", str(report)], env=env, text=True, capture_output=True)
    if r.returncode != 0:
        print(r.stderr[-6000:], file=sys.stderr)
        return 1
    manifest = {"made": str(datetime.date.today()), "builder": f"furiosa-llm {BUILDER}", "loader": f"furiosa-llm {LOADER}",
                "furiosa_deps_no_deps": FURIOSA_DEPS, "venv": VENV_REQS, "standins": sorted({p.split("/")[0] for p in STANDINS}),
                "generate": json.loads(report.read_text()), "check": {}}
    failed = False
    for case in args.cases:
        out = args.work / f"check-{case}.json"
        r = subprocess.run([str(python), str(SIDE), "check", "--src", str(loader), "--case", str(args.out / case),
                            "--report", str(out)], env=env, text=True, capture_output=True)
        manifest["check"][case] = json.loads(out.read_text()) if out.exists() else {"ok": False, "error": r.stderr[-2000:]}
        manifest["check"][case].pop("trace", None)
        failed |= r.returncode != 0
    (args.out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
