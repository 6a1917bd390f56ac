"""Where each parameter of a meta skeleton lives in a Hugging Face safetensors checkpoint.

Only safetensors *headers* are read (``fastpipe.weights.safetensors_header``):
``model.safetensors``, or ``model.safetensors.index.json`` + the shards its
``weight_map`` names (confined to the model folder).

Name matching, per parameter / persistent buffer name ``n`` of the model, in
this order (first hit wins):
  1. ``n`` itself;
  2. the base-model prefix removed or added: a head model (``transformer.h.0...``,
     ``model.layers...``) reading a checkpoint saved from the base model
     (``h.0...``: the original ``openai-community/gpt2`` file), and a base model
     (``BertModel``: ``encoder.layer...``) reading one saved from a head model
     (``BertForMaskedLM``: ``bert.encoder.layer...``);
  3. transformers' "legacy" renames (``LayerNorm.weight``/``.bias`` stored as
     ``LayerNorm.gamma``/``.beta`` in old BERT checkpoints), each with 1-2.
Tied parameters (one tensor under several names: GPT-2 ``lm_head.weight`` is
``transformer.wte.weight``; Llama with ``tie_word_embeddings``) are found by
identity on the skeleton; every name of a tie group maps to the stored tensor
of the first name of the group that the file has (normally only the
embedding is saved; ``save_pretrained`` drops the alias). Stored tensors the
model does not use (GPT-2's legacy ``attn.bias`` masks, BERT MLM heads) are
ignored.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fastpipe.dtypes import SAFETENSORS_TO_TORCH, TORCH_TO_NAME
from fastpipe.errors import ParamError
from fastpipe.weights.paths import resolve_param_path
from fastpipe.weights.safetensors_header import CorruptHeader, read_header

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LEGACY_RENAMES = ((".LayerNorm.weight", ".LayerNorm.gamma"), (".LayerNorm.bias", ".LayerNorm.beta"))


@dataclass(frozen=True)
class StoredTensor:
    file: str                    # relative to the model folder
    name_in_file: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None    # None: a safetensors dtype torch cannot represent
    dtype_label: str             # safetensors spelling, e.g. "F32"


def _header(path: Path, rel: str):
    try:
        return read_header(path, path.stat().st_size)
    except CorruptHeader as e:
        raise ParamError(f"{rel}: expected a safetensors file, found a corrupt header: {e}") from None
    except OSError as e:
        raise ParamError(f"{rel}: expected a readable safetensors file, found {e.strerror or e}") from None


def stored_tensors(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of the folder's safetensors checkpoint, by its stored name (headers only)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    single = model_dir / SINGLE_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ParamError(f"{INDEX_FILE}: expected JSON with a 'weight_map' object, found {type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ParamError(f"{INDEX_FILE}.weight_map: expected an object of file names, found "
                             f"{type(weight_map).__name__}")
        files = sorted(set(weight_map.values()))
    elif single.is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise ParamError(f"{model_dir}: expected {SINGLE_FILE} or {INDEX_FILE}, found neither")

    out: dict[str, StoredTensor] = {}
    for rel in files:
        path = resolve_param_path(model_dir, rel, where=f"{INDEX_FILE}.weight_map")
        header = _header(path, rel)
        for name, e in header.tensors.items():
            if weight_map is not None and weight_map.get(name) != rel:
                continue  # the index is authoritative about which shard holds a name
            out[name] = StoredTensor(rel, name, e.shape, SAFETENSORS_TO_TORCH.get(e.dtype), e.dtype)
    if weight_map is not None:
        lost = [n for n in weight_map if n not in out]
        if lost:
            raise ParamError(f"{INDEX_FILE}.weight_map[{lost[0]!r}]: expected a tensor in "
                             f"'{weight_map[lost[0]]}', found none ({len(lost)} such names)")
    return out


def tie_groups(model) -> list[list[str]]:
    """Names that share one tensor on the skeleton, canonical (named_parameters) name first."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def tied_parameters(model) -> dict[str, str]:
    """alias -> canonical name, for every parameter that is another one (e.g. lm_head.weight -> wte)."""
    return {alias: names[0] for names in tie_groups(model) for alias in names[1:]}


