"""metadata: original-model tensors and the slices that tie pipeline I/O to them.

A slice's key is a pipeline input (or output) tensor; its origin is a tensor of
metadata.tensors.inputs (or .outputs); origin[placements] has the pipeline
tensor's shape and the same dtype; it lives on a slot that consumes it (for
inputs) or produces it (for outputs).
"""
from __future__ import annotations

from fastpipe.errors import ValidationError, key_path
from fastpipe.format.model import Pipeline
from fastpipe.validate.dataflow import Dataflow


def check_metadata(p: Pipeline, flow: Dataflow) -> None:
    m = p.metadata
    for side, originals in (("inputs", m.tensors_inputs), ("outputs", m.tensors_outputs)):
        seen: dict[int, str] = {}
        for name, o in originals.items():
            path = key_path(f"metadata.tensors.{side}", name)
            if o.idx in seen:
                raise ValidationError(f"{path}.idx: expected a position not used by another original {side[:-1]}, found {o.idx} (also \"{seen[o.idx]}\")")
            seen[o.idx] = name
    pipeline_inputs = set(p.input_names)
    pipeline_outputs = set(p.output_names)
    for side, slices, originals, members in (
        ("inputs", m.slices_inputs, m.tensors_inputs, pipeline_inputs),
        ("outputs", m.slices_outputs, m.tensors_outputs, pipeline_outputs),
    ):
        for name, s in slices.items():
            path = key_path(f"metadata.tensor_slices.{side}", name)
            if name not in members:
                raise ValidationError(f"{path}: expected a pipeline {side[:-1]} tensor, found \"{name}\"")
            if s.origin not in originals:
                raise ValidationError(f"{path}.origin: expected a name in metadata.tensors.{side}, found \"{s.origin}\"")
            origin = originals[s.origin]
            tensor = p.tensors[name]
            if s.dtype != origin.dtype or s.dtype != tensor.dtype:
                raise ValidationError(f"{path}.dtype: expected {tensor.dtype} (the tensor's and origin's dtype), found {s.dtype}"
                                      if origin.dtype == tensor.dtype else
                                      f"{path}.dtype: expected origin \"{s.origin}\" ({origin.dtype}) and tensor \"{name}\" ({tensor.dtype}) to agree, found {s.dtype}")
            if len(s.placements) != len(origin.shape):
                raise ValidationError(f"{path}.placements: expected {len(origin.shape)} [start, end] pairs (the rank of \"{s.origin}\"), found {len(s.placements)}")
            for d, ((start, end), size) in enumerate(zip(s.placements, origin.shape)):
                if end > size:
                    raise ValidationError(f"{path}.placements[{d}]: expected 0 <= start <= end <= {size}, found [{start}, {end}]")
            sliced = tuple(e - b for b, e in s.placements)
            if sliced != tensor.shape:
                raise ValidationError(f"{path}.placements: expected a slice of shape {list(tensor.shape)} (tensor \"{name}\"), found {list(sliced)}")
            if s.device not in p.devices:
                raise ValidationError(f"{path}.device: expected a declared slot ({', '.join(sorted(p.devices))}), found \"{s.device}\"")
            if side == "inputs":
                slots = sorted({p.supertasks[c].device for c in flow.consumers.get(name, []) if p.supertasks[c].device})
            else:
                slots = sorted({p.supertasks[c].device for c in flow.producers.get(name, []) if p.supertasks[c].device})
            if slots and s.device not in slots:
                role = "consumes" if side == "inputs" else "produces"
                raise ValidationError(f"{path}.device: expected a slot that {role} \"{name}\" ({', '.join(slots)}), found \"{s.device}\"")
