"""A tensor over memory another object owns: a storage of its own, as vLLM 0.34's extensible KV
cache registers each layer's segment of one reserved address range."""

from __future__ import annotations

import numpy as np
import torch


class _Memory:
    """``size`` bytes at ``ptr`` in the array interface numpy (CPU) or torch (CUDA) reads; holds
    ``owner``, whatever keeps that memory alive, as long as a tensor over it lives."""

    def __init__(self, ptr: int, size: int, cuda: bool, owner: object) -> None:
        interface = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}
        if cuda:
            self.__cuda_array_interface__ = interface
        else:
            self.__array_interface__ = interface
        self.owner = owner


def bytes_at(ptr: int, size: int, device: torch.device, owner: object = None) -> torch.Tensor:
    """A uint8 tensor over ``size`` bytes at ``ptr`` of ``device``, with a storage of its own."""
    if device.type == "cuda":
        return torch.as_tensor(_Memory(ptr, size, True, owner), device=device)
    return torch.from_numpy(np.asarray(_Memory(ptr, size, False, owner)))
