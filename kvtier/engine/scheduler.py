"""Continuous batching: which requests run this step, and how many tokens each computes.

Every step, running requests go first, in admission order (a decode computes one token, a
prompt in progress its next chunk), then waiting requests are admitted first come, first served
while the token budget and the batch size allow. A request is admitted by creating its cache
(which takes ownership of the reusable prefix on any tier), resuming it (which brings those
pages into the primary tier) and growing it for its first chunk.

Policies:
- ``guaranteed_no_evict``: admission reserves capacity for the whole prompt and ``max_tokens``,
  so a running request never needs memory again.
- ``max_utilization``: capacity grows step by step; when a running request cannot grow, the
  most recently admitted request of the lowest priority is preempted (its cache suspended, its
  pages left to be demoted), put back at the head of the queue, and resumed later.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.cache import CacheState
from kvtier.engine.params import SchedulerConfig
from kvtier.engine.request import Request, RequestStatus
from kvtier.errors import OutOfPagesError
from kvtier.manager import KVCacheManager

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` to compute this step, from ``start``."""

    request: Request
    start: int
    num_tokens: int


# Called once a waiting request has a cache, before it is resumed: (request) -> None.
AdmitHook = Callable[[Request], None]


class Scheduler:
    """Waiting and running queues over one cache manager."""

    def __init__(self, config: SchedulerConfig, mgr: KVCacheManager) -> None:
        self.config = config
        self.mgr = mgr
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Hooks a connector driver sets: right after a cache is created, and after each resume.
        self.on_cache_created: AdmitHook = _nothing
        self.on_resumed: AdmitHook = _nothing
        # Whether pages held outside the queues (e.g. by a connector's save in flight) will be freed.
        self.pages_pending_release: Callable[[], bool] = lambda: False

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """The chunks to compute this step (their caches are ACTIVE and large enough)."""
        budget = self.config.max_num_tokens
        batch: list[ScheduledChunk] = []
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if len(batch) >= self.config.max_batch_size or budget == 0:
                break
            n = self._chunk(request, budget)
            if n == 0:
                continue
            if not self._grow(request, request.next_position + n, batch):
                continue  # the request itself was preempted
            batch.append(ScheduledChunk(request, request.next_position, n))
            budget -= n
        while self.waiting and len(batch) < self.config.max_batch_size and budget > 0:
            chunk = self._admit(self.waiting[0], budget, batch)
            if chunk is None:
                break
            self.waiting.popleft()
            batch.append(chunk)
            budget -= chunk.num_tokens
        return batch

    def finish(self, request: Request, reason: str, close_cache: bool = True) -> None:
        """Take a request out of the queues and close its cache (unless a connector still reads it)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request.cache is not None and close_cache:
            request.cache.close()
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens of ``request`` to compute this step within ``budget`` (0: not this step)."""
        want = len(request.tokens) - request.next_position
        if want <= budget:
            return want
        return budget if self.config.chunked_prefill else 0

    def _admit(self, request: Request, budget: int, batch: list[ScheduledChunk]) -> ScheduledChunk | None:
        if request.cache is None:
            request.cache = self.mgr.create_cache(request.prompt, scope=request.scope, priority=request.priority)
            request.reused_by_tier = dict(request.cache.reused_by_tier)
            self.on_cache_created(request)
        cache = request.cache
        if not cache.resume():
            self._check_can_ever_run(request, batch, "its cached pages do not fit in the primary tier")
            return None
        self.on_resumed(request)
        n = self._chunk(request, budget)
        if n == 0:
            if not self.running and not batch:
                raise ValueError(
                    f"request {request.request_id}: a {len(request.tokens)}-token prompt exceeds max_num_tokens="
                    f"{self.config.max_num_tokens} and chunked_prefill is off"
                )
            cache.suspend()
            return None
        target = request.next_position + n
        if self.config.policy == "guaranteed_no_evict":
            target = max(target, len(request.prompt) + request.params.max_tokens)
        if not cache.resize(max(target, cache.capacity)):
            cache.suspend()
            self._check_can_ever_run(request, batch, f"{target} tokens of pages are not available")
            return None
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return ScheduledChunk(request, request.next_position, n)

    def _grow(self, request: Request, end: int, batch: list[ScheduledChunk]) -> bool:
        """Capacity for ``end`` tokens; under max_utilization, preempt others until it fits."""
        cache = request.cache
        assert cache is not None
        while not cache.resize(max(end, cache.capacity)):
            if self.config.policy != "max_utilization":
                raise AssertionError("guaranteed_no_evict reserved every page at admission")
            scheduled = {id(c.request) for c in batch}
            victims = [r for r in self.running if id(r) not in scheduled]
            victim = min(reversed(victims), key=lambda r: r.priority)  # lowest priority, latest admitted
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        assert request.cache is not None and request.cache.state is CacheState.ACTIVE
        request.cache.suspend()
        request.status = RequestStatus.WAITING
        self.running.remove(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        log.debug("preempted request %d at %d tokens", request.request_id, request.num_computed)

    def _check_can_ever_run(self, request: Request, batch: list[ScheduledChunk], why: str) -> None:
        """With nothing running to free memory, a request that cannot start never will."""
        if not self.running and not batch and not self.pages_pending_release():
            raise OutOfPagesError(
                f"request {request.request_id} cannot run even alone: {why}; give the primary tier more memory"
            )


def _nothing(request: Request) -> None:
    return None
