"""fastpipe.weights.page_release: a mapped weight's pages leave the RSS and read back the same bytes;
anonymous memory is never touched; the region processor gives back its merged shards' pages."""
from __future__ import annotations

import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fastpipe.weights.page_release import release

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/maps: Linux")


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_mapped_tensor_leaves_the_rss_and_reads_back_the_same(tmp_path):
    want = torch.randn(4096, 4096)                                   # 64 MiB
    save_file({"w": want}, tmp_path / "m.safetensors")
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        w = f.get_slice("w")[:]
    assert torch.equal(w, want)                                     # every page touched
    before = rss()
    got = release([w])
    after = rss()
    assert got >= 63 * 2**20 and before - after >= 48 * 2**20
    assert torch.equal(w, want)                                     # faulted in again from the file


def test_anonymous_memory_is_never_released():
    t = torch.randn(2048, 2048)
    kept = t.clone()
    assert release([t, t[:, :100], torch.empty(0)]) == 0
    assert torch.equal(t, kept)


def test_the_region_processor_gives_back_its_merged_shards_pages(tmp_path):
    """A tp=2 column-parallel layer: its row shards are views of the file; once merged they are not read."""
    import fastpipe
    from tests.hf_models import make_checkpoint

    make_checkpoint("llama", tmp_path / "ckpt", seed=1)
    path = fastpipe.build(str(tmp_path / "ckpt"), tp=2, batch=1, seq_len=4).save(tmp_path / "out")
    sess = fastpipe.load(path, processor="region", device_map=None, compile="off")
    proc = sess._processor
    assert proc.passes.merged > 0 and proc.released > 0
    ref = fastpipe.load(path)                                       # the reference processor: the file's graphs
    x = {n: torch.randint(0, 100, tuple(sess.pipeline.tensors[n].shape)) for n in sess.pipeline.input_names}
    got, want = sess.run(x), ref.run(x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5)


def test_shards_tiling_one_stored_tensor_merge_into_that_tensor_without_a_copy(tmp_path):
    """o_proj and down_proj (row-parallel: column blocks of one stored weight) and the vocab-parallel head
    merge into the stored tensor itself, a view of the checkpoint's mapping; q/k/v and gate/up (several
    stored tensors) into a new tensor."""
    import fastpipe
    from fastpipe.weights.page_release import _file_mappings
    from tests.hf_models import make_checkpoint

    model = make_checkpoint("llama", tmp_path / "ckpt", seed=2)
    path = fastpipe.build(str(tmp_path / "ckpt"), tp=2, batch=1, seq_len=4).save(tmp_path / "out")
    sess = fastpipe.load(path, processor="region", device_map=None, compile="off")
    maps = _file_mappings()
    mapped = lambda t: any(lo <= t.data_ptr() < hi for lo, hi in maps)  # noqa: E731
    merged = {n: b for n, b in sess._processor.runs[0].gm.named_buffers() if n.startswith("merged")}
    in_file = sorted(n for n, b in merged.items() if mapped(b))
    layers = model.config.num_hidden_layers
    assert len([n for n in in_file if n.startswith("merged_rows")]) == 2 * layers      # o_proj, down_proj
    assert len(in_file) == 2 * layers + 1                                               # + the head
    stored = dict(model.named_parameters())
    for n in in_file:
        assert any(merged[n].shape == p.shape and torch.equal(merged[n], p.detach()) for p in stored.values()), n
