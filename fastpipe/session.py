"""fastpipe.load(...) -> Session; Session.run(inputs) -> outputs.

Loading validates everything first (structure, payloads, param-file headers),
then reads the weights (each slice once per process) and binds every step.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch

from fastpipe.format import Pipeline, read_pipeline
from fastpipe.options import LoadOptions
from fastpipe.payload import decode_payload
from fastpipe.runtime.bind import Binder
from fastpipe.runtime.device_map import resolve_device_map
from fastpipe.runtime.inputs import check_inputs
from fastpipe.runtime.reference import ReferenceRunner
from fastpipe.runtime.steps import comm_step, compute_step
from fastpipe.validate import Checked, validate
from fastpipe.validate.order import node_of
from fastpipe.validate.sources import payload_text
from fastpipe.weights import WeightStore, default_store


class Session:
    """A loaded pipeline, ready to run. Not thread-safe: use one per thread, or serialise calls."""

    def __init__(self, pipeline: Pipeline, *, device_map: Mapping[str, str] | None = None,
                 options: LoadOptions | None = None, store: WeightStore | None = None):
        self.options = options or LoadOptions()
        self.store = store or default_store()
        self.checked: Checked = validate(pipeline, self.options, self.store)
        self.pipeline = pipeline
        self.slot_devices = resolve_device_map(pipeline, device_map)
        self._binder = Binder(pipeline, self.options, self.store, self.slot_devices)
        self.steps = self._build_steps()
        self._runner = ReferenceRunner(self.steps, pipeline.output_names)
        self._input_devices = {
            n: {self.slot_devices[pipeline.supertasks[c].device] for c in self.checked.flow.consumers.get(n, [])}
            for n in pipeline.input_names
        }

    def _build_steps(self):
        p, b = self.pipeline, self._binder
        graphs = self.checked.graphs or {}
        steps, done_groups = [], set()
        by_node = {}
        for sid in p.supertasks:
            by_node.setdefault(node_of(p, sid), sid)
        for node in self.checked.order:
            sid = by_node[node]
            st = p.supertasks[sid]
            if st.kind in ("input", "output"):
                continue
            if st.is_comm:
                if st.group in done_groups:
                    continue
                done_groups.add(st.group)
                group = self.checked.groups[st.group]
                consts = {}
                for m in group.members:
                    consts.update(b.constants_for(p.supertasks[m].inputs, self.slot_devices[p.supertasks[m].device]))
                steps.append(comm_step(group, p.supertasks, self.slot_devices, consts))
                continue
            dev = self.slot_devices[st.device]
            g = graphs.get(sid)
            if g is None and st.kind == "fx":
                text, where = payload_text(p, sid, self.options)
                g = decode_payload(text, where=where)
            fn = b.graph_fn(sid, g, dev)
            steps.append(compute_step(sid, st.device, fn, st.inputs, b.constants_for(st.inputs, dev), dev, st.outputs))
        return steps

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.pipeline.input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.pipeline.output_names

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run once. `inputs` keyed by pipeline input names; returns outputs keyed by pipeline output names."""
        check_inputs(self.pipeline, inputs, self._input_devices)
        return self._runner.run(inputs)


def load(pipeline: str | os.PathLike | Pipeline, device_map: Mapping[str, str] | None = None, *,
         allow_outside_paths: bool = False, trust_export_archives: bool = False,
         store: WeightStore | None = None) -> Session:
    """Load, validate and bind a pipeline (a path to pipeline.json, or a Pipeline)."""
    p = pipeline if isinstance(pipeline, Pipeline) else read_pipeline(Path(pipeline))
    opts = LoadOptions(allow_outside_paths=allow_outside_paths, trust_export_archives=trust_export_archives)
    return Session(p, device_map=device_map, options=opts, store=store)
