"""The weight store: formats, header checks, unsafe files, read-only-the-slice, sharing."""
from __future__ import annotations

import gc
import json
import logging
import os
import struct
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fastpipe.errors import ParamError
from fastpipe.weights import ParamRef, WeightStore, default_store

W = 'tensors["w0"].value'


# -- helpers ---------------------------------------------------------------------
def ref(path, name="w", placements=None, fmt="safetensors") -> ParamRef:
    pl = None if placements is None else tuple(tuple(p) for p in placements)
    return ParamRef(Path(os.path.realpath(path)), fmt, name, pl)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (works for float8 and bool, where torch.equal may not)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def refusal(fn, *args, **kw) -> str:
    with pytest.raises(ParamError) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    assert type(ei.value) is ParamError
    assert msg.startswith(W + "."), msg
    assert "\n" not in msg
    return msg


def sample(dtype: torch.dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(dtype)


def write_raw_safetensors(path: Path, header, data: bytes, n: int | None = None) -> Path:
    """A safetensors file from an explicit header (dict or raw bytes) and data area."""
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb) if n is None else n) + hb + data)
    return path


@pytest.fixture
def wfile(tmp_path) -> Path:
    """w.safetensors: w = arange(32) as f32 [4, 8], b = ones f32 [3]."""
    p = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(32, dtype=torch.float32).reshape(4, 8), "b": torch.ones(3)}, str(p))
    return p


# -- safetensors -------------------------------------------------------------------
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float64,
          torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
