"""Random weights from a seed, scaled so activations stay near unit size (finite in bf16).

Linear weights are ``N(0, 1 / fan_in)``, embeddings ``N(0, 1)``, norm weights ``1 + N(0, 0.1^2)``
(not all ones, so a checkpoint that swaps two norms is caught), and the recurrent gate bias
``2 + N(0, 0.5^2)`` (gates near 0.9: a state that remembers). Parameters are drawn in
``named_parameters`` order from one generator.

Small models are drawn on the CPU in float32 and then moved and cast, so a seed gives the same
model on every device and dtype. Models above ``DEVICE_INIT_MIN_PARAMS`` are drawn on the target
device, in the target dtype, by that device's generator: fast, but device-specific.
"""

from __future__ import annotations

import math

import torch

from kvtier.models.architecture import ModelConfig
from kvtier.models.llama import DecoderModel
from kvtier.models.memory_fit import check_weights_fit

DEVICE_INIT_MIN_PARAMS = 1 << 28


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int) -> DecoderModel:
    """A ``DecoderModel`` of ``config`` with weights drawn from ``seed``, in eval mode, no grads;
    ``ValueError`` when its weights are more than all the memory of ``device``."""
    with torch.device("meta"):
        model = DecoderModel(config)
    check_weights_fit(model, device, dtype)
    num_params = sum(p.numel() for p in model.parameters())
    on_device = num_params >= DEVICE_INIT_MIN_PARAMS
    if on_device:
        model = model.to(dtype).to_empty(device=device)
    else:
        model = model.to(torch.float32).to_empty(device="cpu")
    generator = torch.Generator(device=device if on_device else "cpu")
    generator.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            _draw(name, param, generator)
    model = model.to(device=device, dtype=dtype)
    model.requires_grad_(False)
    return model.eval()


def _draw(name: str, param: torch.Tensor, generator: torch.Generator) -> None:
    if name.endswith("embed_tokens.weight"):
        param.normal_(0.0, 1.0, generator=generator)
    elif "norm" in name:
        param.normal_(1.0, 0.1, generator=generator)
    elif name.endswith("g_proj.bias"):
        param.normal_(2.0, 0.5, generator=generator)
    else:
        param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]), generator=generator)
