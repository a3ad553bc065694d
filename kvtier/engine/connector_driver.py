"""The engine side of the connector protocol: ask, reserve, deliver, save, hand back.

The driver is the scheduler's ``CacheHooks``: the scheduler tells it when a cache is created,
resumed or dropped. Per request, one ``Offer`` (``Request.offer``) records the absolute token
range ``[start, end)`` the connector promised for the current allocation (a memoised absolute
end, never a delta), and how far the protocol got with it:

    ask      when the request's cache is created (it holds the local prefix, ``start``):
             get_num_new_matched_tokens once; the end is clamped below the prompt length and
             the dropped tail handed back with cancel_load at once (the whole offer when the
             cut moves a sliding window back onto a block the offer did not cover)
    reserve  after every successful resume until it succeeds: capacity and history to ``end``
             in one resize; if that cannot be had (or the cache had to start over below
             ``start``), the offer is handed back with cancel_load
    deliver  when the request is in the batch that runs: update_state_after_alloc exactly once,
             the worker loads, and the loaded tokens are committed to the cache; an
             asynchronous load not reported finished by then is *in flight*: its request leaves
             the step's batch, the others run, and each later step asks ``get_finished`` until
             the load is reported (committed then: the request runs from the offer's end) or
             ``ASYNC_LOAD_WAIT_S`` has passed

An offer not delivered when its request is aborted, fails, or is preempted for recompute (its
cache closed) is handed back too. Every request that ends (finished, aborted, failed) is told to
the connector once (``request_finished``). A request whose save is still running when it ends
keeps its cache (pages locked in the primary tier) until ``get_finished`` reports the save done;
``wait_for_saves`` waits for that (``generate`` returns only then). A request whose load is in
flight is never preempted, and one aborted then keeps its cache the same way, until the
connector reports the load (and its save, if it has one): a late write lands in no one else's
page, and a save reads only the request's own bytes.

A step with no batch steps the connector all the same (``idle_step``), as vLLM does, so that it
hears of the requests that ended and starts saves it defers to a step's start.

A load that fails (a load hook raised, a report raised, the connector reported it failed with
``get_failed_loads`` or by a page's block id with ``get_block_ids_with_load_errors``, or it
stayed in flight past ``ASYNC_LOAD_WAIT_S``) is a miss: nothing of
its offer is committed, the request starts over from what the engine holds (``missed_loads``:
the scheduler recomputes it), and the connector is not asked for it again. A cache the
connector may still write into stays open, apart from the request, until the load is reported.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Collection

import torch

from kvtier.cache import CacheState, KVCache
from kvtier.connector.base import ConnectorRequest, SchedulerOutput
from kvtier.engine.batch_scheduler import ScheduledChunk
from kvtier.engine.request import Offer, Request
from kvtier.errors import InvariantError
from kvtier.lifecycle import GroupRule
from kvtier.manager import KVCacheManager
from kvtier.storage.log_limit import RateLimitedWarning

log = logging.getLogger(__name__)

ASYNC_LOAD_WAIT_S = 30.0  # how long a load may stay in flight (and reports keep raising) before it is given up on
EARLY_REPORTS_KEPT = 4096  # saves reported before ``request_finished`` remembered for it

_running: dict[int, weakref.ref] = {}  # id of a connector -> the driver that runs it for an engine not closed


class ConnectorDriver:
    """Runs one connector (an object implementing both halves) over one engine's cache manager."""

    def __init__(self, connector, mgr: KVCacheManager) -> None:
        self.connector = connector
        self.mgr = mgr
        self.saving: dict[int, KVCache] = {}
        self.in_flight: dict[int, tuple[Request, Offer, float]] = {}  # loads running: (request, offer, deadline)
        self._missed: dict[int, Request] = {}  # requests whose loads failed: they start over
        self.unreported_saves: dict[int, KVCache] = {}  # saves given up on: pages held until reported
        self._reports_failing_since: float | None = None  # since when every get_finished has raised
        self.loading: dict[int, KVCache] = {}  # caches of loads given up on that the connector may still write
        self._awaited_until: dict[int, float] = {}  # per request of ``loading``: until then its pages are waited for
        self._saved_early: dict[int, None] = {}  # saves reported before their request finished, the latest last
        self._failures: dict[str, RateLimitedWarning] = {}  # per kind of connector failure
        self._ended: list[int] = []  # requests told ended since the last build that returned
        self._ended_again: list[int] = []  # those a build that raised listed: listed once more
        self._may_save = False  # this step's metadata was bound and lists what the forward computes
        self._load_failed: set[int] = set()  # loads in flight with a page reported failed by block id
        # Synchronous offers of a failed step whose hand-back raised: a load the connector recorded for
        # one may still land at its next ``start_load_kv``, so the cache stays open until one returns
        # (and counts as pages pending release until the deadline beside it).
        self._unsettled: dict[int, tuple[KVCache, float]] = {}
        held = _running.get(id(connector))
        other = held() if held is not None else None
        if other is not None and other.connector is connector:
            raise ValueError(
                "this connector already serves another engine (open, or closed while its saves still ran); give "
                "each engine a connector of its own (one connector keeps one engine's layout, pages and requests)"
            )
        connector.register_kv_cache_layout(mgr.layout())
        _running[id(connector)] = weakref.ref(self)

    def detach(self) -> None:
        """The engine no longer runs the connector (closed, or never built): another engine may."""
        held = _running.get(id(self.connector))
        if held is not None and held() is self:
            del _running[id(self.connector)]

    # -- the three phases (the first two and the hand-back are the scheduler's CacheHooks) -------------

    def cache_created(self, request: Request) -> None:
        """Phase 1, ask, once per allocation: what can the connector add after the local prefix?"""
        if request.offer is not None:
            raise InvariantError(f"request {request.request_id} was asked twice for one allocation")
        request.ask_later = False
        if not request.asks_connector:
            return
        local = request.held_cache().num_committed_tokens
        view = self._view(request, with_blocks=False)
        try:
            tokens, asynchronous = self.connector.get_num_new_matched_tokens(view, local)
            if tokens is None and self._asks_later(request):
                return
            request.asked_later_since = None
            if tokens is None:
                raise TimeoutError(f"it answered 'ask again later' (None) for {ASYNC_LOAD_WAIT_S:g} s: no offer")
            end = local + max(0, int(tokens))
        except Exception as exc:  # a hook that raised, or a count that is no integer (NaN, a str): no offer
            request.asked_later_since = None
            self._connector_failed("an ask", exc)
            return
        limit = len(request.prompt) - 1  # the last prompt token is always computed
        if end > limit:
            if self._window_grows(local, limit, end):  # it may not have the block the cut end needs
                self._hand_back(view, local, end)
                return
            self._hand_back(view, max(local, limit), end)
            end = limit
        if end > local:
            request.offer = Offer(local, end, bool(asynchronous))

    def _asks_later(self, request: Request) -> bool:
        """The connector answered None, vLLM's "not known yet": the request waits (its cache
        suspended) and is asked again at a later step (``Request.ask_later``), for
        ``ASYNC_LOAD_WAIT_S`` at most; then it runs without an offer."""
        now = time.monotonic()
        if request.asked_later_since is None:
            request.asked_later_since = now
        request.ask_later = now - request.asked_later_since < ASYNC_LOAD_WAIT_S
        return request.ask_later

    def cache_resumed(self, request: Request, may_wait: bool) -> bool:
        """Phase 2, reserve, after resume: back the offer with pages, history moved to its end in the
        same call. Pages that cannot be had while ``may_wait`` (others will free some) keep the
        offer: False, the request waits, as vLLM's waits for blocks; else the offer is handed back
        and the request computes instead."""
        offer = request.offer
        if offer is None or offer.delivered:
            return True  # (a delivered offer is loaded and committed: nothing to back or hand back)
        cache = request.held_cache()
        intact = cache.num_committed_tokens == offer.start
        if offer.reserved and intact and cache.history_length >= offer.end:
            return True  # still backed (resumed again after a deferral or a preemption)
        if not offer.reserved and intact:
            if cache.resize(max(offer.end, cache.capacity), history=offer.end):
                offer.reserved = True
                request.loaded_until = offer.end
                return True
            if may_wait:
                return False
        # It could not be had, or the cache started over below the offer: hand it back.
        self._hand_back(self._view(request, with_blocks=False), offer.start, offer.end)
        request.offer = None
        request.loaded_until = 0
        return True

    def pages_pending_release(self) -> bool:
        """Whether saves, loads given up on or unsettled hand-backs hold pages that they will release.
        A load given up on (or a hand-back unsettled) counts for ``ASYNC_LOAD_WAIT_S`` more: a
        connector that never reports it (or whose ``start_load_kv`` keeps raising) must not hold
        back the requests that need its pages for ever (they are recomputed, or fail alone)."""
        if self.saving:
            return True
        now = time.monotonic()
        if any(until > now for _, until in self._unsettled.values()):
            return True
        return any(self._awaited_until.get(request_id, 0.0) > now for request_id in self.loading)

    def keeps_cache(self, request: Request) -> bool:
        """Whether the connector may still write the pages of ``request``'s cache (a load given up
        on, or a synchronous one handed back by a ``cancel_load`` that raised): the cache stays open,
        apart from the request, until the connector reports the load (or, synchronous, until its
        next ``start_load_kv`` returns)."""
        return request.cache is not None and self._held_apart(request.request_id, request.cache)

    def before_forward(self, batch: list[ScheduledChunk]) -> set[int]:
        """Phase 3 for the batch that runs: deliver, load, and commit what was loaded.

        Returns the requests that sit this step out: those whose asynchronous loads are now in
        flight (``Request.awaits_load``), and those whose loads failed (a hook raised, or a value
        it gave was unusable: every offer of the step; or the connector reported it failed), which
        start over (``missed_loads``). Other requests of the batch run as usual.

        The step's save hooks run only if the metadata lists exactly what the forward computes: a
        load failing once it is bound (a hook raised, or a block id reported) takes its request out
        of the forward, and a per-step saver would store pages nothing wrote. Offers handed to the
        connector in a step whose hooks raised are handed back (``cancel_load``): a load it
        recorded for a synchronous one must never land in pages its request gives up now."""
        delivered: list[tuple[Request, Offer]] = []
        for chunk in batch:  # all marked first: a hook raising for one fails every offer of the step
            offer = chunk.request.offer
            if offer is not None and offer.reserved and not offer.delivered:
                offer.delivered = True
                delivered.append((chunk.request, offer))
        waiting = [request for request, offer in delivered if offer.asynchronous]
        # The offers the connector was handed (it may load them, even if it raised).
        handed: list[tuple[Request, Offer]] = []
        self._may_save = False
        stage = "a delivery"  # what failed, for the log
        try:
            for request, offer in delivered:
                view = self._view(request)
                handed.append((request, offer))
                self.connector.update_state_after_alloc(view, view.block_ids_by_layer_group)
            sitting_out = {request.request_id for request in waiting}  # (an asynchronous load sits its step out)
            computing = [c for c in batch if c.request.request_id not in sitting_out]
            output = SchedulerOutput(
                [self._view(c.request, computed=c.start, scheduled=c.num_tokens) for c in computing],
                {c.request.request_id: c.num_tokens for c in computing},
                self._ended_ids(),
            )
            stage = "its step's metadata"
            self._build_and_bind(output)
            stage = "a load"
            stream = self._stream()
            self.connector.start_load_kv(stream)
            self._settle()
            for layer_id in range(len(self.mgr.spec.layers)):
                self.connector.wait_for_layer_load(layer_id, stream)
            deadline = time.monotonic() + ASYNC_LOAD_WAIT_S
            for request, offer in delivered:
                if offer.asynchronous:
                    offer.in_flight = True
                    self.in_flight[request.request_id] = (request, offer, deadline)
            loaded_now = [(request, offer) for request, offer in delivered if not offer.asynchronous]
            for request in self._read_load_errors(loaded_now):
                self._missed[request.request_id] = request
            if waiting:  # a load reported finished already is committed now: it runs from the next step
                self._take_reports(*self._finished(sorted(self.saving), self._loads_asked()))
        except Exception as exc:  # a connector's own bug: the loads of this step cannot be trusted
            self._connector_failed(stage, exc)
            self._may_save = False
            self._fail_handed(handed)
            self._missed.update((request.request_id, request) for request, _ in delivered)
            return {request.request_id for request, _ in delivered}
        for request, offer in delivered:
            if not offer.asynchronous and request.request_id not in self._missed:
                self._commit(request, offer)
        missed = {request.request_id for request, _ in delivered} & self._missed.keys()
        if any(not offer.asynchronous and request.request_id in missed for request, offer in delivered):
            self._may_save = False  # listed as computing, but out of the forward: no save of this step
        return {request.request_id for request in waiting} | missed

    def _fail_handed(self, handed: list[tuple[Request, Offer]]) -> None:
        """The offers handed to the connector in a step whose hooks raised: asynchronous ones are
        given up on (their pages held until reported), synchronous ones handed back (their pages
        are released when their requests start over). The offers after a raising deliver never
        reached it: closed when recomputed."""
        self._give_up([request for request, offer in handed if offer.asynchronous])
        for request, offer in handed:
            if not offer.asynchronous and not self._hand_back(
                self._view(request, with_blocks=False), offer.start, offer.end
            ):
                self._unsettled[request.request_id] = (request.held_cache(), time.monotonic() + ASYNC_LOAD_WAIT_S)

    def _settle(self) -> None:
        """A ``start_load_kv`` returned: loads recorded for offers handed back unconfirmed have landed
        or never will; their caches close (unless a save still reads one)."""
        if not self._unsettled:
            return
        unsettled, self._unsettled = self._unsettled, {}
        for request_id, (cache, _) in unsettled.items():
            if not self._saves_from(request_id, cache):
                cache.close()

    def _commit(self, request: Request, offer: Offer) -> None:
        """The connector loaded ``offer``: its tokens are committed to the request's cache."""
        cache = request.held_cache()
        if cache.num_committed_tokens != offer.start:
            raise InvariantError(f"request {request.request_id} committed past its offer before the load")
        cache.commit(request.tokens[offer.start : offer.end])
        request.reused_by_tier["connector"] = request.reused_by_tier.get("connector", 0) + offer.end - offer.start
        request.loaded_until = 0
        offer.in_flight = False

    def loads_in_flight(self) -> bool:
        return bool(self.in_flight)

    def missed_loads(self) -> list[Request]:
        """The requests whose loads failed since the last call, loads in flight longer than
        ``ASYNC_LOAD_WAIT_S`` among them (given up on now): nothing of their offers is committed;
        they start over (the scheduler recomputes them), and their connector is not asked again."""
        now = time.monotonic()
        late = [request for request, _, deadline in self.in_flight.values() if deadline <= now]
        if late:
            self._connector_failed("to finish a load in time", TimeoutError(f"{ASYNC_LOAD_WAIT_S:g} s"))
            self._give_up(late)
            self._missed.update((request.request_id, request) for request in late)
        missed, self._missed = list(self._missed.values()), {}
        for request in missed:
            request.asks_connector = False
        return missed

    def _give_up(self, requests: list[Request]) -> None:
        """Requests whose asynchronous loads fail while the connector may still write their pages
        (not reported): their caches stay open until it reports the load (``keeps_cache``)."""
        until = time.monotonic() + ASYNC_LOAD_WAIT_S
        for request in requests:
            self.in_flight.pop(request.request_id, None)
            self._load_failed.discard(request.request_id)
            self.loading[request.request_id] = request.held_cache()
            self._awaited_until[request.request_id] = until

    def _loads_asked(self) -> list[int]:
        """The requests whose loads ``get_finished`` is asked about: in flight or given up on."""
        return sorted([*self.in_flight, *self.loading])

    def _finished(self, saving: list[int], loading: list[int]) -> tuple[list[int], list[int], set[int]]:
        """``get_finished`` (a None in its answer read as nothing finished: vLLM's convention), and
        which of the loads it reported failed: named by ``get_failed_loads``, or in flight with a
        page among ``get_block_ids_with_load_errors``. A failure report raising (or answering no
        collection) fails every load of that report: the saves it reported stand."""
        saved, loaded = self.connector.get_finished(saving, loading)
        saved, loaded = list(saved or ()), list(loaded or ())
        try:
            failed = set(self.connector.get_failed_loads() or ())
        except Exception as exc:
            self._connector_failed("reporting its failed loads", exc)
            failed = set(loaded)
        self._read_load_errors([])
        failed.update(request_id for request_id in loaded if request_id in self._load_failed)
        return saved, loaded, failed

    def _read_load_errors(self, loaded_now: list[tuple[Request, Offer]]) -> list[Request]:
        """Read ``get_block_ids_with_load_errors``: the loads in flight with a page among the ids
        are failed when reported (``_load_failed``, kept across reports); returns the requests of
        ``loaded_now`` (synchronous loads of this step) with one."""
        bad = self._load_errors()
        in_flight = [(request, offer) for request, offer, _ in self.in_flight.values()]
        self._load_failed.update(request.request_id for request in self._with_load_errors(in_flight, bad))
        return self._with_load_errors(loaded_now, bad)

    def _load_errors(self) -> set[int] | None:
        """The block ids whose loads failed since the last call (``get_block_ids_with_load_errors``,
        vLLM's report, where the connector has it; a negative id, ``BAD_PAGE_INDEX``, names no
        page); None when that report raised or answered no collection of ids: every load it
        covers is taken as failed."""
        report = getattr(self.connector, "get_block_ids_with_load_errors", None)
        if not callable(report):
            return set()
        try:
            return {block_id for block_id in map(int, report() or ()) if block_id >= 0}
        except Exception as exc:
            self._connector_failed("reporting the blocks its loads failed", exc)
            return None

    def _with_load_errors(self, loads: list[tuple[Request, Offer]], bad: set[int] | None) -> list[Request]:
        """The requests of ``loads`` whose offers have a page among the failed block ids ``bad`` (in
        any layer group: slots are per group, an id is taken as failed in each), all when ``bad``
        is None."""
        if bad is None:
            return [request for request, _ in loads]
        if not bad:
            return []
        tpb = self.mgr.tokens_per_block
        failed = []
        for request, offer in loads:
            cache = request.held_cache()
            first, end = offer.start // tpb, -(-offer.end // tpb)
            for group in self.mgr.layer_groups:
                if not bad.isdisjoint(cache.page_indices(group.group_id)[first:end].tolist()):
                    failed.append(request)
                    break
        return failed

    def after_forward(self) -> None:
        """The batch's KV is computed: the connector's save hooks, then the saves that ended. A hook
        that raises loses saves only (later misses): the step's tokens are the model's, kept. The
        save hooks run only after this step's metadata was bound (else they would act on an older
        step's block ids) and if it lists only what the forward computed (``before_forward``)."""
        if not self._may_save:
            self.poll()
            return
        try:
            stream = self._stream()
            for layer_id in range(len(self.mgr.spec.layers)):
                self.connector.save_kv_layer(layer_id, stream)
            self.connector.wait_for_save(stream)
        except Exception as exc:
            self._connector_failed("a save", exc)
        self.poll()

    def _hand_back(self, view: ConnectorRequest, start: int, end: int) -> bool:
        """``cancel_load``; False when it raised (the connector may keep what it holds for the offer)."""
        try:
            self.connector.cancel_load(view, start, end)
        except Exception as exc:
            self._connector_failed("a hand-back", exc)
            return False
        return True

    def prefill_rate(self, tokens_per_second: float) -> None:
        """Hand the engine's measured prefill rate to a connector that weighs its store against
        recomputing (one with ``set_prefill_rate``, as ``StoreConnector``); one that raises is logged."""
        setter = getattr(self.connector, "set_prefill_rate", None)
        if setter is None:
            return
        try:
            setter(tokens_per_second)
        except Exception as exc:
            self._connector_failed("to take the prefill rate", exc)

    def _connector_failed(self, what: str, exc: Exception) -> None:
        """A rate-limited WARNING per kind of failure: a connector failing every step must not flood the log."""
        failures = self._failures.get(what)
        if failures is None:
            failures = self._failures[what] = RateLimitedWarning(log, f"the engine's connector failed {what}")
        failures(f"{type(exc).__name__}: {exc}")

    # -- endings ----------------------------------------------------------------------------------

    def request_finished(self, request: Request, failed: bool = False) -> bool:
        """Tell the connector ``request`` ended, as vLLM does of every request that ends: finished,
        aborted at any stage, or ``failed`` (once per request; its id goes to the next step's
        ``SchedulerOutput.finished_request_ids``). True if its save runs on and the cache must stay
        open until the save is reported.

        The connector sees the request's pages only while its cache is active; otherwise (no
        cache, a suspended one, or a failed request: nothing of it is saved) no block ids and no
        computed tokens, and a save it claims holds no page."""
        self._ended.append(request.request_id)
        cache = request.cache
        active = not failed and cache is not None and cache.state is CacheState.ACTIVE
        view = self._view(request) if active else self._ended_view(request)
        try:
            saving = self.connector.request_finished(view, view.block_ids_by_layer_group)
            if isinstance(saving, tuple):  # vLLM's (delay_free_blocks, kv_transfer_params)
                saving = saving[0] if saving else False
            saving = bool(saving)
        except Exception as exc:  # its save is lost (a later miss); the request finishes as it would
            self._connector_failed("a request's save", exc)
            return False
        if saving and request.request_id in self._saved_early:
            del self._saved_early[request.request_id]
            return False  # its save was reported done already
        if saving and active:
            self.saving[request.request_id] = cache
            return True
        return False

    def cache_dropped(self, request: Request) -> None:
        """The request's cache is dropped before it finished (closed, or kept while ``keeps_cache``):
        an undelivered offer is handed back; a load in flight is given up on."""
        if request.request_id in self.in_flight:
            self._give_up([request])
        self._missed.pop(request.request_id, None)  # (it ends, or starts over now: nothing left to do)
        offer = request.offer
        if offer is not None and not offer.delivered:
            self._hand_back(self._view(request, with_blocks=False), offer.start, offer.end)
        request.offer = None
        request.loaded_until = 0

    def _ended_ids(self) -> list[int]:
        """The requests the next ``SchedulerOutput`` lists as ended: those told since the last build
        that returned, and those of the one build that raised before it."""
        return [*self._ended_again, *self._ended]

    def _build_and_bind(self, output: SchedulerOutput) -> None:
        """``build_connector_meta`` and ``bind_connector_meta`` (``_may_save`` once both returned) of an
        ``output`` listing ``_ended_ids()`` as they are at the call. A build that raises lists its
        ended requests once more, in the next step's output, then drops them (a build raising on
        one of them must not fail every later step); requests ended by a hook during the build
        (an abort outside a step) are listed by the next."""
        self._may_save = False
        listed = len(self._ended)
        try:
            meta = self.connector.build_connector_meta(output)
        except Exception:
            self._ended_again, self._ended = self._ended[:listed], self._ended[listed:]
            raise
        self._ended_again, self._ended = [], self._ended[listed:]
        self.connector.bind_connector_meta(meta)
        self._may_save = True

    def idle_step(self) -> None:
        """A step of the connector without a forward (the batch is empty), as vLLM runs one: it is
        shown the requests that ended since the last step, may start work it defers to a step's
        start (saves), and its reports are taken. Nothing is run while nothing ended and no save
        or load is pending (an unsettled hand-back counts: its cache closes once a load step returns)."""
        if not (self._ended_ids() or self.saving or self.loading or self.in_flight or self._unsettled):
            return
        try:
            self._build_and_bind(SchedulerOutput([], {}, self._ended_ids()))
            stream = self._stream()
            self.connector.start_load_kv(stream)
            self._settle()
            self.connector.wait_for_save(stream)
        except Exception as exc:
            self._connector_failed("a step without a forward", exc)
        self.poll()

    def poll(self) -> None:
        """Take what ``get_finished`` reports: saves and loads given up on end (their caches close),
        loads in flight land (committed: their requests run from the next step on). A report that
        raises makes the loads in flight misses (as a load hook that raised does: they cannot be
        trusted); reports raising for ``ASYNC_LOAD_WAIT_S`` give the saves up too."""
        if not self.saving and not self.unreported_saves and not self.loading and not self.in_flight:
            return
        try:
            reports = self._finished(sorted([*self.saving, *self.unreported_saves]), self._loads_asked())
        except Exception as exc:  # saves and given-up loads are asked about again next step
            self._connector_failed("reporting its saves and loads", exc)
            given_up = [request for request, _, _ in self.in_flight.values()]
            self._give_up(given_up)
            self._missed.update((request.request_id, request) for request in given_up)
            self._give_up_saves_after_failing_reports()
            return
        self._reports_failing_since = None
        self._take_reports(*reports)

    def _give_up_saves_after_failing_reports(self) -> None:
        """Once every ``get_finished`` has raised for ``ASYNC_LOAD_WAIT_S``, nothing waits for the
        saves any more (``generate`` and ``close`` return): their pages stay held, apart, until a
        later report (``unreported_saves``)."""
        now = time.monotonic()
        if self._reports_failing_since is None:
            self._reports_failing_since = now
        elif now - self._reports_failing_since >= ASYNC_LOAD_WAIT_S and self.saving:
            log.error(
                "kvtier: the engine's connector has failed to report for %g s: the saves of %d requests are "
                "given up on (their pages stay held until it reports them)",
                now - self._reports_failing_since,
                len(self.saving),
            )
            self.unreported_saves.update(self.saving)
            self.saving.clear()

    def _take_reports(self, saved: Collection[int], loaded: Collection[int], failed: Collection[int]) -> None:
        """Act on what one ``get_finished`` call reported (any such call may report any save or load,
        once): loads in flight are committed, or kept for ``missed_loads`` when they failed; the
        caches of requests whose saves, or loads given up on, ended are closed."""
        for request_id in loaded:  # (a request given up on may save from a cache of its own meanwhile)
            self._load_failed.discard(request_id)
            entry = self.in_flight.pop(request_id, None)
            if entry is not None and request_id in failed:
                self._missed[request_id] = entry[0]
            elif entry is not None:
                self._commit(entry[0], entry[1])
            self._awaited_until.pop(request_id, None)
            cache = self.loading.pop(request_id, None)
            if cache is not None and not self._saves_from(request_id, cache):
                cache.close()
        for request_id in saved:
            cache = self.saving.pop(request_id, None) or self.unreported_saves.pop(request_id, None)
            if cache is not None:
                if not self._held_apart(request_id, cache):  # (else closed once its load is reported, or settled)
                    cache.close()
            else:  # reported before ``request_finished`` asked to keep its pages
                self._saved_early[request_id] = None
                while len(self._saved_early) > EARLY_REPORTS_KEPT:
                    del self._saved_early[next(iter(self._saved_early))]

    def _held_apart(self, request_id: int, cache: KVCache) -> bool:
        """Whether ``cache`` is kept open for a load that may still write it (given up on, or unsettled)."""
        unsettled = self._unsettled.get(request_id)
        return self.loading.get(request_id) is cache or (unsettled is not None and unsettled[0] is cache)

    def _saves_from(self, request_id: int, cache: KVCache) -> bool:
        """Whether a save of ``request_id`` still reads ``cache`` (one aborted while its load was in
        flight: the cache closes once both are reported)."""
        return self.saving.get(request_id) is cache or self.unreported_saves.get(request_id) is cache

    def wait_for_saves(self, request_ids: Collection[int] | None = None, timeout_s: float | None = None) -> bool:
        """Wait until the saves of ``request_ids`` (None: all) are complete and their caches closed.

        Returns False if some were still running after ``timeout_s`` seconds (None: no limit).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.idle_step()
            pending = self.saving if request_ids is None else self.saving.keys() & set(request_ids)
            if not pending:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def close(self, timeout_s: float | None = None) -> bool:
        """Wait for every save (at most ``timeout_s``), then close the connector.

        Returns False, leaving the connector open (closing it would wait for them), when saves
        were still running at the deadline.
        """
        if not self.wait_for_saves(None, timeout_s):
            return False
        try:
            close = getattr(self.connector, "close", None)  # (the protocol's classes do not require one)
            if callable(close):
                close()
        finally:
            self.detach()
        return True

    # -- helpers ----------------------------------------------------------------------------------

    def _window_grows(self, start: int, cut: int, end: int) -> bool:
        """Whether a sliding-window group needs, at history ``cut``, a block from the offer's first
        (``start``'s) on that it did not need at ``end``: one the connector had no cause to load."""
        tpb = self.mgr.tokens_per_block
        for group in self.mgr.layer_groups:
            rule = GroupRule.of(group, tpb)
            if rule.window is not None and max(rule.first_live_block(cut), start // tpb) < rule.first_live_block(end):
                return True
        return False

    def _view(
        self, request: Request, with_blocks: bool = True, computed: int | None = None, scheduled: int = 0
    ) -> ConnectorRequest:
        """The connector's view of ``request``: its tokens computed are the cache's committed ones,
        or ``computed`` (a scheduled chunk's start: its offer, loaded in this step, counts); its
        tokens known run ``scheduled`` further (the chunk the forward computes)."""
        cache = request.cache
        if computed is None:
            computed = cache.num_committed_tokens if cache is not None else 0
        blocks = []
        if with_blocks and cache is not None:
            blocks = [cache.page_indices(g.group_id).tolist() for g in self.mgr.layer_groups]
        return ConnectorRequest(
            request.request_id,
            list(request.prompt),
            request.tokens[: computed + scheduled],
            request.scope,
            computed,
            blocks,
            request.priority,
        )

    def _ended_view(self, request: Request) -> ConnectorRequest:
        """What the connector sees of a request that ended without an active cache: no pages, and
        so no tokens computed in them."""
        no_pages: list[list[int]] = [[] for _ in self.mgr.layer_groups]
        prompt = list(request.prompt)
        return ConnectorRequest(request.request_id, prompt, [], request.scope, 0, no_pages, request.priority)

    def _stream(self):
        return torch.cuda.current_stream(self.mgr.device) if self.mgr.device.type == "cuda" else None
