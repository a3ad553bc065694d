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
  most recently admitted request of the lowest priority is preempted and put back at the head
  of the queue. With a tier below the primary, its cache is suspended (its pages may be
  demoted, never dropped) and resumed later; with none, suspending would free nothing, so its
  cache is closed (what it published stays in the tree) and the request is recomputed later
  from its prompt and the tokens it generated.

Prefetch (``prefetch_policy``, with a host and a disk tier): after admission, the disk part of
the cached prefixes of a few waiting requests is read into host memory in the background, so a
request that waited behind others finds its prefix in host memory. When its turn comes before
the read is over, the policy decides whether it starts at once (the read is cancelled) or lets
the requests behind it go first for a while. Under those that let it wait (``timeout``,
``wait_complete``) the reads start before admission, so a request whose turn is now reads its
prefix in the background too, while the running requests go on, rather than during its
admission, which would stall them. The pages read stay in host memory until the request's
cache is resumed (or it finishes): the requests admitted before it would otherwise push them
back to disk. A request whose prefix had nothing on disk when it arrived is tried once more when
it reaches the head of the queue, since the requests ahead may have pushed it there meanwhile.

Nothing stalls: when no request runs and the head of the queue still cannot start, the caches
of the other waiting requests are closed (they will be recomputed), which frees every page a
cache holds; a request that cannot start even then can never run, and finishes with an error
(``failed``) while the others go on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kvtier.cache import CacheState
from kvtier.config import DiskTier, HostTier
from kvtier.engine.admission import RequestLimits
from kvtier.engine.params import SchedulerConfig
from kvtier.engine.request import Request, RequestStatus
from kvtier.errors import InvariantError
from kvtier.manager import KVCacheManager

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` to compute this step, from ``start``."""

    request: Request
    start: int
    num_tokens: int


@dataclass(slots=True)
class _Blocked:
    """Why the request at the head of the queue cannot start this step."""

    reason: str


ASK_LATER = _Blocked("its connector asked to be asked again later")  # the ones behind go first


class CacheHooks(Protocol):
    """What the scheduler tells about requests' caches, and asks, as it goes (a connector driver)."""

    def cache_created(self, request: Request) -> None:
        """Right after ``request.cache`` was created (it holds the local prefix), and at each later
        admission while the hooks set ``request.ask_later`` (the request waits meanwhile)."""
        ...

    def cache_resumed(self, request: Request, may_wait: bool) -> bool:
        """After each successful resume of ``request.cache``; False when the request waits for pages
        (only if ``may_wait``: requests running, or pages pending release, will free some)."""
        ...

    def cache_dropped(self, request: Request) -> None:
        """Before the scheduler closes the cache of a request that has not finished."""
        ...

    def pages_pending_release(self) -> bool:
        """Whether pages held outside the queues (a save in flight) will be freed."""
        ...

    def keeps_cache(self, request: Request) -> bool:
        """Whether ``request``'s cache, dropped, stays open for a while (a connector may still write
        its pages): it is not closed; the hooks close it later."""
        ...


class NoHooks:
    """The hooks of an engine without a connector: nothing to tell, nothing pending."""

    def cache_created(self, request: Request) -> None:
        return None

    def cache_resumed(self, request: Request, may_wait: bool) -> bool:
        return True

    def cache_dropped(self, request: Request) -> None:
        return None

    def pages_pending_release(self) -> bool:
        return False

    def keeps_cache(self, request: Request) -> bool:
        return False


class Scheduler:
    """Waiting and running queues over one cache manager.

    Invariants: a RUNNING request is in ``running`` and its cache is ACTIVE (one whose connector
    load is in flight, ``Request.awaits_load``, is neither scheduled nor preempted); a WAITING request is
    in ``waiting`` and has no cache (never admitted, or preempted for recompute) or a SUSPENDED
    one; a FINISHED request is in neither queue and its cache is closed (or held open by a
    connector's save until that ends).
    """

    def __init__(
        self, config: SchedulerConfig, mgr: KVCacheManager, limits: RequestLimits, hooks: CacheHooks | None = None
    ) -> None:
        self.config = config
        self.mgr = mgr
        self.limits = limits
        self.hooks: CacheHooks = hooks if hooks is not None else NoHooks()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.failed: list[Request] = []  # finished with an error since the engine last took them
        self.num_preemptions = 0
        self.num_recomputes = 0  # preemptions (and unblockings) that closed the cache
        # Suspending frees primary pages only if a tier below can take them.
        self._swap_out = len(mgr.config.tiers) > 1
        kinds = {type(t) for t in mgr.config.tiers}
        # Reads land in a host tier: into the primary tier they would hold slots running requests need.
        self._prefetch_tiers = HostTier in kinds and DiskTier in kinds

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """The chunks to compute this step (their caches are ACTIVE and large enough)."""
        budget = self.config.max_num_tokens
        batch: list[ScheduledChunk] = []
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or request.awaits_load:
                continue  # preempted earlier in this loop, or the connector still loads its pages
            if len(batch) >= self.config.max_batch_size or budget == 0:
                break
            n = self._chunk(request, budget)
            if n == 0:
                continue
            if not self._grow(request, request.next_position + n, batch):
                continue  # the request itself was preempted
            batch.append(ScheduledChunk(request, request.next_position, n))
            budget -= n
        reads_first = self.config.prefetch_policy in ("timeout", "wait_complete")
        if reads_first:
            self._prefetch_waiting()  # even a request whose turn is now waits for its read, not the others
        passed = 0  # waiting requests whose prefetch from disk lets the ones behind go first
        while len(self.waiting) > passed and len(batch) < self.config.max_batch_size and budget > 0:
            request = self.waiting[passed]
            if self._waits_for_prefetch(request):
                passed += 1
                continue
            chunk = self._admit(request, budget, batch)
            if isinstance(chunk, ScheduledChunk):
                del self.waiting[passed]
                batch.append(chunk)
                budget -= chunk.num_tokens
                continue
            if chunk is ASK_LATER:
                passed += 1  # the ones behind go first
                continue
            if self.running or batch or self.hooks.pages_pending_release():
                break  # memory comes back as running requests finish
            if not self._recompute_waiting(but=request) and not self._reuse_whole_blocks(request):
                self.fail(request, f"it cannot run even alone: {chunk.reason}")
        if not reads_first:
            self._prefetch_waiting()  # for the requests still waiting after admission
        if not batch and passed and not self.running:
            self._idle_wait()  # nothing else to do: let the reads go on, or the connector find out
        return batch

    def _idle_wait(self) -> None:
        """Wait a little for the prefix read of the first waiting request whose read is running, else
        (a connector asked to be asked again later) a millisecond."""
        job = next((r.prefetch for r in self.waiting if r.prefetch is not None and not r.prefetch.done()), None)
        if job is not None:
            job.wait(0.005)
        else:
            time.sleep(0.001)

    def finish(self, request: Request, reason: str, close_cache: bool = True) -> None:
        """Take a request out of the queues and close its cache (unless a connector still reads it)."""
        if request.prefetch is not None:
            request.prefetch.cancel()
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request.cache is not None and close_cache:
            request.cache.close()
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)

    def forget_failed(self, request: Request) -> None:
        """``request`` (failed) is not to be handed over by ``take_failed``: it was aborted."""
        if request in self.failed:
            self.failed.remove(request)

    def take_failed(self) -> list[Request]:
        """The requests that finished with an error since the last call."""
        failed, self.failed = self.failed, []
        return failed

    def _waits_for_prefetch(self, request: Request) -> bool:
        """Whether ``request`` lets the requests behind it go first while its prefix is read from
        disk (per ``prefetch_policy``); a read it no longer waits for is cancelled."""
        job = request.prefetch
        if job is None or job.done():
            return False
        policy = self.config.prefetch_policy
        if policy == "wait_complete":
            return True
        if policy == "timeout" and time.monotonic() - job.started < self.config.prefetch_timeout_s:
            return True
        job.cancel()
        request.prefetch = None
        return False

    def _prefetch_waiting(self) -> None:
        """Start reading the disk prefixes of waiting requests into host memory, a few at a time
        (``max_prefetches`` reads running or holding what they read, but the head of the queue may
        always start one): each request when it is first seen here, and once more at the head of
        the queue if the first found nothing on disk."""
        config = self.config
        if config.prefetch_policy == "off" or not self._prefetch_tiers:
            return
        running = sum(1 for r in self.waiting if r.prefetch is not None and (not r.prefetch.done() or r.prefetch.held))
        for position, request in enumerate(self.waiting):
            head = position == 0 and config.max_prefetches > 0  # never kept from a read by those behind it
            if running >= config.max_prefetches and not head:
                return
            if request.prefetch is not None or request.cache is not None:
                continue
            first = not request.prefetch_tried
            if not first:
                if position or not request.prefetch_again:
                    continue
                request.prefetch_again = False  # its one more try
            request.prefetch_tried = True
            request.prefetch = self.mgr.prefetch_to_host(request.tokens, scope=request.scope, hold=True)
            running += request.prefetch is not None
            request.prefetch_again = first and request.prefetch is None

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens of ``request`` to compute this step within ``budget`` (0: not this step).

        A recomputed request is chunked even without ``chunked_prefill``: its prompt fit in one
        step, but the prompt with its output may not. A chunk is no longer than its pages fit in
        the primary tier at once (``RequestLimits.chunk_that_fits``: a sliding-window model's long
        prompt, admitted for the window it holds, is computed a few blocks at a time).
        """
        want = len(request.tokens) - request.next_position
        if want > budget and not (self.config.chunked_prefill or request.output):
            return 0
        n = min(want, budget)
        if n > 1 and (self.config.chunked_prefill or request.output):
            n = self.limits.chunk_that_fits(request.next_position, request.held_cache().history_length, n)
        return n

    def _admit(self, request: Request, budget: int, batch: list[ScheduledChunk]) -> ScheduledChunk | _Blocked:
        if request.cache is None:
            # A recomputed request matches its own published blocks, output included.
            request.cache = self.mgr.create_cache(request.tokens, scope=request.scope, priority=request.priority)
            request.reuse_unread = request.reuse_unread or not request.admitted  # until a resume reads it
            request.admitted = True
            self.hooks.cache_created(request)
        elif request.ask_later:
            self.hooks.cache_created(request)  # asked again, over the same (suspended) cache
        if request.ask_later:  # the connector does not know yet: the request waits, its cache suspended
            return ASK_LATER
        cache = request.cache
        if not cache.resume():
            return _Blocked("its cached pages do not fit in the primary tier")
        if request.prefetch is not None:  # resumed: the pages its read holds are its cache's now
            request.prefetch.cancel()
            request.prefetch = None
        if request.reuse_unread:  # what the resume kept: pages failing their checksum were given up
            request.reused_by_tier = dict(cache.reused_by_tier)
            request.reuse_unread = False
        if not self.hooks.cache_resumed(request, bool(self.running or batch or self.hooks.pages_pending_release())):
            cache.suspend()
            return _Blocked("the pages its connector offer needs are not available in the primary tier")
        n = self._chunk(request, budget)
        if n == 0:
            cache.suspend()
            return _Blocked(f"its {len(request.tokens)} tokens exceed max_num_tokens and chunked_prefill is off")
        target = request.next_position + n
        request.holds_to_completion = False
        if self.config.policy == "guaranteed_no_evict":
            # The last sampled token is never computed: prompt + max_tokens - 1 tokens at most.
            whole = max(target, len(request.prompt) + request.params.max_tokens - 1)
            if self.limits.fits_at_once(whole, cache.history_length):
                target = whole
                request.holds_to_completion = True
            # else a sliding-window request too long to hold at once: computed in chunks its window
            # fits, and it waits (preempting only itself) when the pages it grows into are taken
        if not cache.resize(max(target, cache.capacity)):
            cache.suspend()
            return _Blocked(f"pages for {target} tokens are not available in the primary tier")
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return ScheduledChunk(request, request.next_position, n)

    def _grow(self, request: Request, end: int, batch: list[ScheduledChunk]) -> bool:
        """Capacity for ``end`` tokens; under max_utilization, preempt others until it fits. Under
        guaranteed_no_evict a request holds its pages from admission; one computed in chunks (a
        sliding-window request too long to hold at once) preempts only itself, to wait for pages.

        Without a tier below the primary one, the suspended caches of waiting requests pin their
        pages there (nothing can move them): one of a priority no higher than the victim's (any,
        when the victim would be the request itself) is closed instead of a preemption. Else a
        running request needing those pages would preempt itself, be admitted again, and preempt
        itself again, for ever."""
        cache = request.held_cache()
        while not cache.resize(max(end, cache.capacity)):
            if self.config.policy == "max_utilization":
                scheduled = {id(c.request) for c in batch}
                victims = [r for r in self.running if id(r) not in scheduled and not r.awaits_load]
                victim = min(reversed(victims), key=lambda r: r.priority)  # lowest priority, latest admitted
            elif request.holds_to_completion:
                raise InvariantError("guaranteed_no_evict reserved every page at admission")
            else:
                victim = request  # a request computed in chunks never takes another's pages
            at_most = None if victim is request else victim.priority
            if not self._swap_out and self._drop_a_waiting_cache(at_most):
                continue
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def recompute(self, request: Request) -> None:
        """Back to the head of the queue without its cache (a connector's load into it failed; the
        cache is closed, or kept by the hooks while the connector may still write it): it starts
        over from what is published."""
        if request.status is not RequestStatus.RUNNING:
            raise InvariantError(f"request {request.request_id} recomputed while {request.status.value}")
        self._drop_cache(request)
        request.status = RequestStatus.WAITING
        self.running.remove(request)
        self.waiting.appendleft(request)

    def _preempt(self, request: Request) -> None:
        """Back to the head of the queue, its cache suspended (swap) or closed (recompute)."""
        cache = request.held_cache()
        if cache.state is not CacheState.ACTIVE:
            raise InvariantError(f"request {request.request_id} preempted with a {cache.state.value} cache")
        if self._swap_out:
            cache.suspend()
        else:
            self._drop_cache(request)
        request.status = RequestStatus.WAITING
        self.running.remove(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        log.debug("preempted request %d at %d tokens", request.request_id, request.num_computed)

    def _drop_a_waiting_cache(self, at_most: int | None) -> bool:
        """Close the cache of the waiting request of lowest priority (the latest queued of those)
        that holds one, of a priority of ``at_most`` or below (None: any); False if none does."""
        holders = [r for r in self.waiting if r.cache is not None and (at_most is None or r.priority <= at_most)]
        if not holders:
            return False
        self._drop_cache(min(reversed(holders), key=lambda r: r.priority))
        return True

    def _recompute_waiting(self, but: Request) -> bool:
        """Close the caches of waiting requests other than ``but`` and let go of what their reads
        hold in host memory; False if none had either."""
        holders = [r for r in self.waiting if r is not but and (r.cache is not None or r.prefetch is not None)]
        for request in holders:
            if request.prefetch is not None:
                request.prefetch.cancel()
                request.prefetch = None
            if request.cache is not None:
                self._drop_cache(request)
        return bool(holders)

    def _reuse_whole_blocks(self, request: Request) -> bool:
        """Give up the partly reused last block of a request that cannot run even alone: copying
        it needs one more primary page than the block itself (a prompt that fills the primary
        tier). False when its cache holds no such reuse (or more than its reused prefix)."""
        cache = request.cache
        if cache is None or cache.num_committed_tokens != cache.num_reused_tokens:
            return False
        tpb = self.mgr.config.tokens_per_block
        whole = cache.num_reused_tokens // tpb * tpb
        return whole < cache.num_reused_tokens and cache.shorten_reuse(whole) > 0

    def _drop_cache(self, request: Request) -> None:
        """Close the cache of an unfinished request (unless the hooks keep it): it will be
        recomputed from what was published."""
        cache = request.held_cache()
        self.hooks.cache_dropped(request)
        if not self.hooks.keeps_cache(request):
            cache.close()
        request.cache = None
        request.loaded_until = 0
        self.num_recomputes += 1

    def fail(self, request: Request, reason: str) -> None:
        """Finish ``request`` with an error, its cache closed; ``take_failed`` hands it over."""
        request.error = f"request {request.request_id} failed: {reason}"
        log.warning("kvtier engine: %s", request.error)
        keep = False
        if request.cache is not None:
            self.hooks.cache_dropped(request)
            keep = self.hooks.keeps_cache(request)
        self.finish(request, "error", close_cache=not keep)
        self.failed.append(request)
