"""A Hugging Face model folder -> (meta-device model skeleton, config, family).

Nothing here reads a weight or touches the network: the config comes from the
folder's ``config.json`` (``local_files_only=True``, a local path, so the hub
is never asked), the model is instantiated under ``torch.device("meta")``, and
the only bytes read besides the config are safetensors *headers* (to see
whether a BERT checkpoint has a pooler).

Families: ``config.model_type`` selects a registered family
(fastpipe.builder.hf.families: gpt2, llama, mistral, qwen2, bert, one module
each), whose spec names the model class and whose ``check`` refuses, with a
``BuildError`` naming the config field, the variants whose traced graph would
differ from what the family's trace reproduces (sliding windows, dynamic RoPE,
cross-attention, BERT as a decoder). Any other model_type is refused too.

Attention implementation: ``"eager"`` (the default). Why not "sdpa": under
make_fx, ``aten.scaled_dot_product_attention`` is CompositeImplicit and is
decomposed *at trace time* into the backend kernel picked for the fake
tensors' device (``aten._scaled_dot_product_flash_attention_for_cpu`` when
traced with CPU fakes; the flash/efficient CUDA ops with CUDA fakes), so the
graph would be tied to the device it was traced on. "eager" traces to
``bmm`` + ``_softmax`` + an explicit additive mask: device-neutral aten ops,
and numerically the reference we compare against. ("sdpa" is accepted for
experiments; it is not what the tests prove.)

Non-persistent buffers (Llama ``rotary_emb.inv_freq``/``original_inv_freq``,
BERT ``embeddings.position_ids``/``token_type_ids``) are not in checkpoints;
``load_skeleton`` materializes them as real CPU tensors with the model's own
``_init_weights`` (what ``from_pretrained`` does), so the skeleton is meta
parameters + real small buffers. ``skeleton_buffers(model)`` returns them.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from fastpipe.builder.hf.families import FamilySpec, family_for, get_family
from fastpipe.errors import BuildError

ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
DEFAULT_ATTN = "eager"


def detect_family(config) -> str:
    """The name of ``config``'s registered family (by ``config.model_type``), refusing the variants
    the family's trace does not reproduce (``FamilySpec.check``)."""
    return family_for(config).name


def read_config(model_dir: Path):
    """The folder's config as a transformers config object (local files only)."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise BuildError(f"{path}: expected a Hugging Face config.json, found no such file")
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        msg = " ".join(str(e).split())[:300]
        raise BuildError(f"{path}: expected a config transformers can read, found an error: {msg}") from None


def model_class(family: str | FamilySpec, config):
    """The transformers class instantiated for ``family`` (its spec's ``model_class``)."""
    return get_family(family).resolve_model_class(config)


def build_model(config, family: str | FamilySpec, *, device: str | torch.device = "meta",
                dtype: torch.dtype | None = None, attn_implementation: str = DEFAULT_ATTN,
                model_dir: Path | None = None):
    """Instantiate the family's model class from ``config`` on ``device``, in eval mode.

    ``model_dir``: the checkpoint folder the model is for, if any; the family's ``load_kwargs``
    read it for the class's build options (BERT: a pooler iff the checkpoint has one).
    On "meta" no memory is allocated and nothing is initialized for real; the
    non-persistent buffers are then materialized on CPU (see module docstring).
    """
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise BuildError(f"attn_implementation: expected one of {list(ATTN_IMPLEMENTATIONS)}, "
                           f"found {attn_implementation!r}")
    spec = get_family(family)
    cls = spec.resolve_model_class(config)
    config = copy.deepcopy(config)  # _from_config writes dtype and _attn_implementation into it
    kwargs = {"attn_implementation": attn_implementation, **spec.load_kwargs(model_dir)}
    if dtype is not None:
        kwargs["dtype"] = dtype
    with torch.device(device):
        model = cls._from_config(config, **kwargs)
    model.eval()
    if torch.device(device).type == "meta":
        materialize_buffers(model)
    return model


def materialize_buffers(model) -> None:
    """Replace every non-persistent buffer still on meta by its real value on CPU.

    Uses the model's own ``_init_weights`` on the owning module, the path
    transformers' ``from_pretrained`` takes for these buffers (rotary
    ``inv_freq`` from the RoPE config, BERT's ``position_ids`` arange and
    zero ``token_type_ids``).
    """
    owners = {}
    for name, buf in model.named_non_persistent_buffers():
        if buf.device.type != "meta":
            continue
        parent, _, leaf = name.rpartition(".")
        mod = model.get_submodule(parent)
        mod._buffers[leaf] = torch.empty_like(buf, device="cpu")
        owners[parent] = mod
    for parent, mod in owners.items():
        model._init_weights(mod)


def skeleton_buffers(model) -> dict[str, torch.Tensor]:
    """Non-persistent buffers (name -> real tensor); they are in no checkpoint."""
    out = {}
    for name, buf in model.named_non_persistent_buffers():
        if buf.device.type == "meta":
            raise BuildError(f"buffer {name}: expected a materialized value, found a meta tensor")
        out[name] = buf
    return out


def load_skeleton(model_dir: Path, *, dtype: torch.dtype | None = None,
                  attn_implementation: str = DEFAULT_ATTN):
    """``model_dir`` -> ``(model, config, family)``; parameters on meta, eval mode, no weight read.

    ``dtype``: the parameters' dtype; None -> the config's ``dtype`` if it
    names one, else torch's default (float32). The returned config is the
    model's own (a copy of the folder's, with ``dtype`` and
    ``_attn_implementation`` resolved). ``family`` is the registered family's
    name. The family's ``load_kwargs`` see the folder (BERT: the pooler exists
    iff the checkpoint has ``pooler.dense.weight``; BertForMaskedLM checkpoints
    have none).
    """
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    spec = family_for(config)
    model = build_model(config, spec, device="meta", dtype=dtype, attn_implementation=attn_implementation,
                        model_dir=model_dir)
    return model, model.config, spec.name
