"""What a benchmark result was measured on."""
from __future__ import annotations

import os
import platform
import re
from datetime import date


def machine_info() -> dict[str, str]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"date": date.today().isoformat(), "cpu": f"{cpu} x{os.cpu_count()}", "python": platform.python_version(),
            "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - triton is optional on CPU-only machines
        info["triton"] = "n/a"
    from fastpipe import __version__

    info["fastpipe"] = __version__
    info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return info


def gpu_slug(device: str) -> str:
    """The GPU's model in a file name: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200"."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", device) if w and w.upper() != "NVIDIA"]
    return words[0].lower() if words else "gpu"


def write_result(report: str, doc: dict, out: str | None = None):
    """Write a result document (doc["machine"] from machine_info) atomically to `out`, by default
    bench/measured/<report>_<device>_<date>.json (device: "cpu", or the GPU's model, e.g. "h200"); the path."""
    import json
    from pathlib import Path

    from fastpipe.atomic import write_text

    dev = doc["machine"]["device"]
    kind = "cpu" if dev == "cpu" else gpu_slug(dev)
    path = Path(out) if out else Path(__file__).resolve().parent / "measured" / f"{report}_{kind}_{doc['machine']['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(doc, indent=1) + "\n")
    return path
