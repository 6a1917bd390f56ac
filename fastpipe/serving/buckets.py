"""The loaded pipelines of a serving set (fastpipe.serving.build), told apart by their metadata.

    bs = ServingBuckets("out/")            # fastpipe.load's keywords: processor="auto", compile="background"
    bs.decodes[8]          # Session of the decode step for 8 rows (static cache, state in place)
    bs.prefills[(1, 64)]   # Session of the prefill for 1 prompt of up to 64 tokens
    bs.max_len, bs.vocab

A decode pipeline is one whose model inputs are input_ids [B, 1], cache_position [B] and caches
[B, Hkv, M, D] returned updated (M = max_len). A prefill pipeline takes input_ids [B, S] and
logits_index [B] (each row's last real token) and returns that position's logits [B, 1, V]; the
serving set's prefills also take cache_row [B] and the engine's caches [R, Hkv, M, D] (R rows: the
largest batch built) and return them with each prompt written into its row (`writes_cache(session)`:
state in place, like the decode step). Older sets' prefills are served too: caches [B, Hkv, S, D]
returned for the engine to copy, and (older still) input_ids only -> logits [B, S, V]
(`last_logits_only(session)`). Anything else in the folder is refused by name.
All buckets load through one WeightStore: each weight slice is read and held once (on a GPU: one
copy there, fastpipe.weights.WeightStore.load), and share one
CUDA-graph memory pool (`graph_pool`, fastpipe.runtime.cuda.graph_replay.GraphPool): warmup() captures
the largest bucket first, and the smaller ones reuse its memory. Graphs in one pool take turns (the
engine runs one step at a time on one worker anyway): a bucket never replays while another does.
Replayed, a bucket returns its graph's own output buffers, not clones (RunOptions.alias_outputs): a
decode step's logits are not copied once more before the engine samples from them. So
a bucket's outputs are valid until the next run of any bucket: the engine reads (copies, samples)
each run's before the next; a caller of a bucket's session must do the same, or clone.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Mapping, Sequence

from fastpipe.errors import InputError

KV_PREFIX = "past_key_values_"
LOGITS_INDEX = "logits_index"
CACHE_ROW = "cache_row"


def _kind(p) -> str | None:
    ins, outs = p.metadata.tensors_inputs, p.metadata.tensors_outputs
    if "input_ids" not in ins or "logits" not in outs:
        return None
    kv_in = [n for n in ins if n.startswith(KV_PREFIX)]
    kv_out = [n for n in outs if n.startswith(KV_PREFIX)]
    if set(ins) == {"input_ids", "cache_position", *kv_in} and kv_in and set(kv_in) == set(kv_out):
        return "decode" if ins["input_ids"].shape[1] == 1 else None
    if set(ins) == {"input_ids", LOGITS_INDEX, CACHE_ROW, *kv_in} and kv_in and set(kv_in) == set(kv_out):
        return "prefill"
    if set(ins) in ({"input_ids"}, {"input_ids", LOGITS_INDEX}) and kv_out:
        return "prefill"
    return None


def writes_cache(session) -> bool:
    """Whether a prefill bucket writes its prompts into the engine's cache (cache_row [B] and the caches
    [R, Hkv, M, D] in, updated in place), rather than returning caches [B, Hkv, S, D] to copy."""
    return CACHE_ROW in session.pipeline.metadata.tensors_inputs


def last_logits_only(session) -> bool:
    """Whether a prefill bucket takes logits_index [B] and returns logits [B, 1, V] at those positions
    (fastpipe.serving.build), rather than logits [B, S, V] at every position (an older set)."""
    return LOGITS_INDEX in session.pipeline.metadata.tensors_inputs


def pipeline_paths(source: str | os.PathLike | Sequence) -> list[Path]:
    if isinstance(source, (str, os.PathLike)):
        folder = Path(source)
        paths = sorted(folder.glob("*/pipeline.json"))
        if not paths:
            raise InputError(f"serving set: expected */pipeline.json under \"{folder}\", found none")
        return paths
    return [Path(p) for p in source]


class ServingBuckets:
    def __init__(self, source, *, store=None, **load_kwargs):
        from fastpipe.runtime.cuda.graph_replay import GraphPool, ReplayOptions
        from fastpipe.session import load
        from fastpipe.weights import WeightStore

        paths = pipeline_paths(source)
        self.folder = paths[0].parent.parent
        self.store = store or WeightStore()
        ro = load_kwargs.get("run_options")
        self.graph_pool = (ro.of(ReplayOptions).graph_pool if ro is not None else load_kwargs.get("graph_pool")) or GraphPool()
        # state in place: the decode step and the prefills into the cache update the engine's caches (a bucket
        # without state, an older set's prefill, runs as usual)
        load_kwargs = self._with(load_kwargs, graph_pool=self.graph_pool, alias_outputs=True, state_in_place=True)
        self.decodes: dict[int, object] = {}
        self.prefills: dict[tuple[int, int], object] = {}
        for path in paths:
            from fastpipe.format import read_pipeline

            p = read_pipeline(path)
            kind = _kind(p)
            if kind is None:
                raise InputError(f"serving set: {path}: expected a prefill (input_ids, logits_index[, cache_row, caches] -> "
                                 "logits, caches) or a static-cache decode step (input_ids, cache_position, caches), "
                                 "found model inputs "
                                 + ", ".join(sorted(p.metadata.tensors_inputs)))
            ids = p.metadata.tensors_inputs["input_ids"].shape
            if kind == "decode":
                self.decodes[ids[0]] = load(p, store=self.store, **load_kwargs)
            else:
                self.prefills[(ids[0], ids[1])] = load(p, store=self.store, **load_kwargs)
        if not self.decodes or not self.prefills:
            raise InputError(f"serving set \"{self.folder}\": expected at least one prefill and one decode pipeline, "
                             f"found {len(self.prefills)} prefill and {len(self.decodes)} decode")
        lens = {self._cache_len(s) for s in self.sessions() if s.state}
        vocabs = {s.pipeline.metadata.tensors_outputs["logits"].shape[-1]
                  for s in (*self.decodes.values(), *self.prefills.values())}
        if len(lens) != 1 or len(vocabs) != 1:
            raise InputError(f"serving set \"{self.folder}\": expected one max_len and one vocabulary size, found "
                             f"max_len {sorted(lens)} and vocabularies {sorted(vocabs)}")
        self.max_len, self.vocab = lens.pop(), vocabs.pop()

    @staticmethod
    def _with(load_kwargs: dict, **fields) -> dict:
        """The load keywords with these option fields set (in `run_options` when the caller gave one)."""
        from fastpipe.runtime.processors.registry import with_fields

        kw = dict(load_kwargs)
        if kw.get("run_options") is not None:
            kw["run_options"] = with_fields(kw["run_options"], **fields)
        else:
            kw.update(fields)
        return kw

    @staticmethod
    def _cache_len(session) -> int:
        ins = session.pipeline.metadata.tensors_inputs
        return next(o.shape[2] for n, o in ins.items() if n.startswith(KV_PREFIX))

    @property
    def longest_prompt(self) -> int:
        return max(s for _, s in self.prefills)

    def prefill_for(self, rows: int, length: int):
        """(batch, seq, session) of the prefill bucket for `rows` prompts of up to `length` tokens: the
        shortest seq >= length, then the smallest batch >= rows (or the largest batch: several calls)."""
        seqs = sorted({s for _, s in self.prefills if s >= length})
        if not seqs:
            raise InputError(f"prompt: expected at most {self.longest_prompt} tokens (the largest prefill bucket), "
                             f"found {length}")
        batches = sorted(b for b, s in self.prefills if s == seqs[0])
        b = next((b for b in batches if b >= rows), batches[-1])
        return b, seqs[0], self.prefills[(b, seqs[0])]

    def warmup(self, state_inputs: Callable[[object], Mapping | None] | None = None) -> float:
        """Warm every bucket up now, off the request path: compile it (one warm-up run on seeded inputs)
        and capture its CUDA graph (on a GPU), largest first (by_size), so that the graphs captured later
        reuse the first's memory in the shared pool. `state_inputs(session)`: for a bucket with caches
        updated in place (the decode step, a prefill into the cache), the inputs to warm it up and capture
        it on (an engine's own caches, which become the graph's buffers), or None. Such a bucket without
        them is compiled, not captured: a graph captured on seeded caches would hold a KV cache of its own;
        it captures at its second run, on the caches it is given. Returns the seconds it took.
        Buckets loaded with compile="background" (the default) are left alone: each runs eagerly from its
        first call and compiles in the background once it has been called twice, the busiest bucket first
        (fastpipe.runtime.compiling.background_compile), and captures its CUDA graph once compiled, on the inputs of
        the call (the engine's caches)."""
        import time

        t = time.perf_counter()
        for s in self.by_size():
            if s.background:
                continue
            stateful = bool(s.state)
            inputs = state_inputs(s) if stateful and state_inputs is not None else None
            capture = not stateful or inputs is not None
            if s.compile_report is None and (s.compiled_graphs() or (capture and s.runner.graph_replays())):
                s.compile(inputs, capture=capture)
            elif capture and s.runner.graph_replays():
                s.capture(inputs)                    # warm already: captures unless it holds a graph on these
        return time.perf_counter() - t

    def by_size(self) -> list:
        """The sessions, largest first: tokens per call (input_ids' batch x length), then output elements."""
        import math

        def size(s):
            meta = s.pipeline.metadata
            return (math.prod(meta.tensors_inputs["input_ids"].shape),
                    sum(math.prod(o.shape) for o in meta.tensors_outputs.values()))

        return sorted(self.sessions(), key=size, reverse=True)

    def sessions(self):
        return [*self.prefills.values(), *self.decodes.values()]

    def compiled_graphs(self) -> int:
        """Distinct compiled graphs held by the buckets' sessions."""
        return len({id(cg) for s in self.sessions() for cg in s.compiled_graphs().values()})

    def close(self) -> None:
        """Close every session, then collect garbage once (a collection per session took seconds)."""
        import gc

        for s in self.sessions():
            s.close(collect=False)
        self.decodes.clear()
        self.prefills.clear()
        gc.collect()
