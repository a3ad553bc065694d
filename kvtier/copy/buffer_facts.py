"""What a copy call needs to know about a buffer, learnt once per tensor instead of once per call.

Asking torch whether host memory is pinned goes to the CUDA runtime, and a buffer's device,
address and registration grid cost a few calls more; a tier passes the same tensor object call
after call. ``BufferFactsCache`` keeps these facts per tensor object (weakly: a tensor that is
collected drops out) and takes them again when the tensor's address changed or a host buffer
was registered or released through ``kvtier.storage.pinned`` since. Host memory registered or
unregistered with CUDA by other means while a tensor over it is in use is not noticed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kvtier.storage.pinned import RegistrationGrid, registration_epoch, registration_grid


@dataclass(frozen=True, slots=True)
class BufferFacts:
    """``address``: the tensor's data pointer; ``host``: in host memory (else on the copier's device);
    ``pinned``: host memory that the GPU can reach (pinned or registered; False on the device);
    ``grid``: its chunked registration's grid, None when registered in one piece or not a host buffer."""

    address: int
    host: bool
    pinned: bool
    grid: RegistrationGrid | None


class BufferFactsCache:
    """The facts of the buffers a copier of ``device`` meets; ``ValueError`` for another device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # id(tensor) -> (a weak reference to it, the registration epoch, its facts); an entry
        # leaves when its tensor is collected, before that id can name another tensor
        self._facts: dict[int, tuple[weakref.ref[torch.Tensor], int, BufferFacts]] = {}

    def of(self, name: str, buffer: torch.Tensor) -> BufferFacts:
        """The facts of ``buffer`` (called ``name`` in errors), from the cache while still true."""
        epoch = registration_epoch()
        key = id(buffer)
        known = self._facts.get(key)
        if known is not None and known[0]() is buffer and known[1] == epoch and known[2].address == buffer.data_ptr():
            return known[2]
        facts = self._learn(name, buffer)
        entries = self._facts
        entries[key] = (weakref.ref(buffer, lambda _, key=key: entries.pop(key, None)), epoch, facts)
        return facts

    def _learn(self, name: str, buffer: torch.Tensor) -> BufferFacts:
        if buffer.device.type == "cpu":
            pinned = self.device.type == "cuda" and buffer.is_pinned()
            return BufferFacts(buffer.data_ptr(), True, pinned, registration_grid(buffer))
        if buffer.device != self.device:
            raise ValueError(
                f"{name} is on {buffer.device} but this copier serves {self.device}; use the copier of that device"
            )
        return BufferFacts(buffer.data_ptr(), False, False, None)
