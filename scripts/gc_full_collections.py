"""Time Python's full garbage collections with kvtier's cached blocks in the heap.

As vLLM's engine does once started, the heap is frozen first (``gc.collect(); gc.freeze()``), so
that a full collection scans only objects made later. A CPU ``KVCacheManager`` (one primary tier
of 32 KiB pages) then publishes 64-block prompts of random tokens; at a quarter, a half and all of
``--blocks`` blocks, prints the objects the collector tracks and a full collection's time (the
fastest of three), ms. Run it from two trees in turn to compare them.

    python scripts/gc_full_collections.py --blocks 65536
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

import kvtier

TPB = 16
PROMPT_BLOCKS = 64


def full_collection_ms() -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=65536)
    args = parser.parse_args()
    spec = kvtier.ModelSpec.uniform(4, 2, 64, torch.float16, model_id="kvtier-bench-gc")
    gc.collect()
    gc.freeze()
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(args.blocks * 32768 + (1 << 20))]))
    rng = random.Random(0)
    marks = {args.blocks // 4, args.blocks // 2, args.blocks}
    published = 0
    while published < args.blocks:
        tokens = [rng.getrandbits(30) for _ in range(PROMPT_BLOCKS * TPB)]
        cache = mgr.create_cache(tokens)
        if not (cache.resume() and cache.resize(len(tokens))):
            raise RuntimeError("the primary tier is full")
        cache.commit(tokens)
        cache.close()
        published += PROMPT_BLOCKS
        if published in marks:
            tracked = len(gc.get_objects())
            print(f"blocks {published}: tracked objects {tracked}, full collection {full_collection_ms():.1f} ms")
    mgr.close()


if __name__ == "__main__":
    main()
