"""The e2e bench's cases under pressure (targets 4 and 5 of docs/benchmarks.md): a full GPU and a busy queue.

host-full-wt, host-full-nowt (``--pressure``, on by default)
    The prefix is on host memory while every page of the primary tier holds other requests'
    published, evictable pages (prompts of random tokens, never reused), so resuming the prefix
    must evict them. ``-wt``: ``HostTier(write_through=True)``, the fillers' write-through copies
    landed before the timing (``maintain()`` until it plans nothing), so evicting a victim moves
    no byte; ``-nowt``: the victims go down while the prefix comes up (both directions at once).
    Measured: the TTFT of prefix + suffix, and on a separate run the GPU time of
    ``cache.resume()`` (CUDA events) as GB/s on the prefix bytes and share of the link ceiling
    (target >= 0.9); ``victim_bytes_down``: bytes copied down out of the primary tier during that
    resume. Tiers: ``--pressure-primary-gib`` and ``--pressure-host-gib`` (host memory holds the
    prefix plus a copy of every filler page).
host-queued, disk-queued (``--queued``, on by default)
    A manager with host and disk tiers (``--primary-gib``, ``--host-gib``, ``--disk-gib``) and
    ``max_batch_size=1``. One ``generate`` call submits ``--queue-ahead`` uncached prompts of the
    prefix length and then prefix + suffix, which waits while they run one after another. The
    prefix is on host memory (host-queued) or only on disk, demoted past host, OS page cache
    dropped (disk-queued), where the engine may prefetch it while the request waits
    (``--prefetch-policy``, ``--prefetch-timeout-s``: SchedulerConfig's fields, the engine's
    defaults when not given). Every run starts in a fresh engine. Measured: the queued request's
    TTFT from its arrival, ``own_ms`` (TTFT after the last request ahead of it finished), the
    tokens it reused by tier (a disk prefix prefetched in time shows as host), where the prefix
    was when the queue was submitted, and on disk-queued ``ttft_vs_host`` (target <= 1.2).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import statistics
import tempfile
from collections.abc import Iterator

from kvtier.cli.arguments import at_least, gibibytes, seconds
from kvtier.cli.bench_machine import drop_page_cache

FILLER_PRIORITY = 100  # suspended fillers outrank every published page: the others go down first
MAX_ROUNDS = 10_000  # a bound on filler prompts and write-through batches; reaching it is a failure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pressure", action=argparse.BooleanOptionalAction, default=True, help="host-full cases")
    parser.add_argument(
        "--pressure-primary-gib",
        type=gibibytes,
        default=None,
        help="primary tier of host-full (default: 3 x the KV bytes of the longest prefix)",
    )
    parser.add_argument(
        "--pressure-host-gib",
        type=gibibytes,
        default=None,
        help="host tier of host-full: prefix + a copy of the primary (default: 5 x the longest prefix's KV bytes)",
    )
    parser.add_argument("--queued", action=argparse.BooleanOptionalAction, default=True, help="host/disk-queued cases")
    parser.add_argument(
        "--queue-ahead", type=at_least(1), default=3, help="uncached prompts of the prefix length ahead"
    )
    parser.add_argument(
        "--prefetch-policy",
        default=None,
        choices=["off", "best_effort", "timeout", "wait_complete"],
        help="SchedulerConfig.prefetch_policy of the queued cases (default: the engine's)",
    )
    parser.add_argument("--prefetch-timeout-s", type=seconds, default=None, help="SchedulerConfig.prefetch_timeout_s")


# -- host-full ---------------------------------------------------------------------------------------


def host_full_rows(bench, ref) -> list[dict]:
    """host-full-wt and host-full-nowt."""
    return [_host_full(bench, ref, write_through) for write_through in (True, False)]


def _host_full(bench, ref, write_through: bool) -> dict:
    from kvtier.engine import SamplingParams

    args = bench.args
    one = SamplingParams(max_tokens=1)
    tiers = bench.memory_tiers(args.pressure_primary_gib, args.pressure_host_gib, write_through)
    with bench.engine(tiers, recompute_when_faster=False) as eng:  # from host every block loads: the disk case weighs
        mgr = eng.cache_manager
        full = functools.partial(_host_full_state, bench, eng, ref.prefix)
        eng.generate([ref.prefix], one)
        full()
        eng.generate([ref.prefix + ref.warm], one)  # warm-up
        ttfts, reloads, down, tiers_used, was_full = [], [], [], [], []
        for _ in range(args.repeats):
            was_full.append(full())
            out = eng.generate([ref.prefix + bench.tokens(args.suffix)], one)[0]
            ttfts.append(out.ttft_s)
            tiers_used.append(out.reused_tokens_by_tier)
            was_full.append(full())
            before = _bytes_down(mgr)
            reloads.append(bench.reload_time(eng, ref.prefix + bench.tokens(args.suffix)))
            down.append(_bytes_down(mgr) - before)
        agreement = bench.agreement(eng, ref, full)
    row = bench.row(ref, "host-full-wt" if write_through else "host-full-nowt", ttfts, reloads, tiers_used[-1])
    row["agreement"] = agreement
    row["write_through"] = write_through
    row["primary_full"] = all(was_full)
    row["victim_bytes_down"] = statistics.median(down)
    return row


def _host_full_state(bench, eng, prefix: list[int]) -> bool:
    """The prefix on host and every primary page used by finished requests' published pages, their
    write-through copies (if on) landed. Returns whether the primary tier ended full."""
    mgr = eng.cache_manager
    _clear_memory(bench, mgr, prefix, past_host=False)
    full = _fill_primary(bench, eng, len(prefix))
    for _ in range(MAX_ROUNDS):
        planned = mgr.maintain()
        bench.sync()
        if not planned:
            break
    else:
        raise RuntimeError("write-through copies still planned after MAX_ROUNDS batches")
    return full


def _fill_primary(bench, eng, length: int) -> bool:
    """Generate prompts of fresh random tokens (up to ``length`` each) while the primary tier has
    free pages. Returns whether it ended with none free (a prompt may need one page more than it
    keeps, which can leave one free page per group)."""
    from kvtier.engine import SamplingParams

    mgr = eng.cache_manager
    groups = len(mgr.layer_groups)
    last_free = None
    for _ in range(MAX_ROUNDS):
        primary = mgr.stats().tiers["primary"]
        free = (primary.pages_total - primary.pages_used) // groups
        if free == 0 or free == last_free:
            return free == 0
        last_free = free
        eng.generate([bench.tokens(min(length, free * mgr.tokens_per_block))], SamplingParams(max_tokens=1))
    raise RuntimeError("the primary tier was not filled after MAX_ROUNDS prompts")


def _clear_memory(bench, mgr, prefix: list[int], past_host: bool) -> None:
    """Empty the memory tiers but for the prefix, which lands on host (or, ``past_host``, on the
    next tier down): while a cache holds the prefix, suspended unpublished fillers take every
    other memory page (pushing the other pages down or dropping them), then all are closed."""
    holder = mgr.create_cache([*prefix, 0])  # the extra token lets the whole prefix match
    tiers = mgr.stats().tiers
    groups, tpb = len(mgr.layer_groups), mgr.tokens_per_block
    primary = tiers["primary"].pages_total // groups
    room = primary + tiers["host"].pages_total // groups
    if not past_host:
        room -= -(-holder.num_committed_tokens // tpb)
    fillers = []
    while room > 0:
        n = min(primary, room)
        filler = mgr.create_cache([0], priority=FILLER_PRIORITY)
        assert filler.resume()
        assert filler.resize(n * tpb), "the memory tiers could not be filled"
        filler.suspend()
        fillers.append(filler)
        room -= n
    for filler in fillers:
        filler.close()
    holder.close()
    bench.sync()


def _bytes_down(mgr) -> int:
    """Bytes copied so far out of the primary tier to a lower one."""
    return sum(n for edge, n in mgr.stats().bytes_copied.items() if edge.startswith("primary->"))


# -- host-queued, disk-queued -------------------------------------------------------------------------


def queued_rows(bench, ref) -> list[dict]:
    """host-queued and disk-queued, each run in a fresh engine (after one untimed disk-queued run)."""
    _queued_once(bench, ref, "disk")  # warm-up
    rows = []
    for tier in ("host", "disk"):
        runs = [_queued_once(bench, ref, tier) for _ in range(bench.args.repeats)]
        with _queued_engine(bench) as eng:
            agreement = bench.agreement(eng, ref, functools.partial(_demote, bench, eng, ref.prefix, tier, True))
        row = bench.row(ref, f"{tier}-queued", [r["ttft"] for r in runs], None, runs[-1]["tiers"], agreement)
        row["own_ms"] = statistics.median(r["own"] for r in runs) * 1e3
        row["own_all_ms"] = [r["own"] * 1e3 for r in runs]
        row["prefix_placement_before"] = runs[-1]["before"]
        row["queue_ahead"] = bench.args.queue_ahead
        row["prefetch_policy"] = getattr(eng.scheduler.config, "prefetch_policy", None)
        if tier == "disk":
            row["page_cache_dropped"] = all(r["dropped"] for r in runs)
        rows.append(row)
    host, disk = rows
    disk["ttft_vs_host"] = disk["ttft_ms"] / host["ttft_ms"]
    disk["own_vs_host"] = disk["own_ms"] / host["own_ms"]
    return rows


def _queued_once(bench, ref, tier: str) -> dict:
    """One queue in a fresh engine: TTFT of prefix + suffix behind the uncached prompts."""
    from kvtier.engine import SamplingParams

    args = bench.args
    one = SamplingParams(max_tokens=1)
    with _queued_engine(bench) as eng:
        dropped = _demote(bench, eng, ref.prefix, tier, populate=True)
        before = _placement(eng.cache_manager, ref.prefix)
        ahead = [bench.tokens(ref.length) for _ in range(args.queue_ahead)]
        outs = eng.generate([*ahead, ref.prefix + bench.tokens(args.suffix)], one)
    mine = outs[-1]
    last_ahead = max((o.latency_s for o in outs[:-1]), default=0.0)
    return {
        "ttft": mine.ttft_s,
        "own": mine.ttft_s - last_ahead,
        "tiers": mine.reused_tokens_by_tier,
        "before": before,
        "dropped": dropped,
    }


def _placement(mgr, prefix: list[int]) -> dict[str, int]:
    """The prefix's tokens by the tier they are on (the coldest of a block's pages), moving nothing."""
    cache = mgr.create_cache([*prefix, 0])
    placement = {tier: n for tier, n in cache.reused_by_tier.items() if n}
    cache.close()
    return placement


def _demote(bench, eng, prefix: list[int], tier: str, populate: bool) -> bool:
    """Publish the prefix (``populate``) and leave it on host or only on disk, memory otherwise
    empty; on disk, drop the OS page cache. Returns whether the page cache was dropped."""
    from kvtier.engine import SamplingParams

    if populate:
        eng.generate([prefix], SamplingParams(max_tokens=1))
    _clear_memory(bench, eng.cache_manager, prefix, past_host=tier == "disk")
    return tier == "disk" and drop_page_cache()


@contextlib.contextmanager
def _queued_engine(bench) -> Iterator:
    """A fresh engine with primary, host and a disk tier in a new directory, removed afterwards."""
    import kvtier

    args = bench.args
    if args.disk_path:
        os.makedirs(args.disk_path, exist_ok=True)  # ``kept_directory``: it may be new
    path = tempfile.mkdtemp(prefix="kvtier-e2e-queued-", dir=args.disk_path)
    tiers = bench.memory_tiers(args.primary_gib, args.host_gib)
    tiers.append(kvtier.DiskTier(int(args.disk_gib * (1 << 30)), path))
    eng = bench.engine(tiers, max_batch_size=1, **_prefetch_options(args))
    try:
        yield eng
    finally:
        eng.cache_manager.close(persist=False)
        eng.close()
        shutil.rmtree(path, ignore_errors=True)


def _prefetch_options(args: argparse.Namespace) -> dict:
    """The SchedulerConfig prefetch fields given on the command line."""
    options = {"prefetch_policy": args.prefetch_policy, "prefetch_timeout_s": args.prefetch_timeout_s}
    return {name: value for name, value in options.items() if value is not None}
