"""``LLMEngine``: the reference engine that runs a model's KV cache through kvtier."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from kvtier.config import DEFAULT_SCOPE, CacheConfig, ReuseScope, same_device
from kvtier.connector.base import KvCacheConnectorScheduler, KvCacheConnectorWorker
from kvtier.engine import exit_close
from kvtier.engine.admission import RequestLimits
from kvtier.engine.batch_scheduler import ScheduledChunk, Scheduler
from kvtier.engine.connector_driver import ConnectorDriver
from kvtier.engine.params import SamplingParams, SchedulerConfig
from kvtier.engine.prefill_meter import CALIBRATION_TOKENS, PrefillMeter
from kvtier.engine.request import Request, RequestOutput, RequestStatus
from kvtier.engine.runner import ModelRunner
from kvtier.errors import CacheStateError
from kvtier.manager import KVCacheManager
from kvtier.models import DecoderModel
from kvtier.process_bound import ProcessBound
from kvtier.tiering.eviction import check_priority
from kvtier.weights import WeightWatch, default_model_id

log = logging.getLogger(__name__)


class LLMEngine(ProcessBound):
    """Continuous batching over a ``KVCacheManager`` built from ``model.spec`` and ``cache_config``.

    Greedy output is token-identical to ``model.reference_generate`` whatever the cache does
    (reuse, demotion to host or disk, preemption, a connector's load) when the model runs in
    float64; ``engine.cache_manager`` gives the manager's stats and layout.

    Errors: a constructor argument of the wrong type is a ``TypeError`` naming it, before the
    cache manager exists; a constructor that raises later closes the manager it built, so a
    refused engine never holds a disk tier's directory. A request that can never be served is
    refused before anything is queued (``ValueError`` naming the field, ``TypeError`` for a
    wrong type; kvtier.engine.admission); one that fails while served (it cannot run even
    alone, non-finite logits) finishes with ``finish_reason="error"`` and ``error`` set, its
    pages freed, and the others go on.

    One thread drives an engine, and never from inside a step: ``generate`` and ``step`` called
    while a step runs (from a connector hook) raise ``CacheStateError`` before changing anything;
    ``on_finish`` runs between steps and may drive the engine. ``close()`` (idempotent; also a
    context manager) finishes the connector's saves and closes the cache manager; an engine
    never closed is closed when the interpreter exits (kvtier.engine.exit_close).
    """

    remedy = "build an engine in each process"

    def __init__(
        self,
        model: DecoderModel,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig | None = None,
        connector: object | None = None,
    ) -> None:
        if not isinstance(model, DecoderModel):
            raise TypeError(f"model must be a DecoderModel (kvtier.models.build_model), got {type(model).__name__}")
        if not isinstance(cache_config, CacheConfig):
            raise TypeError(f"cache_config must be a kvtier.CacheConfig, got {type(cache_config).__name__}")
        if connector is not None and not (
            isinstance(connector, KvCacheConnectorScheduler) and isinstance(connector, KvCacheConnectorWorker)
        ):
            raise TypeError(
                "connector must implement both KvCacheConnectorScheduler and KvCacheConnectorWorker "
                f"(e.g. kvtier.connector.FileSystemConnector), got {type(connector).__name__}"
            )
        if not same_device(cache_config.device, model.device):
            raise ValueError(
                f"the cache lives on {cache_config.device} but the model on {model.device}: give both the same device"
            )
        if scheduler_config is not None and not isinstance(scheduler_config, SchedulerConfig):
            raise TypeError(f"scheduler_config must be a SchedulerConfig, got {type(scheduler_config).__name__}")
        self.model = model
        spec = model.spec
        weights = None
        if spec.model_id is None:
            weights, model_id = default_model_id(model, model.config)
            spec = dataclasses.replace(spec, model_id=model_id)
        self._weights = WeightWatch(model, weights)  # and notice weights changed in place later
        self.cache_manager = KVCacheManager(spec, cache_config)
        try:
            self.connector = None if connector is None else ConnectorDriver(connector, self.cache_manager)
            config = scheduler_config or SchedulerConfig()
            self.limits = RequestLimits.of(model.vocab_size, self.cache_manager, config)
            self.scheduler = Scheduler(config, self.cache_manager, self.limits, hooks=self.connector)
            self.runner = ModelRunner(model, self.cache_manager)
            self.prefill: PrefillMeter | None = None  # without it, every cached block is loaded
            if self.scheduler.config.recompute_when_faster:
                self.prefill = PrefillMeter(model.device)
                tokens = min(self.scheduler.config.max_num_tokens, CALIBRATION_TOKENS)
                self._set_prefill_rate(self.prefill.calibrate(model, tokens))
        except BaseException:  # e.g. the connector refused the layout: release the disk directory too
            if getattr(self, "connector", None) is not None:
                self.connector.detach()
            self.cache_manager.close()
            raise
        self._ids = itertools.count()
        self._requests: dict[int, Request] = {}
        # finished with no caller to take them yet (a step whose caller raised first; a request of
        # ``add_request`` that finished inside a ``generate``): the next ``step`` returns them
        self._undelivered: list[RequestOutput] = []
        self._generating: set[int] = set()  # requests of the ``generate`` calls in progress (nested ones too)
        self._closed = False
        self.driver_thread = threading.get_ident()  # the thread that last drove this engine
        self._driving = threading.RLock()  # held by the thread inside generate() or step()
        self._stepping = False  # a step runs: schedule, connector hooks, forward, sampling
        self._aborted_in_step: list[int] = []  # aborts asked for by a hook, done as the step ends
        exit_close.track(self)

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self, prompt: Sequence[int], params: SamplingParams, scope: ReuseScope = DEFAULT_SCOPE, priority: int = 35
    ) -> int:
        """Queue a prompt; returns its request id. Refuses a request that can never be served, and
        any once the model's weights changed in place (``CacheStateError``)."""
        self._check_open()
        self._check_weights()
        _check_scope_and_priority(scope, priority)
        tokens = self.limits.check(prompt, params)
        return self._queue(list(tokens), params, scope, priority)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        scope: ReuseScope = DEFAULT_SCOPE,
        priority: int = 35,
        on_finish: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts``.

        Every prompt is checked before any is queued: one that can never be served raises
        (``ValueError``/``TypeError`` naming ``prompts[i]``) and nothing runs. A request that
        fails while served is in the outputs with ``finish_reason="error"``, one aborted meanwhile
        (``abort_request`` from ``on_finish``) with ``finish_reason="abort"``. Returns once the
        requests have finished and every save they started through the connector is complete.
        ``on_finish`` sees each output as it finishes, also those of requests queued earlier
        with ``add_request`` (which run alongside); without it, theirs are returned by the next
        ``step``. ``CacheStateError`` once the model's weights
        changed in place since the engine was built, while another thread drives the engine, or
        from inside a step (a connector hook). ``TypeError`` naming the argument for ``prompts``
        that is no sequence, ``params`` that is neither a ``SamplingParams`` nor a sequence of
        them, an ``on_finish`` that is not callable.
        """
        self._check_open()
        self._check_weights()
        with self._driven():
            params = _params_per_prompt(prompts, params)
            if on_finish is not None and not callable(on_finish):
                raise TypeError(f"on_finish must be a callable taking a RequestOutput, got {type(on_finish).__name__}")
            _check_scope_and_priority(scope, priority)
            pairs = list(zip(prompts, params, strict=True))
            checked = [self.limits.check(prompt, sp, f"prompts[{i}]") for i, (prompt, sp) in enumerate(pairs)]
            ids = [
                self._queue(list(tokens), sp, scope, priority) for tokens, (_, sp) in zip(checked, pairs, strict=True)
            ]
            requests = {request_id: self._requests[request_id] for request_id in ids}
            done: dict[int, RequestOutput] = {}
            others: list[RequestOutput] = []
            self._generating.update(ids)
            try:
                while len(done) < len(ids):
                    outputs = self.step()
                    for k, output in enumerate(outputs):
                        if output.request_id in requests:
                            done[output.request_id] = output
                        elif on_finish is None and output.request_id not in self._generating:
                            others.append(output)  # queued with ``add_request``: the next ``step`` returns it
                        if on_finish is not None:
                            try:
                                on_finish(output)
                            except BaseException:  # the step's other outputs go to the next step's caller
                                self._undelivered += [o for o in outputs[k + 1 :] if o.request_id not in requests]
                                raise
                    for request_id, request in requests.items():  # finished in a step on_finish called, or aborted
                        if request_id not in done and request.finish_reason is not None:
                            done[request_id] = output = request.to_output()
                            if on_finish is not None and request.finish_reason != "abort":
                                on_finish(output)  # (the nested step's caller took it: this call's own, seen here too)
                if self.connector is not None:
                    self.connector.wait_for_saves(ids)
            except BaseException:
                for request_id in ids:  # nothing of this call stays queued
                    self.abort_request(request_id)
                raise
            finally:
                self._generating.difference_update(ids)
                self._undelivered += others
            return [done[i] for i in ids]

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward over the batch, sample; returns the requests that finished.
        ``CacheStateError``, nothing changed, from inside a step (a connector hook), or once the
        model's weights changed in place since the engine was built (requests in flight included:
        nothing computed with other weights is published under these ones)."""
        self._check_open()
        self._check_weights()
        with self._driven():
            return self._step()

    @contextlib.contextmanager
    def _driven(self) -> Iterator[None]:
        """This thread drives the engine for the block (reentrant between steps: ``on_finish`` may
        step); ``CacheStateError`` at once, before anything changes, while another thread does, or
        from inside a step (its queues are mid-change)."""
        if not self._driving.acquire(blocking=False):
            raise CacheStateError(
                "another thread is inside generate() or step() of this engine: drive an engine from one thread "
                "at a time (hand it over between calls, or serialise them with a lock)"
            )
        try:
            if self._stepping:
                raise CacheStateError(
                    "generate() or step() called from inside a step of this engine (from a connector hook): a hook "
                    "must not drive the engine; on_finish, which runs between steps, may"
                )
            self.driver_thread = threading.get_ident()
            yield
        finally:
            self._driving.release()

    def _step(self) -> list[RequestOutput]:
        undelivered, self._undelivered = self._undelivered, []
        self._stepping = True
        try:
            return undelivered + self._run_step()
        finally:
            self._stepping = False
            aborted, self._aborted_in_step = self._aborted_in_step, []
            for request_id in aborted:
                self.abort_request(request_id)

    def _run_step(self) -> list[RequestOutput]:
        if self.connector is not None:
            self.connector.poll()
            for request in self.connector.missed_loads():  # loads that failed: a miss, recomputed
                self.scheduler.recompute(request)
        batch = self.scheduler.schedule()
        # Background copies (write-through, the free reserve) go now, before the forward: they
        # overlap its compute, and the next step's moves, which wait for them, find them done.
        self.cache_manager.maintain()
        finished = [self._finish_failed(request, request.error) for request in self.scheduler.take_failed()]
        if batch and self.connector is not None:
            # Loads in flight (they run once the connector reports them) or failed (recomputed next step).
            sit_out = self.connector.before_forward(batch)
            batch = [c for c in batch if c.request.request_id not in sit_out]
        elif self.connector is not None:
            self.connector.idle_step()  # the connector's step all the same: ended requests, deferred saves
        if not batch:
            if (
                not finished
                and self.connector is not None
                and (self.connector.pages_pending_release() or self.connector.loads_in_flight())
            ):
                time.sleep(0.001)  # waiting for a save to release its pages, or for a load
            return finished
        meter = self.prefill
        mark = None if meter is None else meter.start(sum(c.num_tokens for c in batch if c.num_tokens > 1))
        try:
            sampled, errors = self.runner.run(batch)
        except BaseException:
            self._fail_unsampled(batch)
            raise
        rate = None if meter is None else meter.finish(mark)
        if self.connector is not None:
            self.connector.after_forward()
        now = time.perf_counter()
        if rate is not None:
            self._set_prefill_rate(rate)
        for chunk in batch:
            request = chunk.request
            error = errors.get(request.request_id)
            if error is not None:
                finished.append(self._finish_failed(request, f"request {request.request_id} failed: {error}"))
                continue
            token = sampled.get(request.request_id)
            if token is None:
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            request.tokens.append(token)
            reason = self._finish_reason(request, token)
            if reason is not None:
                request.finish_time = now
                self._finish(request, reason)
                finished.append(request.to_output())
        return finished

    def has_unfinished_requests(self) -> bool:
        """Whether requests wait or run, or outputs wait for the next ``step`` (none once the engine
        is closed: closing drops them)."""
        return not self._closed and (self.scheduler.has_work() or bool(self._undelivered))

    def abort_request(self, request_id: int) -> None:
        """Drop a request that has not finished; an undelivered connector offer is handed back, and
        the request is reported finished to the connector, as vLLM does of every request that ends
        (one with an active cache shows its pages: the connector may save what it computed); one
        whose connector load is in flight keeps its cache until the connector reports the load.
        Called from inside a step (a connector hook), the request is dropped as the step ends."""
        if self._stepping:
            self._aborted_in_step.append(request_id)
            return
        request = self._requests.pop(request_id, None)  # first: a hook aborting it again finds nothing
        if request is None:
            return
        keep = False  # its cache stays open: a save, or a load in flight, still uses its pages
        if request.status is RequestStatus.FINISHED:  # failed, not reported yet: aborted instead
            self.scheduler.forget_failed(request)
            if self.connector is not None:
                self.connector.request_finished(request, failed=True)
        elif self.connector is not None:
            self.connector.cache_dropped(request)
            keep = self.connector.keeps_cache(request)  # closed once the connector reports the load
            saving = self.connector.request_finished(request)
            keep = keep or saving
        self.scheduler.finish(request, "abort", close_cache=not keep)
        request.finish_time = time.perf_counter()
        self.runner.forget(request)

    # -- closing ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the connector's saves, close it and the cache manager (persisting to its disk tier). Idempotent."""
        self.close_within(None)

    def close_within(self, save_timeout_s: float | None) -> bool:
        """``close``, waiting at most ``save_timeout_s`` for the connector's saves (None: no limit).

        Returns False when saves were still running then: the connector is left open (its saves
        go on) and the cache manager is closed all the same.
        """
        if self._closed:
            return True
        if self._stepping:
            if threading.get_ident() != self.driver_thread:
                raise CacheStateError(
                    "close() called while another thread runs a step of this engine (inside generate() or step()): "
                    "close it from that thread, or once its call has returned"
                )
            raise CacheStateError("close() called from inside a step of this engine (from a connector hook)")
        self._closed = True
        exit_close.untrack(self)
        saved = True
        try:
            if self.connector is not None:
                saved = self.connector.close(save_timeout_s)
        finally:
            self.cache_manager.close()
        return saved

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _queue(self, tokens: list[int], params: SamplingParams, scope: ReuseScope, priority: int) -> int:
        request = Request(next(self._ids), tokens, params, scope, priority)
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def _finish_reason(self, request: Request, token: int) -> str | None:
        if token in request.params.stop_token_ids:
            return "stop"
        if len(request.output) >= request.params.max_tokens:
            return "length"
        return None

    def _finish(self, request: Request, reason: str) -> None:
        saving = self.connector is not None and self.connector.request_finished(request)
        self.scheduler.finish(request, reason, close_cache=not saving)
        self.runner.forget(request)
        self._requests.pop(request.request_id, None)

    def _set_prefill_rate(self, tokens_per_second: float) -> None:
        """The measured prefill rate, for the cache manager's tiers and the connector's store alike."""
        self.cache_manager.set_prefill_rate(tokens_per_second)
        if self.connector is not None:
            self.connector.prefill_rate(tokens_per_second)

    def _fail_unsampled(self, batch: list[ScheduledChunk]) -> None:
        """After a forward that raised: a request whose every token is cached now lost the token
        sampled from them and can never go on, so it fails (the next step reports it); the others
        compute what is left later."""
        for chunk in batch:
            request = chunk.request
            if request.status is RequestStatus.RUNNING and request.next_position >= len(request.tokens):
                self.scheduler.fail(request, "the step that computed its last token raised before sampling it")

    def _finish_failed(self, request: Request, error: str | None) -> RequestOutput:
        """Finish a request with an error (pages freed, nothing saved; the connector told it ended)
        and give its output."""
        if request.status is not RequestStatus.FINISHED:
            keep = False
            if self.connector is not None:
                self.connector.cache_dropped(request)
                keep = self.connector.keeps_cache(request)  # a load still writing its pages: closed once done
            self.scheduler.finish(request, "error", close_cache=not keep)
        if self.connector is not None:
            self.connector.request_finished(request, failed=True)
        request.error = error
        request.finish_time = time.perf_counter()
        self.runner.forget(request)
        self._requests.pop(request.request_id, None)
        return request.to_output()

    def _check_open(self) -> None:
        if self._closed:
            raise CacheStateError("the engine is closed")

    def _check_weights(self) -> None:
        """``CacheStateError`` once the model's weights changed in place (an optimizer step,
        ``load_state_dict``): the cached pages are of the old weights."""
        if not self._weights.unchanged():
            raise CacheStateError(
                "the model's weights changed since this engine was built (its cached pages are of the old "
                "weights): build a new LLMEngine for the new weights"
            )


def _params_per_prompt(
    prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams]:
    """``params`` as one entry per prompt (checked as ``SamplingParams`` at admission), or
    ``TypeError`` naming the argument when ``prompts`` has no length or ``params`` is neither a
    ``SamplingParams`` nor a sequence (a dict of its fields, a number)."""
    try:
        count = len(prompts)
    except TypeError:
        raise TypeError(f"prompts must be a sequence of token id lists, got {type(prompts).__name__}") from None
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    if not isinstance(params, Sequence):
        raise TypeError(
            f"params must be a SamplingParams or a sequence of them, one per prompt, got {type(params).__name__}"
        )
    if len(params) != count:
        raise ValueError(f"{len(params)} SamplingParams for {count} prompts")
    return list(params)


def _check_scope_and_priority(scope: object, priority: object) -> None:
    if not isinstance(scope, ReuseScope):
        raise TypeError(f"scope must be a kvtier.ReuseScope, got {type(scope).__name__}")
    check_priority(priority)  # type: ignore[arg-type]
