"""Chrome/Perfetto traces of a run: one lane per slot, one event per step."""
from __future__ import annotations

from typing import Sequence


def write_chrome_trace(path, events: list, slots: Sequence[str]) -> None:
    """Chrome/Perfetto trace: one lane (tid) per slot, one event per step labelled fp:<slot>:<supertask>."""
    import json

    from fastpipe.atomic import write_text

    lane = {s: i for i, s in enumerate(slots)}
    out = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": lane[s], "args": {"name": f"slot {s}"}} for s in slots]
    out.append({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "fastpipe"}})
    for slot, label, t0, t1, chunk in sorted(events, key=lambda e: e[2]):
        out.append({"name": label, "ph": "X", "pid": 1, "tid": lane[slot], "ts": round(t0 * 1e6, 3),
                    "dur": round((t1 - t0) * 1e6, 3), "args": {"chunk": chunk}})
    write_text(path, json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}) + "\n")
