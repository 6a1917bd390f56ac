"""Serving: several pipelines (buckets) of one model in one process, sharing their weights.

    models = fastpipe.serving.ModelSet(["prefill_b4/pipeline.json", "decode_b4_p8/pipeline.json", ...])
    out = models.run_model(input_ids=ids, past_key_values=cache)   # picks a bucket, pads, runs, un-pads

Buckets: every pipeline is static-shaped. A request goes to the bucket whose model inputs
have the same names and the same shapes except along dim 0 (the batch), choosing the
smallest batch >= the request's. The batch is padded with zeros (token id 0, zero caches)
and the outputs are cut back to the request's rows. Rows are independent in these models,
so padding the batch is exact. Sequence and past lengths must match a bucket exactly: the
pipelines take no attention mask, so padding along those dims would change results.
Build one bucket per length you serve (prefill per prompt length, decode per past length).

Weights: all buckets load through one WeightStore, so a slice shared by several buckets is
read and held once, and on a GPU copied there once.

Threads: each bucket's session is used by one thread at a time (a lock per session);
different buckets run concurrently. A failing request raises to its caller and leaves the
set usable. `close()` drops every session and the weights only they held (and empties the
CUDA cache when a GPU was used).
"""
from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import torch

from fastpipe.errors import InputError
from fastpipe.model_io import assemble_outputs, flatten_args, to_pipeline_inputs
from fastpipe.weights import WeightStore


class Bucket:
    def __init__(self, session):
        self.session = session
        self.lock = threading.Lock()
        meta = session.pipeline.metadata.tensors_inputs
        if not meta or not session.pipeline.metadata.slices_inputs:
            raise InputError(f"{session.pipeline.name}: expected metadata.tensors.inputs and tensor_slices to serve "
                             "model-level calls, found none")
        self.inputs = {n: tuple(o.shape) for n, o in meta.items()}
        self.batch = next(iter(self.inputs.values()))[0]

    def fits(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        if set(shapes) != set(self.inputs):
            return False
        b = next(iter(shapes.values()))[0]
        return b <= self.batch and all(s[0] == b and s[1:] == self.inputs[n][1:] for n, s in shapes.items())


class ModelSet:
    def __init__(self, pipelines: Sequence[str | os.PathLike], *, store: WeightStore | None = None, **load_kwargs):
        from fastpipe.session import load

        self.store = store or WeightStore()
        self.buckets = [Bucket(load(p, store=self.store, **load_kwargs)) for p in pipelines]
        self._closed = False

    def run_model(self, *, check_replicas: bool = False, output_device=None, **model_inputs: Any) -> dict[str, torch.Tensor]:
        """Session.run_model on the smallest bucket the inputs fit (padded to its batch; the outputs cut
        back): outputs on the CPU, or on `output_device`."""
        if self._closed:
            raise InputError("run_model: the model set is closed")
        flat = flatten_args(model_inputs)
        shapes = {n: tuple(t.shape) for n, t in flat.items()}
        fitting = [b for b in self.buckets if b.fits(shapes)]
        if not fitting:
            have = "; ".join(", ".join(f"{n}{list(s)}" for n, s in b.inputs.items()) for b in self.buckets)
            raise InputError(f"run_model: expected inputs fitting a bucket ({have}), found "
                             + ", ".join(f"{n}{list(s)}" for n, s in shapes.items()))
        bucket = min(fitting, key=lambda b: b.batch)
        b = next(iter(shapes.values()))[0]
        padded = {n: _pad(t, bucket.batch) for n, t in flat.items()}
        with bucket.lock:
            sess = bucket.session
            outs = sess.run(to_pipeline_inputs(sess.pipeline, padded))
            res = assemble_outputs(sess.pipeline, outs, check_replicas=check_replicas, device=output_device)
        return {n: t[:b] for n, t in res.items()}

    def warmup(self) -> None:
        """Warm every bucket up now, off the request path: Session.compile() (what is worth compiling is
        compiled here, and settled, whatever the compile mode: no bucket changes how it runs, or its
        numerics, under later requests), then one run on zeros (the first call of a graph generates its
        code)."""
        for b in self.buckets:
            zeros = {n: torch.zeros(s, dtype=_dtype(b, n)) for n, s in b.inputs.items()}
            with b.lock:
                if b.session.compiles and b.session.compile_report is None:
                    b.session.compile(capture=False)
                b.session.run(to_pipeline_inputs(b.session.pipeline, zeros))

    def weight_bytes(self) -> int:
        """Bytes of distinct constant storage held by all buckets together (shared slices count once)."""
        seen: dict[int, int] = {}
        for b in self.buckets:
            for ss in b.session.program.steps.values():
                for st in ss:
                    for r in st.constants.values():
                        seen[r.untyped_storage().data_ptr() + r.storage_offset() * r.element_size()] = r.nbytes
        return sum(seen.values())

    def close(self) -> None:
        self._closed = True
        cuda = any(d.type == "cuda" for bk in self.buckets for d in bk.session.slot_devices.values())
        self.buckets.clear()
        import gc

        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _dtype(bucket: Bucket, name: str) -> torch.dtype:
    from fastpipe import dtypes

    return dtypes.to_torch(bucket.session.pipeline.metadata.tensors_inputs[name].dtype)


def _pad(t: torch.Tensor, batch: int) -> torch.Tensor:
    if t.shape[0] == batch:
        return t
    pad = torch.zeros((batch - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=0)
