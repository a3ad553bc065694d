"""The numerics a call computes keys and values with, beyond the weights and the attention kernels:
torch's autocast on the pages' device, the float32 matmul precision of the device's matmul backend
(TF32 on CUDA; bfloat16 or TF32 through oneDNN on CPUs that have them: ``matmul_precision``), and the
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
    precision = matmul_precision(device.type)
    if precision is not None:
        parts.append(f"matmul-{precision}")
    return TAG + "+".join(parts) if parts else None


def matmul_precision(device_type: str) -> str | None:
    """The reduced precision float32 matmuls run in on this kind of device now ("tf32", "bf16"), or
    None for full precision.

    Read from the backend's ``fp32_precision`` (torch's newer API: "none" there defers to
    ``torch.backends.fp32_precision``), which also reflects ``torch.set_float32_matmul_precision``;
    ``torch.get_float32_matmul_precision()`` itself raises once both APIs were used (transformers'
    ``enable_tf32`` uses the newer one). CUDA's is cuBLAS's; any other device's is oneDNN's, which
    runs float32 matmuls in bfloat16 under "medium" on CPUs with bfloat16 instructions.
    """
    backend = torch.backends.cuda.matmul if device_type == "cuda" else torch.backends.mkldnn.matmul
    value = getattr(backend, "fp32_precision", None)
    if value is None:  # a torch before the newer API
        legacy = torch.get_float32_matmul_precision()
        return None if legacy == "highest" or device_type != "cuda" else legacy
    if value == "none":
        value = getattr(torch.backends, "fp32_precision", "none")
    return None if value in ("none", "ieee") else str(value)


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
