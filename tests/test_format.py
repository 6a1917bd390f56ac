"""Reading pipeline.json: every spelling SPEC lists, strict JSON, field types, round trip."""
import json

import pytest

from fastpipe.errors import FormatError
from fastpipe.format import dumps_pipeline, loads_pipeline, parse_pipeline, read_pipeline
from tests.docs import tp_doc


def load(doc):
    return loads_pipeline(json.dumps(doc))


def err(doc) -> str:
    with pytest.raises(FormatError) as e:
        load(doc)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("text, kind, idx, pe, chips", [
    ("cpu", "cpu", 0, None, ()), ("cpu:3", "cpu", 3, None, ()), ("npu:1", "npu", 1, None, ()),
    ("npu:1:2", "npu", 1, "2", ()), ("npu:0:0-3", "npu", 0, "0-3", ()), ("npu:2:*", "npu", 2, "*", ()),
    ("npu:0,npu:1", "npu", 0, None, (0, 1)), ("cuda:1", "cuda", 1, None, ()), ("gpu:0", "cuda", 0, None, ()),
])
def test_device_strings(text, kind, idx, pe, chips):
    doc = tp_doc()
    doc["devices"]["0"] = text
    d = load(doc).devices["0"]
    assert (d.kind, d.idx, d.pe, d.chips) == (kind, idx, pe, chips)


@pytest.mark.parametrize("obj, kind", [({"kind": "cpu", "idx": 0}, "cpu"), ({"kind": "npu", "idx": 2}, "npu"),
                                       ({"kind": "gpu", "idx": 0}, "cuda"), ({"kind": "cuda", "idx": 1}, "cuda")])
def test_device_objects(obj, kind):
    doc = tp_doc()
    doc["devices"]["1"] = obj
    assert load(doc).devices["1"].kind == kind


@pytest.mark.parametrize("bad", ["tpu:0", "npu:x", "npu:0:3-1", "npu:0,cpu:1", "npu:0,npu:0", ""])
def test_bad_device_strings(bad):
    doc = tp_doc()
    doc["devices"]["0"] = bad
    assert err(doc).startswith('devices["0"]: expected a device like') or "expected" in err(doc)


def test_fx_spellings_and_kinds():
    doc = tp_doc()
    doc["supertasks"]["1"]["kind"] = "FX"
    p = load(doc)
    assert p.supertasks["1"].kind == "fx" and p.supertasks["1"].kind_spelling == "FX"
    assert json.loads(dumps_pipeline(p))["supertasks"]["1"]["kind"] == "FX"


def test_param_files_and_blobs_and_extras():
    doc = tp_doc()
    doc["version"] = "0.1.0"
    doc["param_files"] = {"ckpt": {"path": "w.safetensors", "format": "safetensors"}}
    doc["tensors"]["w_0"]["value"] = {"param_file": "ckpt", "name": "w", "placements": [[0, 8], [0, 8]]}
    doc["blobs"] = {"b": None, "c": "AAAA"}
    doc["supertasks"]["1"].pop("data")
    doc["supertasks"]["1"]["data_blob"] = "b"
    doc["device_constraints"] = []
    p = load(doc)
    assert p.version == "0.1.0" and p.param_files["ckpt"].format == "safetensors"
    assert p.tensors["w_0"].value.param_file == "ckpt" and p.blobs == {"b": None, "c": "AAAA"}
    assert p.supertasks["1"].data_blob == "b" and p.device_constraints == ()


@pytest.mark.parametrize("spelling", ["sum", 0, "RedOpType.SUM"])
def test_reduce_op_spellings_are_read(spelling):
    doc = tp_doc()
    for k in ("3", "4"):
        doc["supertasks"][k]["metadata"]["reduce_op"] = spelling
    assert load(doc).supertasks["3"].metadata["reduce_op"] == spelling


def test_round_trip_is_stable():
    doc = tp_doc()
    doc["devices"]["0"] = "npu:0:0-3"
    doc["supertasks"]["1"]["kind"] = "FX"
    doc["supertasks"]["3"]["metadata"]["reduce_op"] = "RedOpType.SUM"
    doc["supertasks"]["4"]["metadata"]["reduce_op"] = "RedOpType.SUM"
    p = load(doc)
    text = dumps_pipeline(p)
    p2 = loads_pipeline(text)
    assert p2 == p
    assert dumps_pipeline(p2) == text
    back = json.loads(text)
    assert back["devices"]["0"] == "npu:0:0-3" and back["devices"]["1"] == {"kind": "cpu", "idx": 1}


def test_round_trip_of_examples(tmp_path):
    from pathlib import Path

    files = sorted(Path(__file__).resolve().parents[1].glob("graphs/*/pipeline.json"))
    assert len(files) >= 4
    for f in files:
        p = read_pipeline(f)
        assert loads_pipeline(dumps_pipeline(p)) == p
        assert json.loads(dumps_pipeline(p)) == json.loads(f.read_text())


def test_duplicate_keys_are_errors():
    text = json.dumps(tp_doc()).replace('"kind": "input",', '"kind": "input", "kind": "input",', 1)
    with pytest.raises(FormatError, match=r'^supertasks\["0"\]\.kind: duplicate key "kind"$'):
        loads_pipeline(text)


