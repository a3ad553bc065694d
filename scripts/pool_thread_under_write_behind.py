"""Time the pool's thread while write-behind keeps the disk busy (the index's commits among its work).

A CPU ``KVCacheManager`` of 1 MiB pages (primary 64 MiB, host 256 MiB, disk ``--disk-gib`` GiB
under ``--dir``, write-behind on, blocking writes off, as ``kvtier.vllm`` runs it) publishes a
prompt of ``--blocks`` random blocks, then ``maintain()``s, a step every ``--step-ms``, for ``--seconds``:
host memory stays full, so write-behind writes its coldest pages to disk all the time and the
page cache fills with them. Each ``maintain()`` (which lands write-behind batches and commits
the disk index) and each whole step (publish + maintain) is timed on the pool's thread.

Prints the steps, the pages the disk took, and the median, 99th percentile and longest
``maintain()`` and step, ms. Run it from two trees in turn to compare them.

    python scripts/pool_thread_under_write_behind.py --dir /path/on/the/disk
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import torch

import kvtier

TPB = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="a directory on the disk to time (default: the temporary one)")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=20.0, help="a step starts this long after the last")
    parser.add_argument("--disk-gib", type=int, default=8)
    args = parser.parse_args()
    spec = kvtier.ModelSpec.uniform(16, 8, 128, torch.float16, model_id="kvtier-bench-write-behind")
    rng = random.Random(0)
    maintain_s: list[float] = []
    step_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-write-behind-", dir=args.dir) as tmp:
        tiers = [
            kvtier.PrimaryTier(64 << 20),
            kvtier.HostTier(256 << 20),
            kvtier.DiskTier(args.disk_gib << 30, tmp, write_behind=True, blocking_writes=False),
        ]
        manager = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers, device="cpu"))
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            tokens = [rng.getrandbits(31) for _ in range(args.blocks * TPB)]
            t0 = time.perf_counter()
            cache = manager.create_cache(tokens)
            if not (cache.resume() and cache.resize(len(tokens))):
                raise RuntimeError("a prompt did not fit in the primary tier")
            cache.commit(tokens)
            cache.close()
            t1 = time.perf_counter()
            manager.maintain()
            t2 = time.perf_counter()
            maintain_s.append(t2 - t1)
            step_s.append(t2 - t0)
            time.sleep(max(0.0, args.step_ms / 1e3 - (t2 - t0)))
        disk_pages = manager.stats().tiers["disk"].pages_used
        manager.close()
    out = {"steps": len(step_s), "disk_pages": disk_pages}
    for name, each in (("maintain", maintain_s), ("step", step_s)):
        each.sort()
        out[name] = {
            "median_ms": round(statistics.median(each) * 1e3, 2),
            "p99_ms": round(each[int(len(each) * 0.99)] * 1e3, 2),
            "max_ms": round(each[-1] * 1e3, 1),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
