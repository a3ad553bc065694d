"""64 KiB pages on the copy engines under ``kvtier bench copy``'s matmul load, by pages per call and gate.

On an H200 (docs/benchmarks.md, section 58) one run of ``kvtier bench copy`` moved 512 x 64 KiB
under the load at 0.74 of the link host->device, and 1,024 x 64 KiB (its page-size sweep) at
0.94 (section 60: the sweep runs them after copies of smaller pages, which leave the engines in a
faster state). This measures both directions for several call sizes, each with the bench's gate (the
idle kernel before every timed call, so that the call's submission ends before its copies
start) and with one fixed gate, to tell what sets the rate under load; then the same calls timed
``--back-to-back`` at a time between one pair of events (one gate before them), which tells a cost
paid once per call under load from one paid once per timing. Prints one row per case: GB/s idle,
under load, and their ratio. Needs a CUDA device; run from the source tree:
``PYTHONPATH=. python scripts/copy_under_load.py``.
"""

from __future__ import annotations

import argparse
import statistics

from kvtier.cli import bench_copy

PAGE = 64 * 1024
FIXED_GATE = 2_000_000  # cycles of the idle kernel before every call, whatever its pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--back-to-back", type=int, default=4, help="calls timed together in the last rows")
    args = parser.parse_args()
    bench = bench_copy._CopyBench(args.iters, warmup=3)
    print("dir   pages  gate cycles  calls   idle GB/s  load GB/s  load/idle  load covered")
    for direction in ("h2d", "d2h"):
        for pages in args.pages:
            for gate in (bench_copy.GATE_CYCLES + bench_copy.GATE_CYCLES_PER_PAGE * pages, FIXED_GATE):
                _row(
                    bench,
                    direction,
                    pages,
                    gate,
                    1,
                    lambda d=direction, n=pages, g=gate: bench.time_calls("copy_engine", d, n, PAGE, g),
                )
        k = args.back_to_back
        for pages in args.pages[:2]:
            gate = bench_copy.GATE_CYCLES + bench_copy.GATE_CYCLES_PER_PAGE * k * pages  # covers all k submits
            _row(
                bench,
                direction,
                pages,
                gate,
                k,
                lambda d=direction, n=pages, g=gate, k=k: _time_together(bench, d, n, k, g),
            )


def _row(bench: bench_copy._CopyBench, direction: str, pages: int, gate: int, calls: int, measure) -> None:
    idle = measure()
    load, covered = bench.under_load(measure, expected_ms=300.0)
    idle_gbps, load_gbps = (calls * pages * PAGE / statistics.median(times) / 1e6 for times in (idle, load))
    print(
        f"{direction}  {pages:6d}  {gate:11,d}  {calls:5d}   {idle_gbps:9.1f}  {load_gbps:9.1f}  "
        f"{load_gbps / idle_gbps:9.2f}  {covered}"
    )


def _time_together(bench: bench_copy._CopyBench, direction: str, pages: int, calls: int, gate: int) -> list[float]:
    """Milliseconds of ``calls`` calls of ``pages`` pages each, back to back between one pair of
    events, after one gate of ``gate`` cycles; ``bench.iters`` timings after a warm-up."""
    src, dst, src_slots, dst_slots = bench._buffers(direction, PAGE)
    sets = bench._pair_sets(pages, src_slots, dst_slots, calls)  # distinct destinations within each call
    copier, stream = bench.copiers["copy_engine"], bench.stream
    for pairs in sets:
        copier.copy(src, dst, pairs, PAGE, stream)
    stream.synchronize()

    def submit_all(_: int) -> None:
        for pairs in sets:
            copier.copy(src, dst, pairs, PAGE, stream)

    return bench.time_gated(submit_all, gate)


if __name__ == "__main__":
    main()
