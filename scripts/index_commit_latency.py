"""Time the disk index's commits on the committing thread beside a large write to the same disk.

A ``DiskIndex`` in a fresh directory under ``--dir`` takes a commit of ``--blocks`` blocks (a node
row and a page row each, random keys) every 10 ms for ``--seconds``, while ``dd`` writes
``--write-gib`` GiB of zeros to a file beside it (the writeback of a busy disk: the page cache
fills, and fsyncs wait for it). Two ways, in turns, ``--rounds`` times each:

- ``background``: the index as built, its log checkpointed on a thread of its own;
- ``on-commit``: SQLite's default, the automatic checkpoint inside the commit that takes the log
  past 1,000 pages (the index's thread stopped, ``wal_autocheckpoint=1000`` on its connection).

Prints, per way, the commits timed and the median, 99th percentile and longest commit, and the
commits that took 50 ms or more.

    python scripts/index_commit_latency.py --dir /path/on/the/disk
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from kvtier.storage.disk_dir import DiskDirectory
from kvtier.storage.disk_index import DiskIndex, NodeRow, PageRow

SLOW_S = 0.05


def commits_beside_a_write(root: Path, on_commit: bool, seconds: float, blocks: int, write_gib: int) -> list[float]:
    """Seconds of each commit of a fresh index under ``root`` while ``dd`` writes beside it."""
    index = DiskIndex(DiskDirectory(root / "index"), "bench")
    if on_commit:
        index._checkpoints.close(10.0)
        index._checkpoints = None
        index._db.execute("PRAGMA wal_autocheckpoint=1000")
    big = root / "big"
    writer = subprocess.Popen(
        ["dd", "if=/dev/zero", f"of={big}", "bs=1M", f"count={write_gib << 10}"], stderr=subprocess.DEVNULL
    )
    time.sleep(2.0)  # the page cache fills first
    seconds_each: list[float] = []
    slot = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and writer.poll() is None:
            for _ in range(blocks):
                key = os.urandom(16)
                index.put_node(NodeRow(key, os.urandom(16), b"", os.urandom(64), 1))
                index.put(PageRow(key, 0, 0, slot, int.from_bytes(os.urandom(7), "little"), 0))
                slot += 1
            t0 = time.perf_counter()
            if not index.flush():
                raise RuntimeError("a commit failed")
            seconds_each.append(time.perf_counter() - t0)
            time.sleep(0.01)
    finally:
        writer.kill()
        writer.wait()
        big.unlink(missing_ok=True)
        index.close()
        os.sync()
    return seconds_each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="a directory on the disk to time (default: the temporary one)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--write-gib", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"background": [], "on-commit": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-commits-", dir=args.dir) as tmp:
        for n in range(args.rounds):
            for way in times if n % 2 == 0 else reversed(times):
                root = Path(tmp) / f"{way}-{n}"
                root.mkdir()
                on_commit = way == "on-commit"
                times[way] += commits_beside_a_write(root, on_commit, args.seconds, args.blocks, args.write_gib)
    rounds = f"{args.rounds} x {args.seconds:.0f} s each way"
    print(f"commits of {args.blocks} blocks beside a {args.write_gib} GiB write, {rounds}")
    for way, each in times.items():
        each.sort()
        slow = sum(s >= SLOW_S for s in each)
        print(
            f"{way:>10}: {len(each)} commits, median {statistics.median(each) * 1e3:.2f} ms, "
            f"p99 {each[int(len(each) * 0.99)] * 1e3:.2f} ms, longest {each[-1] * 1e3:.1f} ms, "
            f"{slow} of {SLOW_S * 1e3:.0f} ms or more"
        )


if __name__ == "__main__":
    main()
