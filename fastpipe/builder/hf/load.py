"""A Hugging Face model folder -> (meta-device model skeleton, config, family).

Nothing here reads a weight or touches the network: the config comes from the
folder's ``config.json`` (``local_files_only=True``, a local path, so the hub
is never asked), the model is instantiated under ``torch.device("meta")``, and
the only bytes read besides the config are safetensors *headers* (to see
whether a BERT checkpoint has a pooler).

Families (``config.model_type`` -> family):
    gpt2                    -> "gpt2"   (GPT2LMHeadModel)
    llama, mistral, qwen2   -> "llama"  (XForCausalLM; same module layout: q/k/v/o_proj,
                                        gate/up/down_proj, RMSNorm, rotary, GQA)
    bert                    -> "bert"   (BertModel, encoder only)
Anything else, and variants whose traced graph would differ from plain causal
attention (sliding windows, dynamic RoPE, cross-attention, BERT as a decoder),
is refused with a ``BuildError`` naming the config field.

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

from fastpipe.errors import BuildError, ParamError

FAMILIES = ("gpt2", "llama", "bert")
MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "bert": "bert"}
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
DEFAULT_ATTN = "eager"


def detect_family(config) -> str:
    """``config.model_type`` -> "gpt2" | "llama" | "bert", refusing variants the harness does not trace."""
    mt = getattr(config, "model_type", None)
    family = MODEL_TYPES.get(mt)
    if family is None:
        raise BuildError(f"config.json.model_type: expected one of {sorted(MODEL_TYPES)}, found {mt!r}")
    _check_supported(config, family)
    return family


def _refuse(field: str, expected: str, found: object) -> BuildError:
    return BuildError(f"config.json.{field}: expected {expected}, found {found!r}")


def _check_supported(config, family: str) -> None:
    if family == "gpt2":
        if getattr(config, "add_cross_attention", False):
            raise _refuse("add_cross_attention", "false (no cross-attention)", True)
    elif family == "llama":
        if getattr(config, "sliding_window", None) is not None:
            # Mistral v0.1 (4096) / Qwen2 with use_sliding_window: the mask gains a
            # window overlay and the cache a sliding layer; not traced here.
            raise _refuse("sliding_window", "null (no sliding-window attention)", config.sliding_window)
        types = getattr(config, "layer_types", None)
        if types is not None and any(t != "full_attention" for t in types):
            raise _refuse("layer_types", "only 'full_attention'", sorted(set(types)))
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        if rope_type == "dynamic" or rope_type == "longrope" or "dynamic" in str(rope_type):
            # dynamic_rope_update reads max(position_ids) -> data-dependent control flow
            raise _refuse("rope_parameters.rope_type", "a static RoPE (default, linear, llama3, yarn, ...)",
                          rope_type)
    elif family == "bert":
        if getattr(config, "is_decoder", False):
            raise _refuse("is_decoder", "false (BERT is traced as an encoder)", True)


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


def model_class(family: str, config):
    """The transformers class instantiated for ``family`` (causal LM for decoders, BertModel for bert)."""
    from transformers import AutoModelForCausalLM, BertModel

    if family == "bert":
        return BertModel
    if family in ("gpt2", "llama"):
        mapping = AutoModelForCausalLM._model_mapping
        return mapping[type(config)]
    raise BuildError(f"family: expected one of {list(FAMILIES)}, found {family!r}")


def build_model(config, family: str, *, device: str | torch.device = "meta", dtype: torch.dtype | None = None,
                attn_implementation: str = DEFAULT_ATTN, add_pooling_layer: bool = True):
    """Instantiate the family's model class from ``config`` on ``device``, in eval mode.

    On "meta" no memory is allocated and nothing is initialized for real; the
    non-persistent buffers are then materialized on CPU (see module docstring).
    """
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise BuildError(f"attn_implementation: expected one of {list(ATTN_IMPLEMENTATIONS)}, "
                           f"found {attn_implementation!r}")
    cls = model_class(family, config)
    config = copy.deepcopy(config)  # _from_config writes dtype and _attn_implementation into it
    kwargs = {"attn_implementation": attn_implementation}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if family == "bert":
        kwargs["add_pooling_layer"] = add_pooling_layer
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


def _bert_has_pooler(model_dir: Path) -> bool:
    from .checkpoint import stored_tensors

    try:
        names = stored_tensors(model_dir)
    except ParamError:
        return True  # no checkpoint (yet): BertModel's default; checkpoint_index reports what is missing
    return any(n == "pooler.dense.weight" or n.endswith(".pooler.dense.weight") for n in names)


def load_skeleton(model_dir: Path, *, dtype: torch.dtype | None = None,
                  attn_implementation: str = DEFAULT_ATTN):
    """``model_dir`` -> ``(model, config, family)``; parameters on meta, eval mode, no weight read.

    ``dtype``: the parameters' dtype; None -> the config's ``dtype`` if it
    names one, else torch's default (float32). The returned config is the
    model's own (a copy of the folder's, with ``dtype`` and
    ``_attn_implementation`` resolved). For BERT the pooler exists iff the
    checkpoint has ``pooler.dense.weight`` (BertForMaskedLM checkpoints have
    none).
    """
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    family = detect_family(config)
    pooler = _bert_has_pooler(model_dir) if family == "bert" else True
    model = build_model(config, family, device="meta", dtype=dtype, attn_implementation=attn_implementation,
                        add_pooling_layer=pooler)
    return model, model.config, family
