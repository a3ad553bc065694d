"""``kvtier bench e2e``: time to first token when a long prefix comes back (targets 3-5 of docs/benchmarks.md).

For each prefix length, a request of prefix + a short new suffix is timed these ways:

    recompute    no reuse: the whole prompt through the dense prefill path (SDPA / flash attention)
    recompute-engine
                 no reuse: a prompt never seen, through the engine's own chunked prefill (what a
                 request gets when the cache has nothing, or chooses to recompute)
    gpu          the prefix's pages resident in the primary tier
    host         the prefix demoted to host memory (pushed out by other requests)
    disk         the prefix demoted to disk (a manager with no host tier), OS page cache dropped
                 where the system allows it; its target: TTFT <= 1.05 x recompute-engine (the
                 cache never makes a request slower than the same engine recomputing it)
    host-full-wt, host-full-nowt (``--pressure``, on by default)
                 the prefix on host while the primary tier is full of other requests' pages
    host-queued, disk-queued (``--queued``, on by default)
                 the request queued behind long uncached prompts, its prefix on host or on disk

kvtier.cli.bench_e2e_pressure describes the last two pairs. TTFT is measured by the engine
(request arrival to first sampled token). Stage timings come from CUDA events around ``resume``
(the reload) on a separate run. The link ceiling is measured in the same run (one pinned 1 GiB
host-to-device copy). Tokens are compared with the dense path by first-token logits (relative
error, same argmax) and by the common prefix of a few greedy tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.cli import bench_e2e_pressure as pressure
from kvtier.cli.arguments import at_least, device, gibibytes, kept_directory, lengths, non_empty
from kvtier.cli.bench_e2e_report import add_targets, print_table
from kvtier.cli.bench_machine import drop_page_cache, link_ceiling_gbps

GIB = 1 << 30
# Each tier's default size in KV bytes of the longest prefix: for the 8B shape at 32K tokens (4 GiB)
# 24, 8, 8, 12 and 20 GiB; any other model or prefix length gets tiers in the same proportions.
PREFIXES_PER_TIER = {"primary_gib": 6, "host_gib": 2, "disk_gib": 2, "pressure_primary_gib": 3, "pressure_host_gib": 5}


def _sized(name: str) -> str:
    return f"default: {PREFIXES_PER_TIER[name]} x the KV bytes of the longest prefix"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=non_empty, default="llama-8b-shape")
    parser.add_argument("--device", type=device, default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    parser.add_argument("--prefixes", type=lengths, default=[4096, 16384, 32768], help="prefix lengths in tokens")
    parser.add_argument("--suffix", type=at_least(1), default=128, help="new tokens after the prefix")
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--greedy-tokens", type=at_least(1), default=4, help="tokens compared with the dense path")
    parser.add_argument("--tokens-per-block", type=at_least(1), default=32)
    parser.add_argument("--primary-gib", type=gibibytes, default=None, help=_sized("primary_gib"))
    parser.add_argument("--host-gib", type=gibibytes, default=None, help=_sized("host_gib"))
    parser.add_argument("--disk-gib", type=gibibytes, default=None, help=_sized("disk_gib"))
    parser.add_argument(
        "--disk-path",
        type=kept_directory,
        default=None,
        help="disk tier directory, kept (default: a temporary one, removed after)",
    )
    parser.add_argument(
        "--chunk", type=at_least(1), default=8192, help="prefill chunk (max_num_tokens) when populating"
    )
    pressure.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvtier.models import build_model

    short = [n for n in args.prefixes if n < args.tokens_per_block]
    if short:  # refused before a model is built
        raise ValueError(
            f"--prefixes: each prefix holds at least one block of --tokens-per-block {args.tokens_per_block} "
            f"tokens (a shorter one has nothing to reuse), got {', '.join(map(str, short))}"
        )
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, device, dtype, seed=0)
    fill_tier_sizes(args, model.spec)
    bench = Bench(model, args)
    ceiling = link_ceiling_gbps(bench.device)
    rows = []
    for length in args.prefixes:
        ref = bench.reference(length, ceiling)
        rows.extend(bench.prefix(ref))
        if args.pressure:
            rows.extend(pressure.host_full_rows(bench, ref))
        if args.queued:
            rows.extend(pressure.queued_rows(bench, ref))
    add_targets(rows, ceiling)
    result = {"link_ceiling_gbps": ceiling, "rows": rows, "args": vars(args)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print_table(rows, ceiling)
    return 0


def fill_tier_sizes(args: argparse.Namespace, spec) -> None:
    """Give each tier size left unset its default, ``PREFIXES_PER_TIER`` x the KV bytes of the longest
    of ``args.prefixes`` for ``spec`` (a ``kvtier.ModelSpec``)."""
    from kvtier.layout import page_geometries

    tpb = args.tokens_per_block
    block_bytes = sum(g.page_bytes for g in page_geometries(spec, tpb))
    longest = max(args.prefixes)
    prefix_gib = -(-longest // tpb) * block_bytes / GIB
    for name, prefixes in PREFIXES_PER_TIER.items():
        if getattr(args, name) is None:
            setattr(args, name, prefixes * prefix_gib)


@dataclass
class Reference:
    """One prefix length: its tokens, the dense path's answer to ``check`` and the recompute TTFT."""

    length: int
    prefix: list[int]
    warm: list[int]  # a suffix for untimed warm-ups
    check: list[int]  # prefix + a suffix whose tokens every case compares with the dense path
    dense_logits: Any
    dense_tokens: list[int]
    ceiling: float
    recompute: float = 0.0
    prefix_bytes: int | None = None


