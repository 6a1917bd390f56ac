"""The example pipelines in graphs/ and their unsplit modules, for tests."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = ROOT / "graphs"
EXAMPLES = sorted(p.parent.name for p in GRAPHS.glob("*/pipeline.json"))


def make_examples_module():
    spec = importlib.util.spec_from_file_location("make_examples", GRAPHS / "make_examples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def unsplit_module(name: str) -> torch.nn.Module:
    """The example's original module with the checkpoint's weights."""
    mk = make_examples_module()
    cls = {"tp_mlp": mk.TPMLP, "two_stage_skip": mk.TwoStage, "seq_parallel": mk.SPBlock, "moe_all_to_all": mk.SoftMoE}[name]
    m = cls()
    m.load_state_dict(load_file(str(GRAPHS / name / "weights.safetensors")))
    return m.eval()


def copy_example(name: str, dest: Path) -> Path:
    shutil.copytree(GRAPHS / name, dest / name)
    return dest / name / "pipeline.json"


SERVING_SET = ROOT / "tests" / "data" / "serving" / "llama_tp2"


def linked_serving_set(dest: Path) -> Path:
    """A copy of the committed serving set laid out as build_serving_set writes one: every bucket's
    model.safetensors a hard link to one file (git checks them out as separate copies, which a
    WeightStore, keyed by file identity, cannot share)."""
    out = dest / SERVING_SET.name
    shutil.copytree(SERVING_SET, out)
    first, *rest = sorted(out.glob("*/model.safetensors"))
    for f in rest:
        f.unlink()
        f.hardlink_to(first)
    return out