@pytest.mark.parametrize("const", ["NaN", "Infinity", "-Infinity"])
def test_nan_infinity_are_errors(const):
    text = json.dumps(tp_doc()).replace('"idx": 0}', '"idx": %s}' % const, 1)
    with pytest.raises(FormatError, match="is not valid JSON"):
        loads_pipeline(text)


def test_invalid_json_names_line_and_column():
    with pytest.raises(FormatError, match=r"invalid JSON at line 1 column \d+"):
        loads_pipeline('{"name": }')


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d.update(extra=1), r'^extra: unknown field \(allowed: '),
    (lambda d: d["tensors"]["x"].update(stride=[1]), r'^tensors\["x"\]\.stride: unknown field'),
    (lambda d: d["supertasks"]["1"].update(group="g"), r'^supertasks\["1"\]\.group: unknown field'),
    (lambda d: d["supertasks"]["3"].update(data="x"), r'^supertasks\["3"\]\.data: unknown field'),
    (lambda d: d["supertasks"]["0"].update(device="0"), r'^supertasks\["0"\]\.device: unknown field'),
    (lambda d: d["tensors"]["w_0"]["value"].update(offset=3), r'^tensors\["w_0"\]\.value\.offset: unknown field'),
    (lambda d: d["metadata"].update(foo={}), r'^metadata\.foo: unknown field'),
    (lambda d: d.pop("devices"), r'missing required field "devices"'),
    (lambda d: d["tensors"]["x"].update(shape=[4, -1]), r'^tensors\["x"\]\.shape\[1\]: expected a non-negative integer, found -1$'),
    (lambda d: d["tensors"]["x"].update(shape=[4, True]), r'^tensors\["x"\]\.shape\[1\]: expected a non-negative integer, found true$'),
    (lambda d: d["tensors"]["x"].update(dtype="float32"), r'^tensors\["x"\]\.dtype: expected one of f64 f32 .*, found "float32"$'),
    (lambda d: d["supertasks"]["1"].update(kind="conv"), r'^supertasks\["1"\]\.kind: expected one of'),
    (lambda d: d["supertasks"]["1"].pop("data"), r'expected exactly one of "data" or "data_blob" for a fx supertask \(the other absent or null\), found neither'),
    (lambda d: d["supertasks"]["1"].update(data_blob="b"), r'found both'),
    (lambda d: d["supertasks"]["3"].pop("group"), r'missing required field "group" for a all_reduce supertask'),
    (lambda d: d["supertasks"]["3"].update(device_idx=-1), r'^supertasks\["3"\]\.device_idx: expected a non-negative integer'),
    (lambda d: d["supertasks"]["3"]["metadata"].update(reduce_op=1.5), r'^supertasks\["3"\]\.metadata\.reduce_op: expected a non-negative integer or a string'),
    (lambda d: d["tensors"]["w_0"]["value"].update(placements=[[0, 8], [5, 2]]), r'placements\[1\]: expected start <= end, found \[5, 2\]'),
    (lambda d: d["tensors"]["w_0"]["value"].update(placements=[[0, 8, 1]]), r'placements\[0\]: expected a \[start, end\] pair'),
    (lambda d: d["tensors"]["w_0"]["value"].update(format="npz"), r'value\.format: expected one of safetensors, torch.save, torch.export'),
    (lambda d: d["tensors"]["w_0"]["value"].update(param_file="p"), r'expected either path/format or param_file, found both'),
    (lambda d: d["tensors"]["w_0"]["value"].pop("format"), r'missing required field "format"'),
    (lambda d: d["metadata"]["tensors"]["inputs"]["x"].update(idx="0"), r'^metadata\.tensors\.inputs\["x"\]\.idx: expected a non-negative integer'),
    (lambda d: d["metadata"]["tensor_slices"]["inputs"]["x"].update(device=[0]), r'tensor_slices\.inputs\["x"\]\.device: expected a slot id'),
    (lambda d: d.update(device_constraints={}), r'^device_constraints: expected an array'),
    (lambda d: d.update(supertasks=[]), r'^supertasks: expected an object, found an array$'),
])
def test_field_errors_name_the_path(mutate, expected):
    doc = tp_doc()
    mutate(doc)
    assert __import__("re").search(expected, err(doc)), err(doc)


def test_parse_keeps_source_dir(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(tp_doc()))
    assert read_pipeline(f).source_dir == tmp_path.resolve()
    assert parse_pipeline(tp_doc()).source_dir is None


def test_missing_pipeline_file(tmp_path):
    with pytest.raises(FormatError, match="cannot read pipeline file"):
        read_pipeline(tmp_path / "nope.json")


def test_write_pipeline_is_atomic_and_round_trips(tmp_path):
    from fastpipe.format import write_pipeline

    p = load(tp_doc())
    target = tmp_path / "out.json"
    write_pipeline(p, target)
    assert read_pipeline(target) == p
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.json"]   # no temporary left behind


