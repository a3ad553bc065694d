"""What a caller asks of the engine: how to sample, and how to schedule.

Both records check every field when they are built: a wrong type or a value out of range is a
``ValueError`` naming the field, so a request never carries a setting that fails later.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Literal

from kvtier.config import is_int

Policy = Literal["guaranteed_no_evict", "max_utilization"]
PrefetchPolicy = Literal["off", "best_effort", "timeout", "wait_complete"]

MAX_SEED = (1 << 64) - 1  # torch.Generator.manual_seed takes any 64-bit unsigned value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation settings. ``temperature == 0`` is greedy (argmax).

    - ``max_tokens``: tokens to generate, an int >= 1.
    - ``temperature``: a finite real number >= 0.
    - ``seed``: None (the request id seeds the sampler) or an int in ``[0, 2**64)``.
    - ``stop_token_ids``: token ids (ints >= 0) that end the request once sampled.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Numpy numbers are taken as the Python numbers they hold."""
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "temperature", t if isinstance(t, int) else float(t))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "stop_token_ids", _stop_tokens(self.stop_token_ids))


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How the scheduler batches.

    - ``policy``: ``"guaranteed_no_evict"`` admits a request only once pages for its whole
      prompt and ``max_tokens`` are reserved, so a running request never waits for memory;
      ``"max_utilization"`` allocates step by step and, under memory pressure, preempts running
      requests: their caches are suspended (their pages may be demoted to host and disk) and
      resumed later, or, where no tier below the primary can take the pages, closed and the
      requests recomputed later from what they published.
    - ``max_num_tokens``: tokens computed per step (decode tokens + prefill chunks).
    - ``max_batch_size``: requests per step.
    - ``chunked_prefill``: split prompts longer than the step budget over several steps; without
      it a prompt longer than ``max_num_tokens`` is refused.
    - ``prefetch_policy``: requests waiting in the queue have their cached prefixes read from
      disk into host memory in the background (with a host and a disk tier), at most
      ``max_prefetches`` at a time. When such a request's turn comes
      before its read is over: ``"best_effort"`` starts it at once with what was read (the read
      is cancelled); ``"timeout"`` lets the requests behind it go first for up to
      ``prefetch_timeout_s`` seconds from the read's start, then cancels it; ``"wait_complete"``
      lets the requests behind it go first until the read is over. Under these two a request
      whose turn comes at once reads in the background too, so the running requests never wait
      for its disk. What a read brought stays in host memory until the request's cache is resumed
      (a read holding its pages counts against ``max_prefetches``); a request whose prefix had
      nothing on disk when it arrived is tried again once it heads the queue. ``"off"``, or
      ``max_prefetches=0``, prefetches nothing.
    - ``recompute_when_faster``: weigh a cached prefix found below the primary tier against
      recomputing it (each tier's measured bandwidth against the engine's prefill rate, measured
      from its first step on, calibrated when the engine is built) and recompute the blocks that
      would load slower (``kvtier.tiering.load_cost``). False loads every cached block: it spares
      the compute at the cost of a slower first token where a tier is slow.
    """

    policy: Policy = "guaranteed_no_evict"
    max_num_tokens: int = 2048
    max_batch_size: int = 64
    chunked_prefill: bool = True
    prefetch_policy: PrefetchPolicy = "best_effort"
    prefetch_timeout_s: float = 1.0
    max_prefetches: int = 4
    recompute_when_faster: bool = True

    def __post_init__(self) -> None:
        if self.policy not in ("guaranteed_no_evict", "max_utilization"):
            raise ValueError(f"policy must be 'guaranteed_no_evict' or 'max_utilization', got {self.policy!r}")
        for name in ("max_num_tokens", "max_batch_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.chunked_prefill, bool):
            raise ValueError(f"chunked_prefill must be a bool, got {self.chunked_prefill!r}")
        if self.prefetch_policy not in ("off", "best_effort", "timeout", "wait_complete"):
            raise ValueError(
                "prefetch_policy must be 'off', 'best_effort', 'timeout' or 'wait_complete', "
                f"got {self.prefetch_policy!r}"
            )
        timeout = self.prefetch_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 <= timeout < math.inf:
            raise ValueError(f"prefetch_timeout_s must be a finite number of seconds >= 0, got {timeout!r}")
        object.__setattr__(self, "prefetch_timeout_s", timeout if isinstance(timeout, int) else float(timeout))
        if not is_int(self.max_prefetches) or self.max_prefetches < 0:
            raise ValueError(f"max_prefetches must be an int >= 0, got {self.max_prefetches!r}")
        object.__setattr__(self, "max_prefetches", int(self.max_prefetches))
        if not isinstance(self.recompute_when_faster, bool):
            raise ValueError(f"recompute_when_faster must be a bool, got {self.recompute_when_faster!r}")


def _stop_tokens(value: object) -> tuple[int, ...]:
    """``stop_token_ids`` as a tuple of ints >= 0 (numpy integers accepted); ``ValueError`` otherwise."""
    error = ValueError(f"stop_token_ids must be a sequence of int token ids >= 0, got {value!r}")
    if isinstance(value, str | bytes):
        raise error
    try:
        items = list(value)  # type: ignore[call-overload]
        tokens = tuple(operator.index(t) for t in items if not isinstance(t, bool))
    except TypeError:
        raise error from None
    if len(tokens) != len(items) or any(t < 0 for t in tokens):
        raise error
    return tokens
