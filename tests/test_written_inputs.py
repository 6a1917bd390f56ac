"""Inputs a graph writes in place (fastpipe.validate.written): found at load, updated in the caller's
tensors after every run, on every processor, as the producer's paged-cache pipelines need.

The pipeline here has the producer's shape in miniature: two stages (send/recv), each writing its own
cache input by `index_put` + `copy_` into the placeholder and reading it after the write, the block
ids replicated per slot (`d0_slots`, `d1_slots` of one model input). The writes accumulate
(`index_put(accumulate=True)`), so a run applied twice, or a write lost in a copy, shows.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import fastpipe
from fastpipe.builder.assemble import Assembler
from fastpipe.errors import InputError, ValidationError
from fastpipe.format import parse_pipeline

B, D, N = 2, 4, 6


def stage(x, slots, cache):
    h = x * 2 + 1
    new = cache.index_put((slots.long(),), h, accumulate=True)
    cache.copy_(new)
    return h + new.sum(0, keepdim=True)


def reference(x, slots, c0, c1):
    """The unsplit model, eager: both caches updated in place, as the pipeline must leave them."""
    return stage(stage(x, slots, c0), slots, c1)


def paged_pipeline():
    a = Assembler("paged", version="0.1.0")
    a.slot("0", "cpu:0")
    a.slot("1", "cpu:1")
    for name, shape, dt in (("d0_x", (B, D), "f32"), ("d0_slots", (B,), "i32"), ("d1_slots", (B,), "i32"),
                            ("d0_cache_0", (N, D), "f32"), ("d1_cache_1", (N, D), "f32")):
        a.input(name, shape, dt)
    a.fx("0", stage, ["d0_x", "d0_slots", "d0_cache_0"], ["h0"])
    a.send_recv("g", "0", "h0", "1", "h0r")
    a.fx("1", stage, ["h0r", "d1_slots", "d1_cache_1"], ["y"])
    a.output(["y"])
    for i, (name, shape, dt) in enumerate((("x", (B, D), "f32"), ("slots", (B,), "i32"),
                                           ("cache_0", (N, D), "f32"), ("cache_1", (N, D), "f32"))):
        a.original_input(name, shape, dt, i)
    a.original_output("y", (B, D), "f32", 0)
    for t, origin, slot, shape in (("d0_x", "x", "0", (B, D)), ("d0_slots", "slots", "0", (B,)),
                                   ("d1_slots", "slots", "1", (B,)), ("d0_cache_0", "cache_0", "0", (N, D)),
                                   ("d1_cache_1", "cache_1", "1", (N, D))):
        a.slice_of("inputs", t, origin, [[0, n] for n in shape], slot)
    a.slice_of("outputs", "y", "y", [[0, B], [0, D]], "1")
    return parse_pipeline(a.to_json())


def steps(n=6):
    g = torch.Generator().manual_seed(0)
    for k in range(n):
        yield torch.randn(B, D, generator=g), torch.tensor([k % N, (k + 3) % N], dtype=torch.int32)


MODES = [("reference", "off"), ("cpu", "off"), ("cpu", "wait"), ("region", "off"), ("region", "wait")]


@pytest.mark.parametrize("processor,compile", MODES)
def test_chained_runs_update_the_callers_tensors(processor, compile):
    s = fastpipe.load(paged_pipeline(), device_map=None, processor=processor, compile=compile)
    assert s.written_inputs == {"d0_cache_0": "1", "d1_cache_1": "4"}
    assert "2 inputs written in place" in s.describe()
    c0, c1 = torch.zeros(N, D), torch.zeros(N, D)
    r0, r1 = torch.zeros(N, D), torch.zeros(N, D)
    for x, slots in steps():
        out = s.run({"d0_x": x, "d0_slots": slots, "d1_slots": slots, "d0_cache_0": c0, "d1_cache_1": c1})
        want = reference(x, slots, r0, r1)
        torch.testing.assert_close(out["y"], want)
        torch.testing.assert_close(c0, r0)
        torch.testing.assert_close(c1, r1)
    assert r0.abs().sum() > 0 and r1.abs().sum() > 0


def test_background_compile_keeps_the_writes():
    s = fastpipe.load(paged_pipeline(), device_map=None, processor="region", compile="background")
    c0, c1, r0, r1 = (torch.zeros(N, D) for _ in range(4))
    for k, (x, slots) in enumerate(steps(12)):
        if k == 6:
            s.wait_compiled(60)
        out = s.run({"d0_x": x, "d0_slots": slots, "d1_slots": slots, "d0_cache_0": c0, "d1_cache_1": c1})
        torch.testing.assert_close(out["y"], reference(x, slots, r0, r1))
    torch.testing.assert_close((c0, c1), (r0, r1))


def test_strided_cache_gets_the_update_through_a_copy():
    """A cache the graph cannot take as it is (not contiguous) runs on a dense copy, written back."""
    s = fastpipe.load(paged_pipeline(), device_map=None, processor="region", compile="off")
    big0, big1 = torch.zeros(D, N).t(), torch.zeros(N, 2 * D)[:, ::2]
    assert not big0.is_contiguous() and not big1.is_contiguous()
    r0, r1 = torch.zeros(N, D), torch.zeros(N, D)
    for x, slots in steps(3):
        s.run({"d0_x": x, "d0_slots": slots, "d1_slots": slots, "d0_cache_0": big0, "d1_cache_1": big1})
        reference(x, slots, r0, r1)
    torch.testing.assert_close((big0, big1), (r0, r1))


def test_model_level_inputs_and_per_slot_inputs_left_out():
    """run_model(cache_0=...) updates the caller's cache; run() fills d1_slots from d0_slots (all of
    "slots"), as `fastpipe run --inputs` does."""
    s = fastpipe.load(paged_pipeline(), device_map=None, processor="reference")
    c0, c1, r0, r1 = (torch.zeros(N, D) for _ in range(4))
    (x, slots), (x2, slots2) = list(steps(2))
    out = s.run_model(x=x, slots=slots, cache_0=c0, cache_1=c1)
    torch.testing.assert_close(out["y"], reference(x, slots, r0, r1))
    out = s.run({"d0_x": x2, "d0_slots": slots2, "d0_cache_0": c0, "d1_cache_1": c1})
    torch.testing.assert_close(out["y"], reference(x2, slots2, r0, r1))
    torch.testing.assert_close((c0, c1), (r0, r1))
    with pytest.raises(InputError, match=r'inputs\["d0_slots"\]: expected a tensor .* model input "slots"'):
        s.run({"d0_x": x2, "d0_cache_0": c0, "d1_cache_1": c1})


def test_chunks_and_shared_memory_are_refused():
    s = fastpipe.load(paged_pipeline(), device_map=None, processor="reference")
    x, slots = next(steps(1))
    with pytest.raises(InputError, match=r"chunks: expected 1 \(inputs written in place hold one batch: "
                                         r"d0_cache_0, d1_cache_1\), found 2"):
        s.run({"d0_x": torch.cat([x, x]), "d0_slots": torch.cat([slots, slots]),
               "d1_slots": torch.cat([slots, slots]), "d0_cache_0": torch.zeros(2 * N, D),
               "d1_cache_1": torch.zeros(2 * N, D)}, chunks=2)
    shared = torch.zeros(N, D)
    with pytest.raises(InputError, match=r'inputs\["d1_cache_1"\]: expected its own memory'):
        s.run({"d0_x": x, "d0_slots": slots, "d1_slots": slots, "d0_cache_0": shared, "d1_cache_1": shared})


def test_lazy_payloads_find_the_written_inputs_too():
    s = fastpipe.load(paged_pipeline(), device_map=None, processor="reference", check_payloads=False)
    assert s.written_inputs == {"d0_cache_0": "1", "d1_cache_1": "4"}


# ------------------------------------------------------------------------------------------ refusals
def _one_slot(fn, inputs, tmp_path=None, constant=False):
    a = Assembler("w")
    a.slot("0", "cpu")
    for name, shape in inputs:
        a.input(name, shape, "f32")
    names = [n for n, _ in inputs]
    if constant:
        save_file({"w": torch.zeros(N, D)}, str(tmp_path / "w.safetensors"))
        a.constant("w", shape=(N, D), dtype="f32", name_in_file="w", path="w.safetensors")
        names.append("w")
    return a, names


def test_a_graph_writing_a_constant_is_refused(tmp_path):
    a, names = _one_slot(None, [("x", (N, D))], tmp_path, constant=True)
    a.fx("0", lambda x, w: w.add_(x) * 1, names, ["y"])
    a.output(["y"])
    p = parse_pipeline(a.to_json(), source_dir=tmp_path)
    with pytest.raises(ValidationError, match=r'supertasks\["1"\]\.inputs\[1\]: expected a pipeline input where the '
                                              r'graph writes in place \(node add_\), found "w", a constant'):
        fastpipe.load(p, device_map=None)


def test_a_graph_writing_another_supertasks_output_is_refused():
    a, names = _one_slot(None, [("x", (N, D))])
    a.fx("0", lambda x: x * 2, names, ["h"])
    a.fx("0", lambda h: h.mul_(3) + 1, ["h"], ["y"])
    a.output(["y"])
    with pytest.raises(ValidationError, match=r"supertasks\[\"2\"\]\.inputs\[0\]: .* found \"h\", another supertask's output"):
        fastpipe.load(parse_pipeline(a.to_json()), device_map=None)


def test_a_reader_the_write_could_overtake_is_refused():
    a, names = _one_slot(None, [("x", (N, D)), ("c", (N, D))])
    a.fx("0", lambda x, c: c.copy_(x) + 1, names, ["y"])
    a.fx("0", lambda c: c * 2, ["c"], ["z"])
    a.output(["y", "z"])
    with pytest.raises(ValidationError, match=r'supertasks\["1"\]\.inputs\[1\]: expected every other reader of "c", '
                                              r'written in place by this graph \(node copy_\), to come before it in the '
                                              r'dataflow, found supertasks\["2"\], which the write could overtake'):
        fastpipe.load(parse_pipeline(a.to_json()), device_map=None)


def test_a_reader_before_the_write_sees_the_old_value():
    """The producer's decode stage: one graph reads the cache, the next (fed by it) writes it."""
    a, names = _one_slot(None, [("x", (N, D)), ("c", (N, D))])
    a.fx("0", lambda c: c * 2, ["c"], ["old"])
    a.fx("0", lambda x, c, old: c.copy_(x) + old, ["x", "c", "old"], ["y"])
    a.output(["y"])
    for processor in ("reference", "cpu", "region"):
        s = fastpipe.load(parse_pipeline(a.to_json()), device_map=None, processor=processor, compile="off")
        c, x = torch.randn(N, D), torch.randn(N, D)
        want = x + c * 2
        torch.testing.assert_close(s.run({"x": x, "c": c})["y"], want)
        torch.testing.assert_close(c, x)


