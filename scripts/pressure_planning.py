"""Host time of planning a 2,048-page resume under pressure, without the copies.

``kvtier bench manager``'s pressure case (``PressureResume``: both tiers full, a 2,048-block
prefix in host memory that swaps places with as many primary pages) on the CPU, with the CPU
copy path replaced by a no-op, so that only the bookkeeping (locks, eviction, the swap, the
copier's checks and runs, finishing) is timed: the part that the 2 ms target of planning is
about, which on a GPU runs while the copies are in flight. Prints the median and the fastest
resume over ``--seeds`` seeds x 3 resumes. To compare two trees, run it from each in turn;
``--head-start`` times the swap without the mover's swap scratch, as a swap too large for it runs.

Each resume is timed twice, in turns: as ``kvtier bench manager`` times it, after a full collection
(which reads the whole heap, so the resume starts with the CPU's caches cold), and with the
collector only paused (the caches as the set-up left them). The first line is the figure; the
second tells how much of it is the cold caches.
"""

from __future__ import annotations

import argparse
import statistics

import kvtier.copy.copier as copier
from kvtier.cli.bench_manager import PressureResume
from kvtier.tiering import mover


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--write-through", action="store_true")
    parser.add_argument("--head-start", action="store_true", help="no swap scratch: the swap takes its head start")
    args = parser.parse_args()
    if args.head_start:
        mover.SWAP_SCRATCH_BYTES = 0
    copier.copy_pages_cpu = lambda request, runs: None  # the bytes are not what is timed
    times: dict[bool, list[float]] = {True: [], False: []}
    for seed in range(args.seeds):
        side = PressureResume(args.write_through, seed=seed, device="cpu")
        for i in range(6):
            collect = (i + seed) % 2 == 0  # each way first in turn
            times[collect].append(side.once(False, collect=collect)["seconds"] * 1e3)
            side.push_prefix_down()
        side.close()
    for collect, label in ((True, "after a full collection"), (False, "collector paused only")):
        ms = times[collect]
        print(f"planning a 2,048-page resume, {label}: median {statistics.median(ms):.3f} ms, fastest {min(ms):.3f} ms")


if __name__ == "__main__":
    main()