PLACEMENTS = [
    [[1, 4], [0, 6], [0, 4]],   # dim 0
    [[0, 5], [2, 5], [0, 4]],   # dim 1
    [[0, 5], [0, 6], [1, 3]],   # dim 2 (not contiguous in the file)
    [[4, 5], [5, 6], [3, 4]],   # all dims, one element
    [[0, 5], [0, 6], [0, 4]],   # the whole tensor, spelled out
    [[2, 2], [0, 6], [0, 4]],   # 0-size
    [[0, 5], [3, 3], [1, 2]],   # 0-size in the middle
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_safetensors_slices_every_dtype_and_dim(tmp_path, dtype):
    full = sample(dtype, (5, 6, 4))
    p = tmp_path / "w.safetensors"
    save_file({"other": torch.zeros(2), "w": full}, str(p))
    store = WeightStore()
    for pl in PLACEMENTS:
        expected = full[tuple(slice(s, e) for s, e in pl)]
        got = store.load(ref(p, "w", pl), tuple(expected.shape), dtype, where=W)
        assert same(got, expected), pl
        assert got.is_contiguous() and got.device.type == "cpu" and not got.requires_grad
        assert type(got) is torch.Tensor
    whole = store.load(ref(p, "w"), (5, 6, 4), dtype, where=W)
    assert same(whole, full)
    # no placements and placements covering everything are the same slice
    assert whole is store.load(ref(p, "w", PLACEMENTS[4]), (5, 6, 4), dtype, where=W)


def test_safetensors_scalar_and_zero_size_tensor(tmp_path):
    p = tmp_path / "s.safetensors"
    save_file({"s": torch.tensor(2.5), "z": torch.zeros(0, 3, dtype=torch.bfloat16)}, str(p))
    store = WeightStore()
    assert same(store.load(ref(p, "s"), (), torch.float32, where=W), torch.tensor(2.5))
    assert same(store.load(ref(p, "s", []), (), torch.float32, where=W), torch.tensor(2.5))
    z = store.load(ref(p, "z", [[0, 0], [1, 3]]), (0, 2), torch.bfloat16, where=W)
    assert z.shape == (0, 2) and z.dtype == torch.bfloat16


def test_string_dtype_names_are_accepted(wfile):
    got = WeightStore().load(ref(wfile, "w", [[0, 1], [0, 8]]), (1, 8), "f32", where=W)
    assert same(got, torch.arange(8, dtype=torch.float32)[None])


# -- torch.save --------------------------------------------------------------------
@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_torch_save_flat_dict(tmp_path, zipfile):
    full = sample(torch.bfloat16, (6, 5))
    p = tmp_path / "w.pt"
    torch.save({"layer.w": full, "b": torch.nn.Parameter(torch.ones(3))}, str(p),
               _use_new_zipfile_serialization=zipfile)
    store = WeightStore()
    for pl in ([[1, 3], [0, 5]], [[0, 6], [2, 4]], [[5, 5], [0, 5]]):
        expected = full[pl[0][0]:pl[0][1], pl[1][0]:pl[1][1]]
        got = store.load(ref(p, "layer.w", pl, "torch.save"), tuple(expected.shape), torch.bfloat16, where=W)
        assert same(got, expected) and got.is_contiguous()
    b = store.load(ref(p, "b", None, "torch.save"), (3,), torch.float32, where=W)
    assert same(b, torch.ones(3)) and type(b) is torch.Tensor and not b.requires_grad


def test_torch_save_nested_dict_dotted_names(tmp_path):
    p = tmp_path / "ckpt.pt"
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.save({"model": {"layer.w": w}, "step": 7}, str(p))
    got = WeightStore().load(ref(p, "model.layer.w", [[1, 2], [0, 4]], "torch.save"), (1, 4), torch.float32, where=W)
    assert same(got, w[1:2])
    msg = refusal(WeightStore().check, ref(p, "step", None, "torch.save"), (), torch.int64, where=W)
    assert msg == f"{W}.name: expected a tensor under 'step' in torch.save file 'ckpt.pt', found int"


def test_torch_save_not_a_dict_or_corrupt(tmp_path):
    p = tmp_path / "list.pt"
    torch.save([torch.ones(2)], str(p))
    msg = refusal(WeightStore().check, ref(p, "0", None, "torch.save"), (2,), torch.float32, where=W)
    assert msg == f"{W}.path: expected a torch.save file holding a dict of tensors, found list in 'list.pt'"
    bad = tmp_path / "bad.pt"
    torch.save({"w": torch.ones(2)}, str(bad))
    bad.write_bytes(bad.read_bytes()[:60])
    msg = refusal(WeightStore().load, ref(bad, "w", None, "torch.save"), (2,), torch.float32, where=W)
    assert msg.startswith(f"{W}.path: corrupt torch.save file 'bad.pt': ")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x80\x02not a pickle at all" * 3)
    assert "junk.pt" in refusal(WeightStore().load, ref(junk, "w", None, "torch.save"), (2,), torch.float32, where=W)


class MarkerWriter:
    """Unpickling this opens (creates) a marker file: a stand-in for arbitrary code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_torch_save_with_a_pickled_object_is_refused(tmp_path, zipfile):
    marker = tmp_path / "MARKER"
    p = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": MarkerWriter(str(marker))}, str(p), _use_new_zipfile_serialization=zipfile)
    store = WeightStore()
    msg = refusal(store.load, ref(p, "w", None, "torch.save"), (2,), torch.float32, where=W)
    assert msg.startswith(f"{W}.path: expected a torch.save file of plain tensors (weights_only=True), "
                          "found objects it refuses to unpickle in 'evil.pt': ")
    assert "open" in msg  # names the refused global
    assert not marker.exists()
    refusal(store.check, ref(p, "w", None, "torch.save"), (2,), torch.float32, where=W)
    assert not marker.exists() and store.stats()["open_files"] == 0
    # the payload is real: an unsafe load would have run it
    torch.load(str(p), weights_only=False)
    assert marker.exists()


# -- torch.export ------------------------------------------------------------------
@pytest.fixture(scope="module")
def export_archive(tmp_path_factory):
    torch.manual_seed(0)
    mod = torch.nn.Linear(4, 3)
    ep = torch.export.export(mod, (torch.randn(2, 4),))
    p = tmp_path_factory.mktemp("exp") / "m.pt2"
    torch.export.save(ep, str(p))
    return p, mod.weight.detach().clone(), mod.bias.detach().clone()


def test_export_archive_refused_without_trust(export_archive):
    p, w, _ = export_archive
    store = WeightStore()
    for fn in (store.check, store.load):
        msg = refusal(fn, ref(p, "weight", None, "torch.export"), (3, 4), torch.float32, where=W)
        assert msg.startswith(f"{W}.format: expected a trusted torch.export archive, found untrusted 'm.pt2'")
        assert "--trust-export-archives" in msg and "trust_export=True" in msg
    assert store.stats()["file_opens"] == 0


def test_export_archive_loaded_with_trust(export_archive):
    p, w, b = export_archive
    store = WeightStore()
    got_w = store.load(ref(p, "weight", None, "torch.export"), (3, 4), torch.float32, where=W, trust_export=True)
    got_b = store.load(ref(p, "bias", [[1, 3]], "torch.export"), (2,), torch.float32, where=W, trust_export=True)
    got_c = store.load(ref(p, "weight", [[0, 3], [1, 3]], "torch.export"), (3, 2), torch.float32,
                       where=W, trust_export=True)
    assert same(got_w, w) and same(got_b, b[1:3]) and same(got_c, w[:, 1:3])
    assert type(got_w) is torch.Tensor and store.stats()["file_opens"] == 1
    msg = refusal(store.check, ref(p, "nope", None, "torch.export"), (3,), torch.float32, where=W, trust_export=True)
    assert msg == f"{W}.name: expected the name of a tensor in torch.export archive 'm.pt2' (it holds 2: 'bias', 'weight'), found 'nope'"


def test_export_archive_any_file_name_and_corrupt_archives(export_archive, tmp_path, capfd):
    p, w, _ = export_archive
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(p.read_bytes())
    got = WeightStore().load(ref(renamed, "weight", None, "torch.export"), (3, 4), torch.float32,
                             where=W, trust_export=True)
    assert same(got, w)
    handlers = list(logging.getLogger("torch.export").handlers)
    capfd.readouterr()
    for name, data in (("trunc.pt2", p.read_bytes()[:3000]), ("junk.pt2", b"PK\x03\x04" + b"junk" * 50)):
        bad = tmp_path / name
        bad.write_bytes(data)
        msg = refusal(WeightStore().load, ref(bad, "weight", None, "torch.export"), (3, 4), torch.float32,
                      where=W, trust_export=True)
        assert msg.startswith(f"{W}.path: corrupt torch.export archive '{name}': ")
    plain = tmp_path / "plain.pt2"
    torch.save({"weight": w}, str(plain))
    msg = refusal(WeightStore().load, ref(plain, "weight", None, "torch.export"), (3, 4), torch.float32,
                  where=W, trust_export=True)
    assert msg.startswith(f"{W}.path: corrupt torch.export archive 'plain.pt2': ")
    assert "warnings above" not in msg
    out, err = capfd.readouterr()
    assert "Traceback" not in err and out == ""  # torch.export's logged tracebacks were folded into the message
    assert logging.getLogger("torch.export").handlers == handlers


# -- checks against the declaration -------------------------------------------------
def test_declaration_mismatches(wfile):
    store = WeightStore()
    check = store.check
    msg = refusal(check, ref(wfile, "w"), (4, 8), torch.bfloat16, where=W)
    assert msg == f"{W}.name: expected dtype bf16 (the declared dtype), found f32 (tensor 'w' in 'w.safetensors')"
    msg = refusal(check, ref(wfile, "w"), (4, 6), torch.float32, where=W)
    assert msg == (f"{W}.name: expected shape [4, 6] (the declared shape; no placements), found [4, 8] "
                   "(tensor 'w' in 'w.safetensors')")
    msg = refusal(check, ref(wfile, "w", [[0, 4], [0, 8], [0, 1]]), (4, 8, 1), torch.float32, where=W)
    assert msg.startswith(f"{W}.placements: expected 2 [start, end) pairs (one per dim of the stored shape [4, 8]), "
                          "found 3")
    msg = refusal(check, ref(wfile, "w", [[0, 2], [2, 9]]), (2, 7), torch.float32, where=W)
    assert msg == f"{W}.placements[1]: expected 0 <= start <= end <= 8, found [2, 9]"
    msg = refusal(check, ref(wfile, "w", [[3, 1], [0, 8]]), (0, 8), torch.float32, where=W)
    assert msg == f"{W}.placements[0]: expected 0 <= start <= end <= 4, found [3, 1]"
    msg = refusal(check, ref(wfile, "w", [[-1, 2], [0, 8]]), (3, 8), torch.float32, where=W)
    assert msg == f"{W}.placements[0]: expected 0 <= start <= end <= 4, found [-1, 2]"
    msg = refusal(check, ref(wfile, "w", [[0, 2], [0, 8]]), (2, 4), torch.float32, where=W)
    assert msg == (f"{W}.placements: expected a slice of shape [2, 4] (the declared shape), "
                   "found [[0, 2], [0, 8]] of shape [2, 8] (tensor 'w' in 'w.safetensors')")
    msg = refusal(check, ref(wfile, "nope"), (4, 8), torch.float32, where=W)
    assert msg == f"{W}.name: expected the name of a tensor in safetensors file 'w.safetensors' (it holds 2: 'b', 'w'), found 'nope'"
    msg = refusal(check, ParamRef(wfile, "npz", "w", None), (4, 8), torch.float32, where=W)
    assert msg == f"{W}.format: expected one of safetensors, torch.save, torch.export, found 'npz'"
    msg = refusal(check, ref(wfile, "w", [[0, 2], [0, "8"]]), (2, 8), torch.float32, where=W)
    assert msg == f"{W}.placements[1]: expected a [start, end) pair of integers, found (0, '8')"
    # load refuses the same way, and nothing was read
    refusal(store.load, ref(wfile, "w", [[0, 2], [2, 9]]), (2, 7), torch.float32, where=W)
    assert store.stats()["bytes_read"] == 0 and store.stats()["live_slices"] == 0


def test_torch_save_declaration_mismatches(tmp_path):
    p = tmp_path / "w.pt"
    torch.save({"w": torch.zeros(4, 8, dtype=torch.float16)}, str(p))
    store = WeightStore()
    msg = refusal(store.load, ref(p, "w", None, "torch.save"), (4, 8), torch.float32, where=W)
    assert msg == f"{W}.name: expected dtype f32 (the declared dtype), found f16 (tensor 'w' in 'w.pt')"
    msg = refusal(store.load, ref(p, "w", [[0, 5], [0, 8]], "torch.save"), (5, 8), torch.float16, where=W)
    assert msg == f"{W}.placements[0]: expected 0 <= start <= end <= 4, found [0, 5]"
    msg = refusal(store.load, ref(p, "v", None, "torch.save"), (4, 8), torch.float16, where=W)
    assert msg == f"{W}.name: expected the name of a tensor in torch.save file 'w.pt' (it holds 1: 'w'), found 'v'"


def test_stored_dtype_torch_cannot_name(tmp_path):
    p = write_raw_safetensors(tmp_path / "u.safetensors", {"w": {"dtype": "U16", "shape": [2], "data_offsets": [0, 4]}},
                              b"\0" * 4)
    msg = refusal(WeightStore().check, ref(p, "w"), (2,), torch.int16, where=W)
    assert msg == f"{W}.name: expected dtype i16 (the declared dtype), found U16 (tensor 'w' in 'u.safetensors')"


# -- files and headers ---------------------------------------------------------------
def test_missing_file_and_directory(tmp_path):
    store = WeightStore()
    missing = tmp_path / "gone.safetensors"
    msg = refusal(store.load, ref(missing), (1,), torch.float32, where=W)
    assert msg == f"{W}.path: expected an existing file, found '{os.path.realpath(missing)}' (no such file)"
    d = tmp_path / "d.safetensors"
    d.mkdir()
    msg = refusal(store.load, ref(d), (1,), torch.float32, where=W)
    assert msg == f"{W}.path: expected a regular file, found a directory '{os.path.realpath(d)}'"
    for fmt in ("torch.save", "torch.export"):
        refusal(store.load, ref(missing, fmt=fmt), (1,), torch.float32, where=W, trust_export=True)


def corrupt(msg_fragment: str, path: Path, name="w", shape=(4, 8)):
    for fn in (WeightStore().check, WeightStore().load):
        msg = refusal(fn, ref(path, name), shape, torch.float32, where=W)
        assert msg.startswith(f"{W}.path: corrupt safetensors file '{path.name}': "), msg
        assert msg_fragment in msg, msg
    return msg


def test_truncated_file(wfile):
    data = wfile.read_bytes()
    wfile.write_bytes(data[:-20])
    msg = corrupt("tensor 'w' data_offsets [12, 140] past end of data area (120 bytes; truncated file?)", wfile)
    assert msg.endswith("truncated file?)")
    wfile.write_bytes(data[:5])
    corrupt("file is 5 bytes, shorter than the 8-byte header length", wfile)
    wfile.write_bytes(b"")
    corrupt("file is 0 bytes, shorter than the 8-byte header length", wfile)


def test_header_length_past_end(tmp_path):
    p = write_raw_safetensors(tmp_path / "w.safetensors", {}, b"\0" * (1024 - 8 - 2), n=999999)
    assert p.stat().st_size == 1024
    msg = corrupt("", p)
    assert msg == f"{W}.path: corrupt safetensors file 'w.safetensors': header length 999999 past end of file (1024 bytes)"


def test_bad_header_json(tmp_path):
    p = write_raw_safetensors(tmp_path / "w.safetensors", b'{"w": {"dtype": "F32",', b"")
    corrupt("header is not valid JSON (Expecting property name enclosed in double quotes at line 1 column 23)", p)
    write_raw_safetensors(p, b"[1, 2]", b"")
    corrupt("header is JSON list, expected an object", p)
    write_raw_safetensors(p, b'{"w": "\xff\xfe"}', b"")
    corrupt("header is not UTF-8", p)


def test_data_offsets_past_end(tmp_path):
    hdr = {"w": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]},
           "b": {"dtype": "F32", "shape": [4], "data_offsets": [128, 1000]}}
    p = write_raw_safetensors(tmp_path / "w.safetensors", hdr, b"\0" * 144)
    corrupt("tensor 'b' data_offsets [128, 1000] past end of data area (144 bytes; truncated file?)", p)


@pytest.mark.parametrize("header,data,fragment", [
    ({"w": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 100]}}, 100,
     "tensor 'w' data_offsets [0, 100] hold 100 bytes, but F32 x [4, 8] needs 128"),
    ({"w": {"dtype": "F32", "shape": [4, 8], "data_offsets": [8, 136]}}, 136,
     "tensor 'w' data_offsets [8, 136] start at 8, expected 0"),
    ({"w": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]}}, 130,
     "data area is 130 bytes but its tensors cover 128"),
    ({"w": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]},
      "v": {"dtype": "F32", "shape": [1], "data_offsets": [124, 128]}}, 128, "start at 124, expected 128"),
    ({"w": {"dtype": "Q4", "shape": [4, 8], "data_offsets": [0, 128]}}, 128, "tensor 'w' has unknown dtype 'Q4'"),
    ({"w": {"dtype": "F32", "shape": [4, -8], "data_offsets": [0, 128]}}, 128,
     "tensor 'w' has shape [4, -8], expected a list of non-negative integers"),
    ({"w": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0]}}, 128,
     "tensor 'w' has data_offsets [0], expected [begin, end]"),
    ({"w": {"dtype": "F32", "shape": [4, 8], "data_offsets": [128, 0]}}, 128,
     "tensor 'w' data_offsets [128, 0] end before they begin"),
    ({"w": [1]}, 0, "tensor 'w' entry is JSON list, expected an object"),
    ({"__metadata__": {"a": 1}, "w": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]}}, 128,
     "__metadata__ is not an object of strings"),
    ({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, 2, "is not a whole number of bytes"),
])
def test_inconsistent_headers(tmp_path, header, data, fragment):
    p = write_raw_safetensors(tmp_path / "w.safetensors", header, b"\0" * data)
    corrupt(fragment, p)


def test_valid_hand_written_header_with_metadata(tmp_path):
    w = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    hdr = {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]}}
    p = write_raw_safetensors(tmp_path / "w.safetensors", json.dumps(hdr).encode() + b"    ", w.numpy().tobytes())
    assert same(WeightStore().load(ref(p, "w", [[1, 3], [2, 5]]), (2, 3), torch.float32, where=W), w[1:3, 2:5])


def test_every_truncation_and_header_byte_flip_is_a_param_error(wfile):
    """Fuzz: no corruption of a real file escapes as anything but a one-line ParamError."""
    data = wfile.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    variants = [data[:k] for k in range(len(data))]
    variants += [data[:k] + bytes([data[k] ^ 0xFF]) + data[k + 1:] for k in range(8 + n)]
    variants += [data[:k] + b"\x00" + data[k + 1:] for k in range(8 + n)]
    loaded = 0
    for v in variants:
        wfile.write_bytes(v)
        try:
            t = WeightStore().load(ref(wfile, "w", [[1, 2], [0, 8]]), (1, 8), torch.float32, where=W)
        except ParamError as e:
            assert str(e).startswith(W + ".") and "\n" not in str(e)
        else:
            loaded += 1
            assert t.shape == (1, 8) and t.dtype == torch.float32
    assert loaded < len(variants) // 2


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_damaged_torch_save_files_are_param_errors(tmp_path, zipfile):
    p = tmp_path / "w.pt"
    torch.save({"w": torch.arange(32, dtype=torch.float32).reshape(4, 8), "b": torch.ones(3)}, str(p),
               _use_new_zipfile_serialization=zipfile)
    data = p.read_bytes()
    p.write_bytes(data[:-7])
    msg = refusal(WeightStore().load, ref(p, "w", None, "torch.save"), (4, 8), torch.float32, where=W)
    assert msg.startswith(f"{W}.path: corrupt torch.save file 'w.pt': ")
    variants = [data[:k] for k in range(0, len(data), 5)]
    variants += [data[:k] + bytes([data[k] ^ 0x5A]) + data[k + 1:] for k in range(0, len(data), 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about odd pickle protocols in damaged files
        for v in variants:
            p.write_bytes(v)
            try:
                t = WeightStore().load(ref(p, "w", [[1, 2], [0, 8]], "torch.save"), (1, 8), torch.float32, where=W)
            except ParamError as e:
                assert str(e).startswith(W + ".") and "\n" not in str(e)
            else:
                assert t.shape == (1, 8) and t.dtype == torch.float32


# -- a slice reads only its bytes ----------------------------------------------------
def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self/status")
@pytest.mark.parametrize("fmt", ["safetensors", "torch.save"])
def test_small_slice_of_large_file_reads_only_its_bytes(tmp_path, fmt):
    rows, cols = 16384, 1024                       # 64 MiB of f32
    p = tmp_path / ("big.safetensors" if fmt == "safetensors" else "big.pt")
    big = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    if fmt == "safetensors":
        save_file({"w": big}, str(p))
    else:
        torch.save({"w": big}, str(p))
    del big
    gc.collect()
    file_size = p.stat().st_size
    store = WeightStore()
    before = _rss_kib()
    got = store.load(ref(p, "w", [[100, 102], [0, cols]], fmt), (2, cols), torch.float32, where=W)
    # values, against an independent computation of rows 100..101
    expected = torch.arange(100 * cols, 102 * cols, dtype=torch.float32).reshape(2, cols)
    assert torch.equal(got, expected)
    grown = (_rss_kib() - before) * 1024
    assert grown < file_size // 8, f"loading a 8 KiB slice grew RSS by {grown} bytes (file {file_size})"
    assert store.stats()["bytes_read"] == 2 * cols * 4
    # a column slice is copied to a dense tensor of exactly its own size
    col = store.load(ref(p, "w", [[0, rows], [5, 7]], fmt), (rows, 2), torch.float32, where=W)
    assert col.is_contiguous() and col.untyped_storage().nbytes() == rows * 2 * 4
    assert torch.equal(col[:, 0], torch.arange(rows, dtype=torch.float32) * cols + 5)
    assert store.stats()["bytes_read"] == 2 * cols * 4 + rows * 2 * 4
    # control: the measurement does see a whole-file read
    before = _rss_kib()
    blob = p.read_bytes()
    assert (_rss_kib() - before) * 1024 > file_size // 2
    del blob


# -- sharing -------------------------------------------------------------------------
def test_sharing_within_a_store(wfile):
    store = WeightStore()
    a = store.load(ref(wfile, "w", [[0, 2], [0, 8]]), (2, 8), torch.float32, where=W)
    b = store.load(ref(wfile, "w", [[0, 2], [0, 8]]), (2, 8), torch.float32, where='tensors["w1"].value')
    c = store.load(ref(wfile, "w", [[2, 4], [0, 8]]), (2, 8), torch.float32, where=W)
    d = store.load(ref(wfile, "b"), (3,), torch.float32, where=W)
    assert a is b and a is not c
    assert same(c, torch.arange(16, 32, dtype=torch.float32).reshape(2, 8)) and same(d, torch.ones(3))
    s = store.stats()
    assert s["open_files"] == 1 and s["file_opens"] == 1          # one handle for all four loads
    assert s["slice_hits"] == 1 and s["slice_misses"] == 3 and s["live_slices"] == 3
    assert s["bytes_read"] == (16 + 16 + 3) * 4
    store.check(ref(wfile, "w"), (4, 8), torch.float32, where=W)
    assert store.stats()["file_opens"] == 1


def test_slices_are_held_weakly(wfile):
    store = WeightStore()
    r = ref(wfile, "w", [[0, 2], [0, 8]])
    a = store.load(r, (2, 8), torch.float32, where=W)
    assert store.stats()["live_slices"] == 1
    del a
    gc.collect()
    assert store.stats()["live_slices"] == 0  # the store does not keep slices alive by itself
    again = store.load(r, (2, 8), torch.float32, where=W)
    assert same(again, torch.arange(16, dtype=torch.float32).reshape(2, 8))
    assert store.stats()["slice_misses"] == 2 and store.stats()["file_opens"] == 1  # handle kept


def test_two_stores_do_not_share(wfile):
    s1, s2 = WeightStore(), WeightStore()
    r = ref(wfile, "w", [[0, 2], [0, 8]])
    a, b = s1.load(r, (2, 8), torch.float32, where=W), s2.load(r, (2, 8), torch.float32, where=W)
    assert a is not b and same(a, b)
    assert s1.stats()["open_files"] == 1 and s2.stats()["open_files"] == 1


def test_default_store_is_process_global():
    assert default_store() is default_store()
    assert isinstance(default_store(), WeightStore) and default_store() is not WeightStore()


def test_changed_file_is_reopened(wfile):
    store = WeightStore()
    r = ref(wfile, "b")
    old = store.load(r, (3,), torch.float32, where=W)
    save_file({"b": torch.full((3,), 7.0), "pad": torch.zeros(5)}, str(wfile))
    new = store.load(r, (3,), torch.float32, where=W)
    assert same(old, torch.ones(3)) and same(new, torch.full((3,), 7.0))
    assert store.stats()["file_opens"] == 2 and store.stats()["open_files"] == 1  # stale handle dropped
    store.clear()
    assert store.stats()["open_files"] == 0 and same(new, torch.full((3,), 7.0))


def test_concurrent_loads_share_one_object(wfile):
    store = WeightStore()
    r = ref(wfile, "w", [[1, 3], [2, 6]])
    results, errors = [], []
    barrier = threading.Barrier(8)

    def work():
        try:
            barrier.wait()
            results.append(store.load(r, (2, 4), torch.float32, where=W))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 8
    assert all(x is results[0] for x in results)
    assert same(results[0], torch.arange(32, dtype=torch.float32).reshape(4, 8)[1:3, 2:6])
    assert store.stats()["file_opens"] == 1


# -- copies on a device --------------------------------------------------------------
META = torch.device("meta")      # stands in for a GPU: a copy there is a new tensor, as on cuda


def test_one_copy_per_device_shared_and_held_weakly(wfile):
    """Sessions over one store that place a slice on a device get one shared copy there (they used
    to copy it each, so N buckets held N copies of the weights on a GPU); it goes with its last holder."""
    store = WeightStore()
    a = store.load(ref(wfile, placements=[[0, 2], [0, 8]]), (2, 8), torch.float32, where="t", device=META)
    gc.collect()                                  # the CPU slice it was copied from is gone now
    b = store.load(ref(wfile, placements=[[0, 2], [0, 8]]), (2, 8), torch.float32, where="t", device=META)
    assert store.stats()["slice_misses"] == 1     # a hit on the device reads nothing
    other = store.load(ref(wfile, placements=[[2, 4], [0, 8]]), (2, 8), torch.float32, where="t", device=META)
    cpu = store.load(ref(wfile, placements=[[0, 2], [0, 8]]), (2, 8), torch.float32, where="t")
    assert a is b and a.device == META and a is not other and cpu.device.type == "cpu"
    s = store.stats()
    assert (s["device_copies"], s["device_hits"], s["live_device_copies"]) == (2, 1, 2)
    del a, b, other
    gc.collect()
    assert store.stats()["live_device_copies"] == 0
    assert store.load(ref(wfile), (4, 8), torch.float32, where="t", device="cpu").device.type == "cpu"


def test_substitute_reaches_the_device_copies(wfile):
    """The region processor's merged weights replace the shards on a device as they do on the CPU,
    so a later session gets the views (and with them the one merged weight)."""
    store = WeightStore()
    shard = store.load(ref(wfile, placements=[[0, 2], [0, 8]]), (2, 8), torch.float32, where="t", device=META)
    merged = torch.empty(4, 8, device=META)
    view = merged.narrow(0, 0, 2)
    store.substitute([(shard, view)])
    again = store.load(ref(wfile, placements=[[0, 2], [0, 8]]), (2, 8), torch.float32, where="t", device=META)
    assert again is view


def test_sessions_over_one_store_share_device_constants(tmp_path):
    """bind: two sessions' constants on one device are the same objects (so their compiled graphs,
    keyed on the constants' identity, are shared too)."""
    import fastpipe
    from fastpipe.runtime.binding.bind import Binder
    from tests.examples import GRAPHS

    store = WeightStore()
    s1 = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", store=store)
    s2 = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", store=store)
    names = [n for n, t in s1.pipeline.tensors.items() if t.is_constant]
    b1 = Binder(s1.pipeline, s1.options, store, {s: META for s in s1.slot_devices})
    b2 = Binder(s2.pipeline, s2.options, store, {s: META for s in s2.slot_devices})
    assert names and all(b1.constant(n, META) is b2.constant(n, META) for n in names)
    assert all(b1.constant(n, META).device == META for n in names)


@pytest.mark.parametrize("linked", [True, False])
def test_a_serving_sets_buckets_share_weights_only_when_linked_as_built(tmp_path, linked):
    """The buckets of a serving set laid out as build_serving_set writes it (one checkpoint
    hard-linked into each) share every constant over one store, the region processor's merged
    weights included; separate copies of the file (as git checks the committed set out) share none,
    which is why tests/test_weights_gpu.py relinks the committed set."""
    import shutil

    import fastpipe
    from tests.examples import SERVING_SET, linked_serving_set

    if linked:
        root = linked_serving_set(tmp_path)
    else:
        root = tmp_path / "copied"
        shutil.copytree(SERVING_SET, root)
    store = WeightStore()
    decode, prefill = sorted(root.glob("*/pipeline.json"))

    def storages(sess):
        return {t.untyped_storage().data_ptr() for steps in sess.program.steps.values() for st in steps
                for t in st.constants.values()}

    a = fastpipe.load(decode, store=store, processor="region", compile="off")
    b = fastpipe.load(prefill, store=store, processor="region", compile="off")
    sa, sb = storages(a), storages(b)
    assert sa and sb
    if linked:
        assert sa == sb and store.stats()["slice_hits"] > 0 and store.stats()["file_opens"] == 1
    else:
        assert not sa & sb and store.stats()["slice_hits"] == 0
