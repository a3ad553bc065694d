"""What the halves tell each other each step (picklable: numpy arrays, ints and strings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier.vllm.transfer import TransferJob


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step.

    ``jobs``: loads and saves to start this step. ``flush_job_ids``: saves that must have read
    their blocks before this step's forward may overwrite them (their blocks were freed: a
    preempted request, or blocks a sliding window let go). ``delayed_free_req_ids``: finished
    requests whose blocks vLLM keeps until the worker reports their saves done.
    ``prefill_tokens``: prompt tokens this step computes, for the worker to time the step's
    forward (0: not timed; ``recompute_when_faster`` without a given rate).
    """

    jobs: list[TransferJob] = field(default_factory=list)
    flush_job_ids: list[int] = field(default_factory=list)
    delayed_free_req_ids: list[str] = field(default_factory=list)
    prefill_tokens: int = 0


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: the jobs that completed, and whether they succeeded;
    the prefill rate (tokens/s) measured on the worker's timed forwards, when a new sample moved it."""

    done: dict[int, bool] = field(default_factory=dict)
    prefill_rate: float | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMeta:
        """A job succeeded only if it succeeded everywhere it was reported; the slowest rate counts."""
        assert isinstance(other, KVTierWorkerMeta)
        merged = dict(self.done)
        for job_id, ok in other.done.items():
            merged[job_id] = merged.get(job_id, True) and ok
        rates = [r for r in (self.prefill_rate, other.prefill_rate) if r is not None]
        return KVTierWorkerMeta(merged, min(rates) if rates else None)