def test_a_write_into_a_view_of_an_input_counts():
    """`c[1:3].copy_(...)`: the placeholder's slice is written, so the placeholder is."""
    a, names = _one_slot(None, [("x", (2, D)), ("c", (N, D))])
    a.fx("0", lambda x, c: c[1:3].copy_(x) + 0, names, ["y"])
    a.output(["y"])
    s = fastpipe.load(parse_pipeline(a.to_json()), device_map=None, processor="region", compile="off")
    assert s.written_inputs == {"c": "1"}
    c, x = torch.zeros(N, D), torch.randn(2, D)
    s.run({"x": x, "c": c})
    torch.testing.assert_close(c[1:3], x)
    assert c[0].abs().sum() == 0 and c[3:].abs().sum() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("processor", ["cuda", "region"])
def test_cuda_writes_land_in_the_callers_tensors(processor):
    """On a GPU: host caches (copied to the device and back) and device caches (written where they are),
    eager and replayed as a CUDA graph."""
    dev = torch.device("cuda:0")
    s = fastpipe.load(paged_pipeline(), device_map={"0": "cuda:0", "1": "cuda:0"}, processor=processor,
                      compile="off")
    for where in ("cpu", dev):
        c0, c1 = torch.zeros(N, D, device=where), torch.zeros(N, D, device=where)
        r0, r1 = torch.zeros(N, D), torch.zeros(N, D)
        for x, slots in steps(5):
            out = s.run({"d0_x": x, "d0_slots": slots, "d1_slots": slots, "d0_cache_0": c0, "d1_cache_1": c1})
            torch.testing.assert_close(out["y"].cpu(), reference(x, slots, r0, r1))
        torch.testing.assert_close((c0.cpu(), c1.cpu()), (r0, r1))


