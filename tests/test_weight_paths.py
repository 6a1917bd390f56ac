"""Path confinement of parameter files (fastpipe.weights.resolve_param_path)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fastpipe.errors import ParamError
from fastpipe.weights import ParamRef, WeightStore, resolve_param_path

W = 'tensors["w0"].value'


@pytest.fixture
def layout(tmp_path):
    """tmp/pipe/ holds the pipeline (and w.safetensors, sub/v.safetensors); tmp/outside.safetensors is outside."""
    pipe = tmp_path / "pipe"
    (pipe / "sub").mkdir(parents=True)
    for p in (pipe / "w.safetensors", pipe / "sub" / "v.safetensors", tmp_path / "outside.safetensors"):
        save_file({"w": torch.arange(6, dtype=torch.float32)}, str(p))
    return tmp_path, pipe


def refused(pipe, raw, **kw) -> str:
    with pytest.raises(ParamError) as ei:
        resolve_param_path(pipe, raw, where=W, **kw)
    msg = str(ei.value)
    assert msg.startswith(W + ".path: ") and "\n" not in msg
    return msg


def test_relative_paths_resolve_against_the_pipeline_folder(layout):
    _, pipe = layout
    got = resolve_param_path(pipe, "w.safetensors", where=W)
    assert got == Path(os.path.realpath(pipe / "w.safetensors")) and got.is_absolute()
    assert resolve_param_path(pipe, "sub/v.safetensors", where=W) == Path(os.path.realpath(pipe / "sub/v.safetensors"))
    # `..` that stays inside is fine: only the real location counts
    assert resolve_param_path(pipe, "sub/../w.safetensors", where=W) == got
    assert resolve_param_path(pipe, "./sub/./v.safetensors", where=W).name == "v.safetensors"


def test_dotdot_leaving_the_folder_is_refused(layout):
    _, pipe = layout
    msg = refused(pipe, "../outside.safetensors")
    real = os.path.realpath(pipe)
    assert msg == (f"{W}.path: expected a file inside {real} (pass --allow-outside-paths to permit), "
                   "found '../outside.safetensors'")
    refused(pipe, "sub/../../outside.safetensors")


def test_absolute_paths_are_refused(layout):
    tmp, pipe = layout
    absolute = str(pipe / "w.safetensors")  # even one that points inside
    msg = refused(pipe, absolute)
    assert f"expected a relative path to a file inside {os.path.realpath(pipe)} (pass --allow-outside-paths" in msg
    assert msg.endswith(f"found {absolute!r}")
    refused(pipe, str(tmp / "outside.safetensors"))


def test_symlink_pointing_outside_is_refused(layout):
    tmp, pipe = layout
    (pipe / "link.safetensors").symlink_to(tmp / "outside.safetensors")
    msg = refused(pipe, "link.safetensors")
    assert "found 'link.safetensors' (resolves to " in msg
    assert msg.endswith(f"{os.path.realpath(tmp / 'outside.safetensors')})")
    # a symlinked directory that leads outside, too
    (pipe / "outdir").symlink_to(tmp)
    refused(pipe, "outdir/outside.safetensors")


def test_symlink_inside_is_allowed_and_resolved(layout):
    _, pipe = layout
    (pipe / "alias.safetensors").symlink_to("sub/v.safetensors")
    got = resolve_param_path(pipe, "alias.safetensors", where=W)
    assert got == Path(os.path.realpath(pipe / "sub" / "v.safetensors"))


def test_pipeline_folder_reached_through_a_symlink(layout):
    tmp, pipe = layout
    (tmp / "pipe_link").symlink_to(pipe)
    got = resolve_param_path(tmp / "pipe_link", "w.safetensors", where=W)
    assert got == Path(os.path.realpath(pipe / "w.safetensors"))


def test_allow_outside_permits_all(layout):
    tmp, pipe = layout
    (pipe / "link.safetensors").symlink_to(tmp / "outside.safetensors")
    outside = Path(os.path.realpath(tmp / "outside.safetensors"))
    assert resolve_param_path(pipe, "../outside.safetensors", where=W, allow_outside=True) == outside
    assert resolve_param_path(pipe, str(tmp / "outside.safetensors"), where=W, allow_outside=True) == outside
    assert resolve_param_path(pipe, "link.safetensors", where=W, allow_outside=True) == outside


def test_malformed_raw_paths(layout):
    _, pipe = layout
    assert refused(pipe, "") == f"{W}.path: expected a non-empty relative file path, found ''"
    assert "without NUL" in refused(pipe, "w\x00.safetensors")


def test_resolved_path_loads_through_the_store(layout):
    tmp, pipe = layout
    (pipe / "alias.safetensors").symlink_to("w.safetensors")
    store = WeightStore()
    a = store.load(ParamRef(resolve_param_path(pipe, "w.safetensors", where=W), "safetensors", "w", ((1, 4),)),
                   (3,), torch.float32, where=W)
    b = store.load(ParamRef(resolve_param_path(pipe, "alias.safetensors", where=W), "safetensors", "w", ((1, 4),)),
                   (3,), torch.float32, where=W)
    assert torch.equal(a, torch.arange(6, dtype=torch.float32)[1:4])
    assert a is b  # the alias resolves to the same real file, so the same slice object
    assert store.stats()["open_files"] == 1
