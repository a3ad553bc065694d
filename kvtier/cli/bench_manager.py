"""``kvtier bench manager``: the manager's CPU overhead (PERF.md target 2), through the public API.

1. Decode step: ``resize`` by one token and ``commit`` of it, for every one of 256 running
   requests, 16 tokens per block; reported per request per step (crossing block boundaries,
   so allocation and publishing are included in the average).
2. A cached 32K-token prompt: ``create_cache`` (encode + match) and ``resume`` of a prompt
   whose 2,048 blocks are all cached in the primary tier.
3. With ``--tiers``, a demotion/promotion round trip per page on the CPU: pages of suspended
   caches demoted to host (and disk), then promoted back by ``resume``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

DECODE_REQUESTS = 256
DECODE_CONTEXT = 512
TPB = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=256, help="decode steps to time (default 256)")
    parser.add_argument("--prompt-tokens", type=int, default=32768, help="cached prompt length (default 32768)")
    parser.add_argument("--repeats", type=int, default=21, help="repeats of the cached-prompt measurement")
    parser.add_argument("--no-tiers", action="store_true", help="skip the demotion/promotion round trip")


def run(args: argparse.Namespace) -> int:
    results = {
        "decode_us_per_request_step": bench_decode(args.steps),
        "cached_prompt_ms": bench_cached_prompt(args.prompt_tokens, args.repeats),
    }
    if not args.no_tiers:
        results["round_trip_us_per_page"] = bench_round_trip()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    _print_table(results, args.prompt_tokens)
    return 0


def _manager(pages: int, tiers: list | None = None):
    import torch

    import kvtier

    spec = kvtier.ModelSpec.uniform(1, 1, 8, torch.float16)
    page = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)])).page_bytes(0)
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(page * pages), *(tiers or [])])
    return kvtier.KVCacheManager(spec, config), page


def bench_decode(steps: int) -> dict[str, float]:
    """Median over rounds of (time of one step over all requests) / requests."""
    blocks = (DECODE_CONTEXT + steps) // TPB + 2
    mgr, _ = _manager(DECODE_REQUESTS * blocks + 64)
    caches = []
    for r in range(DECODE_REQUESTS):
        prompt = [r * 100_000 + i for i in range(DECODE_CONTEXT)]
        cache = mgr.create_cache(prompt)
        cache.resume()
        cache.resize(DECODE_CONTEXT)
        cache.commit(prompt)
        caches.append(cache)
    per_step = []
    token = [7]
    for _ in range(steps):
        t0 = time.perf_counter()
        for cache in caches:
            cache.resize(cache.capacity + 1)
            cache.commit(token)
        per_step.append((time.perf_counter() - t0) / DECODE_REQUESTS * 1e6)
    mgr.close()
    return {"median": statistics.median(per_step), "mean": statistics.fmean(per_step), "max": max(per_step)}


def bench_cached_prompt(prompt_tokens: int, repeats: int) -> dict[str, float]:
    """create_cache + resume of a fully cached prompt, and the same split into its two calls."""
    mgr, _ = _manager(2 * (prompt_tokens // TPB) + 64)
    prompt = list(range(1, prompt_tokens + 1))
    first = mgr.create_cache(prompt)
    first.resume()
    first.resize(prompt_tokens)
    first.commit(prompt)
    first.close()
    total, create, resume = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        cache = mgr.create_cache(prompt)
        t1 = time.perf_counter()
        assert cache.resume()
        t2 = time.perf_counter()
        assert cache.num_reused_tokens == prompt_tokens - 1
        cache.close()
        total.append((t2 - t0) * 1e3)
        create.append((t1 - t0) * 1e3)
        resume.append((t2 - t1) * 1e3)
    mgr.close()
    return {
        "median": statistics.median(total),
        "create_median": statistics.median(create),
        "resume_median": statistics.median(resume),
    }


def bench_round_trip() -> dict[str, float]:
    """Per page: suspend a cache, push its pages to host (and disk) by filling primary, resume it."""
    import kvtier

    results = {}
    for label in ("host", "host+disk"):
        with tempfile.TemporaryDirectory() as tmp:
            pages = 256
            _, page = _manager(1)
            tiers = [kvtier.HostTier(page * pages * 2)]  # a swap needs room beside the pages it swaps
            if label == "host+disk":
                tiers = [kvtier.HostTier(page * 8), kvtier.DiskTier(page * pages * 2, tmp)]
            mgr, _ = _manager(pages, tiers)
            tokens = [list(range(i * 10**6, i * 10**6 + pages * TPB)) for i in range(2)]
            caches = []
            for t in tokens:
                cache = mgr.create_cache(t)
                assert cache.resume()
                cache.resize(len(t))
                cache.commit(t)
                cache.suspend()
                caches.append(cache)
            times = []
            for i in range(10):
                t0 = time.perf_counter()
                assert caches[i % 2].resume()  # demotes the other cache's pages, promotes its own
                times.append(time.perf_counter() - t0)
                caches[i % 2].suspend()
            mgr.close()
            results[label] = statistics.median(times) / (2 * pages) * 1e6
    return results


def _print_table(results: dict, prompt_tokens: int) -> None:
    decode = results["decode_us_per_request_step"]
    cached = results["cached_prompt_ms"]
    rows = [
        ("decode step, us per request (256 requests)", f"{decode['median']:.3f}", "<= 1.0"),
        (f"cached {prompt_tokens}-token prompt: create + resume, ms", f"{cached['median']:.3f}", "<= 2.0"),
        ("  of which create_cache (encode + match + hold), ms", f"{cached['create_median']:.3f}", ""),
        ("  of which resume (lock in primary), ms", f"{cached['resume_median']:.3f}", ""),
    ]
    for label, value in results.get("round_trip_us_per_page", {}).items():
        rows.append((f"demote + promote round trip via {label}, us per page", f"{value:.2f}", ""))
    width = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{width}}  {'value':>10}  target")
    for label, value, target in rows:
        print(f"{label:<{width}}  {value:>10}  {target}")
