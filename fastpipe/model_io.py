"""Model-level calls: the original model's inputs/outputs <-> the pipeline's tensors (SPEC §1 Metadata).

    flatten_args({"input_ids": t, "past_key_values": [[k0, v0], [k1, v1]]})
        -> {"input_ids": t, "past_key_values_0_0": k0, "past_key_values_0_1": v0, ...}
    to_pipeline_inputs(pipeline, flat)      # each pipeline input = origin[placements] (on its slot)
    complete_inputs(pipeline, given)        # pipeline inputs a caller left out, sliced from what it gave
    assemble_outputs(pipeline, outputs)     # each original output from its slices (device=: where; the CPU)

Naming (SPEC): a whole argument keeps its name; an element of a nested list/tuple is
`{name}_{i}_{j}...`. Replicated slices (several slots holding the same region, e.g. the
logits every tensor-parallel rank gathers) must agree: `check_replicas=True` verifies it
(a debug mode: it costs a comparison per replica).
"""
from __future__ import annotations

from typing import Any, Collection, Mapping

import torch

from fastpipe import dtypes
from fastpipe.errors import InputError, RunError
from fastpipe.runtime.binding.inputs import dense


def flatten_args(args: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def walk(name: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{name}_{i}", x)
        elif hasattr(v, "layers") and hasattr(v.layers, "__iter__"):      # a transformers Cache
            for i, layer in enumerate(v.layers):
                walk(f"{name}_{i}", [layer.keys, layer.values])
        else:
            raise InputError(f"{name}: expected a tensor or a (nested) list/tuple of tensors, found {type(v).__name__}")

    for k, v in args.items():
        walk(k, v)
    return out


def _slice(t: torch.Tensor, placements) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in placements)]