def _candidates(name: str, prefix: str) -> list[str]:
    def with_prefix(n: str) -> list[str]:
        out = [n]
        if prefix:
            if n.startswith(prefix + "."):
                out.append(n[len(prefix) + 1:])
            else:
                out.append(f"{prefix}.{n}")
        return out

    cands = with_prefix(name)
    for new, old in LEGACY_RENAMES:
        if name.endswith(new):
            cands += with_prefix(name[: -len(new)] + old)
    return cands


def _label(dtype: torch.dtype) -> str:
    return TORCH_TO_NAME.get(dtype, str(dtype))


def _expected_names(model) -> list[str]:
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    non_persistent = {n for n, _ in model.named_non_persistent_buffers()}
    names += [n for n, _ in model.named_buffers() if n not in non_persistent]
    return names


def checkpoint_index(model_dir: Path, model) -> dict[str, StoredTensor]:
    """Every parameter (tied aliases included) and persistent buffer of ``model`` -> its stored tensor.

    ``model`` is the skeleton from ``load_skeleton``. Raises ParamError naming
    the first missing tensor (and how many are missing), or a tensor whose
    stored shape differs from the model's.
    """
    stored = stored_tensors(model_dir)
    prefix = getattr(model, "base_model_prefix", "") or ""
    groups = {n: g for g in tie_groups(model) for n in g}
    shapes = dict(model.named_parameters(remove_duplicate=False))
    shapes.update(model.named_buffers())

    index: dict[str, StoredTensor] = {}
    missing: list[str] = []
    for name in _expected_names(model):
        if name in index:
            continue
        group = groups.get(name, [name])
        hit = None
        for member in group:
            hit = next((stored[c] for c in _candidates(member, prefix) if c in stored), None)
            if hit is not None:
                break
        if hit is None:
            missing += [m for m in group if m not in index]
            continue
        for member in group:
            want = tuple(shapes[member].shape)
            if tuple(hit.shape) != want:
                raise ParamError(f"{hit.file}[{hit.name_in_file!r}]: expected shape {list(want)} for "
                                 f"{member}, found {list(hit.shape)}")
            if hit.dtype != shapes[member].dtype:     # weights are slices of the file: no cast on the way
                raise ParamError(f"{hit.file}[{hit.name_in_file!r}]: expected dtype {_label(shapes[member].dtype)} for "
                                 f"{member} (the build's dtype), found {hit.dtype_label}; a pipeline's weights are "
                                 "slices of the checkpoint and keep its dtype: build with the checkpoint's dtype "
                                 "or convert the checkpoint first")
            index[member] = hit
    if missing:
        raise ParamError(f"{model_dir}: expected a stored tensor for {missing[0]}, found none "
                         f"({len(missing)} parameters missing; prefix tried: {prefix!r})")
    return index


def load_tensors(model_dir: Path, index: dict[str, StoredTensor], names=None) -> dict[str, torch.Tensor]:
    """Read the real tensors for ``names`` (default: all of ``index``) with safetensors; for tests and tools.

    The pipeline runtime reads weights through fastpipe.weights (slices, mmap);
    this helper reads whole tensors, each stored tensor once (tied names share it).
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    names = list(index) if names is None else list(names)
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(index[n].file, []).append(n)
    out: dict[str, torch.Tensor] = {}
    for rel, ns in by_file.items():
        with safe_open(os.fspath(model_dir / rel), framework="pt") as f:
            read: dict[str, torch.Tensor] = {}
            for n in ns:
                key = index[n].name_in_file
                if key not in read:
                    read[key] = f.get_tensor(key)
                out[n] = read[key]
    return out
