"""A request inside the engine, the connector's offer for it, and the ``RequestOutput`` it turns into."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from kvtier.cache import KVCache
from kvtier.config import ReuseScope
from kvtier.engine.params import SamplingParams
from kvtier.errors import InvariantError
from kvtier.tiering.host_prefetch import HostPrefetch


@dataclass(slots=True)
class Offer:
    """What the connector promised a request for its current allocation: tokens ``[start, end)``.

    ``reserved``: the cache has capacity and history up to ``end`` for it; ``delivered``: the
    connector was told the pages (``update_state_after_alloc``) and the load started;
    ``in_flight``: an asynchronous load the connector has not reported finished yet (its tokens
    are not committed; kvtier.engine.connector_driver).
    """

    start: int
    end: int
    asynchronous: bool
    reserved: bool = False
    delivered: bool = False
    in_flight: bool = False


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its cache suspended)
    RUNNING = "running"  # its cache is ACTIVE
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """One prompt being served.

    ``tokens`` is the prompt followed by every generated token. The cache holds the KV of
    ``tokens[: cache.num_committed_tokens]``; the next forward computes from there, so a cache
    that had to start over after a damaged page simply recomputes more, and a request preempted
    for recompute (no cache) gets a new one that matches what it published, its output included.
    """

    request_id: int
    prompt: list[int]
    params: SamplingParams
    scope: ReuseScope
    priority: int
    arrival: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(init=False)
    status: RequestStatus = RequestStatus.WAITING
    cache: KVCache | None = None
    admitted: bool = False  # had a cache once (a recompute keeps the first admission's reuse counts)
    reuse_unread: bool = False  # its first cache's reuse is read at its first resume (a damaged page lowers it)
    holds_to_completion: bool = False  # guaranteed_no_evict reserved every page it will need at its admission
    first_token_time: float | None = None
    finish_time: float | None = None
    computed_prompt_tokens: int = 0
    reused_by_tier: dict[str, int] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str | None = None  # why it finished with finish_reason "error"
    offer: Offer | None = None  # the connector's offer for this allocation
    loaded_until: int = 0  # end of a reserved connector offer: tokens below it are loaded, not computed
    prefetch: HostPrefetch | None = None  # its prefix being read from disk into host memory while it waits
    prefetch_tried: bool = False
    prefetch_again: bool = False  # its first prefetch found nothing on disk: tried again at the queue's head
    asks_connector: bool = True  # False once a connector's load for it failed: it is not offered again
    asked_later_since: float | None = None  # when the connector first answered "ask again later" (None)
    ask_later: bool = False  # the connector's ask answered None: it waits, asked again at a later step

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def num_computed(self) -> int:
        """Tokens whose KV is in the cache (0 before admission)."""
        return self.cache.num_committed_tokens if self.cache is not None else 0

    @property
    def next_position(self) -> int:
        """Where this step's compute starts: after the cached tokens and any reserved connector load."""
        return max(self.num_computed, self.loaded_until)

    @property
    def awaits_load(self) -> bool:
        """Whether the connector's asynchronous load into its pages is in flight: it computes nothing
        and is never preempted until the load is reported (its cache stays ACTIVE)."""
        return self.offer is not None and self.offer.in_flight

    def held_cache(self) -> KVCache:
        """The request's cache; ``InvariantError`` if it has none (a RUNNING request always has one)."""
        if self.cache is None:
            raise InvariantError(f"request {self.request_id} ({self.status.value}) has no cache")
        return self.cache

    def to_output(self) -> RequestOutput:
        if self.finish_time is None:
            raise InvariantError(f"request {self.request_id} has not finished")
        first = self.first_token_time
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt),
            token_ids=self.output,
            ttft_s=math.nan if first is None else first - self.arrival,
            latency_s=self.finish_time - self.arrival,
            num_prompt_tokens=len(self.prompt),
            num_computed_prompt_tokens=self.computed_prompt_tokens,
            reused_tokens_by_tier={"primary": 0, "host": 0, "disk": 0, "connector": 0, **self.reused_by_tier},
            finish_reason=self.finish_reason or "length",
            error=self.error,
        )


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """The result of one prompt.

    ``num_computed_prompt_tokens``: prompt tokens this engine ran through the model (a request
    preempted and recomputed counts them again); ``reused_tokens_by_tier``: prompt tokens whose
    KV came from each tier ("primary", "host", "disk") or from the connector ("connector") when
    the request was first admitted. ``finish_reason`` is "stop", "length", "abort" or "error";
    with "error", ``error`` says why and ``token_ids`` holds what was generated before it
    (``ttft_s`` is NaN when no token was).
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    ttft_s: float
    latency_s: float
    num_prompt_tokens: int
    num_computed_prompt_tokens: int
    reused_tokens_by_tier: dict[str, int]
    finish_reason: str
    error: str | None = None
