"""The table ring's events without cuda-bindings: torch's CUDA events, on streams given by raw handle.

``kvtier.copy.table_ring`` needs three calls: make an event, record it on a raw stream, wait on
the host until it has completed. ``DriverApi`` makes them through the driver; where cuda-bindings
is not installed, ``TorchEvents`` makes them through torch, a few microseconds a call more.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class TorchEvents:
    """``create_event`` / ``record`` / ``synchronize`` on ``torch.cuda.Event``.

    ``stream_of`` turns a raw stream handle into the torch stream it names (the copier's
    ``torch_stream``, which keeps one wrapper per handle).
    """

    def __init__(self, stream_of: Callable[[int], torch.cuda.Stream]) -> None:
        self._stream_of = stream_of

    def create_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record(self, event: torch.cuda.Event, stream: int) -> None:
        event.record(self._stream_of(stream))

    def synchronize(self, event: torch.cuda.Event) -> None:
        """Block until ``event`` has completed; returns at once when it has (or was never recorded)."""
        if not event.query():
            event.synchronize()
