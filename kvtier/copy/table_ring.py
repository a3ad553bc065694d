"""Pinned host tables of slot pairs that the launched copy kernels read in place.

The kernel path needs each call's ``(src_slot, dst_slot)`` pairs where the GPU can read them. An
upload from pageable memory made every call wait for a staging copy; a table in pinned (mapped)
host memory needs no upload at all: each program reads its own 16-byte pair over the link once,
then copies its rows. The price is that a table must outlive the kernel that reads it, which the ring keeps:
its slots are taken round-robin, an event is recorded on the launch's stream after each launch,
and a slot is written again only after that event has completed.

The events come from the driver (``kvtier.copy.driver_api.DriverApi``) or, without cuda-bindings,
from torch (``kvtier.copy.torch_events.TorchEvents``): anything with the ``RingEvents`` calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from kvtier.copy.driver_api import DriverApi

SLOTS = 8
_FIRST_ROWS = 1024


class RingEvents(Protocol):
    """The three event calls the ring makes; an event is whatever ``create_event`` returns."""

    def create_event(self) -> Any: ...

    def record(self, event: Any, stream: int) -> None: ...

    def synchronize(self, event: Any) -> None: ...


class TableRing:
    """``SLOTS`` pinned (rows, 2) int64 tables, each with the event of the last launch that read it.

    Invariants: ``take`` hands out a slot only once the last launch that read it has completed
    (its event), so no table is overwritten while a launched kernel may still read it; a slot
    grows (to at least twice its size) when a call needs more rows and never shrinks, and its
    device address is asked again after it grows. Callers serialise ``take``, ``address`` and
    ``launched`` (the copier holds a lock) and call them with the device's context current.
    """

    def __init__(self, events: RingEvents) -> None:
        self._events_api = events
        self._tables: list[torch.Tensor | None] = [None] * SLOTS
        self._arrays: list[np.ndarray | None] = [None] * SLOTS
        self._addresses = [0] * SLOTS  # each table's device-mapped address; 0 until asked
        self._events: list[Any] = [None] * SLOTS
        self._next = 0

    def take(self, rows: int) -> tuple[int, np.ndarray, torch.Tensor]:
        """The next slot: its index, a numpy view of at least ``rows`` rows to fill, and its tensor
        (what Triton's normal launch passes the kernel)."""
        index = self._next
        self._next = (index + 1) % SLOTS
        event = self._events[index]
        if event is not None:
            self._events_api.synchronize(event)
        array = self._arrays[index]
        if array is None or array.shape[0] < rows:
            size = max(rows, _FIRST_ROWS, 0 if array is None else 2 * array.shape[0])
            table = torch.empty((size, 2), dtype=torch.int64, device="cpu", pin_memory=True)
            self._tables[index] = table
            self._arrays[index] = array = table.numpy()
            self._addresses[index] = 0
        return index, array, self._tables[index]  # type: ignore[return-value]

    def address(self, index: int, api: DriverApi) -> int:
        """The device-mapped address of slot ``index``'s table (what a fast launch passes the
        kernel), asked of the driver once per table."""
        address = self._addresses[index]
        if not address:
            table = self._tables[index]
            assert table is not None, "address() of a slot never taken"
            address = self._addresses[index] = api.device_pointer(table.data_ptr())
        return address

    def launched(self, index: int, stream: int) -> None:
        """Mark slot ``index`` as read by the work just enqueued on raw ``stream``."""
        event = self._events[index]
        if event is None:
            event = self._events[index] = self._events_api.create_event()
        self._events_api.record(event, stream)