# ------------------------------------------------------------------------------------------ the CLI
def test_cli_chains_runs_through_state_files(tmp_path, capsys):
    """`fastpipe run --state-in/--state-out`: each run starts from the state the previous one left (keyed
    by model input names), once, however many timed runs follow; outputs are the first run's."""
    from safetensors.torch import load_file

    from fastpipe.cli import main
    from fastpipe.format import write_pipeline

    write_pipeline(paged_pipeline(), tmp_path / "pipeline.json")
    r0, r1 = torch.zeros(N, D), torch.zeros(N, D)
    save_file({"cache_0": r0.clone(), "cache_1": r1.clone()}, str(tmp_path / "kv.safetensors"))
    for k, (x, slots) in enumerate(steps(4)):
        save_file({"x": x, "slots": slots}, str(tmp_path / "in.safetensors"))
        code = main(["run", str(tmp_path / "pipeline.json"), "--inputs", str(tmp_path / "in.safetensors"),
                     "--state-in", str(tmp_path / "kv.safetensors"), "--state-out", str(tmp_path / "kv.safetensors"),
                     "--outputs", str(tmp_path / "out.safetensors"), "--repeat", "3", "--warmup", "2"])
        assert code == 0
        assert "wrote 2 inputs written in place to" in capsys.readouterr().out
        want = reference(x, slots, r0, r1)
        torch.testing.assert_close(load_file(str(tmp_path / "out.safetensors"))["y"], want)
        state = load_file(str(tmp_path / "kv.safetensors"))
        assert set(state) == {"cache_0", "cache_1"}
        torch.testing.assert_close((state["cache_0"], state["cache_1"]), (r0, r1))


def test_cli_state_options_refuse_what_they_cannot_use(tmp_path, capsys):
    from fastpipe.cli import main
    from fastpipe.format import write_pipeline

    write_pipeline(paged_pipeline(), tmp_path / "pipeline.json")
    save_file({"cache_9": torch.zeros(N, D)}, str(tmp_path / "bad.safetensors"))
    code = main(["run", str(tmp_path / "pipeline.json"), "--state-in", str(tmp_path / "bad.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert 'expected tensors of inputs the graphs write in place (cache_0, cache_1, d0_cache_0, d1_cache_1), ' \
           'found "cache_9"' in err
    code = main(["run", "graphs/tp_mlp/pipeline.json", "--state-out", str(tmp_path / "s.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and "--state-out: expected a pipeline whose graphs write inputs in place, found none" in err
    assert not (tmp_path / "s.safetensors").exists()
