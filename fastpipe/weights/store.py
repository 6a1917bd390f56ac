"""The weight store: shared, checked, read-once access to parameter files.

* One store per process (``default_store()``); ``WeightStore()`` makes a private
  one (tests).
* Open files are cached by identity ``(st_dev, st_ino, st_size, st_mtime_ns)``,
  not by path: pipelines that share files (buckets of one model, each folder
  holding its own hard link to the checkpoint) share one ``safe_open`` handle /
  one loaded torch.save dict and one copy of every slice. A file that changed
  on disk gets a new identity; the stale entry for the same inode is dropped.
* Identical slices ``(file identity, format, name, placements, dtype)`` are the
  SAME tensor object while anyone holds it (a WeakValueDictionary), so the
  tensors a store returns are shared: treat them as read-only.
* Contiguity policy: a slice that is contiguous in the file (the whole tensor,
  or placements that only narrow the leading dims) is returned as a zero-copy
  view of the file's private mmap (pages are read when first touched, e.g. by
  the copy to a device); any other slice is made contiguous, which copies
  exactly the slice's bytes. Kernels and host-to-device copies then always see
  dense tensors, and no slice makes more than its own bytes resident.
  Legacy (non-zip) torch.save files and torch.export archives cannot be mapped:
  they are read whole when opened and stay in memory until ``clear()``.
* Read-only: views of one file share its mapping, so an in-place write to a
  returned tensor is seen by every overlapping slice (never by the file: the
  mapping is private). Rewriting a parameter file in place while a process
  uses it changes or invalidates (SIGBUS) its mapped pages: write a new file
  and rename it (safetensors' save_file does).
* Whole tensors from slices: ``whole(ws, dim)`` (and ``whole_of`` over every live store) returns
  the stored tensor that CPU slices ``ws`` tile in order along ``dim``, read as any slice is (the
  whole tensor is contiguous in its file: a zero-copy view); the region processor's shard merge
  takes it instead of concatenating a copy.
* Thread-safe: one lock guards the caches and file opening; slice data is
  read outside it (two threads racing for one slice still get one object).
"""
from __future__ import annotations

import math
import threading
import warnings
import weakref
from pathlib import Path

import torch

from fastpipe.dtypes import to_torch
from fastpipe.errors import ParamError

from .checks import check_ref, check_stored
from .formats import OPENERS
from .paths import stat_param_file
from .ref import ParamRef

FileKey = tuple  # (format, st_dev, st_ino, st_size, st_mtime_ns)


def _untrusted_export(ref: ParamRef, where: str) -> ParamError:
    return ParamError(
        f"{where}.format: expected a trusted torch.export archive, found untrusted '{ref.path.name}' "
        "(its loader can unpickle arbitrary objects; pass --trust-export-archives on the CLI "
        "or trust_export=True in Python to load it)")


_STORES: "weakref.WeakSet[WeightStore]" = weakref.WeakSet()


def whole_of(ws, dim: int) -> torch.Tensor | None:
    """The one stored tensor that the CPU slices `ws` tile, in order, along `dim` (each spanning every
    other dimension whole), as the store hands it out (a zero-copy view of its file where the file holds
    it contiguously); None where they are not such slices of any live store. cat(ws, dim) equals it."""
    for store in list(_STORES):
        t = store.whole(ws, dim)
        if t is not None:
            return t
    return None


