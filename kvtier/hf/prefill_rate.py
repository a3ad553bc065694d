"""The prefill rate of a transformers model, measured over ``PrefixCache.generate`` calls.

``PrefixCache`` tells its manager this rate (``KVCacheManager.set_prefill_rate``), so that a
cached prefix is loaded only where that is estimated faster than recomputing it: blocks on a
slow disk are recomputed, and a call is never slower than plain ``generate`` by more than a
wrong estimate. A sample is one call's prompt forward: the token positions computed past the
reused columns (every row, pads included) over the time from just before the first forward
that computes them to the end of ``generate``'s first forward (the prefill). On CUDA the time is
read from two events once ``generate`` returned (it waits for the device every step), elsewhere
it is the wall time. A call computing fewer than ``MIN_TOKENS`` positions adds no sample, and
until one has, every cached block is loaded (``kvtier.engine.prefill_meter``), unless the rate
starts from the one remembered on the disk tier's directory.
"""

from __future__ import annotations

import torch

from kvtier.engine.prefill_meter import PrefillMeter


class PrefillTiming:
    """Samples of the prefill rate on ``device``: ``begin`` before a call's prompt forwards, ``hook``
    as a forward hook on the model during ``generate`` (it ends the sample at its first call),
    ``end`` after it."""

    def __init__(self, device: torch.device, rate: float | None = None) -> None:
        self._meter = PrefillMeter(device)
        self._meter.rate = rate  # a remembered rate: samples move it as they would a measured one
        self._mark: tuple[int, object] | None = None

    @property
    def rate(self) -> float | None:
        """The current estimate (tokens/s), None before the first sample and without a remembered rate."""
        return self._meter.rate

    def begin(self, positions: int) -> None:
        """The prompt forwards that compute ``positions`` token positions start now."""
        self._mark = self._meter.start(positions)

    def hook(self, module: torch.nn.Module, args: object, output: object) -> None:
        """A forward hook: the first forward after ``begin`` ends the sample."""
        if self._mark is not None:
            self._meter.finish(self._mark)
            self._mark = None

    def end(self) -> float | None:
        """The call is over: the measured rate (tokens/s), or None while no sample was taken."""
        self._mark = None
        self._meter.finish(None)  # reads the samples whose events completed
        return self._meter.rate
