"""Continuous batching over a serving set: requests join and leave the decode rows between steps.

    engine = Engine("out/")                                    # a folder from build_serving_set
    req = engine.submit([5, 7, 9], max_new_tokens=64, sampling=SamplingParams(temperature=0.8, seed=1))
    for token in req: ...                                      # streamed as each step makes it
    engine.generate([[5, 7, 9], [4, 2]], max_new_tokens=16)     # -> [[...16 ids], [...]]
    engine.close()                                             # finish in-flight requests (cancel=True: stop them)

One worker thread owns the sessions. Between decode steps it admits waiting requests into free
rows of the decode bucket (`batch` rows, default the largest built): newcomers are prefilled
together in the smallest fitting prefill bucket (right-padded), which writes their keys and values
straight into their rows of the engine's cache (KVState; an older set's prefill returns caches that
are copied there), and their first token is sampled from the prefill's logits. Logits (and an older
prefill's caches) are assembled on the device of the decode step's logits (`engine.device`: on a GPU they never cross to
the host; only each step's sampled ids do), and the requests' generators live there. Then one decode step
runs every row at its own position (cache_position), writing the caches in place; each active
row samples its next token (fastpipe.serving.sampling, the request's own generator) and
streams it. A request finishes at EOS (unless ignore_eos), at max_new_tokens, or when cancelled;
its row is free for the next waiting request at the next step.

Faults (docs/serving.md, "Faults"): a request's outcome depends only on its own prompt and parameters.
submit() checks a request before it is queued (bad input raises InputError there, and fails alone). A
prefill or decode step that raises runs once more (exact: it rewrites the same cache positions); a
prefill failing again is split into one prompt per run, so only a prompt that fails alone fails; a row
whose sampling fails (fastpipe.serving.sampling.sample_rows) fails alone. Only a decode step failing
twice ends every row in it ("error"): that is the engine's fault, not a request's; the engine goes on.
submit() and the request methods (fastpipe.serving.request) are safe from any thread.
"""
from __future__ import annotations

import itertools
import threading
import time
import warnings
from typing import Sequence

import torch

from fastpipe.errors import FastpipeError, InputError, RunError, described
from fastpipe.model_io import assemble_outputs, to_pipeline_inputs
from fastpipe.serving.buckets import CACHE_ROW, LOGITS_INDEX, ServingBuckets, last_logits_only, writes_cache
from fastpipe.serving.kv_state import KVState, cache_rows
from fastpipe.serving.request import Request
from fastpipe.serving.sampling import SamplingParams, sample_rows

class _Row:
    __slots__ = ("req", "position", "token", "generator")

    def __init__(self, req: Request, position: int, token: int, generator):
        self.req, self.position, self.token, self.generator = req, position, token, generator


