"""Build a tensor- and pipeline-parallel pipeline from a local Hugging Face checkpoint folder.

    built = build_hf("path/to/model", tp=2, pp=2, batch=1, seq_len=128)       # no KV cache
    built = build_hf(..., past_len=0)     # prefill: also outputs the KV cache
    built = build_hf(..., past_len=P)     # decode step: takes and returns the KV cache
    built = build_hf(..., past_len=0, last_logits=True)   # a serving prefill: also takes logits_index [B],
                                          # returns logits [B, 1, V] at each row's position (not [B, S, V])
    built = build_hf(..., seq_len=1, max_len=M)   # decode step on a static cache of M positions:
                                          # takes cache_position [B] and the caches, returns them updated
    built = build_hf(..., seq_len=S, max_len=M, cache_rows=R, last_logits=True)   # a serving prefill
                                          # into rows of a static cache [R, Hkv, M, D]: takes logits_index [B],
                                          # cache_row [B] and the caches, returns the logits and the caches
                                          # updated (fastpipe.builder.hf.trace's docstring)
    built.save("out/")                    # out/pipeline.json; the checkpoint files hard-linked in place

The model is instantiated on the meta device (no weight is read: only the
safetensors headers). Each rank gets a copy whose planned modules are replaced
by the tensor-parallel layers of fastpipe.builder.tp_layers (plan:
fastpipe.builder.hf.plans); decoder layers are cut into `pp` even stages. Every
constant is a slice of the original checkpoint tensor.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
import torch.fx as fx

from fastpipe import dtypes
from fastpipe.builder import markers
from fastpipe.builder.api import Built, trace_rank
from fastpipe.builder.emit import Emitter, IOSpec, RankGraph, StoredParam
from fastpipe.builder.hf import plans
from fastpipe.builder.hf.checkpoint import checkpoint_index
from fastpipe.builder.hf.families import FamilySpec, get_family, registered_families
from fastpipe.builder.hf.load import load_skeleton
from fastpipe.builder.hf.trace import flat_signature, traced_forward
from fastpipe.builder.rank_forms import RankForms
from fastpipe.builder.sharding import apply_sharding
from fastpipe.builder.sources import Source
from fastpipe.builder.tp_layers import ColumnLinear, RowLinear, VocabEmbedding
from fastpipe.errors import BuildError
from fastpipe.format import parse_pipeline
from fastpipe.validate import validate_structure

def even_split_points(family: str | FamilySpec, n_layers: int, pp: int) -> list[str]:
    """The pp - 1 blocks (items of the family's ``layers`` module) where stages 1.. begin."""
    if pp > n_layers:
        raise BuildError(f"pp: expected at most the number of layers ({n_layers}), found {pp}")
    layers = get_family(family).layers
    return [f"{layers}.{(s * n_layers) // pp}" for s in range(1, pp)]


def _module_rules(plan, model) -> dict[str, str]:
    """module name -> plan kind of its weight."""
    out = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        mod, _, leaf = name.rpartition(".")
        if leaf == "weight":
            out[mod] = plan.rule_for(name)
    return out


def rank_local(model, family: str | FamilySpec, plan, rank: int, tp: int, *, sequence_parallel: bool,
               split_points: dict[str, int]):
    """A meta copy of `model` with this rank's layers; returns (local, sources by local param name).

    With sequence parallelism the hidden states become sequence shards where the family's
    ``sp_scatter`` says, and the modules of its ``sp_gather`` gather them first.
    """
    spec = get_family(family)
    local = copy.deepcopy(model)
    rules = _module_rules(plan, model)
    sp = sequence_parallel and tp > 1
    reduce_to = "shard:1" if sp else "replicate"
    in_layout = None    # with sequence parallelism whole modules gather their input (sp_gather)
    for mod_name, rule in rules.items():
        mod = model.get_submodule(mod_name)
        shape = tuple(mod.weight.shape)
        has_bias = getattr(mod, "bias", None) is not None
        transposed = type(mod).__name__ == "Conv1D"
        dt = mod.weight.dtype            # the shards keep the checkpoint's dtype (bf16 stays bf16)
        k = rule.kind
        new = None
        if tp == 1 or k == "replicate":
            continue
        if k in ("column", "column_packed"):
            new = ColumnLinear(mod_name, shape, has_bias, rank, tp, transposed=transposed,
                               parts=list(rule.parts) if rule.parts else None, input_layout=in_layout, dtype=dt)
        elif k == "kv_column":
            heads = plans.kv_heads_for_rank(rank, tp, plan.n_q_heads, plan.n_kv_heads)
            new = ColumnLinear(mod_name, shape, has_bias, rank, tp, transposed=transposed,
                               part_ranges=[(heads.start * plan.head_dim, heads.stop * plan.head_dim)],
                               input_layout=in_layout, dtype=dt)
        elif k == "row":
            new = RowLinear(mod_name, shape, has_bias, rank, tp, transposed=transposed, reduce_to=reduce_to, dtype=dt)
        elif k == "vocab_embedding":
            new = VocabEmbedding(mod_name, shape, rank, tp, reduce_to="replicate", dtype=dt)
        elif k == "lm_head":
            if plans.lm_head_sharded(plan.vocab_size, tp):
                new = ColumnLinear(mod_name, shape, has_bias, rank, tp, gather=True, input_layout=in_layout,
                                   dtype=dt)
        if new is not None:
            parent, _, attr = mod_name.rpartition(".")
            setattr(local.get_submodule(parent) if parent else local, attr, new)
    if tp > 1:
        for pattern, attrs in plans.attribute_updates(plan, tp):
            for mod_name, mod in local.named_modules():
                if re.fullmatch(pattern, mod_name) and not isinstance(mod, (ColumnLinear, RowLinear, VocabEmbedding)):
                    for attr, value in attrs.items():
                        setattr(mod, attr, value)
    if sp:
        if spec.sp_scatter is None:
            able = ", ".join(f.name for f in registered_families() if f.sp_scatter is not None)
            raise BuildError(f"sequence_parallel: supported for {able}, found {spec.name}")
        when, where = spec.sp_scatter
        if when == "post":
            local.get_submodule(where).register_forward_hook(
                lambda m, a, out: markers.transition(out, "replicate", "shard:1", tp))
        else:
            local.get_submodule(where).register_forward_pre_hook(_hidden_transition("replicate", "shard:1", tp),
                                                                  with_kwargs=True)
        for pattern in spec.sp_gather:
            for mod_name, mod in local.named_modules():
                if re.fullmatch(pattern, mod_name):
                    mod.register_forward_pre_hook(_gather_hidden(tp), with_kwargs=True)
    for name, stage in split_points.items():
        local.get_submodule(name).register_forward_pre_hook(_pipe_split(stage))
    sources: dict[str, Source] = {}
    for mname, m in local.named_modules():
        if isinstance(m, (ColumnLinear, RowLinear, VocabEmbedding)):
            for pname, src in m.sources.items():
                sources[f"{mname}.{pname}"] = src
    for pname, p in local.named_parameters():
        sources.setdefault(pname, Source.whole(pname, p.shape))
    return local, sources


def _hidden_transition(src: str, dst: str, tp: int):
    """Pre-hook: move `hidden_states` (first positional or keyword) from layout src to dst."""
    def hook(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            args = (markers.transition(args[0], src, dst, tp),) + tuple(args[1:])
        elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
            kwargs = dict(kwargs, hidden_states=markers.transition(kwargs["hidden_states"], src, dst, tp))
        return args, kwargs
    return hook


def _gather_hidden(tp: int):
    """Pre-hook: all-gather the sequence shards of `hidden_states` before a module that needs the whole sequence."""
    return _hidden_transition("shard:1", "replicate", tp)


def _pipe_split(stage: int):
    def hook(module, args, kwargs=None):
        if args and isinstance(args[0], torch.Tensor):
            return (markers.pipe_split(args[0], stage),) + tuple(args[1:])
        return None
    return hook


def _trace_rank(ff, local, pnames: list[str]) -> fx.GraphModule:
    """make_fx of a rank-local model's flat forward, its parameters as the first placeholders (fake)."""
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in local.named_parameters()}
    inputs = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in ff.signature.inputs]   # made fake there
    gm = trace_rank(local, pnames, lambda _local, params, *xs: ff.fn(params, *xs), [shapes[n] for n in pnames],
                    inputs, allow_non_fake_inputs=True)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def build_hf(model_dir: str | Path, *, tp: int = 1, pp: int = 1, batch: int = 1, seq_len: int = 128,
             past_len: int | None = None, split_points: list[str] | None = None,
             sequence_parallel: bool = False, dtype: torch.dtype | None = None,
             max_len: int | None = None, last_logits: bool = False, cache_rows: int | None = None) -> Built:
    model_dir = Path(model_dir)
    model, config, family = load_skeleton(model_dir, dtype=dtype)
    spec = get_family(family)
    index = checkpoint_index(model_dir, model)
    plan = plans.tp_plan(spec, config)
    plans.check_plan(plan, model, tp)
    n_layers = len(model.get_submodule(spec.layers))
    points = split_points if split_points is not None else even_split_points(spec, n_layers, pp)
    if len(points) != pp - 1:
        raise BuildError(f"split_points: expected {pp - 1} module names for pp={pp}, found {len(points)}")
    stages = {name: i + 1 for i, name in enumerate(points)}
    if sequence_parallel and tp > 1 and seq_len % tp:
        raise BuildError(f"sequence_parallel: expected seq_len divisible by tp={tp}, found {seq_len}")
    if not spec.decoder:
        if max_len is not None:
            raise BuildError(f"max_len: expected None for {spec.name} (no KV cache), found {max_len}")
        past_len = None
    if max_len is not None and sequence_parallel:
        raise BuildError("sequence_parallel: expected off with a static cache (max_len), found on")
    full_sig = flat_signature(spec, config, batch, seq_len, past_len, dtype=next(model.parameters()).dtype,
                              pooler=getattr(model, "pooler", None) is not None, max_len=max_len,
                              last_logits=last_logits, cache_rows=cache_rows)
    q_local, kv_local = plans.local_heads(plan.n_q_heads, plan.n_kv_heads, tp)
    name = (f"{model_dir.name}-tp{tp}-pp{pp}" + (f"-static{max_len}" if max_len is not None else "")
            + (f"-rows{cache_rows}" if cache_rows is not None else "")
            + ("-last-logits" if last_logits else ""))
    files = sorted({st.file for st in index.values()})
    emitter = Emitter(name, tp, pp, lambda p: StoredParam(index[p].file, index[p].name_in_file))
    forms = RankForms()                  # ranks of one form share one trace (most of a build's time)
    for rank in range(tp):
        local, sources = rank_local(model, spec, plan, rank, tp, sequence_parallel=sequence_parallel,
                                    split_points=stages)
        ff = traced_forward(local, spec, config, batch=batch, seq_len=seq_len, past_len=past_len,
                            num_kv_heads=kv_local, max_len=max_len, last_logits=last_logits,
                            cache_rows=cache_rows)
        pnames = list(ff.param_names)
        signature = tuple((tuple(t.shape), t.dtype) for t in (*ff.signature.inputs, *ff.signature.outputs))
        gm = forms.graph(local, (tuple(pnames), signature), lambda ff=ff, local=local, pnames=pnames:
                         _trace_rank(ff, local, pnames))
        apply_sharding(gm, rank, tp)
        heads = plans.kv_heads_for_rank(rank, tp, plan.n_q_heads, plan.n_kv_heads)

        def io(full, local_t):
            pl = None
            if full.name.startswith("past_key_values_") and tp > 1:
                pl = tuple((heads.start, heads.stop) if d == 1 else (0, s) for d, s in enumerate(full.shape))
            return IOSpec(full.name, pl, full.idx, tuple(full.shape), dtypes.to_name(full.dtype))

        rg = RankGraph(gm, [sources[p] for p in pnames],
                       [io(f, l) for f, l in zip(full_sig.inputs, ff.signature.inputs)],
                       [io(f, l) for f, l in zip(full_sig.outputs, ff.signature.outputs)])
        emitter.add_rank(rank, rg)
    doc = emitter.finish()
    validate_structure(parse_pipeline(doc))
    return Built(doc, links={f: model_dir / f for f in files})