def to_pipeline_inputs(p, flat: Mapping[str, torch.Tensor], *, partial: bool = False,
                       views: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Each pipeline input = its model input's slice (checked against the model's shape and dtype);
    `partial`: only the pipeline inputs of the model inputs given (a caller passing the others, e.g. a
    KV cache updated in place, as pipeline tensors of its own). Each slice is made dense (a copy where
    it is strided), except those named in `views`: inputs a graph writes in place stay views of the
    caller's tensor, so the run's update lands there (fastpipe.validate.written)."""
    originals = p.metadata.tensors_inputs
    if not p.metadata.slices_inputs:
        raise InputError("run_model: the pipeline has no metadata.tensor_slices.inputs; call run() with pipeline tensors")
    for name in flat:
        if name not in originals:
            raise InputError(f"run_model: {name}: expected one of the model's inputs ({', '.join(sorted(originals))}), found an unknown name")
    out = {}
    for tensor, s in p.metadata.slices_inputs.items():
        if s.origin not in flat:
            if partial:
                continue
            raise InputError(f"run_model: {s.origin}: expected a tensor for this model input, found none")
        o, x = originals[s.origin], flat[s.origin]
        if tuple(x.shape) != o.shape:
            raise InputError(f"run_model: {s.origin}.shape: expected {list(o.shape)}, found {list(x.shape)}")
        if x.dtype != dtypes.to_torch(o.dtype):
            raise InputError(f"run_model: {s.origin}.dtype: expected {o.dtype}, found {dtypes.TORCH_TO_NAME.get(x.dtype, x.dtype)}")
        part = _slice(x, s.placements)
        out[tensor] = part if tensor in views else dense(part)
    return out


def state_keys(p, names: Collection[str]) -> dict[str, str]:
    """Pipeline input -> the name it is saved under as state (`fastpipe run --state-out`): the model input
    it holds whole (so a prefill's state feeds a decode pipeline whose slot inputs are named otherwise),
    else its own name (a part of a model input, or a model input two of them hold)."""
    slices, originals = p.metadata.slices_inputs, p.metadata.tensors_inputs
    whole = {}
    for n in names:
        s = slices.get(n)
        if s is not None and s.origin in originals and _covers_whole(s, originals[s.origin]):
            whole[n] = s.origin
    taken = [o for o in whole.values()]
    return {n: whole[n] if n in whole and taken.count(whole[n]) == 1 else n for n in names}


def _covers_whole(s, origin) -> bool:
    return tuple(b - a for a, b in s.placements) == tuple(origin.shape) and all(a == 0 for a, _ in s.placements)


def input_sources(p, available: Collection[str], names: Collection[str] | None = None, *,
                  untied: bool = True) -> dict[str, str]:
    """For each pipeline input (of `names`, default all) missing from `available` (the names a caller
    gives, e.g. an --inputs file's keys): the available name its value is derived from through
    metadata.tensor_slices.inputs. A missing input tied to original input O comes from O's own name,
    else from a given pipeline input tied to O that covers O whole (a producer-style pipeline reads
    `x` on one slot and `x_slot1` on another: either one gives both). InputError naming the missing
    input when it cannot be derived (untied=False: except an input the metadata does not describe,
    left out of the result for the caller's own check to name)."""
    slices, originals = p.metadata.slices_inputs, p.metadata.tensors_inputs
    out: dict[str, str] = {}
    for name in (p.input_names if names is None else names):
        if name in available:
            continue
        s = slices.get(name)
        if s is None or s.origin not in originals:
            if not untied:
                continue
            raise InputError(f"inputs[\"{name}\"]: expected a tensor for this pipeline input, found none")
        source = _source_of(p, s.origin, available)
        if source is None:
            if name == s.origin and not any(k != name and getattr(slices.get(k), "origin", None) == name
                                            for k in p.input_names):
                raise InputError(f"inputs[\"{name}\"]: expected a tensor for this pipeline input, found none")
            how = (f"give \"{name}\", or another pipeline input that holds all of it" if name == s.origin else
                   f"give \"{name}\", or \"{s.origin}\" whole: under its own name or a pipeline input's that holds all of it")
            raise InputError(f"inputs[\"{name}\"]: expected a tensor for this pipeline input, found none, nor all of the "
                             f"model input \"{s.origin}\" it is a slice of ({how})")
        out[name] = source
    return out


def _source_of(p, origin: str, available: Collection[str]) -> str | None:
    o = p.metadata.tensors_inputs[origin]
    if origin in available:         # the model input's own name: itself, or a pipeline input of that name holding all of it
        s = p.metadata.slices_inputs.get(origin)
        if origin not in p.input_names or (s is not None and s.origin == origin and _covers_whole(s, o)):
            return origin
    for name in p.input_names:
        s = p.metadata.slices_inputs.get(name)
        if name in available and s is not None and s.origin == origin and _covers_whole(s, o):
            return name
    return None


def complete_inputs(p, given: Mapping[str, torch.Tensor], *, names: Collection[str] | None = None,
                    chunks: int = 1, views: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """The given pipeline inputs plus each one (of `names`, default all) they lack, derived through the
    metadata (input_sources): its model input sliced by its placements (one the metadata does not
    describe stays missing, for Session.run's check to name). A given name that is a model
    input's own and not a pipeline input's is dropped once used (or not). chunks=k: every tensor
    carries k times the batch along dim 0 (Session.run(chunks=k)); each chunk is sliced alike. `views`:
    as in to_pipeline_inputs.
    Nothing missing: `given` as it is."""
    missing = [n for n in (p.input_names if names is None else names) if n not in given]
    originals = p.metadata.tensors_inputs
    extra = [k for k in given if k not in p.input_names and k in originals]
    if not missing and not extra:
        return dict(given)
    sources = input_sources(p, given, missing, untied=False)
    out = {k: v for k, v in given.items() if k not in extra}
    by_origin: dict[str, list[str]] = {}
    for name in sources:
        by_origin.setdefault(p.metadata.slices_inputs[name].origin, []).append(name)
    for origin, wanted in by_origin.items():
        src_name = sources[wanted[0]]
        x, o = given[src_name], originals[origin]
        if not isinstance(x, torch.Tensor):
            raise InputError(f"inputs[\"{src_name}\"]: expected a torch.Tensor, found {type(x).__name__}")
        shape = (o.shape[0] * chunks, *o.shape[1:]) if chunks > 1 and o.shape else tuple(o.shape)
        for_what = f"(all of the model's input \"{origin}\", from which \"{wanted[0]}\" is sliced)"
        if tuple(x.shape) != shape:
            raise InputError(f"inputs[\"{src_name}\"].shape: expected {list(shape)} {for_what}, found {list(x.shape)}")
        if x.dtype != dtypes.to_torch(o.dtype):
            raise InputError(f"inputs[\"{src_name}\"].dtype: expected {o.dtype} {for_what}, "
                             f"found {dtypes.TORCH_TO_NAME.get(x.dtype, x.dtype)}")
        parts = x.chunk(chunks) if chunks > 1 else (x,)
        sliced = [to_pipeline_inputs(p, {origin: part}, partial=True, views=views) for part in parts]
        for name in wanted:
            out[name] = sliced[0][name] if chunks == 1 else torch.cat([s[name] for s in sliced])
    return out


def assemble_outputs(p, outputs: Mapping[str, torch.Tensor], *, check_replicas: bool = False,
                     only: Collection[str] | None = None, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Each original output from its slices, a new tensor on `device` (None: torch's default, the CPU).
    Which slice fills which part is worked out once per pipeline (the placements are static); a run
    only copies.
    check_replicas: slices that overlap an earlier one (replicas) must agree with it (slower: compares
    them, on the CPU). only: these original outputs (e.g. the logits of a decode step, not its caches).
    device: where the caller goes on with them (a generation engine: its GPU, so logits and caches
    never cross to the host and back)."""
    if check_replicas:
        res = _assemble_checked(p, outputs)
        return {k: v if device is None else v.to(device) for k, v in res.items() if only is None or k in only}
    res: dict[str, torch.Tensor] = {}
    for origin, (shape, dtype, copies, missing) in _assembly_plan(p).items():
        if only is not None and origin not in only:
            continue
        if missing:
            raise RunError(f"run_model: {origin}: expected the output's slices to cover it, found {missing} elements missing")
        out = torch.empty(shape, dtype=dtype, device=device)       # always a copy: the caller's to keep
        for tensor, placements in copies:
            (out if placements is None else _slice(out, placements)).copy_(outputs[tensor].detach())
        res[origin] = out
    return res


_plans: dict[int, tuple] = {}      # id(pipeline) -> (weakref to it, plan); dropped when it is collected


def _assembly_plan(p) -> dict:
    """origin -> (shape, dtype, [(slice tensor, placements or None for the whole)], elements missing),
    in the original outputs' order: the first slice to reach any element fills it, as in
    _assemble_checked."""
    import weakref

    key = id(p)
    entry = _plans.get(key)
    if entry is not None and entry[0]() is p:
        return entry[1]
    plan: dict = {}
    covered: dict[str, torch.Tensor] = {}
    for tensor, s in p.metadata.slices_outputs.items():
        o = p.metadata.tensors_outputs[s.origin]
        if s.origin not in plan:
            plan[s.origin] = (tuple(o.shape), dtypes.to_torch(o.dtype), [], 0)
            covered[s.origin] = torch.zeros(o.shape, dtype=torch.bool)
        seen = _slice(covered[s.origin], s.placements)
        if seen.any():
            continue
        seen.fill_(True)
        whole = all(a == 0 and b == n for (a, b), n in zip(s.placements, o.shape))
        plan[s.origin][2].append((tensor, None if whole else s.placements))
    plan = {k: (shape, dt, copies, int((~covered[k]).sum())) for k, (shape, dt, copies, _) in plan.items()}
    plan = dict(sorted(plan.items(), key=lambda kv: p.metadata.tensors_outputs[kv[0]].idx))
    _plans[key] = (weakref.ref(p, lambda _ref: _plans.pop(key, None)), plan)
    return plan


def _assemble_checked(p, outputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    res: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for tensor, s in p.metadata.slices_outputs.items():
        o = p.metadata.tensors_outputs[s.origin]
        part = outputs[tensor].detach().cpu()
        if s.origin not in res:
            res[s.origin] = torch.empty(o.shape, dtype=dtypes.to_torch(o.dtype))
            covered[s.origin] = torch.zeros(o.shape, dtype=torch.bool)
        region, seen = _slice(res[s.origin], s.placements), _slice(covered[s.origin], s.placements)
        if seen.any():
            if not torch.equal(region[seen], part[seen]):
                diff = (region[seen].double() - part[seen].double()).abs().max().item()
                raise RunError(f"run_model: {s.origin}: replicated slice \"{tensor}\" disagrees with another slot's copy (max abs diff {diff:.3g})")
            continue
        region.copy_(part)
        seen.fill_(True)
    for name, c in covered.items():
        if not bool(c.all()):
            raise RunError(f"run_model: {name}: expected the output's slices to cover it, found {int((~c).sum())} elements missing")
    return dict(sorted(res.items(), key=lambda kv: p.metadata.tensors_outputs[kv[0]].idx))


def nest(flat: Mapping[str, torch.Tensor], name: str) -> list:
    """Rebuild `{name}_{i}_{j}` tensors into a nested list (e.g. past_key_values[layer][0|1])."""
    items: dict[tuple[int, ...], torch.Tensor] = {}
    for k, v in flat.items():
        if k.startswith(name + "_"):
            try:
                items[tuple(int(x) for x in k[len(name) + 1:].split("_"))] = v
            except ValueError:
                continue

    def build(prefix):
        if prefix in items:
            return items[prefix]
        idxs = sorted({key[len(prefix)] for key in items if len(key) > len(prefix) and key[:len(prefix)] == prefix})
        return [build(prefix + (i,)) for i in idxs]

    return build(()) if items else []
