"""``KVTierConnector``: vLLM's ``KVConnectorBase_V1`` (both roles) and ``SupportsHMA`` over kvtier.

A thin translation: the scheduler role delegates to ``KVTierScheduler``, the worker role to
``KVTierWorker``; each vLLM hook maps to one call. Loads are asynchronous (a request with a hit
waits in ``WAITING_FOR_REMOTE_KVS`` until its blocks are in), so ``wait_for_layer_load`` and
``save_kv_layer`` have nothing to do; saves copy whole blocks after the forward.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.vllm.kv_groups import plan_model
from kvtier.vllm.meta import KVTierMetadata, KVTierWorkerMeta
from kvtier.vllm.scheduler import KVTierScheduler
from kvtier.vllm.settings import TESTED_VLLM, ConnectorSettings, model_identity, untested_vllm, vllm_version
from kvtier.vllm.worker import KVTierWorker

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's blocks kept in kvtier's host and disk tiers; see ``kvtier.vllm``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_one_process(vllm_config)
        if untested_vllm(vllm_version()):
            log.warning(
                "kvtier.vllm is tested with vLLM %s, not %s: its scheduler or model runner may call the "
                "connector otherwise (pip install 'kvtier[vllm]' installs a tested release)",
                " and ".join(TESTED_VLLM),
                vllm_version(),
            )
        settings = ConnectorSettings.parse(self._kv_transfer_config.kv_connector_extra_config)
        layout = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
        plan = plan_model(kv_cache_config, model_identity(vllm_config, layout, settings.model_id))
        engine_id = str(self._kv_transfer_config.engine_id)
        self._scheduler: KVTierScheduler | None = None
        self._worker: KVTierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning(
                    "kvtier.vllm: with kv_load_failure_policy=%r vLLM fails a request whose pages turn out damaged "
                    "(disk or store); set kv_load_failure_policy='recompute' to recompute them instead (inside a "
                    "MultiConnector, in kvtier's entry too: vLLM reads the top-level policy, kvtier its own entry's)",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
            by_priority = vllm_config.scheduler_config.policy == "priority"
            self._scheduler = KVTierScheduler(
                plan, _per_dp_rank(settings, vllm_config), engine_id, by_priority=by_priority
            )
        else:
            self._worker = KVTierWorker(plan, engine_id, kv_cache_config.num_blocks)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a wrong token

    @property
    def scheduler(self) -> KVTierScheduler:
        assert self._scheduler is not None, "a scheduler-side call on the worker connector"
        return self._scheduler

    @property
    def worker(self) -> KVTierWorker:
        assert self._worker is not None, "a worker-side call on the scheduler connector"
        return self._worker

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM is about to unmap its KV cache (sleep, or a weight update that borrows its memory):
        every copy in flight finishes first. Nothing is dropped: the same addresses come back."""
        self.worker.drain()

    def restore_kv_caches(self) -> None:
        """The KV cache is mapped again at the same addresses: the routes still hold."""

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVTierMetadata):
            self._worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVTierMetadata):
            self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish before their request is scheduled; nothing to wait for per layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Saves copy whole blocks in ``wait_for_save``; nothing to do per layer."""

    def wait_for_save(self) -> None:
        self.worker.start_saves(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self.worker.finished(finished_req_ids)
        return KVConnectorTransferResults(sending, recving, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        return None if self._worker is None else self._worker.worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def _meta(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        return meta

    # -- scheduler side --------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.block_ids_of = kv_cache_manager.get_block_ids
        self.scheduler.vllm_cached = getattr(kv_cache_manager, "get_num_cached_tokens", None)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.scheduler.null_block_id = gpu_block_pool.null_block.block_id

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: Request) -> bool:
        return self.scheduler.may_load_async(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        host, disk, store = self.scheduler.hit_sources(request, num_external_tokens)
        counts = {CacheHitSource.HOST: host, CacheHitSource.DISK: disk, CacheHitSource.EXTERNAL_UNSPECIFIED: store}
        return {source: n for source, n in counts.items() if n}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request), None

    def reset_cache(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)``: nothing saved so far is served again (the
        worker keeps no blocks of its own)."""
        return self._scheduler.reset_cache() if self._scheduler is not None else True


def check_one_process(vllm_config: VllmConfig) -> None:
    """``NotImplementedError`` unless vLLM runs its scheduler and its one worker in one process."""
    parallel = vllm_config.parallel_config
    backend = parallel.distributed_executor_backend
    if parallel.world_size != 1 or backend not in (None, "uni"):
        raise NotImplementedError(
            "kvtier.vllm keeps its pages in the engine process: it needs tensor_parallel_size=1, "
            f"pipeline_parallel_size=1 and the 'uni' executor (got world size {parallel.world_size}, "
            f"executor {backend!r})"
        )


def _per_dp_rank(settings: ConnectorSettings, vllm_config: VllmConfig) -> ConnectorSettings:
    """With data parallelism each engine keeps its disk pages in a directory of its own."""
    parallel = vllm_config.parallel_config
    if settings.disk_path is None or parallel.data_parallel_size <= 1:
        return settings
    path = os.path.join(settings.disk_path, f"dp{parallel.data_parallel_rank}")
    return dataclasses.replace(settings, disk_path=path)
