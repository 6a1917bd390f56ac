"""fastpipe.build(module, example_inputs, tp=..., pp=..., ...) -> Built (a pipeline + how to save it)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from fastpipe import dtypes
from fastpipe.atomic import write_text
from fastpipe.builder.emit import Emitter, IOSpec, RankGraph, StoredParam
from fastpipe.builder.rank_forms import RankForms
from fastpipe.builder.rewrite import shard_module
from fastpipe.builder.sharding import apply_sharding
from fastpipe.errors import BuildError
from fastpipe.format import parse_pipeline
from fastpipe.torch_compat import FakeTensorMode, fx_tracing_lock, lazy_graph_modules
from fastpipe.validate import validate_structure


@dataclass
class Built:
    doc: dict                                    # the pipeline.json document
    weights: dict[str, torch.Tensor] = field(default_factory=dict)   # tensors to write beside it (generic modules)
    weights_file: str = "weights.safetensors"
    links: dict[str, Path] = field(default_factory=dict)             # file name -> checkpoint file to link in place

    @property
    def pipeline(self):
        return parse_pipeline(self.doc)

    def save(self, out_dir: str | os.PathLike, *, style: str = "fastpipe") -> Path:
        """Write pipeline.json (+ weights, or links to the checkpoint files) into out_dir.
        style="producer" (or "producer-2024.1") writes furiosa-llm's spelling (fastpipe.format.write_pipeline)."""
        from fastpipe.format import STYLES

        if style not in STYLES:
            raise BuildError(f"style: expected one of {', '.join(STYLES)}, found {style!r}")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.weights:
            from safetensors.torch import save_file

            from fastpipe.atomic import atomic_path

            with atomic_path(out / self.weights_file) as tmp:
                save_file({k: v.detach().contiguous() for k, v in self.weights.items()}, str(tmp))
        for name, target in self.links.items():
            _link_in_place(out / name, Path(target))
        if style != "fastpipe":
            from fastpipe.format import write_pipeline

            from fastpipe.payload import to_torch21

            write_pipeline(parse_pipeline(self.doc, source_dir=out.resolve()), out / "pipeline.json", style=style,
                           rewrite_payload=to_torch21 if style == "producer-2024.1" else None)
        else:
            write_text(out / "pipeline.json", json.dumps(self.doc, indent=1) + "\n")
        return out / "pipeline.json"


def _link_in_place(link: Path, target: Path) -> None:
    """A hard link: the checkpoint's own bytes, inside the pipeline's folder (no copy, no path escape)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.exists():
        if os.path.samefile(link, target):
            return
        link.unlink()
    try:
        os.link(target, link)
    except OSError as e:
        raise OSError(f"cannot hard-link {target} into {link.parent} ({e.strerror}); build into a folder on the "
                      "same filesystem as the checkpoint, so weights are referenced in place rather than copied") from None


def _stages(pp: int, split_points) -> dict[str, int]:
    if pp == 1:
        return {}
    if split_points is None or len(split_points) != pp - 1:
        raise BuildError(f"pp={pp} needs {pp - 1} split points (module names to split before), found {split_points!r}")
    return {name: i + 1 for i, name in enumerate(split_points)}


def trace_rank(local: nn.Module, param_names: Sequence[str], forward: Callable, param_shapes, input_vals,
               constants: Mapping[str, torch.Tensor] | None = None, *,
               allow_non_fake_inputs: bool = False) -> torch.fx.GraphModule:
    """Trace forward(local, params_dict, *inputs) with params as explicit placeholders (fake tensors).
    allow_non_fake_inputs: the forward may read real tensors of its own (a model's buffers)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fparams = [torch.empty(s, dtype=d) for s, d in param_shapes]
        finputs = [torch.empty(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v for v in input_vals]
    n = len(param_names)

    def flat(*xs):
        params = dict(zip(param_names, xs[:n]))
        if constants:
            params.update(constants)
        out = forward(local, params, *xs[n:])
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    with fx_tracing_lock(), lazy_graph_modules():   # FX's tracing state is global: never beside a compile
        return make_fx(flat, tracing_mode="fake", _allow_non_fake_inputs=allow_non_fake_inputs)(*fparams, *finputs)


def _default_forward(local, params, *inputs):
    return torch.func.functional_call(local, params, tuple(inputs))


def build(module: nn.Module, example_inputs: Sequence[torch.Tensor], *, tp: int = 1, pp: int = 1,
          split_points: Sequence[str] | None = None, plan: Mapping[str, object] | None = None,
          sequence_parallel: bool = False, input_names: Sequence[str] | None = None,
          output_names: Sequence[str] | None = None, name: str | None = None,
          transmit: Sequence[str] = ()) -> Built:
    """Split a plain PyTorch module into a tp x pp pipeline.

    `plan` maps submodule names to "column" / "column_gather" / "row" / "vocab" (see
    fastpipe.builder.rewrite); `split_points` names the pp-1 submodules each new stage starts
    at. The module's own weights are written beside the pipeline (weights.safetensors) and
    every constant is a slice of them. Parameters several stages use are replicated on each
    (each stage reads its slice), unless named in `transmit`: then the first stage holds them
    and sends them on.
    """
    if tp < 1 or pp < 1:
        raise BuildError(f"tp and pp must be >= 1, found tp={tp}, pp={pp}")
    module = module.eval()
    stages = _stages(pp, split_points)
    state = {k: v for k, v in module.state_dict().items()}
    in_names = list(input_names or [f"input_{i}" for i in range(len(example_inputs))])
    with torch.no_grad():
        outs = module(*example_inputs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    out_names = list(output_names or (["output"] if len(outs) == 1 else [f"output_{i}" for i in range(len(outs))]))
    emitter = Emitter(name or type(module).__name__, tp, pp, lambda p: StoredParam("weights.safetensors", p))
    forms = RankForms()                  # ranks of one form share one trace
    buffers = {n: b for n, b in module.named_buffers()}
    for rank in range(tp):
        local, sources = shard_module(module, plan or {}, rank, tp, sequence_parallel=sequence_parallel,
                                      split_points=stages)
        pnames = [n for n, _ in local.named_parameters()]
        shapes = [(sources[n].shape, dict(local.named_parameters())[n].dtype) for n in pnames]
        gm = forms.graph(local, (tuple(pnames), tuple(shapes)), lambda local=local, pnames=pnames, shapes=shapes:
                         trace_rank(local, pnames, _default_forward, shapes, example_inputs, constants=buffers))
        apply_sharding(gm, rank, tp)
        rg = RankGraph(
            gm, [sources[n] for n in pnames],
            [IOSpec(nm, None, i, tuple(x.shape), dtypes.to_name(x.dtype)) for i, (nm, x) in enumerate(zip(in_names, example_inputs))],
            [IOSpec(nm, None, i, tuple(o.shape), dtypes.to_name(o.dtype)) for i, (nm, o) in enumerate(zip(out_names, outs))])
        emitter.add_rank(rank, rg, frozenset(transmit))
    doc = emitter.finish()
    validate_structure(parse_pipeline(doc))
    return Built(doc, weights={k: v for k, v in state.items() if k in {n for n, _ in module.named_parameters()}})