class WeightStore:
    def __init__(self) -> None:
        _STORES.add(self)
        self._origin: dict[int, tuple] = {}   # id(CPU slice) -> (weakref to it, (slice key, opened, ref))
        self._lock = threading.RLock()
        self._files: dict[FileKey, object] = {}
        self._path_keys: dict[str, FileKey] = {}   # path -> the identity it had when last opened
        self._slices: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # (slice key, device) -> the slice's copy on that device, shared by every session placing it there
        self._on_device: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._counts = {"file_opens": 0, "slice_hits": 0, "slice_misses": 0, "bytes_read": 0,
                        "device_copies": 0, "device_hits": 0,
                        "staged_bytes": 0}

    # -- opening -----------------------------------------------------------------
    def _open(self, ref: ParamRef, *, where: str, trust_export: bool):
        check_ref(ref, where=where)
        if ref.format == "torch.export" and not trust_export:
            raise _untrusted_export(ref, where)
        path = Path(ref.path)
        st = stat_param_file(path, where=where)
        key = (ref.format, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            opened = self._files.get(key)
            if opened is None:
                opened = OPENERS[ref.format](path, st.st_size, where=where)
                stale = [k for k in self._files if k[:3] == key[:3]]          # same inode, rewritten in place
                if self._path_keys.get(str(path), key) != key:               # the path now names another file
                    stale.append(self._path_keys[str(path)])
                for old in stale:
                    self._files.pop(old, None)
                self._files[key] = opened
                self._counts["file_opens"] += 1
            self._path_keys[str(path)] = key
        return key, opened

    def _checked(self, ref: ParamRef, shape, dtype, *, where: str, trust_export: bool):
        if isinstance(dtype, str):
            dtype = to_torch(dtype)
        key, opened = self._open(ref, where=where, trust_export=trust_export)
        stored = opened.stored(ref.name, where=where)
        if stored is None:
            names = opened.names()
            listed = ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
            raise ParamError(f"{where}.name: expected the name of a tensor in {opened.kind} {opened.label} "
                             f"(it holds {len(names)}: {listed}), found {ref.name!r}")
        placements = check_stored(ref, tuple(shape), dtype, where=where, file_label=opened.label,
                                  stored_dtype=stored.dtype, stored_dtype_label=stored.dtype_label,
                                  stored_shape=stored.shape)
        return key, opened, placements, dtype

    # -- public ------------------------------------------------------------------
    def check(self, ref: ParamRef, shape: tuple[int, ...], dtype: torch.dtype, *, where: str,
              trust_export: bool = False) -> None:
        """Check ``ref`` against the declared shape/dtype from metadata only (no tensor data is read)."""
        self._checked(ref, shape, dtype, where=where, trust_export=trust_export)

    def load(self, ref: ParamRef, shape: tuple[int, ...], dtype: torch.dtype, *, where: str,
             trust_export: bool = False, device: torch.device | None = None) -> torch.Tensor:
        """The checked slice as a dense CPU tensor, shared with every other holder of the same slice;
        with a `device` other than the CPU, its copy there (``.to(device)``), shared the same way (sessions
        over one store hold one copy of a weight per device, and their graphs see the same constant
        objects). One request of load_many."""
        return self.load_many([(ref, shape, dtype, where, trust_export)], "cpu" if device is None else device,
                              upload="pageable")[0]

    def load_many(self, requests, device: torch.device, *, upload: str = "pinned") -> list[torch.Tensor]:
        """For each request ``(ref, shape, dtype, where, trust_export)`` its checked slice: on the CPU a dense
        tensor shared with every other holder of the same slice, on another device its copy there, shared the
        same way. Every request is checked before any byte is read. The slices not yet on `device` go there
        together: with ``upload="pinned"`` on a CUDA device through
        pinned staging buffers that overlap reading the file with the copies (fastpipe.weights.upload; a
        RuntimeWarning says so where pinned memory cannot be had, and they go as "pageable"), with
        "pageable" by ``.to(device)`` one after another. Every copy is done on return."""
        dev = torch.device(device)
        checked = [self._checked(ref, shape, dtype, where=where, trust_export=trust)
                   for ref, shape, dtype, where, trust in requests]
        skeys = [(key, ref.name, placements, dtype) for (ref, *_), (key, _, placements, dtype) in zip(requests, checked)]
        if dev.type == "cpu":
            outs = [self._shared(self._slices, skey, self._reader(opened, ref, placements, dtype, where),
                                 "slice_hits", "slice_misses")
                    for skey, (ref, _, _, where, _), (_, opened, placements, dtype) in zip(skeys, requests, checked)]
            for t, skey, (ref, *_rest), (_, opened, _, _) in zip(outs, skeys, requests, checked):
                self._remember(t, (skey, opened, ref))
            return outs
        out: list = [None] * len(requests)
        todo: dict[tuple, list[int]] = {}           # (slice key, device) -> the requests it answers
        with self._lock:
            for i, skey in enumerate(skeys):
                t = self._on_device.get((skey, str(device)))
                if t is not None:
                    self._counts["device_hits"] += 1
                    out[i] = t
                else:
                    todo.setdefault((skey, str(device)), []).append(i)
        firsts = [ids[0] for ids in todo.values()]

        def host_slices():                          # one at a time: the upload drops each once it is staged
            for i in firsts:
                (ref, _, _, where, _), (_, opened, placements, dtype) = requests[i], checked[i]
                yield self._shared(self._slices, skeys[i], self._reader(opened, ref, placements, dtype, where),
                                   "slice_hits", "slice_misses")

        copies = self._to_device(host_slices(), dev, upload, sum(self._nbytes(checked[i]) for i in firsts))
        for (dkey, ids), t in zip(todo.items(), copies):
            t = self._shared(self._on_device, dkey, lambda t=t: t, "device_hits", "device_copies")
            with self._lock:
                self._counts["device_hits"] += len(ids) - 1        # the same slice asked for again
            for i in ids:
                out[i] = t
        return out

    @staticmethod
    def _nbytes(checked) -> int:
        _, _, placements, dtype = checked
        return math.prod(e - s for s, e in placements) * dtype.itemsize

    def _to_device(self, slices, device: torch.device, upload: str, total: int) -> list[torch.Tensor]:
        """The copies on `device` of the host tensors `slices` yields (an iterator, read once)."""
        from . import upload as staging

        queue = staging.queue_for(device) if upload == "pinned" and total > 0 else None
        if queue is not None:
            try:
                outs, staged = staging.upload(slices, device, queue=queue, total_bytes=total)
            except staging.PinnedStagingUnavailable as e:     # raised before `slices` was read
                warnings.warn(f"fastpipe: weights copied to {device} from pageable memory, one tensor after "
                              f"another: pinned staging buffers unavailable ({e})", RuntimeWarning, stacklevel=4)
            else:
                with self._lock:
                    self._counts["staged_bytes"] += staged
                return outs
        return [t.to(device) for t in slices]

    def _reader(self, opened, ref: ParamRef, placements, dtype, where: str):
        return lambda: self._read(opened, ref, placements, dtype, where)

    def _shared(self, index, key, make, hit: str, miss: str) -> torch.Tensor:
        """index[key], made by make() outside the lock if absent; one object even when two threads race."""
        with self._lock:
            t = index.get(key)
            if t is not None:
                self._counts[hit] += 1
                return t
        t = make()
        with self._lock:
            existing = index.get(key)
            if existing is not None:  # another thread made it meanwhile: keep one object
                self._counts[hit] += 1
                return existing
            index[key] = t
            self._counts[miss] += 1
        return t

    def _read(self, opened, ref: ParamRef, placements, dtype, where: str) -> torch.Tensor:
        t = opened.read(ref.name, placements, where=where).detach().contiguous()
        if t.dtype != dtype or tuple(t.shape) != tuple(e - s for s, e in placements):
            raise ParamError(f"{where}.path: expected the slice read from {opened.label} to have the checked "
                             f"dtype and shape, found {t.dtype} {list(t.shape)} (file changed while reading?)")
        with self._lock:
            self._counts["bytes_read"] += t.numel() * t.element_size()
        return t

    def whole(self, ws, dim: int) -> torch.Tensor | None:
        """whole_of for this store's slices: the stored tensor they tile along dim, or None."""
        with self._lock:
            hits = [self._origin.get(id(w)) for w in ws]
        origins = [h[1] if h is not None and h[0]() is w else None for h, w in zip(hits, ws)]
        if len(ws) < 2 or any(o is None for o in origins):
            return None
        (key, name, _, dtype), opened, ref = origins[0]
        stored = opened.stored(name, where="whole")
        if stored is None or any(o[0][0] != key or o[0][1] != name or o[0][3] != dtype for o in origins):
            return None
        full = tuple((0, n) for n in stored.shape)
        at = 0
        for (_, _, placements, _), _, _ in origins:
            for d, (pl, fl) in enumerate(zip(placements, full)):
                if d == dim:
                    if pl[0] != at:
                        return None
                    at = pl[1]
                elif pl != fl:
                    return None
        if at != full[dim][1]:
            return None
        skey = (key, name, full, dtype)
        t = self._shared(self._slices, skey, self._reader(opened, ref, full, dtype, "whole"), "slice_hits",
                         "slice_misses")
        self._remember(t, (skey, opened, ref))
        return t

    def _remember(self, t: torch.Tensor, origin: tuple) -> None:
        """Where CPU slice t came from (whole() reads it), for as long as t lives."""
        d, k = self._origin, id(t)

        def gone(r, d=d, k=k):
            if d.get(k, (None,))[0] is r:
                d.pop(k, None)
        with self._lock:
            if k not in d or d[k][0]() is not t:
                d[k] = (weakref.ref(t, gone), origin)

    def substitute(self, pairs) -> None:
        """For each (old, new) in `pairs`: hand out `new` (equal values: a view of a merged weight)
        wherever `old` would be handed out. One pass over the slice index."""
        new_for = {id(old): (old, new) for old, new in pairs}
        if not new_for:
            return
        with self._lock:
            for index in (self._slices, self._on_device):
                for key, t in list(index.items()):
                    hit = new_for.get(id(t))
                    if hit is not None and hit[0] is t:
                        index[key] = hit[1]

    def stats(self) -> dict:
        """``open_files`` (cached handles), ``live_slices`` (slices someone still holds),
        ``live_device_copies``, ``file_opens``, ``slice_hits``, ``slice_misses``, ``bytes_read``
        (sum of the sizes of the slices read: a slice costs its own bytes, never the file's),
        ``device_copies`` (slices copied to a device), ``device_hits`` (copies handed out again) and
        ``staged_bytes`` (bytes copied to a GPU through pinned staging buffers: load_many)."""
        with self._lock:
            return {"open_files": len(self._files), "live_slices": len(self._slices),
                    "live_device_copies": len(self._on_device), **self._counts}

    def clear(self) -> None:
        """Drop cached handles and the slice index (tensors already returned stay valid)."""
        with self._lock:
            self._files.clear()
            self._slices.clear()
            self._on_device.clear()


_default: WeightStore | None = None
_default_lock = threading.Lock()


def default_store() -> WeightStore:
    """The process-wide store that every pipeline shares."""
    global _default
    with _default_lock:
        if _default is None:
            _default = WeightStore()
        return _default
