"""fastpipe.runtime.binding.graph_device: a graph traced on the CPU (factory ops carry device=cpu) runs on
its step's device. The "meta" device stands in for a GPU here: a tensor made on the CPU cannot mix
with meta tensors, as it cannot with CUDA ones. The GPU runs are the serving set's cuda tests
(tests/test_serving_fixture.py, tests/test_graph_replay_gpu.py), which failed without this."""
import pytest
import torch
import torch.fx as fx

import fastpipe
from fastpipe.runtime.binding.bind import Binder
from fastpipe.runtime.binding.graph_device import foreign_devices, placed_graph, retarget_devices
from tests.examples import SERVING_SET

aten = torch.ops.aten
META = torch.device("meta")
CPU = torch.device("cpu")


def traced_on_cpu() -> fx.GraphModule:
    """y = x + arange(4) + zeros([2, 4]) + x copied with device=cpu: three device arguments."""
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(aten.arange.default, (4,), {"dtype": torch.float32, "device": CPU})
    z = g.call_function(aten.zeros.default, ([2, 4],), {"dtype": torch.float32, "device": "cpu"})
    c = g.call_function(aten._to_copy.default, (x,), {"device": CPU})
    y = g.call_function(aten.add.Tensor, (g.call_function(aten.add.Tensor, (x, r)), z))
    g.output((g.call_function(aten.add.Tensor, (y, c)),))
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_graph_traced_on_the_cpu_runs_on_another_device_once_placed():
    gm = traced_on_cpu()
    x = torch.empty(2, 4, device=META)
    with pytest.raises((RuntimeError, NotImplementedError)):
        gm(x)                                              # as it was: CPU tensors meet the input's device
    placed = placed_graph(gm, META)
    (y,) = placed(x)
    assert y.device == META and y.shape == (2, 4)
    assert foreign_devices(placed, META) == []
    assert len(foreign_devices(gm, META)) == 3             # a copy: the decoded graph is shared, untouched
    (cpu_y,) = gm(torch.ones(2, 4))
    assert torch.equal(cpu_y, 2 + torch.arange(4.0).expand(2, 4))


def test_a_graph_already_there_is_not_copied_and_counts_are_exact():
    gm = traced_on_cpu()
    assert placed_graph(gm, CPU) is gm
    assert retarget_devices(gm, META) == 3 and retarget_devices(gm, META) == 0
    assert foreign_devices(gm, CPU) == ["arange_default: meta", "zeros_default: meta", "_to_copy_default: meta"]


def test_positional_device_arguments_are_retargeted():
    g = fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(aten.to.device, (x, CPU, torch.float32)),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    (y,) = placed_graph(gm, META)(torch.empty(3, device=META))
    assert y.device == META


def test_bound_steps_of_a_serving_set_carry_no_cpu_device_arguments():
    """The committed serving set (built on the CPU) has arange/zeros/full(device=cpu) in its graphs;
    bound on another device, no step's graph keeps one."""
    sess = fastpipe.load(SERVING_SET / "decode_b2" / "pipeline.json")
    binder = Binder(sess.pipeline, sess.options, sess.store, {s: META for s in sess.slot_devices})
    graphs = sess.checked.graphs
    before = after = 0
    for sid, st in sess.pipeline.supertasks.items():
        if st.kind != "fx":
            continue
        before += len(foreign_devices(graphs[sid].gm, META))
        _, graph = binder.graph_fn(sid, graphs[sid], META)
        after += len(foreign_devices(graph, META))
        assert all(t.device == META for t in graph.buffers())
    assert before > 0 and after == 0
