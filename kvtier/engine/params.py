"""What a caller asks of the engine: how to sample, and how to schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Policy = Literal["guaranteed_no_evict", "max_utilization"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation settings. ``temperature == 0`` is greedy (argmax)."""

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How the scheduler batches.

    - ``policy``: ``"guaranteed_no_evict"`` admits a request only once pages for its whole
      prompt and ``max_tokens`` are reserved, so a running request never waits for memory;
      ``"max_utilization"`` allocates step by step and, under memory pressure, suspends running
      requests (their pages may be demoted to host and disk) and resumes them later.
    - ``max_num_tokens``: tokens computed per step (decode tokens + prefill chunks).
    - ``max_batch_size``: requests per step.
    - ``chunked_prefill``: split prompts longer than the step budget over several steps.
    """

    policy: Policy = "guaranteed_no_evict"
    max_num_tokens: int = 2048
    max_batch_size: int = 64
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.policy not in ("guaranteed_no_evict", "max_utilization"):
            raise ValueError(f"policy must be 'guaranteed_no_evict' or 'max_utilization', got {self.policy!r}")
        for name in ("max_num_tokens", "max_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
