"""The producer's LLM pipelines, run unchanged: furiosa-llm 2026.3.0's own PipelineBuilder output (a tiny
Llama, prefill and decode buckets, pp=2 over two slots, paged KV cache written in place, the decode
graphs calling furiosa::sparse_select_v1_5), against its own eager model's 17-step chained greedy run
(tests/data/producer_llm/PROVENANCE.md: how they were made, with scripts/producer_llm.py)."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastpipe
from fastpipe.format import read_pipeline
from fastpipe.serving.producer_llm import ProducerLLM

DATA = Path(__file__).parent / "data" / "producer_llm"
CASES = ("f32", "bf16")
STEPS = 17


def case(name):
    d = DATA / name
    return d, load_file(str(d / "steps.safetensors")), json.loads((d / "tokens.json").read_text())


def step_inputs(steps, k) -> dict:
    return {n.split(".", 1)[1]: v for n, v in steps.items() if n.startswith(f"step{k}.") and not n.endswith(".logits")}


def initial_caches(steps) -> dict:
    return {n.split(".", 1)[1]: v.clone() for n, v in steps.items() if n.startswith("initial.")}


def assert_near(got, want, dtype_name, what):
    """f32: within 1e-5 of the largest value (the producer's eager path and its traced graph round alike
    up to reassociation); bf16: within 5e-2 (17 chained steps of bf16 caches)."""
    got, want = got.float(), want.float()
    scale = want.abs().max().clamp_min(1.0)
    err = ((got - want).abs().max() / scale).item()
    assert err <= (1e-5 if dtype_name == "f32" else 5e-2), f"{what}: error {err:.2e} of the largest value"


def without_padding_block(t):
    return t[1:]       # block 0 is written by every padded position, in an order nothing fixes


@pytest.mark.parametrize("name", CASES)
def test_the_producers_files_validate_with_their_written_caches_and_foreign_op(name):
    d, _, _ = case(name)
    for bucket in ("prefill", "decode"):
        p = read_pipeline(d / f"{bucket}.json")
        assert p.version == "0.1.0" and sorted(p.devices) == ["0", "1"]
        s = fastpipe.load(p, device_map=None, processor="reference")
        origins = {p.metadata.slices_inputs[n].origin for n in s.written_inputs}
        assert origins == {"kv_caches_0_0", "kv_caches_0_1", "kv_caches_1_0", "kv_caches_1_1"}
        assert s.state == {}                  # no cache output paired with an input: the graphs write in place
        decoded = "".join(base64.b64decode((d / f"{st.data_blob}.fx").read_text()).decode()
                          for st in p.supertasks.values() if st.data_blob)
        assert ("torch.ops.furiosa.sparse_select_v1_5.default" in decoded) == (bucket == "decode")


MODES = [("reference", "off"), ("cpu", "off"), ("region", "off"), ("region", "wait")]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("processor,compile", MODES)
def test_recorded_steps_match_the_producers_eager_model(name, processor, compile):
    """Each of the 17 steps fed the inputs the producer's eager model got: the logits agree, and the
    caches the graphs write in place equal its own after the prefill and at the end."""
    d, steps, _ = case(name)
    pre = fastpipe.load(d / "prefill.json", device_map=None, processor=processor, compile=compile)
    dec = fastpipe.load(d / "decode.json", device_map=None, processor=processor, compile=compile)
    caches = initial_caches(steps)
    for k in range(STEPS):
        out = (pre if k == 0 else dec).run_model(**step_inputs(steps, k), **caches)
        assert_near(out["logits"], steps[f"step{k}.logits"], name, f"step {k} logits")
        if k == 0:
            for n, c in caches.items():
                assert_near(without_padding_block(c), without_padding_block(steps[f"after_prefill.{n}"]), name, n)
    for n, c in caches.items():
        assert_near(without_padding_block(c), without_padding_block(steps[f"final.{n}"]), name, n)


@pytest.mark.parametrize("name", CASES)
def test_step_inputs_follow_the_producers_rule(name):
    """ProducerLLM's inputs, for the block tables the reference run used, are the very inputs it fed."""
    d, steps, tok = case(name)
    llm = ProducerLLM(d / "prefill.json", d / "decode.json", device_map=None, processor="reference")
    prompts, tables, gen = tok["prompts"], tok["block_tables"], tok["generated"]
    for n, v in llm.prefill_inputs(prompts, tables).items():
        assert torch.equal(v, steps[f"step0.{n}"]), n
    for k in range(1, STEPS):
        lengths = [len(p) + k - 1 for p in prompts]
        for n, v in llm.decode_inputs([g[k - 1] for g in gen], lengths, tables).items():
            assert torch.equal(v, steps[f"step{k}.{n}"]), (k, n)


@pytest.mark.parametrize("name,processor,compile", [("f32", "reference", "off"), ("f32", "region", "wait"),
                                                    ("bf16", "region", "off")])
def test_chained_greedy_decode_equals_the_producers_tokens(name, processor, compile):
    """A prefill and 16 decode steps, blocks from fastpipe's own allocator (interleaved between the rows,
    so each table is non-contiguous), caches carried in place: the producer's tokens, one for one."""
    d, _, tok = case(name)
    llm = ProducerLLM(d / "prefill.json", d / "decode.json", device_map=None, processor=processor, compile=compile)
    assert llm.generate(tok["prompts"], STEPS) == tok["generated"]
    tables = llm.last_tables
    assert [len(t) for t in tables] == [len(p) + STEPS - 1 for p in tok["prompts"]]
    assert all(any(b - a != 1 for a, b in zip(t, t[1:])) for t in tables)      # non-contiguous
    assert 0 not in tables[0] + tables[1] and llm.blocks.free_blocks == 47     # all given back
    # a second request on the same caches and pool: the same tokens (blocks reused, old contents overwritten)
    assert llm.generate(tok["prompts"][:1], 4) == [tok["generated"][0][:4]]


