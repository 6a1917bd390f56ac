"""Proof that nothing in a pipeline executes code, through fastpipe.load and the CLI.

Malicious pipelines (payload targets such as builtins.eval / os.system, an expression in
every string field of a payload, constants blobs and side files that are pickles, param files
of every format carrying code) are loaded while every way of running code from data is
replaced by a tripwire that records the call and refuses it:

    builtins.eval / exec / compile, pickle.loads / load, pickle.Unpickler (find_class),
    pickle._Unpickler.find_class, os.system, os.popen, subprocess.Popen

Each case must end in a FastpipeError (exit 2 on the CLI) or, for data that only *looks*
like code, in a correct run; no tripwire may fire and no marker file may appear.

Two uses of exec/eval are not data from the pipeline and are let through, with checks:
- importlib executing a module's code (and that module's set-up, e.g. dataclasses): the
  module must come from outside the pipeline's folder (nothing is ever imported from it, or
  from any path named in it);
- torch generating code from what fastpipe validated (``TORCH_CODEGEN``: the GraphModule's
  forward, op-schema type strings): the source must contain none of the planted strings.

torch.export archives are the documented exception: refused unless trusted, because their
loader can unpickle. With --trust-export-archives / trust_export_archives=True they load by
design (test_export_archive_needs_trust): trust means "I made this file".
"""
from __future__ import annotations

import base64
import builtins
import contextlib
import copy
import importlib.util
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import fastpipe
from fastpipe.cli import main
from fastpipe.errors import FastpipeError
from fastpipe.weights import WeightStore

ROOT = Path(__file__).resolve().parents[1]
MARK = "PWNED"                         # every planted command creates a file whose name starts so


