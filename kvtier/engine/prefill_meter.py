"""The engine's measured prefill rate, which the cache manager weighs loads against.

The rate starts from a calibration when the engine is built: the model's dense forward over a
prompt of up to ``CALIBRATION_TOKENS`` tokens, run once to warm the device up (a cold first
forward pays for library start-up: measured 1.28 s against 0.38 s warm for an 8K chunk of an
8B model on an H200) and once timed. With no context before it, that forward is faster than a
chunk deep into a long prompt, so the first estimate errs toward recomputing.

Then every step that computes at least ``MIN_TOKENS`` prompt tokens (chunks longer than one
token) adds a sample: its prompt tokens over the time the device spent on the step. On CUDA that
time comes from two events around the step, read once they completed (a later step, never a
wait), since a step that samples no token returns before its kernels ran. On the CPU it is the
wall time. The rate is an exponentially weighted mean. A step mixing prefill and decode counts
its prefill tokens only, so the rate errs low: loads are kept a little more often than they win.
"""

from __future__ import annotations

import time
from collections import deque

import torch

MIN_TOKENS = 256  # shorter prefills are dominated by fixed per-step costs
CALIBRATION_TOKENS = 1024
SMOOTHING = 0.3


class PrefillMeter:
    """Tokens per second of prefill on ``device``, measured over the engine's own steps."""

    def __init__(self, device: torch.device) -> None:
        self.rate: float | None = None
        self._device = device
        self._cuda = device.type == "cuda"
        self._pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = deque()

    def calibrate(self, model, tokens: int) -> float:
        """Time the model's dense forward over ``tokens`` tokens (after one untimed warm-up); that
        rate becomes the first estimate. Returns it."""
        ids = torch.arange(tokens, device=self._device) % model.vocab_size
        with torch.inference_mode():
            model.forward_dense(ids, "last")
            self._settle()
            began = time.perf_counter()
            model.forward_dense(ids, "last")
            self._settle()
            seconds = time.perf_counter() - began
        self.rate = tokens / max(seconds, 1e-9)
        return self.rate

    def start(self, prefill_tokens: int) -> tuple[int, object] | None:
        """A mark before a step that computes ``prefill_tokens`` prompt tokens (None when too few
        to sample): a recorded event on CUDA, the wall clock elsewhere."""
        if prefill_tokens < MIN_TOKENS:
            return None
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self._device))
            return prefill_tokens, event
        return prefill_tokens, time.perf_counter()

    def finish(self, mark: tuple[int, object] | None) -> float | None:
        """The step marked by ``mark`` (if any) is done on the host; returns the new rate when a
        sample (this step's, or an earlier one's whose events completed since) moved it, else None."""
        moved = False
        if mark is not None:
            tokens, began = mark
            if self._cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record(torch.cuda.current_stream(self._device))
                self._pending.append((tokens, began, end))
            else:
                moved = self._add(tokens, time.perf_counter() - began)
        while self._pending and self._pending[0][2].query():
            tokens, began, ended = self._pending.popleft()
            moved = self._add(tokens, began.elapsed_time(ended) / 1e3) or moved
        return self.rate if moved else None

    def _add(self, tokens: int, seconds: float) -> bool:
        if seconds <= 0:
            return False
        sample = tokens / seconds
        self.rate = sample if self.rate is None else (1 - SMOOTHING) * self.rate + SMOOTHING * sample
        return True

    def _settle(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self._device)
