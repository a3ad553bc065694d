"""The worker half: runs the scheduler half's jobs on vLLM's registered KV caches and reports back.

Works only from its metadata and the caches given to ``register_kv_caches`` (never from attention
metadata or the forward context). Per step, in vLLM's order:

    handle_preemptions     the forward waits (on the GPU) for saves whose blocks were freed
    bind                   the step's jobs; finished requests whose blocks wait for their saves;
                           the forward's timing starts (a step with prompt tokens to time)
    start_load_kv          loads start on the transfer stream (after the forward, as vLLM calls it)
    wait_for_save          the forward's timing ends; saves start on the transfer stream, after
                           the forward wrote the blocks
    get_transfer_results   completed loads (``finished_recving``; failed ones also in
                           ``failed_recving`` when block ids are per group), and finished requests
                           whose saves are all done (``finished_sending``)
    load errors            vLLM block ids of failed loads, reported in the same step
    worker meta            every completed job and whether it succeeded, and the prefill rate when
                           a timed forward moved it (``kvtier.engine.prefill_meter``), for the
                           scheduler half

With a drafter vLLM calls ``wait_for_save`` last (``defer_finalize``, after the drafter ran): a
request it then reports finished has no save of this step, since it was not scheduled in it.

The host pages are found by the engine id (``kvtier.vllm.host_pool``) on the first job.
"""

from __future__ import annotations

import logging

import torch

from kvtier.copy import CopyPolicy, PageCopier
from kvtier.engine.prefill_meter import PrefillMeter
from kvtier.vllm import host_pool
from kvtier.vllm.kv_groups import ModelPlan
from kvtier.vllm.meta import KVTierMetadata, KVTierWorkerMeta
from kvtier.vllm.transfer import KERNEL_ONLY, BlockTransfer, Direction, GroupRoute, TransferJob, route_groups

log = logging.getLogger(__name__)


class KVTierWorker:
    """One worker's side of the connector; see the module docstring."""

    def __init__(self, plan: ModelPlan, engine_id: str, num_blocks: int) -> None:
        self.plan = plan
        self._engine_id = engine_id
        self._num_blocks = num_blocks
        self._allocation: torch.Tensor | None = None
        self._routes: list[GroupRoute] = []
        self._transfer: BlockTransfer | None = None
        self._bulk: PageCopier | None = None  # the kernel-only copier of large calls, built at registration
        self._registration: host_pool.Registration | None = None
        self._jobs: dict[int, TransferJob] = {}
        self._saves_of: dict[str, set[int]] = {}
        self._delayed: set[str] = set()
        self._finished: set[str] = set()
        self._done: dict[int, bool] = {}
        self._load_errors: set[int] = set()
        self._failed_requests: set[str] = set()
        self._meter: PrefillMeter | None = None
        self._mark: tuple[int, object] | None = None
        self._rate: float | None = None  # measured since the last report

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._allocation, self._routes = route_groups(self.plan.groups, kv_caches, self._num_blocks)
        device = self._allocation.device
        if device.type == "cuda":  # built at start-up, so the first large transfer does not wait for it
            self._bulk = PageCopier(device, policy=KERNEL_ONLY)
            self._bulk.warm_up([route.page_bytes for route in self._routes])

    def bind(self, meta: KVTierMetadata) -> None:
        self._delayed.update(meta.delayed_free_req_ids)
        if meta.prefill_tokens and self._allocation is not None:
            if self._meter is None:
                self._meter = PrefillMeter(self._allocation.device)
            self._mark = self._meter.start(meta.prefill_tokens)

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        if meta.flush_job_ids and self._transfer is not None:
            self._transfer.fence(meta.flush_job_ids)

    def start_loads(self, meta: KVTierMetadata) -> None:
        self._submit([job for job in meta.jobs if job.direction is Direction.LOAD])

    def start_saves(self, meta: KVTierMetadata) -> None:
        if self._meter is not None:  # the forward is done on the host: its timing ends here
            rate = self._meter.finish(self._mark)
            self._mark = None
            if rate is not None:
                self._rate = rate
        saves = [job for job in meta.jobs if job.direction is Direction.SAVE]
        for job in saves:
            self._saves_of.setdefault(job.req_id, set()).add(job.job_id)
        self._submit(saves)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) as of now.

        A request is reported sent once vLLM told this worker it finished, the scheduler half
        said its blocks wait for its saves, and no save of it is in flight.
        """
        recving: set[str] = set()
        for job_id, ok in self._transfer.poll() if self._transfer is not None else ():
            job = self._jobs.pop(job_id)
            self._done[job_id] = ok
            if job.direction is Direction.LOAD:
                recving.add(job.req_id)
                self._note_load_errors(job, ok)
                continue
            saves = self._saves_of[job.req_id]
            saves.discard(job_id)
            if not saves:
                del self._saves_of[job.req_id]
        self._finished.update(finished_req_ids)
        sending = {rid for rid in self._delayed & self._finished if rid not in self._saves_of}
        self._delayed -= sending
        self._finished &= self._delayed
        failed, self._failed_requests = self._failed_requests, set()
        return sending, recving, failed

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def worker_meta(self) -> KVTierWorkerMeta | None:
        if not self._done and self._rate is None:
            return None
        done, self._done = self._done, {}
        rate, self._rate = self._rate, None
        return KVTierWorkerMeta(done, rate)

    def drain(self) -> None:
        """Wait on the host until every copy submitted so far has completed."""
        if self._transfer is not None:
            self._transfer.synchronize()

    def shutdown(self) -> None:
        self.drain()
        if self._registration is not None:
            self._registration.release()
            self._registration = None

    def _note_load_errors(self, job: TransferJob, ok: bool) -> None:
        if ok and not job.failed_block_ids:
            return
        if self.plan.num_vllm_groups > 1:
            self._failed_requests.add(job.req_id)
            return
        self._load_errors.update(job.failed_block_ids)
        if not ok:  # nothing of the job can be trusted: every block it was to fill
            for blocks in job.groups:
                self._load_errors.update(int(b) for b in blocks.device_blocks[:, 0])

    def _submit(self, jobs: list[TransferJob]) -> None:
        if not jobs:
            return
        transfer = self._ensure_transfer()
        for job in jobs:
            self._jobs[job.job_id] = job
        transfer.submit(jobs)

    def _ensure_transfer(self) -> BlockTransfer:
        if self._transfer is not None:
            return self._transfer
        if self._allocation is None:
            raise RuntimeError("kvtier.vllm: a job arrived before register_kv_caches")
        pool = host_pool.lookup(self._engine_id)
        if pool is None:
            raise RuntimeError(
                "kvtier.vllm: this worker cannot reach the connector's host pages; the scheduler and the worker "
                "must run in one process (tensor_parallel_size=1, pipeline_parallel_size=1, the 'uni' executor)"
            )
        device = self._allocation.device
        self._registration = host_pool.register_for_device(pool, device)
        policy, bulk = None, None
        if device.type == "cuda" and self._registration is None:
            policy = CopyPolicy(copy_engine_min_bytes=0)  # the copy kernel cannot reach pageable memory
        elif device.type == "cuda":
            bulk = self._bulk  # large calls: the kernel's host cost is flat
        self._transfer = BlockTransfer(
            self._allocation, self._routes, pool.buffers, PageCopier(device, policy=policy), bulk
        )
        return self._transfer