# ----------------------------------------------------------------------------- what furiosa-llm writes
def test_null_optional_fields_read_as_absent_and_are_written_back():
    """The producer writes dataclasses.asdict: data and data_blob both present, one null."""
    doc = tp_doc()
    doc["blobs"] = {"b": "AAAA"}
    doc["supertasks"]["1"] = dict(doc["supertasks"]["1"], data=None, data_blob="b")
    doc["supertasks"]["2"] = dict(doc["supertasks"]["2"], data_blob=None)
    p = load(doc)
    assert (p.supertasks["1"].data, p.supertasks["1"].data_blob) == (None, "b")
    assert (p.supertasks["2"].data, p.supertasks["2"].data_blob) == ("AAAA", None)
    assert json.loads(dumps_pipeline(p))["supertasks"] == doc["supertasks"]


def test_both_data_fields_non_null_is_refused():
    doc = tp_doc()
    doc["blobs"] = {"b": "AAAA"}
    doc["supertasks"]["1"]["data_blob"] = "b"
    assert err(doc) == ('supertasks["1"]: expected exactly one of "data" or "data_blob" for a fx supertask '
                        '(the other absent or null), found both')


def test_null_comm_group_is_a_group_of_its_own():
    doc = tp_doc()
    doc["supertasks"]["3"]["group"] = None
    p = load(doc)
    st = p.supertasks["3"]
    assert st.group_is_null and st.group == "<null:3>" and p.supertasks["4"].group == "g"
    assert json.loads(dumps_pipeline(p))["supertasks"]["3"]["group"] is None


@pytest.mark.parametrize("kind", ["edf", "EDF", "dfg"])
def test_npu_graph_kinds(kind):
    doc = tp_doc()
    doc["supertasks"]["1"]["kind"] = kind
    st = load(doc).supertasks["1"]
    assert st.kind == kind.lower() and st.is_compute


@pytest.mark.parametrize("text, idx, pe", [("rngd:0:4", 0, "x4"), ("rngd:3:1", 3, "x1"), ("rngd:1:8", 1, "x8")])
def test_rngd_devices(text, idx, pe):
    doc = tp_doc()
    doc["devices"]["0"] = text
    d = load(doc).devices["0"]
    assert (d.kind, d.idx, d.pe, d.spelling) == ("npu", idx, pe, text)


@pytest.mark.parametrize("bad", ["rngd:0:3", "rngd:0", "rngd:x:4", "rngd:0:0-3"])
def test_bad_rngd_devices(bad):
    doc = tp_doc()
    doc["devices"]["0"] = bad
    assert err(doc).startswith('devices["0"]: expected a device like')


def test_f8e4m3fn_is_f8_and_keeps_its_spelling():
    doc = tp_doc()
    for name in ("x", "p_0", "p_1", "y_0", "y_1"):
        doc["tensors"][name]["dtype"] = "f8e4m3fn"
    doc["metadata"]["tensors"]["inputs"]["x"]["dtype"] = "f8e4m3fn"
    doc["metadata"]["tensor_slices"]["inputs"]["x"]["dtype"] = "f8e4m3fn"
    p = load(doc)
    assert p.tensors["x"].dtype == "f8" and p.metadata.slices_inputs["x"].dtype == "f8"
    back = json.loads(dumps_pipeline(p))
    assert back["tensors"]["x"]["dtype"] == "f8e4m3fn" and back["metadata"]["tensors"]["inputs"]["x"]["dtype"] == "f8e4m3fn"


def test_device_constraints_are_read_kept_and_shown(tmp_path, capsys):
    from fastpipe.summary import summary_text

    doc = tp_doc()
    doc["device_constraints"] = [{"kind": "ring", "devices": [["0", "1"]]}, {"kind": "pair", "devices": {}}]
    p = load(doc)
    assert [(c.kind, c.devices) for c in p.device_constraints] == [("ring", (("0", "1"),)), ("pair", None)]
    assert json.loads(dumps_pipeline(p))["device_constraints"] == doc["device_constraints"]
    text = summary_text(p)
    assert "device constraint: ring over [[0, 1]]" in text and "device constraint: pair over {}" in text


@pytest.mark.parametrize("bad, expected", [
    ([{"kind": "ring"}], r'^device_constraints\[0\]: missing required field "devices"$'),
    ([{"kind": "", "devices": []}], r"^device_constraints\[0\]\.kind: expected a non-empty string"),
    ([{"kind": "ring", "devices": "0,1"}], r'^device_constraints\[0\]\.devices: expected a nested array of slot ids'),
    ([{"kind": "ring", "devices": [[0.5]]}], r'^device_constraints\[0\]\.devices\[0\]\[0\]: expected a slot id'),
])
def test_bad_device_constraints(bad, expected):
    doc = tp_doc()
    doc["device_constraints"] = bad
    with pytest.raises(FormatError, match=expected):
        load(doc)


def test_next_gen_format_is_named():
    with pytest.raises(FormatError, match=r"^stages: expected the supertask format .*experimental stage-based format"):
        load({"name": "n", "inputs": {}, "outputs": {}, "stages": [], "version": "0.1.0"})
