"""fastpipe.runtime.binding.inputs.to_device: device copies are normal tensors, even under inference_mode.

Why it matters (checked below with torch.compile itself): Dynamo guards on whether a tensor is an
inference tensor. A warm-up whose inputs were copied to the GPU under inference_mode (inference
tensors) and a capture on an engine's KV caches (normal tensors, made outside it) would compile the
graph again inside the CUDA-graph capture. Every device copy fastpipe makes on the way into a
compiled graph goes through to_device (region processor args, the cuda processor's placement, step
args), and GraphReplay's static buffers are normal tensors too.
"""
import torch

from fastpipe.runtime import execute
from fastpipe.runtime.cuda import stream_issue
from fastpipe.runtime.processors import region as region_processor
from fastpipe.runtime.binding.inputs import to_device
from fastpipe.torch_compat import unique_graphs


def test_a_copy_made_under_inference_mode_is_a_normal_tensor():
    x = torch.arange(6.0).reshape(2, 3)
    with torch.inference_mode():
        moved = to_device(x, torch.device("meta"))
        plain = x.to("meta")
        assert to_device(x, torch.device("cpu")) is x                  # already there: itself
    assert moved.device.type == "meta" and moved.shape == x.shape and moved.dtype == x.dtype
    assert not moved.is_inference() and plain.is_inference()          # what .to() alone would give
    assert not torch.is_grad_enabled() or not moved.requires_grad
    pinned = to_device(torch.ones(3), torch.device("cpu"), non_blocking=True)
    assert torch.equal(pinned, torch.ones(3))


def test_mixing_inference_and_normal_tensors_recompiles_so_copies_are_normal():
    torch._dynamo.reset()
    f = torch.compile(lambda x, c: x * 2 + c, backend="eager", dynamic=False)
    caches = torch.zeros(4)                                          # the engine's: a normal tensor
    with torch.inference_mode():
        with torch.inference_mode(False):
            warm = torch.ones(4)                                     # what to_device makes
        f(warm, caches)
        before = unique_graphs()
        f(warm, caches)
        assert unique_graphs() == before                             # one kind throughout: no recompile
        f(torch.ones(4), caches)                                     # an inference tensor: compiled again
        assert unique_graphs() == before + 1


def test_every_device_copy_on_the_way_into_a_graph_is_normal():
    """Step args (execute.step_args), the cuda processor's placement (CudaBackend.place) and region args
    (RegionProcessor._args), each copying a CPU tensor to another device ("meta" here) under
    inference_mode, as runs do."""
    from types import SimpleNamespace as NS

    meta = torch.device("meta")
    x = torch.ones(2, 3)
    with torch.inference_mode():
        step = NS(constants={}, reads=("x",), device=meta)
        run = NS(device=meta, region=NS(reads=("x",)))
        outs = [*execute.step_args(step, {"x": x}), stream_issue.CudaBackend().place(x, meta),
                *region_processor.RegionProcessor._args(run, {"x": x})]
    assert [(t.device.type, t.is_inference()) for t in outs] == [("meta", False)] * 3
