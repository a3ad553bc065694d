"""The numerics a call computes keys and values with, beyond the weights and the attention kernels:
torch's autocast on the pages' device (and, on CUDA, the float32 matmul precision: TF32), and the
hub's kernels when the model uses them (``use_kernels``: from transformers 5.25 ``from_pretrained``
turns them on where the ``kernels`` package is installed; in the mode ``train()`` and ``eval()``
switch, ``kernels_mode``).

They are part of each call's reuse scope (``with_numerics``), so pages computed under autocast are
served only to calls under the same autocast, and a plain call never reads them: a bfloat16-rounded
key in a float32 page changes the tokens that follow. Likewise pages of the hub's kernels, and of
each of their modes.
"""

from __future__ import annotations

import torch

from kvtier.config import ReuseScope

TAG = "numerics:"


def numerics_tag(device: torch.device, model: torch.nn.Module | None = None) -> str | None:
    """What a call of ``model`` on ``device`` computes with now, if not the model's own precision
    and torch's kernels; else None."""
    parts = []
    if model is not None and getattr(model, "use_kernels", False):
        parts.append(f"kernels-{getattr(model, 'kernels_mode', None)}")
    if torch.is_autocast_enabled(device.type):
        parts.append(f"autocast-{torch.get_autocast_dtype(device.type)}")
    if device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        parts.append(f"matmul-{torch.get_float32_matmul_precision()}")
    return TAG + "+".join(parts) if parts else None


def with_numerics(scope: ReuseScope, device: torch.device, model: torch.nn.Module | None = None) -> ReuseScope:
    """``scope``, its salt extended with ``numerics_tag`` when a call of ``model`` on ``device`` has one."""
    tag = numerics_tag(device, model)
    return scope if tag is None else salted(scope, tag)


def salted(scope: ReuseScope, tag: str) -> ReuseScope:
    """``scope`` with ``tag`` added to its salt: a scope of its own, the same for the same tags."""
    salt = scope.salt
    if salt is None:
        salt = tag
    elif isinstance(salt, bytes):
        salt = salt + b"|" + tag.encode()
    else:
        salt = f"{salt}|{tag}"
    return ReuseScope(lora_id=scope.lora_id, salt=salt)
