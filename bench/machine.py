"""What a benchmark result was measured on."""
from __future__ import annotations

import os
import platform
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
