"""fastpipe.validate.sources.payload_text reads each payload side file once per Pipeline object.

validate(), the binder and the session each ask for the same payloads; the side file
(`<blob-id>.fx`, or `<blob-id>.dfg`/`.edf` bytes) is opened the first time only, the path
rules still apply on every call, and two Pipeline objects never share text.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
from pathlib import Path

import pytest

from fastpipe.errors import ParamError, PayloadError
from fastpipe.format import read_pipeline
from fastpipe.options import LoadOptions
from fastpipe.validate import sources, validate
from fastpipe.validate.sources import payload_text
from fastpipe.weights import WeightStore
from tests.examples import copy_example

OPTS = LoadOptions()


@pytest.fixture
def reads(monkeypatch):
    """Every Path.read_text / Path.read_bytes call, as (file name, method)."""
    seen: list[tuple[str, str]] = []
    real_text, real_bytes = Path.read_text, Path.read_bytes

    def read_text(self, *a, **kw):
        seen.append((self.name, "text"))
        return real_text(self, *a, **kw)

    def read_bytes(self, *a, **kw):
        seen.append((self.name, "bytes"))
        return real_bytes(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    return seen


def _sid(p, blob: str) -> str:
    return next(sid for sid, st in p.supertasks.items() if st.data_blob == blob)


def test_second_call_does_not_reopen_the_file(tmp_path, reads):
    f = copy_example("seq_parallel", tmp_path)
    p = read_pipeline(f)
    sid = _sid(p, "col_row")
    first = payload_text(p, sid, OPTS)
    assert reads.count(("col_row.fx", "text")) == 1
    os.unlink(f.parent / "col_row.fx")       # gone from disk: only the cache can answer now
    again = payload_text(p, sid, OPTS)
    assert again == first and again[0] is first[0]
    assert again[1] == 'blobs["col_row"]'
    assert reads.count(("col_row.fx", "text")) == 1


def test_validate_then_later_callers_read_each_side_file_once(tmp_path, reads):
    f = copy_example("seq_parallel", tmp_path)
    p = read_pipeline(f)
    validate(p, store=WeightStore())
    for sid, st in p.supertasks.items():      # what the binder and the session ask for after validating
        if st.data_blob is not None:
            payload_text(p, sid, OPTS)
    fx_reads = [r for r in reads if r[0].endswith(".fx")]
    assert sorted(fx_reads) == [("col_row.fx", "text"), ("resid_ln.fx", "text")]


def test_two_pipelines_do_not_share_text(tmp_path):
    f = copy_example("seq_parallel", tmp_path)
    side = f.parent / "col_row.fx"
    p1 = read_pipeline(f)
    sid = _sid(p1, "col_row")
    old = payload_text(p1, sid, OPTS)[0]
    side.write_text(old + "\n")               # the file changes between two loads
    p2 = read_pipeline(f)
    assert p2 == p1 and p2 is not p1          # equal data, different objects
    assert payload_text(p2, sid, OPTS)[0] == old + "\n"
    assert payload_text(p1, sid, OPTS)[0] == old   # p1 keeps what it read
    p3 = dataclasses.replace(p1)              # a copy is another pipeline: reads the file again
    assert payload_text(p3, sid, OPTS)[0] == old + "\n"


def test_cache_goes_with_the_pipeline(tmp_path):
    f = copy_example("seq_parallel", tmp_path)
    p = read_pipeline(f)
    payload_text(p, _sid(p, "col_row"), OPTS)
    key = id(p)
    assert key in sources._side_files
    del p
    gc.collect()
    assert key not in sources._side_files


def test_path_rules_apply_on_every_call(tmp_path):
    """A file read once under allow_outside_paths is still refused to a caller without it."""
    f = copy_example("seq_parallel", tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (f.parent / "col_row.fx").rename(outside / "col_row.fx")
    (f.parent / "col_row.fx").symlink_to(outside / "col_row.fx")
    p = read_pipeline(f)
    sid = _sid(p, "col_row")
    text, _ = payload_text(p, sid, LoadOptions(allow_outside_paths=True))
    assert text
    with pytest.raises(ParamError, match=r'^blobs\["col_row"\]\.path: expected a file inside'):
        payload_text(p, sid, OPTS)


def test_errors_are_not_cached(tmp_path):
    f = copy_example("seq_parallel", tmp_path)
    side = f.parent / "col_row.fx"
    text = side.read_text()
    side.unlink()
    p = read_pipeline(f)
    sid = _sid(p, "col_row")
    for _ in range(2):
        with pytest.raises(PayloadError, match=r'^blobs\["col_row"\]: expected the payload file "col_row\.fx" beside '
                                               r'the pipeline \(the blob is null\), found no such file$'):
            payload_text(p, sid, OPTS)
    side.write_text(text)                     # the file appears: the next call reads it
    assert payload_text(p, sid, OPTS)[0] == text


def test_npu_side_file_bytes_read_once(tmp_path, reads):
    f = copy_example("seq_parallel", tmp_path)
    doc = json.loads(f.read_text())
    st = next(s for s in doc["supertasks"].values() if s.get("data_blob") == "col_row")
    st["kind"] = "dfg"
    f.write_text(json.dumps(doc))
    (f.parent / "col_row.dfg").write_bytes(b"\x00compiled\xff")
    p = read_pipeline(f)
    sid = _sid(p, "col_row")
    assert payload_text(p, sid, OPTS) == (b"\x00compiled\xff", 'blobs["col_row"]')
    assert payload_text(p, sid, OPTS)[0] == b"\x00compiled\xff"
    assert reads.count(("col_row.dfg", "bytes")) == 1
