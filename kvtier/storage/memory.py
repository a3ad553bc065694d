"""A memory tier's storage: one flat uint8 buffer per layer group, addressed by slot.

Slot ``i`` of group ``g`` is bytes ``[i * page_bytes[g], (i + 1) * page_bytes[g])`` of
``buffers[g]``. The storage knows nothing of pages or caches; it hands out slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvtier.storage.pinned import HostBuffer
from kvtier.storage.slots import SlotAllocator

# (num_bytes, page_bytes) -> a flat uint8 tensor, or a HostBuffer that owns one (pinned memory)
BufferFactory = Callable[[int, int], "torch.Tensor | HostBuffer"]


class MemoryStorage:
    """Per-group buffers and slot allocators of one memory tier (primary or host)."""

    def __init__(self, page_bytes: Sequence[int], num_slots: Sequence[int], allocate: BufferFactory) -> None:
        self.page_bytes = tuple(page_bytes)
        self.slots = tuple(SlotAllocator(n) for n in num_slots)
        made = [allocate(n * p, p) for n, p in zip(num_slots, page_bytes, strict=True)]
        self._host_buffers = [m for m in made if isinstance(m, HostBuffer)]
        self.buffers = tuple(m.tensor if isinstance(m, HostBuffer) else m for m in made)

    def close(self) -> None:
        """Release the buffers (unpinning host memory); the storage must not be used afterwards."""
        for host in self._host_buffers:
            host.release()
        self._host_buffers = []
        self.buffers = ()
