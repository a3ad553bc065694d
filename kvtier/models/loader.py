"""Models from a Hugging Face style directory: ``config.json`` plus ``*.safetensors`` shards.

Weights use Llama names (see ``kvtier.models.llama``). ``config.json`` keys read: ``vocab_size``,
``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads`` (required);
``num_key_value_heads``, ``head_dim``, ``rope_theta``, ``rope_scaling`` (``linear`` or
``llama3``), ``rms_norm_eps``, ``tie_word_embeddings``, ``sliding_window``, ``use_sliding_window``,
``layer_types`` (``full_attention`` / ``sliding_attention`` / ``linear_attention``) and
``sink_tokens`` (a kvtier extension: leading tokens a sliding-window layer always sees).
Without ``layer_types``, a ``sliding_window`` makes every layer sliding-window unless
``use_sliding_window`` is false, or the ``model_type`` is ``llama``, whose network transformers
runs without a window whatever the file says.

``model_type``, when present, must be ``llama`` or ``mistral``: those are this network. Other
architectures keep Llama's tensor names and change the network (Granite's multipliers, Cohere's
logit scale); a partial rotary embedding (``partial_rotary_factor``) is refused too. So a
checkpoint loads only where the model computes what transformers computes for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from kvtier.models.architecture import LayerKind, ModelConfig
from kvtier.models.llama import DecoderModel
from kvtier.models.memory_fit import check_weights_fit
from kvtier.models.rope import RopeScaling

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_MODEL_TYPES = ("llama", "mistral")  # the transformers architectures that are this network


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """A ``ModelConfig`` from the parsed ``config.json``; ``ValueError`` for what cannot be run."""
    missing = [key for key in _REQUIRED if raw.get(key) is None]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}: add them (Hugging Face Llama names)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported: the MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ValueError(f"{key}=true is not supported: the projections have no bias")
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in _MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported: the reference model runs Llama and Mistral "
            "checkpoints (other architectures that keep Llama's tensor names compute another network)"
        )
    partial = raw.get("partial_rotary_factor", (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported: rotary embedding of every dimension")
    heads = raw["num_attention_heads"]
    num_layers = raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    try:
        if layer_types is not None:
            if len(layer_types) != num_layers:
                raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
            kinds = tuple(LayerKind(kind) for kind in layer_types)
        elif window is not None and model_type != "llama" and raw.get("use_sliding_window", True):
            kinds = (LayerKind.SLIDING_ATTENTION,) * num_layers
        else:
            kinds = (LayerKind.FULL_ATTENTION,) * num_layers
        theta, scaling = _rope(raw)
        return ModelConfig(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            layer_kinds=kinds,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=window if LayerKind.SLIDING_ATTENTION in kinds else None,
            sink_tokens=int(raw.get("sink_tokens", 0)),
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"malformed config.json: {err}") from err


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` content that :func:`config_from_hf` reads back as ``config``."""
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "layer_types": [kind.value for kind in config.layer_kinds],
        "sliding_window": config.sliding_window,
        "sink_tokens": config.sink_tokens,
    }
    if config.rope_scaling is not None:
        s = config.rope_scaling
        raw["rope_scaling"] = {
            "rope_type": s.kind,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return raw


def load_model(path: str | os.PathLike[str], device: torch.device, dtype: torch.dtype) -> DecoderModel:
    """The model stored in directory ``path``, on ``device`` in ``dtype``, in eval mode, no grads.

    Every parameter must be present with its shape; unknown tensors are an error too (except a
    saved ``lm_head.weight`` of a tied model and RoPE frequency buffers, which are ignored).
    """
    from safetensors import safe_open

    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{directory} has no config.json: give a model name or a Hugging Face style directory")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} must hold a JSON object")
    config = config_from_hf(raw)
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{directory} has no *.safetensors weight files")
    with torch.device("meta"):
        model = DecoderModel(config)
    check_weights_fit(model, device, dtype)
    model = model.to(dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for shard in shards:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.lm_head is None):
                        continue
                    if name not in params:
                        raise ValueError(f"{shard.name} holds {name!r}, which this model does not have")
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(params[name].shape):
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)}, config.json implies "
                            f"{tuple(params[name].shape)}"
                        )
                    params[name].copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"{directory}: {len(missing)} weights missing from the safetensors files: {shown}")
    model.requires_grad_(False)
    return model.eval()


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``rope_theta`` and the scaling, from ``rope_theta``/``rope_scaling`` or ``rope_parameters``."""
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    return theta, RopeScaling(
        kind=kind,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )
