"""Chrome/Perfetto traces of a run: one lane per slot (or region), one event per step (or region)."""
from __future__ import annotations

from typing import Mapping, Sequence


def write_chrome_trace(path, events: list, lanes: Sequence[str] | Mapping[str, str]) -> None:
    """Chrome/Perfetto trace: one lane (tid) per slot, one event per step labelled fp:<slot>:<supertask>.
    `lanes`: slot names (lanes "slot <name>"), or lane key -> lane title (the region processor's
    regions); events are (lane key, label, start s, end s, chunk)."""
    import json

    from fastpipe.atomic import write_text

    titles = dict(lanes) if isinstance(lanes, Mapping) else {s: f"slot {s}" for s in lanes}
    lane = {s: i for i, s in enumerate(titles)}
    out = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": lane[s], "args": {"name": t}} for s, t in titles.items()]
    out.append({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "fastpipe"}})
    for slot, label, t0, t1, chunk in sorted(events, key=lambda e: e[2]):
        out.append({"name": label, "ph": "X", "pid": 1, "tid": lane[slot], "ts": round(t0 * 1e6, 3),
                    "dur": round((t1 - t0) * 1e6, 3), "args": {"chunk": chunk}})
    write_text(path, json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}) + "\n")
