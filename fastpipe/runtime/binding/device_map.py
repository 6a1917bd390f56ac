"""Slots -> torch devices.

Default: every slot on the CPU when there is no GPU. With GPUs, `cpu` slots
stay on the CPU and `npu`/`cuda` slots with index N go to cuda:(N mod count)
(several slots may share one GPU). Override per slot with
``--device-map 0=cpu,1=cuda:0`` or ``device_map={"0": "cpu", ...}``; slots
not named keep their default.
"""
from __future__ import annotations

from typing import Mapping

import torch

from fastpipe.errors import InputError
from fastpipe.format.model import Pipeline


def parse_device_map_option(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, part in enumerate(p for p in text.split(",") if p.strip()):
        slot, sep, dev = part.partition("=")
        if not sep or not slot.strip() or not dev.strip():
            raise InputError(f"--device-map[{i}]: expected SLOT=DEVICE (e.g. 0=cpu,1=cuda:0), found \"{part}\"")
        out[slot.strip()] = dev.strip()
    return out


def default_device(kind: str, idx: int) -> torch.device:
    if kind == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", idx % torch.cuda.device_count())


def resolve_device_map(p: Pipeline, device_map: Mapping[str, str | torch.device] | None) -> dict[str, torch.device]:
    device_map = dict(device_map or {})
    out = {slot: default_device(d.kind, d.idx) for slot, d in p.devices.items()}
    for slot, dev in device_map.items():
        slot = str(slot)
        if slot not in p.devices:
            raise InputError(f"device_map[\"{slot}\"]: expected a slot of the pipeline ({', '.join(sorted(p.devices))}), found \"{slot}\"")
        try:
            d = torch.device(dev)
        except (RuntimeError, TypeError):
            raise InputError(f"device_map[\"{slot}\"]: expected a torch device (cpu, cuda:0, ...), found \"{dev}\"") from None
        if d.type == "cuda":
            if not torch.cuda.is_available():
                raise InputError(f"device_map[\"{slot}\"]: expected an available device, found \"{dev}\" but CUDA is not available")
            if d.index is not None and d.index >= torch.cuda.device_count():
                raise InputError(f"device_map[\"{slot}\"]: expected cuda:0..cuda:{torch.cuda.device_count() - 1}, found \"{dev}\"")
            if d.index is None:                  # "cuda" is the current GPU: one spelling per device
                d = torch.device("cuda", torch.cuda.current_device())
        elif d.type != "cpu":
            raise InputError(f"device_map[\"{slot}\"]: expected cpu or cuda[:N], found \"{dev}\"")
        out[slot] = d
    return out
