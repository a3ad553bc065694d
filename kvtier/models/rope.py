"""Rotary position embedding (RoPE), Llama convention: the two halves of a head are rotated.

Dimension ``i < head_dim / 2`` of a head is paired with dimension ``i + head_dim / 2`` and the pair
is rotated by the angle ``position * inv_freq[i]``. Angles are computed in float64 from integer
positions, so the same position gets the same rotation whatever the chunk it arrives in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Frequency scaling for long contexts, as in Hugging Face ``rope_scaling``.

    ``kind`` is ``"linear"`` (every frequency divided by ``factor``) or ``"llama3"`` (low
    frequencies divided by ``factor``, high ones kept, a smooth blend between, decided by the
    wavelength relative to ``original_max_position_embeddings``).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"unsupported rope scaling {self.kind!r}: use 'linear' or 'llama3', or none")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                "llama3 rope scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """float64 ``[head_dim // 2]`` rotation frequencies (radians per position), on the CPU."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    wavelength = 2 * math.pi / inv_freq
    context = scaling.original_max_position_embeddings
    # 0 for wavelengths longer than context / low_freq_factor (fully scaled), 1 for those
    # shorter than context / high_freq_factor (kept), linear in context / wavelength between.
    blend = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blend = blend.clamp(0.0, 1.0)
    return (1 - blend) * inv_freq / scaling.factor + blend * inv_freq


@dataclass(frozen=True, slots=True)
class Rotation:
    """The rotation of ``n`` token positions: ``cos`` and ``sin`` ``[n, 1, head_dim // 2]`` in the
    working dtype (float32, or float64 for a float64 model). Computed once per forward and shared
    by every attention layer."""

    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [n, heads, head_dim]``; the result has ``x``'s dtype and shape."""
        first, second = x.to(self.cos.dtype).chunk(2, dim=-1)
        rotated_first = torch.addcmul(first * self.cos, second, self.sin, value=-1)
        rotated_second = torch.addcmul(second * self.cos, first, self.sin)
        return torch.cat((rotated_first, rotated_second), dim=-1).to(x.dtype)


class Rope:
    """RoPE for one head size: float64 frequencies kept on the CPU, copied once per device.

    Deliberately not a module buffer, so that casting a model (``model.to(torch.bfloat16)``)
    never rounds the frequencies.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        self._inv_freq = {torch.device("cpu"): inverse_frequencies(head_dim, theta, scaling)}

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation of int64 ``positions [n]`` for a model computing in ``dtype``."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[positions.device] = self._inv_freq[torch.device("cpu")].to(positions.device)
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        work = torch.float64 if dtype == torch.float64 else torch.float32
        return Rotation(angles.cos().to(work)[:, None, :], angles.sin().to(work)[:, None, :])
