"""A session's weights are freed as its last reference goes, not at Python's next garbage collection
(fastpipe.runtime.binding.release): every torch.fx GraphModule is a reference cycle, and the region processor's
stitched graphs (and a compiled graph's module) hold the weights as buffers. Each test turns the collector
off, drops the session and counts what the weight store still sees alive."""
import contextlib
import gc
import weakref

import pytest
import torch

import fastpipe
from fastpipe.random_inputs import random_inputs
from fastpipe.runtime.cuda import capture as cuda_capture
from fastpipe.runtime.binding.release import drop_constants, release_with, weak_method
from fastpipe.weights import WeightStore
from tests.examples import GRAPHS


@contextlib.contextmanager
def no_collection():
    """The collector off (fastpipe.runtime.cuda.capture.no_collection), after one collection of what earlier
    tests left."""
    gc.collect()
    with cuda_capture.no_collection():
        yield


@pytest.mark.parametrize("processor,compile", [("region", False), ("region", True), ("reference", False),
                                               ("cpu", False)])
def test_a_dropped_session_frees_its_weights_at_once(processor, compile):
    store = WeightStore()
    sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", store=store, processor=processor, compile=compile)
    ins = random_inputs(sess.pipeline)
    sess.run(ins)
    sess.run(ins)
    held = []
    if processor == "region":        # the stitched graphs' buffers: the merged weights among them
        held = [weakref.ref(t) for run in sess.runner.runs if run.gm is not None for t in run.gm.buffers()]
        assert held and sess.runner.rebound > 0
    with no_collection():
        assert store.stats()["live_slices"] > 0
        del sess
        assert store.stats()["live_slices"] == 0
        assert [r for r in held if r() is not None] == []


def test_with_closes_the_session():
    store = WeightStore()
    with fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", store=store, processor="region", compile="off") as sess:
        out = sess.run(random_inputs(sess.pipeline))
        assert out and store.stats()["live_slices"] > 0
    assert sess.program is None and sess.runner is None and store.stats()["live_slices"] == 0


def test_release_with_drops_the_modules_constants_when_the_owner_goes():
    class Owner:
        pass

    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    w = weakref.ref(gm.weight)
    owner = Owner()
    release_with(owner, [gm, "not a module"])
    with no_collection():
        assert w() is not None
        del owner
        assert w() is None and dict(gm.named_parameters()) == {}
    drop_constants([gm])                                              # twice: nothing left to drop


def test_weak_method_holds_its_object_weakly_and_says_when_it_is_gone():
    class Runner:
        def __init__(self):
            self.fn = weak_method(self.run)                          # held by its own object: no cycle

        def run(self, x, *, k=1):
            return x + k

    r = Runner()
    fn = r.fn
    assert fn(1, k=2) == 3 and "Runner.run" in fn.__qualname__
    with no_collection():
        dead = weakref.ref(r)
        del r
        assert dead() is None
    with pytest.raises(RuntimeError, match="Runner.run: its object was freed"):
        fn(1)
