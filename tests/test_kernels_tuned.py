"""Measured launch configs (fastpipe.kernels.tuned) come before pick_config's heuristic on the GPU
they were measured on, for their dtype, N, K, n and launcher, within a factor of two of the measured M
(nearest first) or above the largest; a bad table is reported once and not used."""
import json

import pytest
import torch

import fastpipe.kernels.mm_reduce_scatter_kernel as mrs
from fastpipe.kernels import pick_config

H100 = "NVIDIA H100 80GB HBM3"


def entry(M, bm, *, launcher="mm_sum", n=2, device=H100):
    return {"launcher": launcher, "device": device, "dtype": "bfloat16", "M": M, "N": 4096, "K": 4096, "n": n,
            "config": {"block_m": bm, "block_n": 64, "block_k": 128, "group_m": 4, "num_warps": 4, "num_stages": 5},
            "ms": 0.1, "heuristic_ms": 0.2}


@pytest.fixture
def on_h100(monkeypatch):
    monkeypatch.setattr(mrs, "interpreting", lambda: False)
    monkeypatch.setattr(mrs, "_num_sms", lambda device: 132)
    monkeypatch.setattr(mrs, "_device_name", lambda device: H100)


def write(tmp_path, monkeypatch, doc) -> None:
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setenv("FASTPIPE_TUNED_CONFIGS", str(path))


def test_tuned_entry_wins_where_it_applies(tmp_path, monkeypatch, on_h100):
    heuristic = pick_config(64, 4096, 4096, torch.bfloat16, "cuda", n=2)
    heuristic_f16 = pick_config(64, 4096, 4096, torch.float16, "cuda", n=2)
    write(tmp_path, monkeypatch, {"format": 1, "entries": [entry(1024, 128), entry(128, 32), entry(128, 16, n=4)]})
    pick = lambda M, **kw: pick_config(M, 4096, 4096, torch.bfloat16, "cuda", **kw)  # noqa: E731
    assert (pick(65, n=2).block_m, pick(128, n=2).block_m, pick(256, n=2).block_m) == (32, 32, 32)
    assert (pick(513, n=2).block_m, pick(2048, n=2).block_m) == (128, 128)        # 1024's window: (512, 2048]
    assert pick(8192, n=2).block_m == 128 and pick(8192, n=2).num_stages == 5     # above all: the largest M's
    assert pick(100, n=4).block_m == 16
    assert pick(64, n=2) == heuristic                      # below 128's window: a decode's M is not 128's
    assert pick(300, n=2) == pick(300, n=8)                # between windows: the heuristic
    assert pick(300, n=2).num_stages != 5
    assert pick(64, n=8) == heuristic                                            # no entry for n=8
    assert pick(64, n=2, launcher="gather_rows") == heuristic                    # another kernel
    assert pick_config(64, 4096, 4096, torch.float16, "cuda", n=2) == heuristic_f16   # another dtype
    monkeypatch.setattr(mrs, "_device_name", lambda device: "NVIDIA H200")
    assert pick(64, n=2) == heuristic                                            # another GPU
    monkeypatch.setattr(mrs, "interpreting", lambda: True)
    monkeypatch.setattr(mrs, "_device_name", lambda device: H100)
    assert pick(64, n=2).num_stages == 1                                         # the interpreter: never


@pytest.mark.parametrize("doc, field", [
    ({"format": 2, "entries": []}, "expected {\"format\": 1"),
    ({"format": 1, "entries": [{**entry(8, 16), "M": 0}]}, "entries[0].M: expected an integer >= 1, found 0"),
    ({"format": 1, "entries": [{**entry(8, 16), "launcher": "mm"}]}, "entries[0].launcher: expected one of"),
    ({"format": 1, "entries": [{**entry(8, 16), "dtype": "bf16"}]}, "entries[0].dtype: expected a torch dtype"),
    ({"format": 1, "entries": [entry(8, 16), {**entry(8, 16), "config": {"block_m": 24}}]}, "entries[1].config"),
    ({"format": 1, "entries": [{**entry(8, 16), "config": {**entry(8, 16)["config"], "split_k": 0}}]},
     "entries[0].config: expected KernelConfig fields"),
])
def test_bad_table_is_reported_once_and_not_used(tmp_path, monkeypatch, on_h100, doc, field):
    monkeypatch.delenv("FASTPIPE_TUNED_CONFIGS", raising=False)
    heuristic = pick_config(64, 4096, 4096, torch.bfloat16, "cuda", n=2)
    write(tmp_path, monkeypatch, doc)
    with pytest.warns(RuntimeWarning, match="tuned kernel configs not used") as caught:
        assert pick_config(64, 4096, 4096, torch.bfloat16, "cuda", n=2) == heuristic
    assert field in str(caught[0].message) and "tuned.json" in str(caught[0].message)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pick_config(64, 4096, 4096, torch.bfloat16, "cuda", n=2) == heuristic   # once


def test_no_table_is_the_heuristic(tmp_path, monkeypatch, on_h100):
    monkeypatch.setenv("FASTPIPE_TUNED_CONFIGS", str(tmp_path / "absent.json"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = pick_config(8192, 4096, 4096, torch.bfloat16, "cuda")
    assert (cfg.block_m, cfg.block_n, cfg.block_k) == (128, 256, 64)


def test_a_split_k_config_applies_only_near_its_m(tmp_path, monkeypatch, on_h100):
    """A split-K config tuned at M 128 (128 rows fill few tiles) is not carried above its window, as a
    plain config is: at M 8192 the rows fill the GPU, and the shares' workspace would be 64x larger."""
    split = {**entry(128, 64), "config": {**entry(128, 64)["config"], "split_k": 4}}
    write(tmp_path, monkeypatch, {"format": 1, "entries": [entry(16, 16), split]})
    pick = lambda M: pick_config(M, 4096, 4096, torch.bfloat16, "cuda", n=2)  # noqa: E731
    assert (pick(128).block_m, pick(128).split_k) == (64, 4) and pick(256).split_k == 4
    heuristic = pick(8192)
    assert heuristic.split_k == 1 and heuristic.block_m == 128 and heuristic.num_stages != 5
    write(tmp_path, monkeypatch, {"format": 1, "entries": [entry(16, 16), entry(128, 64)]})
    assert pick(8192).block_m == 64                   # a plain config: above the largest M too
    # gather_rows (all_gather_matmul dim 0) takes split-K configs too, on the same terms
    rows = {**entry(16, 64, launcher="gather_rows"), "config": {**entry(16, 64)["config"], "split_k": 8}}
    write(tmp_path, monkeypatch, {"format": 1, "entries": [rows]})
    pick_rows = lambda M: pick_config(M, 4096, 4096, torch.bfloat16, "cuda", launcher="gather_rows", n=2)  # noqa: E731
    assert pick_rows(16).split_k == 8 and pick_rows(64).split_k == 1
