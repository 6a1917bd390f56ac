"""Weights on a GPU are held once per store (marked `cuda`: skipped cleanly without one): sessions
over one WeightStore share each constant's copy on the device, the region processor's merged weights
included, and a serving set's buckets hold the weights of one. The CPU side (the "meta" device standing
in for a GPU) is in tests/test_weights.py."""
import gc

import pytest
import torch

import fastpipe
from fastpipe.weights import WeightStore
from tests.examples import GRAPHS, linked_serving_set

pytestmark = pytest.mark.cuda



def _constants(sess) -> dict[str, int]:
    return {f"{s}:{i}:{n}": t.data_ptr() for s, steps in sess.program.steps.items() for i, st in enumerate(steps)
            for n, t in st.constants.items()}


@pytest.mark.parametrize("processor", ["cuda", "region"])
def test_sessions_share_device_constants(processor):
    path = GRAPHS / "tp_mlp" / "pipeline.json"
    store = WeightStore()
    dm = {s: "cuda:0" for s in fastpipe.load(path).pipeline.devices}
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    a = fastpipe.load(path, device_map=dm, store=store, processor=processor)
    grow_a = torch.cuda.memory_allocated() - base
    b = fastpipe.load(path, device_map=dm, store=store, processor=processor)
    grow_b = torch.cuda.memory_allocated() - base - grow_a
    assert grow_a > 0 and grow_b <= 0.1 * grow_a                    # no second copy of the weights
    ca, cb = _constants(a), _constants(b)
    assert ca and ca == cb and all(ptr != 0 for ptr in ca.values())
    assert store.stats()["device_hits"] > 0
    x = {n: torch.randn(a.pipeline.tensors[n].shape, device="cuda:0") for n in a.input_names}
    for k, v in a.run(x).items():
        torch.testing.assert_close(b.run(x)[k], v)


def test_buckets_hold_one_copy_of_the_weights(tmp_path):
    """A serving set's prefill and decode pipelines (one checkpoint, hard-linked into each bucket as
    the builder lays it out) loaded over one store: the second adds no weights on the GPU (each used
    to copy every constant there)."""
    decode, prefill = sorted(linked_serving_set(tmp_path).glob("*/pipeline.json"))
    dm = {"0": "cuda:0", "1": "cuda:0"}
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    store = WeightStore()
    a = fastpipe.load(decode, device_map=dm, store=store, processor="region")
    w1 = torch.cuda.memory_allocated() - base
    b = fastpipe.load(prefill, device_map=dm, store=store, processor="region")
    assert w1 > 0 and torch.cuda.memory_allocated() - base - w1 < 0.1 * w1
    a.close()
    b.close()
