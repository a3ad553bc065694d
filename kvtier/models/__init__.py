"""Models that run their KV cache through kvtier: a Llama-style decoder with full, sliding-window
and recurrent layers, its paged forward, and the cache-free greedy oracle.

``build_model(name_or_path, device, dtype, seed=0)`` gives a named variant with random weights
(``tiny-llama``, ``tiny-swa``, ``tiny-hybrid``, ``small-llama``, ``llama-8b-shape``) or the model
stored in a Hugging Face style directory (``config.json`` + ``*.safetensors``: a Llama or Mistral
checkpoint, or one this package wrote; ``kvtier.models.loader``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvtier.config import check_device_usable
from kvtier.models.architecture import NAMED_CONFIGS, LayerKind, ModelConfig, named_config
from kvtier.models.batch import PagedSequence
from kvtier.models.llama import DecoderModel
from kvtier.models.loader import config_from_hf, config_to_hf, load_model
from kvtier.models.random_init import random_model
from kvtier.models.rope import RopeScaling
from kvtier.pages import BAD_PAGE_INDEX

__all__ = [
    "BAD_PAGE_INDEX",
    "NAMED_CONFIGS",
    "DecoderModel",
    "LayerKind",
    "ModelConfig",
    "PagedSequence",
    "RopeScaling",
    "build_model",
    "config_from_hf",
    "config_to_hf",
    "load_model",
    "named_config",
]


def build_model(
    name_or_path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> DecoderModel:
    """A model in eval mode without gradients, on ``device`` in ``dtype``.

    A known name gives random weights drawn from ``seed`` (a name wins over a directory of the same
    name); an existing directory is loaded (``seed`` is then unused). ``ValueError`` for anything
    else, listing the known names; ``RuntimeError`` for a CUDA device this process cannot use.
    """
    device = torch.device(device)
    check_device_usable(device)
    is_name = isinstance(name_or_path, str) and name_or_path in NAMED_CONFIGS
    if not is_name and Path(name_or_path).is_dir():
        return load_model(name_or_path, device, dtype)
    return random_model(named_config(os.fspath(name_or_path)), device, dtype, seed)
