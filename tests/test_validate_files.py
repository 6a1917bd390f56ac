"""Validation that reads files: graph payloads against their supertasks, param-file headers, paths."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

import fastpipe
from fastpipe.errors import ParamError, PayloadError, ValidationError
from fastpipe.format import read_pipeline
from fastpipe.validate import validate
from fastpipe.weights import WeightStore
from tests.examples import copy_example


def edit(path, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))
    return path


def refused(path, cls, pattern, **kw):
    with pytest.raises(cls) as e:
        validate(read_pipeline(path), store=WeightStore(), **kw)
    assert "\n" not in str(e.value)
    assert __import__("re").search(pattern, str(e.value)), str(e.value)


def test_examples_validate(tmp_path):
    for name in ("tp_mlp", "seq_parallel"):
        c = validate(read_pipeline(copy_example(name, tmp_path)), store=WeightStore())
        assert c.graphs


def test_payload_output_shape_disagrees_with_supertask(tmp_path):
    f = copy_example("two_stage_skip", tmp_path)
    # declare y (the graph's output) with another shape everywhere it is used
    edit(f, lambda d: (d["tensors"]["y"].update(shape=[4, 16]), d["metadata"]["tensors"]["outputs"]["y"].update(shape=[4, 16]),
                       d["metadata"]["tensor_slices"]["outputs"]["y"].update(placements=[[0, 4], [0, 16]])))
    refused(f, PayloadError, r'^supertasks\["\d+"\]\.outputs\[0\]: expected f32\[4, 32\] \(graph output 0 in supertasks\["\d+"\]\.data\), found f32\[4, 16\]$')


def test_payload_input_dtype_disagrees(tmp_path):
    f = copy_example("two_stage_skip", tmp_path)
    edit(f, lambda d: (d["tensors"]["scale"].update(dtype="f64"), d["metadata"]["tensors"]["inputs"]["scale"].update(dtype="f64"),
                       d["metadata"]["tensor_slices"]["inputs"]["scale"].update(dtype="f64")))
    refused(f, PayloadError, r'\.inputs\[2\]: expected f32\[4, 1\] \(graph input 2 in supertasks\["\d+"\]\.data\), found f64\[4, 1\]$')


def test_payload_input_count_disagrees(tmp_path):
    f = copy_example("two_stage_skip", tmp_path)

    def drop(d):
        st = next(s for s in d["supertasks"].values() if s.get("device") == "1" and s["kind"] == "FX")
        st["inputs"].remove("scale")
        d["supertasks"]["in"]["outputs"].remove("scale")
        del d["tensors"]["scale"]
        del d["metadata"]["tensor_slices"]["inputs"]["scale"]
    edit(f, drop)
    refused(f, PayloadError, r'\.data: expected 4 graph inputs \(the inputs of supertask "\d+"\), found 5$')


def test_payload_garbage(tmp_path):
    f = copy_example("two_stage_skip", tmp_path)
    edit(f, lambda d: next(s for s in d["supertasks"].values() if s["kind"] == "FX").update(data="!!not base64!!"))
    refused(f, PayloadError, r'^supertasks\["\d+"\]\.data: ')


def test_blob_side_file_missing(tmp_path):
    f = copy_example("seq_parallel", tmp_path)
    os.unlink(f.parent / "col_row.fx")
    refused(f, PayloadError, r'^blobs\["col_row"\]: expected the payload file "col_row\.fx" beside the pipeline \(the blob is null\), found no such file$')


def test_unknown_blob_id(tmp_path):
    f = copy_example("tp_mlp", tmp_path)
    edit(f, lambda d: next(s for s in d["supertasks"].values() if "data_blob" in s).update(data_blob="nope"))
    refused(f, ValidationError, r'\.data_blob: expected an id in blobs \(col_row\), found "nope"$')


def test_blob_id_escaping_the_folder(tmp_path):
    f = copy_example("seq_parallel", tmp_path)

    def evil(d):
        d["blobs"]["../evil"] = None
        next(s for s in d["supertasks"].values() if s.get("data_blob") == "col_row").update(data_blob="../evil")
    edit(f, evil)
    (tmp_path / "evil.fx").write_text((f.parent / "col_row.fx").read_text())
    refused(f, ParamError, r'^blobs\["\.\./evil"\]\.path: expected a file inside')


def test_unknown_param_file_id(tmp_path):
    f = copy_example("seq_parallel", tmp_path)
    edit(f, lambda d: d["tensors"]["w1_0"]["value"].update(param_file="other"))
    refused(f, ValidationError, r'^tensors\["w1_0"\]\.value\.param_file: expected an id in param_files \(ckpt\), found "other"$')


def test_placements_out_of_bounds(tmp_path):
    f = copy_example("tp_mlp", tmp_path)
    edit(f, lambda d: d["tensors"]["w1_1"]["value"].update(placements=[[64, 129], [0, 64]]))
    refused(f, ParamError, r'^tensors\["w1_1"\]\.value\.placements\[0\]: expected 0 <= start <= end <= 128, found \[64, 129\]$')


def test_dtype_disagrees_with_the_graph(tmp_path):
    f = copy_example("tp_mlp", tmp_path)
    edit(f, lambda d: d["tensors"]["b2"].update(dtype="f16"))
    refused(f, PayloadError, r'^supertasks\["\d+"\]\.inputs\[1\]: expected f32\[64\] \(graph input 1 in supertasks\["\d+"\]\.data\), found f16\[64\]$')


def test_dtype_checked_against_the_header(tmp_path):
    from fastpipe.options import LoadOptions

    f = copy_example("tp_mlp", tmp_path)
    save_file({"fc1.weight": torch.zeros(128, 64, dtype=torch.float16)}, str(f.parent / "half.safetensors"))
    edit(f, lambda d: d["tensors"]["w1_0"]["value"].update(path="half.safetensors"))
    refused(f, ParamError, r'^tensors\["w1_0"\]\.value\.name: expected dtype f32', opts=LoadOptions(check_payloads=False))


@pytest.mark.parametrize("path, pattern", [
    ("/etc/passwd", r'^tensors\["w1_0"\]\.value\.path: expected a relative path to a file inside .*found \'/etc/passwd\'$'),
    ("../outside.safetensors", r'^tensors\["w1_0"\]\.value\.path: expected a file inside'),
])
def test_paths_confined(tmp_path, path, pattern):
    f = copy_example("tp_mlp", tmp_path)
    edit(f, lambda d: d["tensors"]["w1_0"]["value"].update(path=path))
    refused(f, ParamError, pattern)


def test_symlink_outside_refused_unless_allowed(tmp_path):
    f = copy_example("tp_mlp", tmp_path / "a")
    outside = tmp_path / "elsewhere.safetensors"
    (f.parent / "weights.safetensors").rename(outside)
    os.symlink(outside, f.parent / "weights.safetensors")
    refused(f, ParamError, r'\.path: expected a file inside')
    sess = fastpipe.load(f, allow_outside_paths=True, store=WeightStore())
    assert sess.run({"x": torch.zeros(8, 64)})["y"].shape == (8, 64)


def test_torch_save_weights(tmp_path):
    """The same example with its constants read from a torch.save file (weights_only, mmap)."""
    from safetensors.torch import load_file

    f = copy_example("two_stage_skip", tmp_path)
    torch.save(load_file(str(f.parent / "weights.safetensors")), f.parent / "weights.pt")

    def to_pt(d):
        for t in d["tensors"].values():
            if "value" in t:
                t["value"].update(path="weights.pt", format="torch.save")
    edit(f, to_pt)
    ins = load_file(str(f.parent / "inputs.safetensors"))
    out = fastpipe.load(f, store=WeightStore()).run(ins)
    torch.testing.assert_close(out["y"], load_file(str(f.parent / "expected.safetensors"))["y"])


def test_pickled_object_in_torch_save_refused(tmp_path):
    f = copy_example("two_stage_skip", tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"l1.weight": Evil()}, f.parent / "evil.pt")
    edit(f, lambda d: d["tensors"]["l1.w"]["value"].update(path="evil.pt", format="torch.save"))
    refused(f, ParamError, r'^tensors\["l1\.w"\]\.value')
    assert not marker.exists()