def test_generate_refuses_what_the_buckets_cannot_hold():
    d, _, tok = case("f32")
    llm = ProducerLLM(d / "prefill.json", d / "decode.json", device_map=None, processor="reference")
    with pytest.raises(fastpipe.errors.InputError, match=r"prompts\[0\]: expected 1 to 8 tokens"):
        llm.generate([list(range(9))], 2)
    with pytest.raises(fastpipe.errors.InputError, match=r"max_new_tokens: expected at most 27 for prompts\[0\]"):
        llm.generate([[1, 2, 3, 4, 5]], 28)


def test_per_slot_inputs_left_out_are_filled_from_the_metadata():
    """The producer replicates each input per slot (d0_..., d1_... of one model input): run() takes one."""
    d, steps, _ = case("f32")
    s = fastpipe.load(d / "prefill.json", device_map=None, processor="reference")
    p = s.pipeline
    by_origin: dict[str, list[str]] = {}
    for n in p.input_names:
        by_origin.setdefault(p.metadata.slices_inputs[n].origin, []).append(n)
    model = {**step_inputs(steps, 0), **initial_caches(steps)}
    first_only = {names[0]: model[o] for o, names in by_origin.items()}
    assert len(first_only) < len(p.input_names)
    out = s.run(first_only)
    (logits_name,) = p.output_names
    assert_near(out[logits_name], steps["step0.logits"], "f32", "logits")


def test_cli_chains_the_recorded_steps_through_state_files(tmp_path, capsys):
    """`fastpipe run` per step: --state-in the caches the last run left, --state-out what this one
    leaves, --check the producer's logits."""
    from fastpipe.cli import main

    d, steps, _ = case("f32")
    save_file(initial_caches(steps), str(tmp_path / "kv.safetensors"))
    for k in range(5):
        bucket = d / ("prefill.json" if k == 0 else "decode.json")
        (out_name,) = read_pipeline(bucket).output_names
        save_file(step_inputs(steps, k), str(tmp_path / "in.safetensors"))
        save_file({out_name: steps[f"step{k}.logits"]}, str(tmp_path / "want.safetensors"))
        code = main(["run", str(bucket), "--inputs", str(tmp_path / "in.safetensors"), "--state-in",
                     str(tmp_path / "kv.safetensors"), "--state-out", str(tmp_path / "kv.safetensors"), "--check",
                     str(tmp_path / "want.safetensors"), "--atol", "1e-4", "--repeat", "2"])
        assert code == 0, capsys.readouterr().err
        assert "check: 1 outputs match" in capsys.readouterr().out
    state = load_file(str(tmp_path / "kv.safetensors"))
    assert sorted(state) == ["kv_caches_0_0", "kv_caches_0_1", "kv_caches_1_0", "kv_caches_1_1"]
    for n, c in state.items():     # after step 4: positions up to 4 decode tokens past each prompt written
        assert not torch.equal(c, steps[f"initial.{n}"])


DIST_SCRIPT = r"""
import json, sys, torch
from safetensors.torch import load_file, save_file
import fastpipe
d, out = sys.argv[1], sys.argv[2]
steps = load_file(d + "/steps.safetensors")
caches = {n.split(".", 1)[1]: v.clone() for n, v in steps.items() if n.startswith("initial.")}
pre = fastpipe.load(d + "/prefill.json", processor="dist", compile="off")
dec = fastpipe.load(d + "/decode.json", processor="dist", compile="off")
err = 0.0
for k in range(17):
    ins = {n.split(".", 1)[1]: v for n, v in steps.items() if n.startswith(f"step{k}.") and not n.endswith(".logits")}
    got = (pre if k == 0 else dec).run_model(**ins, **caches)
    if got:
        err = max(err, (got["logits"] - steps[f"step{k}.logits"]).abs().max().item())
rank = torch.distributed.get_rank()
save_file({n: c.contiguous() for n, c in caches.items()}, f"{out}/caches{rank}.safetensors")
json.dump({"err": err, "logits": rank == 0}, open(f"{out}/rank{rank}.json", "w"))
pre.close(); dec.close()
"""


def test_two_ranks_write_their_caches_in_place(tmp_path):
    """The dist processor (gloo, one process per stage): each rank's graphs update that rank's caches."""
    from tests.test_distributed import ok, torchrun

    d, steps, _ = case("f32")
    script = tmp_path / "ranks.py"
    script.write_text(DIST_SCRIPT)
    ok(torchrun(2, str(script), str(d), str(tmp_path), module=False, timeout=300))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["logits"] and not r1["logits"] and r0["err"] <= 1e-4
    for rank, layer in ((0, 0), (1, 1)):
        got = load_file(str(tmp_path / f"caches{rank}.safetensors"))
        for kv in (0, 1):
            n = f"kv_caches_{layer}_{kv}"
            assert_near(without_padding_block(got[n]), without_padding_block(steps[f"final.{n}"]), "f32", n)
        other = f"kv_caches_{1 - layer}_0"      # the other stage's cache is not this rank's to write
        assert torch.equal(got[other], steps[f"initial.{other}"])
