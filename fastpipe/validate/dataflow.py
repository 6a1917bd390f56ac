"""Who produces and who consumes each tensor: the facts every rule reads."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fastpipe.format.model import Pipeline


@dataclass(frozen=True)
class Dataflow:
    producers: dict[str, list[str]]   # tensor -> supertask ids that list it as an output
    consumers: dict[str, list[str]]   # tensor -> supertask ids that list it as an input (once per supertask)
    input_id: str
    output_id: str


def dataflow(p: Pipeline, input_id: str, output_id: str) -> Dataflow:
    producers: dict[str, list[str]] = defaultdict(list)
    consumers: dict[str, list[str]] = defaultdict(list)
    for sid, st in p.supertasks.items():
        for t in st.outputs:
            producers[t].append(sid)
        for t in dict.fromkeys(st.inputs):
            consumers[t].append(sid)
    return Dataflow(dict(producers), dict(consumers), input_id, output_id)
