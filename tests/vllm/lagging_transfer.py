"""``LaggingTransfer``: a ``BlockTransfer`` whose batches run (copy and complete) only ``lag`` steps
after they were submitted, in order, as on a GPU whose transfer stream lags behind the compute;
``fence`` runs the fenced batches (and every one before them) at once, ``synchronize`` all.
Patched into ``kvtier.vllm.worker`` by a test that needs a save still in flight."""

from __future__ import annotations

from kvtier.vllm.transfer import BlockTransfer


class LaggingTransfer(BlockTransfer):
    lag = 0  # steps a batch waits before it runs (read when it is submitted)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._queue: list[list] = []  # [jobs, steps left]

    def submit(self, jobs) -> None:
        if jobs:
            self._queue.append([list(jobs), LaggingTransfer.lag])

    def _run_upto(self, count: int) -> None:
        for jobs, _ in self._queue[:count]:
            super().submit(jobs)
        del self._queue[:count]

    def poll(self):
        due = 0
        for entry in self._queue:
            if entry[1] > 0:
                break
            due += 1
        self._run_upto(due)
        for entry in self._queue:
            entry[1] -= 1
        return super().poll()

    def fence(self, job_ids) -> None:
        wanted, last = set(job_ids), -1
        for i, (jobs, _) in enumerate(self._queue):
            if any(job.job_id in wanted for job in jobs):
                last = i
        self._run_upto(last + 1)

    def synchronize(self) -> None:
        self._run_upto(len(self._queue))
