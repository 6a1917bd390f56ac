"""Pipelines written by the producer's own code (tests/data/producer/<release>/<case>/).

scripts/producer_interop.py built them with furiosa-llm's own classes, comm ops and
serialize_gm, in a venv with the torch that release pins, saved them as its artifact builder
does, and checked each with that release's own loader (MANIFEST.json). Inputs and expected
outputs come from the unsplit torch module. Every case must validate and run to its expected
outputs on every CPU processor, through the CLI, and read back and write out unchanged.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastpipe.cli import main
from fastpipe.format import dumps_pipeline, read_pipeline

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "producer"
RELEASES = ["2024.1.0", "2024.1.1", "2024.2.0", "2024.2.1", "2025.1.0", "2025.1.1", "2025.1.2", "2025.2.0",
            "2025.2.1", "2025.3.0", "2025.3.1", "2025.3.2", "2025.3.3", "2025.3.4", "2026.1.0", "2026.2.0",
            "2026.2.1", "2026.3.0"]
CASES = ["tp_mlp_all_reduce", "two_stage_send_recv", "seq_parallel", "gather_reduce", "broadcast_all_to_all",
         "newest_spellings"]
ALL = [(r, c) for r in RELEASES for c in CASES]
NEWEST = RELEASES[-1]


def cli(capsys, monkeypatch, folder: Path, *args) -> tuple[int, str, str]:
    monkeypatch.chdir(folder)
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_every_release_and_case_is_committed_and_passed_its_own_loader():
    for release in RELEASES:
        manifest = json.loads((CORPUS / release / "MANIFEST.json").read_text())
        assert manifest["producer"] == release
        assert set(manifest["cases"]) == set(CASES), release
        for case, info in manifest["cases"].items():
            assert info["self_check"]["ok"], f"{release} {case}: {info['self_check']}"
            assert (CORPUS / release / case / "pipeline.json").is_file()


@pytest.mark.parametrize("release, case", ALL)
def test_validate_and_run_check_on_every_cpu_processor(release, case, capsys, monkeypatch):
    folder = CORPUS / release / case
    code, out, err = cli(capsys, monkeypatch, folder, "validate", "pipeline.json")
    assert code == 0, err
    assert "valid" in out
    # compiled once per distinct payload for the newest release; eagerly for the rest (CI time)
    compiled = [] if release == NEWEST else ["--no-compile"]
    for processor in ("reference", "cpu", "region"):
        code, out, err = cli(capsys, monkeypatch, folder, "run", "pipeline.json", "--inputs", "inputs.safetensors",
                             "--check", "expected.safetensors", "--processor", processor, "--warmup", "0",
                             "--repeat", "1", *([] if processor == "reference" else compiled))
        assert code == 0, f"{release} {case} {processor}: {err}"
        assert "outputs match" in out


@pytest.mark.parametrize("release, case", ALL)
def test_written_back_as_read(release, case):
    """fastpipe's writer keeps what it read: every null, device string and spelling."""
    path = CORPUS / release / case / "pipeline.json"
    assert json.loads(dumps_pipeline(read_pipeline(path))) == json.loads(path.read_text())


def test_the_corpus_covers_what_the_producer_writes():
    """The spellings the issue names are really in the committed files."""
    docs = [json.loads((CORPUS / r / c / "pipeline.json").read_text()) for r, c in ALL]
    computes = [st for d in docs for st in d["supertasks"].values() if st["kind"] == "fx"]
    assert any(st["data"] is None and st["data_blob"] for st in computes)
    assert any(st["data_blob"] is None and st["data"] for st in computes)
    assert any(v is None for d in docs for v in d["blobs"].values())          # payloads in <blob-id>.fx
    assert any(isinstance(v, str) for d in docs for v in d["blobs"].values())  # inline blobs
    ops = {st["metadata"].get("reduce_op") for d in docs for st in d["supertasks"].values()
           if isinstance(st.get("metadata"), dict)} - {None}
    assert {0, "RedOpType.SUM"} <= ops
    devices = {v for d in docs for v in d["devices"].values()}
    assert {"npu:0:*", "npu:0", "cpu:0", "npu:0:0-3", "rngd:0:4", "npu:1,npu:2"} <= devices
    assert {"bf16", "f32", "f8e4m3fn"} <= {t["dtype"] for d in docs for t in d["tensors"].values()}
    formats = {f["format"] for d in docs for f in d["param_files"].values()}
    assert formats == {"safetensors", "torch.save"}
    assert all(set(d) == {"name", "devices", "tensors", "supertasks", "metadata", "blobs", "param_files",
                          "device_constraints", "version"} for d in docs)
