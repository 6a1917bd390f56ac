"""The committed tiny serving set (tests/data/serving/llama_tp2, made by tests/data/make_serving_set.py
with transformers' greedy tokens as expected.json): runs where transformers is absent, on the CPU and,
marked `cuda`, on a GPU with the decode step captured as a CUDA graph at warm-up."""
import json
from pathlib import Path

import pytest
import torch

import fastpipe
from fastpipe.format import read_pipeline
from fastpipe.serving.engine import Engine
from tests.examples import SERVING_SET

SET = SERVING_SET
EXPECTED = json.loads((SET / "expected.json").read_text())


def _generate(eng) -> list[list[int]]:
    reqs = [eng.submit(p, max_new_tokens=n) for p, n in zip(EXPECTED["prompts"], EXPECTED["max_new_tokens"])]
    return [r.result(timeout=300) for r in reqs]


def test_committed_set_generates_transformers_tokens_on_cpu():
    with Engine(SET, eos_token_id=None, compile=False) as eng:
        assert eng.batch == 2 and eng.max_len == 24 and len(EXPECTED["prompts"]) > eng.batch
        assert _generate(eng) == EXPECTED["tokens"]


def test_engine_on_the_cpu_processor_writes_its_caches_in_the_steps(monkeypatch):
    """processor="cpu" (a thread per slot, as the cuda processor runs slots on several GPUs with a stream
    each): every bucket's steps write the engine's caches themselves (fastpipe.runtime.binding.bind), so no decode
    step or prefill hands back a new cache for the session to copy in, and the tokens are transformers'."""
    from tests.test_state_in_place import spy_write_back

    seen = spy_write_back(monkeypatch)
    with Engine(SET, eos_token_id=None, compile=False, processor="cpu") as eng:
        buckets = eng.buckets.by_size()
        assert {b.processor for b in buckets} == {"cpu"}
        for b in buckets:
            n = len(b.state)
            assert n and f"{n} state tensors updated in place ({n} by an in-place write)" in b.describe(), b.describe()
        seen.clear()
        assert _generate(eng) == EXPECTED["tokens"]
    assert seen and all(all(run) for run in seen), seen


def test_committed_greedy_tokens_win_by_a_margin_no_device_rounding_can_flip(monkeypatch):
    """The GPU test below compares greedy tokens made on the GPU with expected.json (made on the CPU):
    that holds only while every expected token beats the runner-up by far more than f32 rounding
    across devices (~1e-6 of logits near 0.6). Every logit row the engine samples from is kept here."""
    import fastpipe.serving.engine as engine_mod

    rows = []

    def greedy(logits, params, gens):                        # logits [R, V]
        rows.append(logits.detach().clone())
        return logits.argmax(-1).tolist(), {}
    monkeypatch.setattr(engine_mod, "sample_rows", greedy)
    with Engine(SET, eos_token_id=None, compile=False) as eng:
        assert _generate(eng) == EXPECTED["tokens"]
    top2 = torch.cat(rows).topk(2, dim=-1).values                 # [steps, 2]
    assert top2.shape[0] == sum(EXPECTED["max_new_tokens"])              # one row per token made
    gap = float((top2[:, 0] - top2[:, 1]).min())
    assert gap > 1e-4, gap                                        # 5.2e-4 when made (2026-11-25)



def _watch_engine_devices(monkeypatch) -> dict:
    """Where the engine assembles (the device asked of assemble_outputs), samples (the logits' device) and
    where the prefills' inputs and caches are (the devices of what the prefill sessions run on); each a list
    of what was seen. No prefill runs at the model level (run_model) or has its caches copied (admit)."""
    import fastpipe.serving.engine as engine_mod
    from fastpipe.serving.kv_state import KVState
    from fastpipe.session import Session

    seen = {"assemble": [], "sample": [], "prefill": []}
    assemble, sample, prefill_inputs = engine_mod.assemble_outputs, engine_mod.sample_rows, Engine._prefill_inputs

    def assemble_spy(*a, device=None, **kw):
        seen["assemble"].append(device)
        return assemble(*a, device=device, **kw)

    def sample_spy(logits, params, gens):
        seen["sample"].append(logits.device)
        return sample(logits, params, gens)

    def prefill_spy(self, sess, placed):
        inputs = prefill_inputs(self, sess, placed)
        seen["prefill"] += [t.device for t in inputs.values()]
        return inputs

    monkeypatch.setattr(engine_mod, "assemble_outputs", assemble_spy)
    monkeypatch.setattr(engine_mod, "sample_rows", sample_spy)
    monkeypatch.setattr(Engine, "_prefill_inputs", prefill_spy)
    monkeypatch.setattr(Session, "run_model", lambda *a, **kw: pytest.fail("a prefill ran at the model level"))
    monkeypatch.setattr(KVState, "admit", lambda *a: pytest.fail("a prefill's caches were copied"))
    return seen


