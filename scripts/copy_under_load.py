"""64 KiB pages on the copy engines under ``kvtier bench copy``'s matmul load, by pages per call and gate.

On an H200 (docs/benchmarks.md, section 58) one run of ``kvtier bench copy`` moved 512 x 64 KiB
under the load at 0.74 of the link host->device, and 1,024 x 64 KiB (its page-size sweep) at
0.94. This measures both directions for several call sizes, each with the bench's gate (the
idle kernel before every timed call, so that the call's submission ends before its copies
start) and with one fixed gate, to tell what sets the rate under load. Prints one row per case:
GB/s idle, under load, and their ratio. Needs a CUDA device; run from the source tree:
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
    args = parser.parse_args()
    bench = bench_copy._CopyBench(args.iters, warmup=3)
    print("dir   pages  gate cycles   idle GB/s  load GB/s  load/idle  load covered")
    for direction in ("h2d", "d2h"):
        for pages in args.pages:
            for gate in (bench_copy.GATE_CYCLES + bench_copy.GATE_CYCLES_PER_PAGE * pages, FIXED_GATE):
                idle = bench.time_calls("copy_engine", direction, pages, PAGE, gate)
                load, covered = bench.under_load(
                    lambda d=direction, n=pages, g=gate: bench.time_calls("copy_engine", d, n, PAGE, g),
                    expected_ms=300.0,
                )
                idle_gbps, load_gbps = (pages * PAGE / statistics.median(times) / 1e6 for times in (idle, load))
                print(
                    f"{direction}  {pages:6d}  {gate:11,d}   {idle_gbps:9.1f}  {load_gbps:9.1f}  "
                    f"{load_gbps / idle_gbps:9.2f}  {covered}"
                )


if __name__ == "__main__":
    main()