class Bench:
    """The model, the arguments and helpers shared by the cases."""

    def __init__(self, model, args: argparse.Namespace) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.args = args
        self.device = model.device
        self.gen = torch.Generator().manual_seed(1234)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def tokens(self, n: int) -> list[int]:
        return self.torch.randint(0, self.model.vocab_size, (n,), generator=self.gen).tolist()

    def reference(self, length: int, ceiling: float) -> Reference:
        """The dense path's first-token logits and greedy tokens for prefix + a suffix."""
        prefix = self.tokens(length)
        warm = self.tokens(self.args.suffix)
        check = prefix + self.tokens(self.args.suffix)
        logits = self.model.forward_dense(self.torch.tensor(check, device=self.device), "last")[0].float()
        return Reference(length, prefix, warm, check, logits, self._dense_greedy(check), ceiling)

    def prefix(self, ref: Reference) -> list[dict]:
        """The recompute, gpu, host and disk rows; sets ``ref.recompute`` and ``ref.prefix_bytes``."""
        torch = self.torch
        from kvtier.engine import SamplingParams

        args = self.args
        prefix, warm = ref.prefix, ref.warm
        one = SamplingParams(max_tokens=1)
        # ``warm`` warms each path up (untimed); every case then times suffixes no request has
        # used yet, so each reuses exactly the prefix.
        fresh = {case: [self.tokens(args.suffix) for _ in range(args.repeats)] for case in ("recompute", "gpu", "host")}
        rows = []

        # (a) recompute on the dense path
        times = []
        self.model.forward_dense(torch.tensor(prefix + warm, device=self.device), "last")
        for suffix in fresh["recompute"]:
            self.sync()
            t0 = time.perf_counter()
            logits = self.model.forward_dense(torch.tensor(prefix + suffix, device=self.device), "last")
            int(logits[0].argmax())
            times.append(time.perf_counter() - t0)
        ref.recompute = statistics.median(times)
        rows.append(self.row(ref, "recompute", times))

        # From memory tiers every cached block loads, whatever the load cost says (on a CPU under
        # load it may prefer recomputing): the weighing is the disk case's.
        with self.engine(self.memory_tiers(args.primary_gib, args.host_gib), recompute_when_faster=False) as eng:
            eng.generate([prefix], one)  # populate: the prefix's blocks are published
            ref.prefix_bytes = (
                ref.length
                // args.tokens_per_block
                * sum(eng.cache_manager.page_bytes(g.group_id) for g in eng.cache_manager.layer_groups)
            )
            eng.generate([prefix + warm], one)  # warm-up, resident
            self.push_out(eng)
            eng.generate([prefix + warm], one)  # warm-up, from host
            for case in ("gpu", "host"):
                ttfts, reloads, tiers = [], [], []
                for suffix in fresh[case]:
                    if case == "host":
                        self.push_out(eng)
                    out = eng.generate([prefix + suffix], one)[0]
                    ttfts.append(out.ttft_s)
                    tiers.append(out.reused_tokens_by_tier)
                    if case == "host":
                        self.push_out(eng)
                        reloads.append(self.reload_time(eng, prefix + suffix))
                push = functools.partial(self.push_out, eng)
                agreement = self.agreement(eng, ref, push if case == "host" else None)
                rows.append(self.row(ref, case, ttfts, reloads, tiers[-1], agreement))
        rows.append(self._engine_recompute(ref))
        rows.append(self._disk(ref))
        return rows

    def _engine_recompute(self, ref: Reference) -> dict:
        """Prompts of the prefix's length that no request used before, through the engine: its own
        prefill in chunks of ``--chunk`` tokens, with nothing to reuse."""
        from kvtier.engine import SamplingParams

        args = self.args
        one = SamplingParams(max_tokens=1)
        with self.engine(self.memory_tiers(args.primary_gib, None)) as eng:
            eng.generate([self.tokens(ref.length + args.suffix)], one)  # warm-up
            ttfts = []
            for _ in range(args.repeats):
                out = eng.generate([self.tokens(ref.length + args.suffix)], one)[0]
                reused = sum(out.reused_tokens_by_tier.values())
                if reused:
                    raise RuntimeError(f"a prompt never seen reused {reused} tokens")
                ttfts.append(out.ttft_s)
        return self.row(ref, "recompute-engine", ttfts)

    def _disk(self, ref: Reference) -> dict:
        """The prefix on disk (no host tier), in ``--disk-path`` or in a temporary directory removed after."""
        if self.args.disk_path:
            return self._disk_in(ref, self.args.disk_path)
        with tempfile.TemporaryDirectory(prefix="kvtier-e2e-") as path:
            return self._disk_in(ref, path)

    def _disk_in(self, ref: Reference, path: str) -> dict:
        """The prefix on disk under ``path``, the OS page cache dropped before each request; the
        tokens are then checked by a second engine on the same directory that loads every block."""
        import kvtier
        from kvtier.engine import SamplingParams

        args = self.args
        one = SamplingParams(max_tokens=1)
        run_dir = os.path.join(path, "run")
        tiers = self.memory_tiers(args.primary_gib, None)
        tiers.append(kvtier.DiskTier(int(args.disk_gib * GIB), run_dir))
        with self.engine(tiers) as eng:
            eng.generate([ref.prefix], one)
            self.push_out(eng)
            drop_page_cache()  # the warm-up reads cold, as the timed runs do: the engine measures that disk
            eng.generate([ref.prefix + ref.warm], one)  # warm-up, from disk
            ttfts, tiers, dropped = [], [], []
            for _ in range(args.repeats):
                self.push_out(eng)
                dropped.append(drop_page_cache())
                out = eng.generate([ref.prefix + self.tokens(args.suffix)], one)[0]
                ttfts.append(out.ttft_s)
                tiers.append(out.reused_tokens_by_tier)
        # The tokens are checked on pages read from disk, whatever the timed requests chose: after
        # a restart on the same directory, with every cached block loaded.
        tiers_again = [*self.memory_tiers(args.primary_gib, None), kvtier.DiskTier(int(args.disk_gib * GIB), run_dir)]
        with self.engine(tiers_again, recompute_when_faster=False) as eng:
            agreement = self.agreement(eng, ref, functools.partial(self.push_out, eng))
        row = self.row(ref, "disk", ttfts, None, tiers[-1], agreement)
        row["page_cache_dropped"] = all(dropped)
        return row

    def memory_tiers(self, primary_gib: float, host_gib: float | None, write_through: bool | None = None) -> list:
        """A primary tier and, unless ``host_gib`` is None, a host tier, sized in GiB."""
        import kvtier

        tiers: list = [kvtier.PrimaryTier(int(primary_gib * GIB))]
        if host_gib is not None:
            tiers.append(kvtier.HostTier(int(host_gib * GIB), write_through=write_through))
        return tiers

    def engine(self, tiers: list, **scheduler):
        """An engine over ``tiers``; ``scheduler`` overrides the SchedulerConfig fields."""
        import kvtier
        from kvtier.engine import LLMEngine, SchedulerConfig

        config = kvtier.CacheConfig(self.args.tokens_per_block, tiers, device=str(self.device))
        options = {"max_num_tokens": self.args.chunk, "max_batch_size": 4, **scheduler}
        return LLMEngine(self.model, config, SchedulerConfig(**options))

    def push_out(self, eng) -> None:
        """Fill the primary tier with a request of its own, as other traffic would: the prefix moves down."""
        mgr = eng.cache_manager
        filler = mgr.create_cache([0])
        assert filler.resume()
        pages = min(mgr.stats().tiers["primary"].pages_total // len(mgr.layer_groups), 1 << 30)
        assert filler.resize(pages * mgr.tokens_per_block), "the primary tier could not be emptied"
        filler.close()
        self.sync()

    def reload_time(self, eng, prompt: list[int]) -> float:
        """GPU time of ``resume`` (the promotion of the prefix's pages), by CUDA events."""
        torch = self.torch
        cache = eng.cache_manager.create_cache(prompt)
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            assert cache.resume()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            assert cache.resume()
            seconds = time.perf_counter() - t0
        cache.close()
        return seconds

    def _dense_greedy(self, prompt: list[int]) -> list[int]:
        out: list[int] = []
        for _ in range(self.args.greedy_tokens):
            logits = self.model.forward_dense(self.torch.tensor(prompt + out, device=self.device), "last")
            out.append(int(logits[0].argmax()))
        return out

    def agreement(self, eng, ref: Reference, prepare: Callable[[], None] | None) -> dict:
        """First-token logits of ``ref.check`` against the dense path, and the common prefix of
        greedy tokens; ``prepare`` (if any) puts the prefix where the case wants it before each."""
        from kvtier.engine import SamplingParams
        from kvtier.models import PagedSequence

        torch = self.torch
        prompt, dense_logits, dense_tokens = ref.check, ref.dense_logits, ref.dense_tokens
        if prepare is not None:
            prepare()
        mgr = eng.cache_manager
        cache = mgr.create_cache(prompt)
        assert cache.resume()
        start = cache.num_committed_tokens
        assert cache.resize(len(prompt))
        pages = tuple(torch.from_numpy(cache.page_indices(g.group_id)).to(self.device) for g in mgr.layer_groups)
        ids = torch.tensor(prompt[start:], device=self.device)
        logits = self.model.forward_paged([PagedSequence(ids, start, pages)], mgr.kv_views, "last")[0].float()
        cache.close()
        rel = float((logits - dense_logits).norm() / dense_logits.norm())
        if prepare is not None:
            prepare()
        tokens = eng.generate([prompt], SamplingParams(max_tokens=len(dense_tokens)))[0].token_ids
        common = next((i for i, (a, b) in enumerate(zip(tokens, dense_tokens, strict=True)) if a != b), len(tokens))
        return {
            "logit_rel_err": rel,
            "same_argmax": int(logits.argmax()) == int(dense_logits.argmax()),
            "common_prefix": common,
            "of": len(tokens),
            "reused_tokens": start,
        }

    def row(self, ref: Reference, case: str, ttfts, reloads=None, tiers=None, agreement=None) -> dict:
        """Median TTFT (and reload) of a case, its ratios to recompute, the tiers reused and the agreement."""
        ttft = statistics.median(ttfts)
        row = {"prefix": ref.length, "case": case, "ttft_ms": ttft * 1e3, "ttft_all_ms": [t * 1e3 for t in ttfts]}
        row["speedup_vs_recompute"] = ref.recompute / ttft
        row["ttft_over_recompute"] = ttft / ref.recompute
        if tiers is not None:
            row["reused_by_tier"] = tiers
        if agreement is not None:
            row["agreement"] = agreement
        if reloads:
            reload = statistics.median(reloads)
            row["reload_ms"] = reload * 1e3
            row["reload_all_ms"] = [t * 1e3 for t in reloads]
            row["reload_gbps"] = ref.prefix_bytes / reload / 1e9
            if ref.ceiling:
                row["link_share"] = row["reload_gbps"] / ref.ceiling
        if ref.prefix_bytes is not None:
            row["prefix_bytes"] = ref.prefix_bytes
        return row
