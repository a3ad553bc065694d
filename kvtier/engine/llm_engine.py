"""``LLMEngine``: the reference engine that runs a model's KV cache through kvtier."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence

import torch

from kvtier.cache import as_token_array
from kvtier.config import DEFAULT_SCOPE, CacheConfig, ReuseScope
from kvtier.engine.params import SamplingParams, SchedulerConfig
from kvtier.engine.request import Request, RequestOutput
from kvtier.engine.runner import ModelRunner
from kvtier.engine.scheduler import Scheduler
from kvtier.eviction import check_priority
from kvtier.manager import KVCacheManager
from kvtier.models import DecoderModel
from kvtier.weights import weights_fingerprint


class LLMEngine:
    """Continuous batching over a ``KVCacheManager`` built from ``model.spec`` and ``cache_config``.

    Greedy output is token-identical to ``model.reference_generate`` whatever the cache does
    (reuse, demotion to host or disk, preemption, a connector's load) when the model runs in
    float64; ``engine.cache_manager`` gives the manager's stats and layout.
    """

    def __init__(
        self,
        model: DecoderModel,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig | None = None,
        connector: object | None = None,
    ) -> None:
        if torch.device(cache_config.device).type != model.device.type:
            raise ValueError(
                f"the cache lives on {cache_config.device} but the model on {model.device}: give both the same device"
            )
        self.model = model
        spec = model.spec
        if spec.model_id is None:  # name the weights, so pages never outlive a change of checkpoint
            spec = dataclasses.replace(spec, model_id=f"weights:{weights_fingerprint(model)}")
        self.cache_manager = KVCacheManager(spec, cache_config)
        self.scheduler = Scheduler(scheduler_config or SchedulerConfig(), self.cache_manager)
        self.runner = ModelRunner(model, self.cache_manager)
        self.connector = None
        if connector is not None:
            from kvtier.engine.connector_driver import ConnectorDriver

            self.connector = ConnectorDriver(connector, self)
        self._ids = itertools.count()
        self._requests: dict[int, Request] = {}

    def add_request(
        self, prompt: Sequence[int], params: SamplingParams, scope: ReuseScope = DEFAULT_SCOPE, priority: int = 35
    ) -> int:
        """Queue a prompt; returns its request id."""
        tokens = as_token_array(prompt)
        if not tokens:
            raise ValueError("a prompt needs at least one token")
        if max(tokens) >= self.model.vocab_size:
            raise ValueError(f"prompt tokens must be below the model's vocabulary size {self.model.vocab_size}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_priority(priority)
        request = Request(next(self._ids), list(tokens), params, scope, priority)
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward over the batch, sample; returns the requests that finished."""
        if self.connector is not None:
            self.connector.poll()
        batch = self.scheduler.schedule()
        if not batch:
            if self.connector is not None and self.connector.saving:
                time.sleep(0.001)  # waiting for a save to release its pages
            return []
        if self.connector is not None:
            self.connector.before_forward(batch)
        sampled = self.runner.run(batch)
        if self.connector is not None:
            self.connector.after_forward(batch)
        now = time.perf_counter()
        finished = []
        for chunk in batch:
            request = chunk.request
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

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        scope: ReuseScope = DEFAULT_SCOPE,
        priority: int = 35,
        on_finish: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts``."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp, scope, priority) for p, sp in zip(prompts, params, strict=True)]
        done: dict[int, RequestOutput] = {}
        while len(done) < len(ids):
            for output in self.step():
                done[output.request_id] = output
                if on_finish is not None:
                    on_finish(output)
        return [done[i] for i in ids]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def close(self) -> None:
        """Close the cache manager (persisting to its disk tier, if any)."""
        if self.connector is not None:
            self.connector.close()
        self.cache_manager.close()

    def _finish_reason(self, request: Request, token: int) -> str | None:
        if token in request.params.stop_token_ids:
            return "stop"
        if len(request.output) >= request.params.max_tokens:
            return "length"
        return None

    def abort_request(self, request_id: int) -> None:
        """Drop a request that has not finished; an undelivered connector offer is handed back."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if self.connector is not None:
            self.connector.abort(request)
        self.scheduler.finish(request, "abort")
        self.runner.forget(request)
        self._requests.pop(request_id, None)

    def _finish(self, request: Request, reason: str) -> None:
        saving = self.connector is not None and self.connector.request_finished(request)
        self.scheduler.finish(request, reason, close_cache=not saving)
        self.runner.forget(request)
        self._requests.pop(request.request_id, None)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
