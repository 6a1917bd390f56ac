"""Compiled graphs persist between processes (fastpipe.runtime.compiling.compile_cache): a second process compiling
the same graph hits inductor's cache in fastpipe's per-torch-version folder; another graph misses; a
TORCHINDUCTOR_CACHE_DIR the user set is left alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from fastpipe.runtime.compiling import compile_cache

ROOT = Path(__file__).resolve().parents[1]

_PROCESS = r"""
import json, os, sys
import torch
from torch._dynamo.utils import counters
from fastpipe.runtime.compiling.compile import CompiledGraph


def chain(n):
    class Chain(torch.nn.Module):
        def forward(self, x):
            for i in range(n):
                x = torch.sin(x) * 1.5 + 0.25
            return (x,)
    return torch.fx.symbolic_trace(Chain())


seen = {}
for n in map(int, sys.argv[1:]):
    before = dict(counters["inductor"])
    cg = CompiledGraph(chain(n), "chain", "raise", device="cpu")
    x = torch.randn(32)
    out = cg(x)[0]
    ref = x
    for i in range(n):
        ref = torch.sin(ref) * 1.5 + 0.25
    torch.testing.assert_close(out, ref)
    seen[n] = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
    seen[n]["compiled"] = cg.compiled
print(json.dumps({"graphs": seen, "dir": os.environ["TORCHINDUCTOR_CACHE_DIR"]}))
"""


def _process(cache: Path, *chains: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(FASTPIPE_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _PROCESS, *map(str, chains)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_second_process_reuses_the_first_ones_compiled_graph(tmp_path):
    first = _process(tmp_path, 7)
    folder = tmp_path / f"torch-{torch.__version__.replace('+', '_')}" / "inductor"
    assert first["dir"] == str(folder)
    assert first["graphs"]["7"] == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1, "compiled": True}
    assert any(folder.rglob("*")), "nothing written to the persistent folder"
    second = _process(tmp_path, 7, 8)        # the same graph hits; another graph never takes a stale entry
    assert second["graphs"]["7"] == {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 0, "compiled": True}, second
    assert second["graphs"]["8"]["fxgraph_cache_miss"] == 1, second


def test_the_users_own_inductor_cache_folder_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.use_persistent_cache() == str(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_the_folder_follows_xdg_and_fastpipe_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("FASTPIPE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    version = torch.__version__.replace("+", "_")
    assert compile_cache.persistent_cache_dir() == tmp_path / "xdg" / "fastpipe" / f"torch-{version}" / "inductor"
    monkeypatch.setenv("FASTPIPE_CACHE_DIR", str(tmp_path / "fp"))
    assert compile_cache.persistent_cache_dir() == tmp_path / "fp" / f"torch-{version}" / "inductor"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compile_cache.use_persistent_cache() == str(tmp_path / "fp" / f"torch-{version}" / "inductor")
    assert (tmp_path / "fp" / f"torch-{version}" / "inductor").is_dir()


def test_an_unwritable_folder_warns_and_leaves_inductors_default(monkeypatch, tmp_path):
    import pytest

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("FASTPIPE_CACHE_DIR", str(blocker))
    with pytest.warns(RuntimeWarning, match="cannot create the compile cache folder"):
        assert compile_cache.use_persistent_cache() == ""
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
