"""Device slots: the object form {kind, idx} and the producer's string forms."""
from __future__ import annotations

import re

from fastpipe.errors import FormatError
from fastpipe.format import fields
from fastpipe.format.model import Device

KINDS = {"cpu": "cpu", "npu": "npu", "cuda": "cuda", "gpu": "cuda", "rngd": "npu"}
# cpu, cpu:N, npu:N, npu:N:P, npu:N:P-Q, npu:N:*, cuda:N, gpu:N; rngd:N:K (furiosa-torch's
# spelling of chip N with K fused processing elements, furiosa-llm 2025.3+)
_ONE = re.compile(r"^(?:(?P<kind>cpu|npu|cuda|gpu)(?::(?P<idx>\d+)(?::(?P<pe>\d+(?:-\d+)?|\*))?)?"
                  r"|(?P<rngd>rngd):(?P<ridx>\d+):(?P<npes>1|2|4|8))$")


def parse_device(value, path: str) -> Device:
    if isinstance(value, str):
        return _parse_string(value, path)
    d = fields.obj(value, path, required=("kind", "idx"))
    kind = fields.string(d["kind"], f"{path}.kind")
    if kind not in KINDS:
        raise fields.bad(f"{path}.kind", "one of cpu, npu, cuda, gpu", kind)
    return Device(kind=KINDS[kind], idx=fields.uint(d["idx"], f"{path}.idx"))


def _parse_string(text: str, path: str) -> Device:
    chips, pe, kind = [], None, None
    for part in text.split(","):
        m = _ONE.match(part.strip())
        if not m:
            raise FormatError(f"{path}: expected a device like cpu, cpu:N, npu:N, npu:N:P, npu:N:P-Q, npu:N:*, rngd:N:K, "
                              f"cuda:N (comma-joined for several chips), found {fields.show(text)}")
        if m["rngd"]:
            m = {"kind": "rngd", "idx": m["ridx"], "pe": f"x{m['npes']}"}
        k = KINDS[m["kind"]]
        if kind is not None and k != kind:
            raise FormatError(f"{path}: expected chips of one kind, found {fields.show(text)}")
        kind = k
        if m["pe"] is not None and "-" in m["pe"]:
            lo, hi = (int(x) for x in m["pe"].split("-"))
            if lo > hi:
                raise FormatError(f"{path}: expected a processing-element range P-Q with P <= Q, found {fields.show(text)}")
        chips.append(int(m["idx"] or 0))
        pe = pe if pe is not None else m["pe"]
    if len(set(chips)) != len(chips):
        raise FormatError(f"{path}: expected distinct chips, found {fields.show(text)}")
    return Device(kind=kind, idx=chips[0], pe=pe, chips=tuple(chips) if len(chips) > 1 else (), spelling=text)


def device_to_json(d: Device):
    if d.spelling is not None:
        return d.spelling
    return {"kind": d.kind, "idx": d.idx}
