"""Small pages on the copy engines under ``kvtier bench copy``'s matmul load: scattered, or in runs.

``scripts/copy_under_load.py`` finds that the rate of scattered 64 KiB pages under the load does
not depend on the pages per call. This asks whether it depends on the size of each copy: the
same calls with the pages in runs of ``run`` consecutive slots on both sides (which the copier
joins into one copy of ``run`` pages), for 64, 128 and 256 KiB pages, 32 MiB a call, both ways,
each call gated as the bench gates it. Prints GB/s idle, under load, and their ratio. Needs a
CUDA device; run from the source tree: ``PYTHONPATH=. python scripts/copy_runs_under_load.py``.
"""

from __future__ import annotations

import statistics

import numpy as np

from kvtier.cli import bench_copy

SHAPES = ((64 * 1024, 512), (128 * 1024, 256), (256 * 1024, 128))  # (page bytes, pages a call)
RUNS = (1, 4, 16)
ITERS = 12


def main() -> None:
    bench = bench_copy._CopyBench(ITERS, warmup=3)
    print("dir  page KiB  pages  run   idle GB/s  load GB/s  load/idle  load covered")
    for direction in ("h2d", "d2h"):
        for page, pages in SHAPES:
            for run in RUNS:
                measure = lambda d=direction, b=page, n=pages, r=run: _time_calls(bench, d, b, n, r)  # noqa: E731
                idle = measure()
                load, covered = bench.under_load(measure, expected_ms=300.0)
                idle_gbps, load_gbps = (pages * page / statistics.median(times) / 1e6 for times in (idle, load))
                print(
                    f"{direction}  {page // 1024:8d}  {pages:5d}  {run:3d}   {idle_gbps:9.1f}  {load_gbps:9.1f}  "
                    f"{load_gbps / idle_gbps:9.2f}  {covered}"
                )


def _runs(pages: int, src_slots: int, dst_slots: int, run: int) -> np.ndarray:
    """``pages`` (src, dst) pairs in ``pages // run`` runs of ``run`` consecutive slots on both
    sides, the runs at random distinct places (int64, what the tiers pass)."""
    rng = np.random.default_rng(pages * 7 + run)
    src_starts = rng.permutation(src_slots // run)[: pages // run] * run
    dst_starts = rng.permutation(dst_slots // run)[: pages // run] * run
    step = np.arange(run)
    src, dst = (src_starts[:, None] + step).ravel(), (dst_starts[:, None] + step).ravel()
    return np.stack([src, dst], axis=1).astype(np.int64)


def _time_calls(bench: bench_copy._CopyBench, direction: str, page: int, pages: int, run: int) -> list[float]:
    """Milliseconds of ``ITERS`` calls on the copy engines, each after the bench's gate, after a warm-up."""
    src, dst, src_slots, dst_slots = bench._buffers(direction, page)
    pairs = _runs(pages, src_slots, dst_slots, run)
    copier, stream = bench.copiers["copy_engine"], bench.stream
    for _ in range(4):
        copier.copy(src, dst, pairs, page, stream)
    stream.synchronize()
    gate = bench_copy.GATE_CYCLES + bench_copy.GATE_CYCLES_PER_PAGE * pages
    return bench.time_gated(lambda _: copier.copy(src, dst, pairs, page, stream), gate)


if __name__ == "__main__":
    main()
