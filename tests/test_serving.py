"""Embedding fastpipe in a server: model-level calls, exact-size buckets sharing weights, threads.
(Generation: tests/test_generation_engine.py; the HTTP server: tests/test_server*.py.)"""
import gc
import threading
import weakref

import pytest
import torch

import fastpipe
from fastpipe.errors import InputError, RunError
from fastpipe.model_io import assemble_outputs, flatten_args, nest, to_pipeline_inputs
from tests.hf_models import hf_reference, make_checkpoint

from fastpipe.builder.hf.build import build_hf  # noqa: E402
from fastpipe.serving import ModelSet  # noqa: E402



@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama") / "m"
    return folder, make_checkpoint("llama", folder, seed=7)


def _past(cfg, batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    hd = cfg.hidden_size // cfg.num_attention_heads
    return [[torch.randn(batch, cfg.num_key_value_heads, length, hd, generator=g) for _ in range(2)]
            for _ in range(cfg.num_hidden_layers)]


def test_flatten_and_nest_follow_spec_naming():
    k, v = torch.zeros(1), torch.ones(1)
    flat = flatten_args({"input_ids": k, "past_key_values": [[k, v], [v, k]]})
    assert list(flat) == ["input_ids", "past_key_values_0_0", "past_key_values_0_1", "past_key_values_1_0", "past_key_values_1_1"]
    assert nest(flat, "past_key_values")[1][0] is v
    with pytest.raises(InputError, match="expected a tensor or a \\(nested\\) list/tuple of tensors, found str"):
        flatten_args({"x": "nope"})


def test_run_model_equals_hf_with_nested_cache(llama, tmp_path):
    folder, model = llama
    sess = fastpipe.load(build_hf(folder, tp=2, pp=2, batch=2, seq_len=3, past_len=5).save(tmp_path / "o"), processor="reference")
    ids = torch.randint(0, 100, (2, 3), generator=torch.Generator().manual_seed(1))
    past = _past(model.config, 2, 5, 2)
    out = sess.run_model(input_ids=ids, past_key_values=past, check_replicas=True)
    ref = hf_reference(model, "llama", {"input_ids": ids}, [tuple(p) for p in past])
    assert list(out)[0] == "logits"
    for k, want in ref.items():
        torch.testing.assert_close(out[k], want, rtol=1e-4, atol=1e-5)
    fast = sess.run_model(input_ids=ids, past_key_values=past)       # the planned copy, no replica checks
    assert list(fast) == list(out) and all(torch.equal(fast[k], out[k]) for k in out)
    outs = sess.run(to_pipeline_inputs(sess.pipeline, flatten_args({"input_ids": ids, "past_key_values": past})))
    assert all(assemble_outputs(sess.pipeline, outs)[k].data_ptr() != v.data_ptr() for k, v in outs.items()
               if k in out)                                           # copies, never the pipeline's tensors



def test_outputs_are_assembled_on_the_device_asked_for(llama, tmp_path):
    """assemble_outputs(device=) / run_model(output_device=): each output a new tensor there (the engine
    keeps a GPU's logits and caches on it); the "meta" device stands in for a GPU here. Default: the CPU."""
    folder, _ = llama
    sess = fastpipe.load(build_hf(folder, tp=2, batch=1, seq_len=3).save(tmp_path / "o"), processor="reference")
    ids = torch.randint(0, 100, (1, 3), generator=torch.Generator().manual_seed(2))
    on_cpu = sess.run_model(input_ids=ids)
    assert on_cpu and all(t.device.type == "cpu" for t in on_cpu.values())
    outs = sess.run(to_pipeline_inputs(sess.pipeline, flatten_args({"input_ids": ids})))
    for check in (False, True):
        meta = assemble_outputs(sess.pipeline, outs, check_replicas=check, device="meta")
        assert list(meta) == list(on_cpu)
        for k, t in meta.items():
            assert t.device.type == "meta" and (t.shape, t.dtype) == (on_cpu[k].shape, on_cpu[k].dtype), k
    only = sess.run_model(input_ids=ids, output_device="meta")
    assert list(only) == list(on_cpu) and all(t.device.type == "meta" for t in only.values())
    logits = assemble_outputs(sess.pipeline, outs, only=("logits",), device="cpu")
    assert list(logits) == ["logits"] and torch.equal(logits["logits"], on_cpu["logits"])

def test_run_model_says_what_no_slice_covers(llama, tmp_path):
    import dataclasses

    folder, _ = llama
    sess = fastpipe.load(build_hf(folder, tp=2, batch=1, seq_len=3).save(tmp_path / "o"), processor="reference")
    outs = sess.run({"input_ids": torch.zeros(1, 3, dtype=torch.int64)})
    md = sess.pipeline.metadata
    name, sl = next((n, s) for n, s in md.slices_outputs.items() if s.origin == "logits")
    half = dataclasses.replace(sl, placements=((0, 1), (0, 3), (0, 50)))
    only = dataclasses.replace(md, slices_outputs={name: half})
    p = dataclasses.replace(sess.pipeline, metadata=only)
    for check in (False, True):
        with pytest.raises(RunError, match=r"run_model: logits: expected the output's slices to cover it, found 150 "
                                           r"elements missing"):
            assemble_outputs(p, {name: outs[name][..., :50]}, check_replicas=check)


def test_replicated_slices_must_agree_in_debug_mode(llama, tmp_path):
    folder, _ = llama
    sess = fastpipe.load(build_hf(folder, tp=2, batch=1, seq_len=4).save(tmp_path / "o"), processor="reference")
    outs = sess.run({"input_ids": torch.zeros(1, 4, dtype=torch.int64)})
    outs["logits_rank1"] = outs["logits_rank1"] + 1e-3
    fast = assemble_outputs(sess.pipeline, outs)                # not checked: the first replica (rank 0's) wins
    assert torch.equal(fast["logits"], outs["logits"]) and not torch.equal(fast["logits"], outs["logits_rank1"])
    with pytest.raises(RunError, match=r'logits: replicated slice "logits_rank1" disagrees with another slot\'s copy'):
        assemble_outputs(sess.pipeline, outs, check_replicas=True)


@pytest.fixture(scope="module")
def buckets(llama, tmp_path_factory):
    folder, model = llama
    out = tmp_path_factory.mktemp("buckets")
    paths = [build_hf(folder, tp=2, batch=b, seq_len=6).save(out / f"b{b}") for b in (1, 2, 4)]
    paths += [build_hf(folder, tp=2, batch=b, seq_len=1, past_len=6).save(out / f"d{b}") for b in (1, 4)]
    return paths, model


def test_buckets_share_weights_and_pad(buckets):
    paths, model = buckets
    with ModelSet(paths[:3]) as three, ModelSet(paths[:1]) as one:
        assert three.store.stats()["live_slices"] == one.store.stats()["live_slices"]
        assert three.weight_bytes() <= 1.1 * one.weight_bytes()
        ids = torch.randint(0, 100, (3, 6), generator=torch.Generator().manual_seed(3))   # batch 3 -> bucket 4, padded
        out = three.run_model(input_ids=ids)
        assert out["logits"].shape == (3, 6, 100)
        torch.testing.assert_close(out["logits"], hf_reference(model, "llama", {"input_ids": ids}, None)["logits"],
                                   rtol=1e-4, atol=1e-5)
        with pytest.raises(InputError, match=r"run_model: expected inputs fitting a bucket"):
            three.run_model(input_ids=torch.zeros(5, 6, dtype=torch.int64))
        meta = three.run_model(input_ids=ids, output_device="meta")
        assert meta["logits"].device.type == "meta" and meta["logits"].shape == (3, 6, 100)


def test_region_buckets_share_merged_weights(buckets):
    """Buckets on the region processor: each is one stitched graph with its shard matmuls merged; the
    merged weights are made once and shared by every bucket, so weight memory stays that of one."""
    paths, model = buckets
    from fastpipe.weights import WeightStore

    with ModelSet(paths[:3], store=WeightStore(), processor="region") as three, \
            ModelSet(paths[:1], store=WeightStore(), processor="region") as one:
        assert all(b.session.runner.passes.merged > 0 for b in three.buckets)
        merged = [{t.data_ptr() for n, t in b.session.runner.runs[0].gm.named_buffers() if n.startswith("merged")}
                  for b in three.buckets]
        assert merged[0] and merged[0] == merged[1] == merged[2]
        assert three.weight_bytes() <= 1.1 * one.weight_bytes()
        ids = torch.randint(0, 100, (3, 6), generator=torch.Generator().manual_seed(5))
        torch.testing.assert_close(three.run_model(input_ids=ids)["logits"],
                                   hf_reference(model, "llama", {"input_ids": ids}, None)["logits"], rtol=1e-4, atol=1e-5)


def test_threads_mixed_requests_equal_single_threaded(buckets):
    paths, model = buckets
    requests = []
    g = torch.Generator().manual_seed(4)
    for i in range(40):
        b = 1 + i % 4
        if i % 3 == 0:   # a decode step over a 6-token cache
            b = 1 if b < 3 else 4
            requests.append({"input_ids": torch.randint(0, 100, (b, 1), generator=g),
                             "past_key_values": _past(model.config, b, 6, i)})
        else:
            requests.append({"input_ids": torch.randint(0, 100, (b, 6), generator=g)})
    with ModelSet(paths) as models:
        models.warmup()
        want = [models.run_model(**r) for r in requests]
        got: dict[tuple[int, int], dict] = {}
        errors = []

        def worker(t):
            try:
                for j in range(20):
                    k = (t * 7 + j) % len(requests)
                    got[(t, j)] = (k, models.run_model(**requests[k]))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors and len(got) == 160
        for k, out in got.values():
            for name, v in want[k].items():
                assert torch.equal(out[name], v), (k, name)


def test_failing_request_does_not_poison(buckets):
    paths, _ = buckets
    with ModelSet(paths[:1]) as models:
        with pytest.raises(InputError, match=r"run_model: expected inputs fitting a bucket"):
            models.run_model(input_ids=torch.zeros(1, 5, dtype=torch.int64))
        with pytest.raises(InputError, match=r"run_model: input_ids.dtype|fitting a bucket"):
            models.run_model(input_ids=torch.zeros(1, 6, dtype=torch.int32))
        assert models.run_model(input_ids=torch.zeros(1, 6, dtype=torch.int64))["logits"].shape == (1, 6, 100)


def test_close_frees_weights(buckets):
    paths, _ = buckets
    models = ModelSet(paths[:2])
    ref = weakref.ref(next(r for ss in models.buckets[0].session.program.steps.values() for st in ss for r in st.constants.values()))
    assert ref() is not None
    models.close()
    gc.collect()
    assert ref() is None
    with pytest.raises(InputError, match="the model set is closed"):
        models.run_model(input_ids=torch.zeros(1, 6, dtype=torch.int64))