class Engine:
    def __init__(self, source, *, batch: int | None = None, eos_token_id="auto", buckets: ServingBuckets | None = None,
                 warmup: bool = True, **load_kwargs):
        """source: a serving-set folder or a list of pipeline.json paths; load_kwargs: fastpipe.load's
        (processor="auto" and compile="background" unless given: requests are served eagerly at once, each
        bucket compiled in the background as it is used, busiest first, and swapped in once ready).
        eos_token_id: an id, a list, None, or "auto" (generation_config.json / config.json in the folder).
        warmup: with compile="wait", compile every bucket and capture its CUDA graph (on a GPU; the decode
        step's on the engine's own caches) now (`warmup_seconds`), not on the first requests."""
        load_kwargs.setdefault("processor", "auto")
        self.buckets = buckets if buckets is not None else ServingBuckets(source, **load_kwargs)
        try:
            self._setup(batch, eos_token_id, warmup)
        except BaseException:
            if buckets is None:           # ours: release the sessions loaded for nothing
                self.buckets.close()
            raise
        self._cv = threading.Condition()
        self._closing = self._cancel_all = False
        self._worker = threading.Thread(target=self._loop, name="fastpipe-engine", daemon=True)
        self._worker.start()

    def _setup(self, batch, eos_token_id, warmup: bool) -> None:
        rows = sorted(self.buckets.decodes)
        if batch is not None and batch not in rows:
            raise InputError(f"batch: expected one of the decode buckets {rows}, found {batch}")
        self.batch = batch if batch is not None else rows[-1]
        self.decode = self.buckets.decodes[self.batch]
        # the prefills into the cache write rows of one cache of R rows (the largest batch built); the decode
        # step takes its first `batch`
        into = [s for s in self.buckets.prefills.values() if writes_cache(s)]
        rows_wanted = sorted({cache_rows(s) for s in into})
        if len(rows_wanted) > 1 or (rows_wanted and rows_wanted[0] < self.batch):
            raise InputError(f"serving set \"{self.buckets.folder}\": expected prefills writing into one cache of at "
                             f"least {self.batch} rows (the decode batch), found caches of {rows_wanted} rows")
        self.kv = KVState(self.decode, rows=rows_wanted[0] if rows_wanted else None)
        self._prefill_caches = {id(s): self.kv.inputs_of(s) for s in into}      # checked here, once
        self.max_len, self.vocab = self.buckets.max_len, self.buckets.vocab
        self.longest_prompt = self.buckets.longest_prompt
        self.eos = frozenset(_eos_ids(self.buckets.folder) if eos_token_id == "auto" else _as_ids(eos_token_id))
        p = self.decode.pipeline
        self._step_names = {n: s.origin for n, s in p.metadata.slices_inputs.items()
                            if s.origin in ("input_ids", "cache_position")}
        self._devices = {n: self.decode.slot_devices[p.metadata.slices_inputs[n].device] for n in self._step_names}
        # logits and prefill caches are assembled where the decode step's logits are (its GPU): sampling runs
        # there, and caches go to their rows device to device; only the sampled ids come to the host
        self.device = next((self.decode.slot_devices[s.device] for s in p.metadata.slices_outputs.values()
                            if s.origin == "logits"), torch.device("cpu"))
        self.rows: list[_Row | None] = [None] * self.batch
        self.steps = 0                         # decode steps run
        self._waiting: list[Request] = []
        self._ids = itertools.count()
        self._busy = threading.Lock()          # held while the sessions run (the worker, or warmup())
        self.retries = 0                       # steps and prefills run a second time after a failure
        self.warmup_seconds = 0.0
        if warmup:
            self.warmup()

    def warmup(self) -> float:
        """Warm every bucket up (ServingBuckets.warmup: compiled, and on a GPU its CUDA graph captured,
        largest first, in the buckets' shared graph pool), with the decode step captured on the engine's
        own caches, which become the graph's buffers: the first request replays, nothing is captured on
        the request path. Returns the seconds it took (also `warmup_seconds`). The constructor calls it
        unless warmup=False."""
        with self._busy:
            t = time.perf_counter()
            self.buckets.warmup(state_inputs=self._warmup_inputs)
            self.warmup_seconds = time.perf_counter() - t
        return self.warmup_seconds

    def _warmup_inputs(self, session):
        """The inputs a bucket with state warms up and is captured on: the engine's own caches (the decode
        step: every row free, token 0 at position 0; a prefill: pad tokens into row 0: nobody's yet)."""
        if session is self.decode:
            return self._step_inputs([])
        if id(session) in self._prefill_caches:
            return self._prefill_inputs(session, [])
        return None

    # ------------------------------------------------------------------ callers
    def submit(self, prompt, *, max_new_tokens: int, sampling: SamplingParams | None = None,
               ignore_eos: bool = False) -> Request:
        if self._closing:
            raise InputError("submit: expected an open engine, found it closed")
        ids, sampling = self.check(prompt, max_new_tokens=max_new_tokens, sampling=sampling)
        req = Request(next(self._ids), ids, max_new_tokens, sampling, frozenset() if ignore_eos else self.eos)
        with self._cv:
            if self._closing:
                raise InputError("submit: expected an open engine, found it closed")
            self._waiting.append(req)
            self._cv.notify()
        return req

    def check(self, prompt, *, max_new_tokens: int, sampling: SamplingParams | None = None):
        """What submit checks, without submitting: (the prompt's ids, the sampling parameters), or a
        one-line InputError."""
        ids = _prompt_ids(prompt, self.vocab)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens: expected an integer >= 1, found {max_new_tokens!r}")
        if len(ids) > self.longest_prompt:
            raise InputError(f"prompt: expected at most {self.longest_prompt} tokens (the largest prefill "
                             f"bucket), found {len(ids)}")
        if len(ids) + max_new_tokens > self.max_len:
            raise InputError(f"max_new_tokens: expected at most {self.max_len - len(ids)} (max_len {self.max_len} - "
                             f"the prompt's {len(ids)} tokens), found {max_new_tokens}")
        sampling = sampling if sampling is not None else SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise InputError(f"sampling: expected a SamplingParams, found {type(sampling).__name__}")
        sampling.check()
        return ids, sampling

    def generate(self, prompts: Sequence, *, max_new_tokens: int, sampling: SamplingParams | None = None,
                 ignore_eos: bool = False) -> list[list[int]]:
        """Every prompt's tokens (each submitted as its own request; they share the decode rows)."""
        reqs = [self.submit(p, max_new_tokens=max_new_tokens, sampling=sampling, ignore_eos=ignore_eos)
                for p in prompts]
        return [r.result() for r in reqs]

    def cancel(self, request) -> None:
        """Stop a request (a Request or its id) at the next step; an unknown one raises InputError."""
        rid = request.id if isinstance(request, Request) else request
        with self._cv:
            live = [r for r in self._waiting] + [row.req for row in self.rows if row is not None]
            req = next((r for r in live if r.id == rid), None)
            if req is None:
                raise InputError(f"cancel: expected a waiting or running request, found id {rid!r}")
            req.cancel()
            self._cv.notify()

    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests; finish the in-flight ones (cancel=True: end them at the next step, reason
        "cancelled"); the worker then stops and releases the sessions. timeout: wait at most that many
        seconds; requests still in flight then end "cancelled" at once (keeping the tokens they have), and
        the worker releases the sessions when the step it is running returns, never under it."""
        with self._cv:
            self._closing = True
            self._cancel_all = self._cancel_all or cancel
            self._cv.notify()
        self._worker.join(timeout)
        if self._worker.is_alive():
            with self._cv:
                self._cancel_all = True
                for r in self._in_flight():
                    r._finish("cancelled")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(cancel=exc[0] is not None)

    @property
    def active(self) -> int:
        """Rows decoding now."""
        return sum(r is not None for r in self.rows)

    @property
    def waiting(self) -> int:
        """Requests submitted and waiting for a free row (the queue's depth)."""
        return len(self._waiting)

    def _in_flight(self) -> list[Request]:
        return self._waiting + [row.req for row in self.rows if row is not None]

    # ------------------------------------------------------------------ the worker
    def _loop(self) -> None:
        """The worker: steps while there is work, until closed; it alone runs and releases the sessions."""
        try:
            while True:
                with self._cv:
                    while not self._waiting and not self.active and not self._closing:
                        self._cv.wait()
                    if self._closing and (self._cancel_all or (not self._waiting and not self.active)):
                        self._end_all("cancelled")
                        return
                    newcomers = self._take_newcomers()
                with self._busy:
                    self._advance(newcomers)
        except BaseException as e:    # a fault of the engine itself: nothing may wait forever on it
            with self._cv:
                self._closing = True
                self._end_all("error", RunError(f"generation engine: {described(e)}"))
            raise
        finally:
            self.buckets.close()

    def _end_all(self, reason: str, error: BaseException | None = None) -> None:
        for r in self._in_flight():
            r._finish(reason, error)
        self._waiting.clear()
        self.rows = [None] * self.batch

    def _advance(self, newcomers: list[Request]) -> None:
        """Admit the newcomers, then one decode step; failures end only the requests they belong to."""
        self._admit(newcomers)
        if self.active:
            self._step()

    def _take_newcomers(self) -> list[Request]:
        for k, row in enumerate(self.rows):                      # cancelled rows free up first
            if row is not None and row.req._cancel:
                self.rows[k] = None
                row.req._finish("cancelled")
        for r in [r for r in self._waiting if r._cancel]:
            self._waiting.remove(r)
            r._finish("cancelled")
        free = self.rows.count(None)
        out, self._waiting = self._waiting[:free], self._waiting[free:]
        return out

    def _retrying(self, what: str, run):
        """run(), and once more if it raises (a transient fault: out of memory, a flaky device). Running a
        step again is exact: it rewrites the same cache positions from the same inputs. Warns (the reason)."""
        try:
            return run()
        except Exception as e:  # noqa: BLE001
            self.retries += 1
            warnings.warn(f"fastpipe: {what} failed ({described(e)}); running it once more", RuntimeWarning,
                          stacklevel=2)
            return run()

    def _admit(self, reqs: list[Request]) -> None:
        """Prefill the newcomers (grouped into prefill buckets) into free rows, and emit each one's first
        token."""
        while reqs:
            b, s, sess = self.buckets.prefill_for(len(reqs), max(len(r.prompt) for r in reqs))
            group = [r for r in reqs if len(r.prompt) <= s][:b]
            reqs = [r for r in reqs if r not in group]
            self._prefill_group(sess, b, s, group)

    def _prefill_group(self, sess, b: int, s: int, group: list[Request]) -> None:
        """Prefill `group` into free rows and start each one with its first token. A prefill that fails
        twice (see _retrying) fails a lone request; a group of several is prefilled again one by one, in
        the one-row bucket that fits, so that only the requests that fail alone fail."""
        rows = [k for k, row in enumerate(self.rows) if row is None][:len(group)]
        try:
            last = self._retrying(f"prefill {sess.pipeline.name}", lambda: self._prefill(sess, b, s, rows, group))
        except Exception as e:  # noqa: BLE001
            if len(group) == 1:
                group[0]._finish("error", _as_error(e))
                return
            for r in group:
                b1, s1, one = self.buckets.prefill_for(1, len(r.prompt))
                self._prefill_group(one, b1, s1, [r])
            return
        gens = [r.sampling.generator(last.device) for r in group]
        first, errors = sample_rows(last, [r.sampling for r in group], gens)
        for k, (row, r) in enumerate(zip(rows, group)):
            if k in errors:
                r._finish("error", errors[k])
            else:
                self.rows[row] = _Row(r, len(r.prompt), first[k], gens[k])
                self._emitted(row, first[k])

    def _prefill(self, sess, b: int, s: int, rows: list[int], group: list[Request]) -> torch.Tensor:
        """Run the prefill of `group` into `rows`: each prompt's logits at its last token [n, V]."""
        if id(sess) in self._prefill_caches:             # writes the prompts into their rows (in place)
            outs = sess.run(self._prefill_inputs(sess, list(zip(rows, group))))
            last = assemble_outputs(sess.pipeline, outs, only=("logits",), device=self.device)["logits"]
            return last[:len(group), 0]                                                      # [n, V]
        last, out = self._prefill_returning_caches(sess, b, s, group)   # an older set's: caches copied in
        for k, row in enumerate(rows):
            self.kv.admit(row, out, k)
        return last

    def _prefill_inputs(self, sess, placed) -> dict:
        """A prefill into the cache's pipeline inputs for `placed` [(row, request)]: prompts right-padded to
        the bucket's length, each one's last real token, its row; pad rows (and a warm-up's, with nothing
        placed) point at the first prompt's row (row 0 without one) with token 0: the prefill writes the
        first batch row naming a cache row, so they write nothing of their own. The caches as they are."""
        meta = sess.pipeline.metadata
        b, s = meta.tensors_inputs["input_ids"].shape
        ids = _right_padded([r for _, r in placed], b, s)                 # [b, s]
        index = torch.zeros((b,), dtype=torch.int64)                     # [b]
        rows = torch.full((b,), placed[0][0] if placed else 0, dtype=torch.int64)    # [b]
        for i, (row, r) in enumerate(placed):
            index[i], rows[i] = len(r.prompt) - 1, row
        model = {"input_ids": ids, LOGITS_INDEX: index, CACHE_ROW: rows}
        inputs = to_pipeline_inputs(sess.pipeline, model, partial=True)            # the caches: the engine's
        inputs = {n: t.to(sess.slot_devices[meta.slices_inputs[n].device]) for n, t in inputs.items()}
        return {**inputs, **self._prefill_caches[id(sess)]}

    def _prefill_returning_caches(self, sess, b: int, s: int, group):
        """An older set's prefill: (each prompt's logits at its last token [n, V], caches origin -> [b, Hkv, s, D])."""
        ins = {"input_ids": _right_padded(group, b, s)}
        rows_only = last_logits_only(sess)          # logits [b, 1, V] at logits_index, else [b, s, V]
        if rows_only:                               # each row's last real token (pad rows: 0)
            ins[LOGITS_INDEX] = torch.tensor([len(r.prompt) - 1 for r in group] + [0] * (b - len(group)))
        out = sess.run_model(**ins, output_device=self.device)    # logits, caches [b, Hkv, s, D]
        last = torch.stack([out["logits"][i, 0 if rows_only else len(r.prompt) - 1]
                            for i, r in enumerate(group)])                          # [n, V]
        return last, out

    def _step_inputs(self, live) -> dict:
        """The decode step's pipeline inputs: the live rows' tokens and positions (free rows: token 0 at
        position 0), and the caches as they are."""
        ids = torch.zeros((self.batch, 1), dtype=torch.int64)          # [B, 1]
        pos = torch.zeros((self.batch,), dtype=torch.int64)            # [B]
        for k, row in live:
            ids[k, 0], pos[k] = row.token, row.position
        model = {"input_ids": ids, "cache_position": pos}
        inputs = {n: model[o].to(self._devices[n]) for n, o in self._step_names.items()}
        return {**inputs, **self.kv.tensors}

    def _step(self) -> None:
        """One decode step for every row (free rows compute on token 0 at position 0, unread). A step that
        fails twice (see _retrying) fails every row in it: it is the engine's fault, not one request's."""
        live = [(k, row) for k, row in enumerate(self.rows) if row is not None]
        try:
            logits = self._retrying("decode step", lambda: self._decode(live))                    # [B, V]
        except Exception as e:  # noqa: BLE001 - the engine goes on with the next requests
            for k, row in live:
                self.rows[k] = None
                row.req._finish("error", _as_error(e))
            return
        self.steps += 1
        rows = [k for k, _ in live]
        toks, errors = sample_rows(logits[rows], [row.req.sampling for _, row in live], [row.generator for _, row in live])
        for i, (k, row) in enumerate(live):
            if i in errors:                                  # this row's sampling failed: it alone ends
                self.rows[k] = None
                row.req._finish("error", errors[i])
                continue
            row.position += 1
            row.token = toks[i]
            self._emitted(k, toks[i])

    def _decode(self, live) -> torch.Tensor:
        outs = self.decode.run(self._step_inputs(live))
        return assemble_outputs(self.decode.pipeline, outs, only=("logits",), device=self.device)["logits"][:, 0]  # [B, V]

    def _emitted(self, k: int, tok: int) -> None:
        row = self.rows[k]
        req = row.req
        if not req._emit(tok):                  # already ended (a close that timed out): the row frees
            self.rows[k] = None
            return
        reason = ("eos" if tok in req.eos else "length" if len(req.tokens) >= req.max_new_tokens
                  else "cancelled" if req._cancel else None)
        if reason is not None:
            self.rows[k] = None
            req._finish(reason)


def _right_padded(reqs: list[Request], b: int, s: int) -> torch.Tensor:
    """The requests' prompts as rows of a [b, s] int64 tensor, right-padded (and pad rows) with token 0."""
    ids = torch.zeros((b, s), dtype=torch.int64)
    for i, r in enumerate(reqs):
        ids[i, :len(r.prompt)] = torch.tensor(r.prompt)
    return ids


def _prompt_ids(prompt, vocab: int) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype not in (torch.int64, torch.int32):
            raise InputError(f"prompt: expected a 1-d tensor of int64 token ids, found {prompt.dim()}-d "
                             f"{str(prompt.dtype).replace('torch.', '')}")
        prompt = prompt.tolist()
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise InputError(f"prompt: expected a list of token ids, found {type(prompt).__name__}")
    bad = next((x for x in prompt if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < vocab), None)
    if bad is not None:
        raise InputError(f"prompt: expected token ids in [0, {vocab}), found {bad!r}")
    if not prompt:
        raise InputError("prompt: expected at least one token, found none")
    return list(prompt)


def _as_ids(v) -> list[int]:
    if v is None:
        return []
    ids = [v] if isinstance(v, int) and not isinstance(v, bool) else list(v)
    if any(isinstance(x, bool) or not isinstance(x, int) for x in ids):
        raise InputError(f"eos_token_id: expected an id, a list of ids, None or \"auto\", found {v!r}")
    return ids


def _eos_ids(folder) -> list[int]:
    """EOS ids from generation_config.json, else config.json, in the serving set's folder (none: [])."""
    import json

    for name in ("generation_config.json", "config.json"):
        f = folder / name
        if f.is_file():
            v = json.loads(f.read_text()).get("eos_token_id")
            if v is not None:
                return _as_ids(v)
    return []


def _as_error(e: Exception) -> BaseException:
    return e if isinstance(e, FastpipeError) else RunError(f"generation step: {described(e)}")
