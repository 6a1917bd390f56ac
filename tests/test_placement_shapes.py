"""Placements must give the tensor's shape dim by dim, not just its element count: a constant's
value.placements against its declared shape (fastpipe.weights.checks.check_stored) and a
metadata.tensor_slices entry against its pipeline tensor (fastpipe.validate.metadata). Each case
below has the right element count and the wrong shape (transposed, or regrouped)."""
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

import fastpipe
from fastpipe.errors import ParamError, ValidationError
from fastpipe.weights import WeightStore
from fastpipe.weights.ref import ParamRef
from tests.examples import GRAPHS


@pytest.fixture
def tp_mlp(tmp_path):
    """A copy of graphs/tp_mlp: fc1.weight is stored [128, 64]; w1_1 = its rows 64:128 ([64, 64]);
    input x is [8, 64], its own origin (metadata.tensors.inputs["x"], [8, 64])."""
    folder = tmp_path / "tp_mlp"
    shutil.copytree(GRAPHS / "tp_mlp", folder)
    path = folder / "pipeline.json"
    return path, json.loads(path.read_text())


def _refused(path, doc, cls, message):
    path.write_text(json.dumps(doc))
    with pytest.raises(cls, match="^" + re.escape(message) + "$") as e:
        fastpipe.load(path)
    assert type(e.value) is cls


def test_the_unchanged_copy_loads(tp_mlp):
    path, doc = tp_mlp
    assert fastpipe.load(path).pipeline.tensors["w1_1"].value.placements == ((64, 128), (0, 64))


def test_param_placements_with_the_element_count_but_not_the_shape(tp_mlp):
    path, doc = tp_mlp
    doc["tensors"]["w1_1"]["value"]["placements"] = [[0, 128], [0, 32]]         # [128, 32]: 4096 elements, as [64, 64]
    _refused(path, doc, ParamError,
             'tensors["w1_1"].value.placements: expected a slice of shape [64, 64] (the declared shape), found '
             "[[0, 128], [0, 32]] of shape [128, 32] (tensor 'fc1.weight' in 'weights.safetensors')")


@pytest.mark.parametrize("side, name", [("inputs", "x"), ("outputs", "y")])
def test_metadata_slice_transposed(tp_mlp, side, name):
    path, doc = tp_mlp
    doc["metadata"]["tensors"][side][name]["shape"] = [64, 64]                  # an origin a [64, 8] slice fits in
    doc["metadata"]["tensor_slices"][side][name]["placements"] = [[0, 64], [0, 8]]
    _refused(path, doc, ValidationError,
             f'metadata.tensor_slices.{side}["{name}"].placements: expected a slice of shape [8, 64] (tensor "{name}"), '
             "found [64, 8]")


def test_metadata_slice_of_a_bigger_origin_is_fine(tp_mlp):
    path, doc = tp_mlp                      # the same origin with a slice of the right shape: accepted
    doc["metadata"]["tensors"]["inputs"]["x"]["shape"] = [64, 64]
    doc["metadata"]["tensor_slices"]["inputs"]["x"]["placements"] = [[8, 16], [0, 64]]
    path.write_text(json.dumps(doc))
    fastpipe.load(path)


def test_weight_store_refuses_a_transposed_slice_before_reading(tmp_path):
    f = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(6, 4), "big": torch.zeros(8, 8)}, str(f))
    where = 'tensors["w"].value'
    store = WeightStore()
    cases = [
        (ParamRef(f, "safetensors", "w", ((0, 6), (0, 4))), (4, 6),          # the whole [6, 4], declared [4, 6]
         "found [[0, 6], [0, 4]] of shape [6, 4] (tensor 'w' in 'w.safetensors')"),
        (ParamRef(f, "safetensors", "big", ((0, 8), (0, 2))), (2, 8),        # [8, 2] of [8, 8], declared [2, 8]
         "found [[0, 8], [0, 2]] of shape [8, 2] (tensor 'big' in 'w.safetensors')"),
    ]
    for r, shape, found in cases:
        want = f"{where}.placements: expected a slice of shape {list(shape)} (the declared shape), {found}"
        for fn in (store.check, store.load):
            with pytest.raises(ParamError) as e:
                fn(r, shape, torch.float32, where=where)
            assert str(e.value) == want
    assert store.stats()["bytes_read"] == 0