def test_engine_assembles_logits_where_the_decode_logits_are_and_prefills_into_its_cache(monkeypatch):
    """Logits are assembled on the device of the decode step's logits (engine.device) and sampled there;
    the prefills write into the engine's cache where it lives: on a GPU nothing but the sampled ids (and
    the prompts' ids going in) crosses the host (the GPU test below). Here: the engine asks for that
    device every time."""
    seen = _watch_engine_devices(monkeypatch)
    with Engine(SET, eos_token_id=None, compile=False) as eng:
        want = eng.decode.slot_devices[next(s.device for s in eng.decode.pipeline.metadata.slices_outputs.values()
                                            if s.origin == "logits")]
        assert eng.device == want
        assert _generate(eng) == EXPECTED["tokens"]
    assert seen["assemble"] and seen["sample"] and seen["prefill"]
    assert set(seen["assemble"]) == set(seen["sample"]) == set(seen["prefill"]) == {want}


def _on_gpu(path: Path) -> dict:
    p = read_pipeline(path)
    return {slot: "cuda:0" for slot in p.devices}


@pytest.mark.cuda
def test_engine_on_gpu_captures_the_decode_step_at_warmup_and_keeps_its_caches():
    device_map = _on_gpu(SET / "decode_b2" / "pipeline.json")
    with Engine(SET, eos_token_id=None, compile=True, compile_policy="raise", device_map=device_map) as eng:
        replay = eng.decode.runner.replay
        assert replay is not None and replay.replaying            # captured in the constructor, not on a request
        assert all(t.device.type == "cuda" for t in eng.kv.tensors.values())
        ptrs = {n: t.data_ptr() for n, t in eng.kv.tensors.items()}
        assert replay.static_in[next(iter(ptrs))] is eng.kv.tensors[next(iter(ptrs))]   # the caches are the graph's
        prefill = eng.buckets.prefills[(2, 8)]                     # and the prefill's, captured on the same caches
        pre = prefill.runner.replay
        assert pre is not None and pre.replaying
        caches = eng.kv.inputs_of(prefill)                         # name -> the engine's [R, Hkv_slot, M, D]
        assert len(caches) == len(prefill.state) and all(pre.static_in[n] is t for n, t in caches.items())
        assert _generate(eng) == EXPECTED["tokens"]
        assert _generate(eng) == EXPECTED["tokens"]                # replayed again, same tokens
        assert {n: t.data_ptr() for n, t in eng.kv.tensors.items()} == ptrs
        assert "replayed as one CUDA graph" in eng.decode.describe()


@pytest.mark.cuda
@pytest.mark.parametrize("processor", ["region", "cuda", "reference"])
def test_state_in_place_on_gpu_equals_the_cpu_copying_path(processor):
    path = SET / "decode_b2" / "pipeline.json"
    ref = fastpipe.load(path)
    sess = fastpipe.load(path, processor=processor, state_in_place=True, device_map=_on_gpu(path))
    g = torch.Generator().manual_seed(0)
    cpu = {}
    for n in sess.input_names:
        t = sess.pipeline.tensors[n]
        cpu[n] = torch.randn(t.shape, generator=g) if n.startswith("past") else torch.zeros(t.shape, dtype=torch.int64)
    for n in cpu:
        if n.startswith("input_ids"):
            cpu[n] = torch.tensor([[7], [11]])
        elif n.startswith("cache_position"):
            cpu[n] = torch.tensor([3, 9])
    for step in range(3):                                   # several steps: replay (where enabled) after the first
        want = ref.run({n: t.clone() for n, t in cpu.items()})
        gpu = {n: t.cuda() for n, t in cpu.items()}
        out = sess.run(gpu)
        for i, o in sess.state.items():
            assert out[o] is gpu[i]
        for n, w in want.items():
            torch.testing.assert_close(out[n].cpu(), w, rtol=1e-4, atol=1e-5)
        cpu = {n: (want[sess.state[n]] if n in sess.state else t) for n, t in cpu.items()}
        cpu = {n: (t + 1 if n.startswith("cache_position") else t) for n, t in cpu.items()}


@pytest.mark.cuda
def test_engine_on_gpu_samples_there_and_prefills_into_its_cache_there(monkeypatch):
    seen = _watch_engine_devices(monkeypatch)
    with Engine(SET, eos_token_id=None, compile=False, device_map=_on_gpu(SET / "decode_b2" / "pipeline.json")) as eng:
        assert eng.device == torch.device("cuda:0")
        assert _generate(eng) == EXPECTED["tokens"]
    assert seen["sample"] and seen["prefill"]
    assert {d.type for key in ("sample", "prefill") for d in seen[key]} == {"cuda"}
    assert {torch.device(d).type for d in seen["assemble"]} == {"cuda"}