def _make_bad():
    spec = importlib.util.spec_from_file_location("make_bad", ROOT / "tests" / "data" / "make_bad.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MB = _make_bad()
X = torch.arange(8, dtype=torch.float32).reshape(2, 4)


def expected_y() -> torch.Tensor:
    w = MB._weights()
    return X @ w["w"][:4].T + w["b"]


def shell(tag: str) -> str:
    return f"touch {MARK}_{tag}"


def expr(tag: str) -> str:
    return f"__import__('os').system('{shell(tag)}')"


# ----------------------------------------------------------------------------- tripwires
# Callers whose exec/eval is torch generating code from what fastpipe has already validated: the
# GraphModule's forward (from checked targets and sanitized names), and type strings of op schemas
# from torch's own registry. What they run is recorded and checked for the planted strings.
TORCH_CODEGEN = {("torch.fx.graph_module", "_exec_with_source"),
                 ("torch.fx.operator_schemas", "_torchscript_type_to_python_type")}

class Tripwires:
    def __init__(self, tmp: Path):
        self.tmp = str(tmp)
        self.calls: list[str] = []
        self.codegen: list[str] = []

    def _caller(self) -> tuple[str, str]:
        f = sys._getframe(2)
        return f.f_globals.get("__name__", "?"), f.f_code.co_name

    @staticmethod
    def _importing() -> bool:
        """Inside a module import (module-level set-up of installed code, e.g. dataclasses)?"""
        f = sys._getframe(3)
        while f is not None:
            if f.f_globals.get("__name__", "").startswith("importlib"):
                return True
            f = f.f_back
        return False

    def gate(self, name, orig):
        def wrapper(*args, **kwargs):
            mod, fn = self._caller()
            src = args[0] if args else None
            if mod.startswith("importlib") or self._importing():      # importing a module
                code_file = getattr(src, "co_filename", "") or (args[1] if name == "compile" and len(args) > 1 else "")
                if str(code_file).startswith(self.tmp):
                    self.calls.append(f"{name} of a module from the pipeline's folder: {code_file}")
                    raise AssertionError(self.calls[-1])
                return orig(*args, **kwargs)
            if (mod, fn) in TORCH_CODEGEN:       # torch's own code generation, from validated graphs and op schemas
                if isinstance(src, str):
                    self.codegen.append(src)
                return orig(*args, **kwargs)
            self.calls.append(f"{name} from {mod}.{fn}: {str(src)[:80]!r}")
            raise AssertionError(f"tripwire: {self.calls[-1]}")
        return wrapper

    def trip(self, name):
        def wrapper(*args, **kwargs):
            self.calls.append(f"{name}{tuple(str(a)[:60] for a in args)}")
            raise AssertionError(f"tripwire: {name} called")
        return wrapper

    @contextlib.contextmanager
    def armed(self):
        tw = self

        class TrippedUnpickler(pickle.Unpickler):
            def find_class(self, module, name):
                tw.calls.append(f"pickle.Unpickler.find_class({module}, {name})")
                raise AssertionError("tripwire: pickle.Unpickler.find_class")

        def py_find_class(self, module, name):
            tw.calls.append(f"pickle._Unpickler.find_class({module}, {name})")
            raise AssertionError("tripwire: pickle._Unpickler.find_class")

        with pytest.MonkeyPatch.context() as mp:
            for name in ("eval", "exec", "compile"):
                mp.setattr(builtins, name, self.gate(name, getattr(builtins, name)))
            mp.setattr(pickle, "loads", self.trip("pickle.loads"))
            mp.setattr(pickle, "load", self.trip("pickle.load"))
            mp.setattr(pickle, "Unpickler", TrippedUnpickler)
            mp.setattr(pickle._Unpickler, "find_class", py_find_class)
            mp.setattr(os, "system", self.trip("os.system"))
            mp.setattr(os, "popen", self.trip("os.popen"))
            mp.setattr(subprocess, "Popen", self.trip("subprocess.Popen"))
            yield self

    def assert_clean(self, folder: Path, planted=(MARK, "__import__", "os.system")):
        assert self.calls == [], f"code ran: {self.calls}"
        for src in self.codegen:
            for s in planted:
                assert s not in src, f"planted {s!r} reached generated code:\n{src}"
        for p in (folder, Path.cwd()):
            left = [q.name for q in p.iterdir() if q.name.startswith(MARK)]
            assert not left, f"marker files created: {left}"


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """Load and run a valid pipeline once with no tripwires, so that lazy imports and
    library set-up (dataclasses, typing, torch.fx schemas) happen before the checks."""
    folder = tmp_path_factory.mktemp("warm")
    MB.save(folder, MB.p2p(folder))
    save_file({"x": X.clone()}, str(folder / "inputs.safetensors"))
    for args in (["validate", str(folder / "pipeline.json")],
                 ["run", str(folder / "pipeline.json"), "--inputs", str(folder / "inputs.safetensors"), *MB.RUN[3:]]):
        assert main(args) == 0
    out = fastpipe.load(folder / "pipeline.json", store=WeightStore()).run({"x": X})
    torch.testing.assert_close(out["y"], expected_y())
    # error paths import a few more modules: one refusal of each kind
    for name in ("payload_builtins_exec", "torch_save_pickled_object", "torch_export_untrusted", "payload_as_expr",
                 "payload_pickle_blob", "safetensors_header_garbage"):
        case = ROOT / "tests" / "data" / "bad" / name
        with pytest.raises(FastpipeError):
            fastpipe.load(case / "pipeline.json", store=WeightStore())
    return True


@pytest.fixture
def tw(tmp_path, warmed, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return Tripwires(tmp_path)


def p2p_folder(tmp_path: Path, name: str = "p") -> tuple[Path, dict]:
    folder = tmp_path / name
    folder.mkdir()
    doc = MB.p2p(folder, inputs={"x": X.clone()})
    return folder, doc


def load_refused(tw: Tripwires, folder: Path, doc: dict, **kw) -> FastpipeError:
    """fastpipe.load and the CLI (validate and run) must both refuse, with no tripwire."""
    MB.save(folder, doc)
    if not (folder / "inputs.safetensors").exists():
        save_file({"x": X.clone()}, str(folder / "inputs.safetensors"))
    with tw.armed():
        with pytest.raises(FastpipeError) as e:
            fastpipe.load(folder / "pipeline.json", store=WeightStore(), **kw)
        for cmd in (["validate"], MB.RUN):
            argv = [cmd[0], str(folder / "pipeline.json"), *[str(folder / a) if a.endswith(".safetensors") else a
                                                           for a in cmd[1:]]]
            assert main(argv) == 2
    tw.assert_clean(folder)
    return e.value


def load_runs(tw: Tripwires, folder: Path, doc: dict, **kw) -> None:
    """Data that merely looks like code: loads and runs correctly, with no tripwire."""
    MB.save(folder, doc)
    with tw.armed():
        out = fastpipe.load(folder / "pipeline.json", store=WeightStore(), **kw).run({"x": X})
        assert main(["run", str(folder / "pipeline.json"), "--inputs", str(folder / "inputs.safetensors"),
                     "--processor", "reference", "--no-compile", "--warmup", "0", "--repeat", "1"]) == 0
    torch.testing.assert_close(out["y"], expected_y())
    assert tw.codegen, "expected torch.fx codegen to have run (and been checked)"
    tw.assert_clean(folder)


# ----------------------------------------------------------------------------- graph payloads
def _payload(doc: dict, sid: str = "1") -> dict:
    return MB.unpack(doc["supertasks"][sid]["data"])


@pytest.mark.parametrize("target", ["builtins.eval", "builtins.exec", "os.system", "subprocess.Popen", "posix.system",
                                    "torch.load", "pickle.loads", "torch.ops.aten.save.default",
                                    f"builtins.exec('{shell('T')}')", "__import__('os').system"])
def test_payload_targets(tw, tmp_path, target):
    folder, doc = p2p_folder(tmp_path)
    g = _payload(doc)
    MB.node_with(g, "mm.default")["target"] = target
    doc["supertasks"]["1"]["data"] = MB.pack(g)
    assert "target" in str(load_refused(tw, folder, doc))


def test_payload_target_naming_a_module_beside_the_pipeline_is_never_imported(tw, tmp_path, monkeypatch):
    folder, doc = p2p_folder(tmp_path)
    (folder / "fp_evil_mod.py").write_text(f"import os\nos.system({shell('IMPORT')!r})\ndef run(*a): pass\n")
    monkeypatch.syspath_prepend(str(folder))       # even importable, it must not be imported
    g = _payload(doc)
    MB.node_with(g, "mm.default")["target"] = "fp_evil_mod.run"
    doc["supertasks"]["1"]["data"] = MB.pack(g)
    load_refused(tw, folder, doc)
    assert "fp_evil_mod" not in sys.modules


def _string_paths(value, prefix=()):
    if isinstance(value, str):
        yield prefix
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _string_paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _string_paths(v, prefix + (i,))


def _set(doc, path, value):
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


def test_expression_in_every_string_field_of_a_payload(tw, tmp_path):
    """Every string of the payload JSON at once, then each one alone: refused or inert."""
    folder, doc = p2p_folder(tmp_path)
    g = _payload(doc)
    paths = list(_string_paths(g))
    assert len(paths) > 10
    every = copy.deepcopy(g)
    for i, p in enumerate(paths):
        _set(every, p, expr(f"ALL{i}"))
    doc["supertasks"]["1"]["data"] = MB.pack(every)
    load_refused(tw, folder, doc)

    outcomes = {"refused": 0, "ran": 0}
    for i, p in enumerate(paths):
        one = copy.deepcopy(g)
        _set(one, p, expr(f"ONE{i}"))
        doc["supertasks"]["1"]["data"] = MB.pack(one)
        MB.save(folder, doc)
        with tw.armed():
            try:
                out = fastpipe.load(folder / "pipeline.json", store=WeightStore()).run({"x": X})
            except FastpipeError:
                outcomes["refused"] += 1
            else:       # an inert field (e.g. a node name list in metadata): still the right answer
                torch.testing.assert_close(out["y"], expected_y())
                outcomes["ran"] += 1
        tw.assert_clean(folder)
    assert outcomes["refused"] >= len(paths) // 2, outcomes


def test_expression_in_pipeline_strings_is_inert(tw, tmp_path):
    """Names in pipeline.json (tensor, supertask, group, slot names) are only ever data."""
    folder, doc = p2p_folder(tmp_path)
    text = json.dumps(doc)
    for old, tag in (('"h_r"', "T"), ('"p"', "G")):
        text = text.replace(old, json.dumps(expr(tag)))
    doc = json.loads(text)
    doc["name"] = expr("NAME")
    doc["supertasks"][expr("SID")] = doc["supertasks"].pop("4")
    load_runs(tw, folder, doc)


def test_constants_blob_that_is_a_pickle(tw, tmp_path):
    folder, doc = p2p_folder(tmp_path)

    class Boom:
        def __reduce__(self):
            return (os.system, (shell("BLOB"),))

    for blob in (pickle.dumps({"c": Boom()}), pickle.dumps(Boom(), protocol=0)):
        g = _payload(doc)
        g["metadata"]["constant_saved_info"]["blob"] = base64.b64encode(blob).decode()
        doc["supertasks"]["1"]["data"] = MB.pack(g)
        assert "blob" in str(load_refused(tw, folder, doc))


def test_side_file_that_is_a_pickle(tw, tmp_path):
    """A null blob's <blob-id>.fx side file holding pickle bytes (raw, then base64) is refused."""
    class Boom:
        def __reduce__(self):
            return (os.system, (shell("SIDE"),))

    for raw in (pickle.dumps(Boom()), base64.b64encode(pickle.dumps(Boom()))):
        folder = tmp_path / f"side{len(raw)}"
        folder.mkdir()
        doc = MB.tp(folder)
        doc["blobs"]["mm"] = None
        (folder / "mm.fx").write_bytes(raw)
        load_refused(tw, folder, doc)


@pytest.mark.parametrize("payload", ["os.system", "exec", "open"])
def test_torch21_payload_constant_with_reduce_payload(tw, tmp_path, payload):
    """furiosa-llm 2024.1 payloads keep constants as base64 torch.save files: read with
    weights_only=True, a pickled object in one is refused, never run."""
    folder, doc = p2p_folder(tmp_path)
    evil = {"os.system": Reducer(os.system, shell("T21")),
            "exec": Reducer(builtins.exec, f"import os; os.system({shell('T21EXEC')!r})"),
            "open": Reducer(open, str(folder / f"{MARK}_T21OPEN"), "w")}[payload]
    buf = io.BytesIO()
    torch.save({"c": evil}, buf)
    g = _payload(doc)
    g.pop("metadata")
    g["constants"] = {"c": base64.b64encode(buf.getvalue()).decode()}
    doc["supertasks"]["1"]["data"] = MB.pack(g)
    assert "weights_only=True" in str(load_refused(tw, folder, doc))


def test_torch21_payload_with_a_constant_loads_under_tripwires(tw, tmp_path):
    """The torch 2.1 spelling fastpipe writes for furiosa-llm 2024.1.x reads back and runs, its
    torch.save constant read without unpickling anything but a tensor."""
    from fastpipe.payload import encode_payload
    from fastpipe.payload.torch21 import to_torch21

    folder, doc = p2p_folder(tmp_path)
    one = torch.ones(4)

    def mm_times_one(x, w):
        return (x @ w.t()) * one          # `one`: an embedded constant

    w = MB._weights()["w"][:4]            # the slice the pipeline's constant "w" holds
    gm = torch.fx.experimental.proxy_tensor.make_fx(mm_times_one)(X, w)
    doc["supertasks"]["1"]["data"] = to_torch21(encode_payload(gm, (X, w)))
    assert "constants" in MB.unpack(doc["supertasks"]["1"]["data"])
    load_runs(tw, folder, doc)


# ----------------------------------------------------------------------------- param files
def test_safetensors_header_with_code_like_strings_is_data(tw, tmp_path):
    folder, doc = p2p_folder(tmp_path)
    w = MB._weights()
    name = f"w'); {expr('NAME')} #"
    save_file({name: w["w"], "b": w["b"]}, str(folder / "code.safetensors"),
              metadata={"format": "pt", "__init__": expr("META"), "exec": f"exec({shell('META2')!r})"})
    doc["tensors"]["w"]["value"].update(path="code.safetensors", name=name)
    doc["tensors"]["w"]["value"]["name_in_graph"] = expr("NIG")
    load_runs(tw, folder, doc)


def test_safetensors_file_that_is_a_pickle(tw, tmp_path):
    folder, doc = p2p_folder(tmp_path)

    class Boom:
        def __reduce__(self):
            return (os.system, (shell("ST"),))

    (folder / "evil.safetensors").write_bytes(pickle.dumps({"w": Boom()}))
    doc["tensors"]["w"]["value"]["path"] = "evil.safetensors"
    assert "safetensors" in str(load_refused(tw, folder, doc))


class Reducer:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize("payload", ["os.system", "exec", "eval", "open", "subprocess"])
def test_torch_save_with_reduce_payload(tw, tmp_path, payload, zipfile):
    folder, doc = p2p_folder(tmp_path)
    evil = {"os.system": Reducer(os.system, shell("SYS")),
            "exec": Reducer(builtins.exec, f"import os; os.system({shell('EXEC')!r})"),
            "eval": Reducer(builtins.eval, expr("EVAL")),
            "open": Reducer(open, str(folder / f"{MARK}_OPEN"), "w"),
            "subprocess": Reducer(subprocess.call, ["touch", f"{MARK}_SUB"])}[payload]
    torch.save({"w": MB._weights()["w"], "b": MB._weights()["b"], "evil": evil}, str(folder / "evil.pt"),
               _use_new_zipfile_serialization=zipfile)
    for t in ("w", "b"):
        doc["tensors"][t]["value"].update(path="evil.pt", format="torch.save")
    err = load_refused(tw, folder, doc)
    assert "weights_only=True" in str(err)


def test_plain_torch_save_loads_without_unpickling_objects(tw, tmp_path):
    """The safe path really is safe: a plain torch.save file loads under the tripwires."""
    folder, doc = p2p_folder(tmp_path)
    torch.save(MB._weights(), str(folder / "w.pt"))
    for t in ("w", "b"):
        doc["tensors"][t]["value"].update(path="w.pt", format="torch.save")
    load_runs(tw, folder, doc)


@pytest.fixture(scope="module")
def export_archive(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    MB._export(folder)
    return folder / "model.pt2"


def test_export_archive_needs_trust(tw, tmp_path, export_archive):
    """Refused untrusted (nothing read, no tripwire); with trust it loads, by design."""
    folder, doc = p2p_folder(tmp_path)
    (folder / "model.pt2").write_bytes(export_archive.read_bytes())
    doc["tensors"]["w"]["value"].update(path="model.pt2", format="torch.export")
    assert "trust" in str(load_refused(tw, folder, doc))
    # trusted: allowed by design (its loader may unpickle, which is what trust accepts); no tripwires here
    out = fastpipe.load(folder / "pipeline.json", store=WeightStore(), trust_export_archives=True).run({"x": X})
    torch.testing.assert_close(out["y"], expected_y())


# ----------------------------------------------------------------------------- the corpus, under tripwires
CODE_CASES = ["payload_builtins_exec", "payload_os_system", "payload_aten_save", "payload_as_expr", "payload_pickle_blob",
              "payload_legacy_constant_pickle",
              "torch_save_pickled_object", "torch_export_untrusted", "param_symlink_escape", "param_absolute"]


@pytest.mark.parametrize("name", CODE_CASES)
def test_corpus_cases_under_tripwires(tw, tmp_path, name, capsys):
    import shutil

    folder = tmp_path / name
    shutil.copytree(ROOT / "tests" / "data" / "bad" / name, folder, symlinks=True)
    with tw.armed():
        with pytest.raises(FastpipeError):
            fastpipe.load(folder / "pipeline.json", store=WeightStore())
        assert main(["validate", str(folder / "pipeline.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    tw.assert_clean(folder)
    assert not (folder / MB.MARKER).exists()


def test_tripwires_work(tw, tmp_path):
    """The tripwires catch what they are meant to catch (so a clean run means something)."""
    with tw.armed():
        for fn in (lambda: eval("1"), lambda: os.system("true"), lambda: pickle.loads(b"."),
                   lambda: pickle.Unpickler(io.BytesIO(pickle.dumps(Reducer(print, "x")))).load(),
                   lambda: torch.load(io.BytesIO(_pickled_reducer()), weights_only=False),
                   lambda: subprocess.run(["true"])):
            with pytest.raises(AssertionError):
                fn()
    assert len(tw.calls) == 6, tw.calls


def _pickled_reducer() -> bytes:
    buf = io.BytesIO()
    torch.save({"x": Reducer(print, "x")}, buf)
    return buf.getvalue()
