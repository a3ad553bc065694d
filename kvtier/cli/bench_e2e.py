"""``kvtier bench e2e``: time to first token when a long prefix comes back (PERF.md target 3).

For each prefix length, a request of prefix + a short new suffix is timed four ways:

    recompute  no reuse: the whole prompt through the dense prefill path (SDPA / flash attention)
    gpu        the prefix's pages resident in the primary tier
    host       the prefix demoted to host memory (pushed out by other requests)
    disk       the prefix demoted to disk (a manager with no host tier), OS page cache dropped
               where the system allows it

TTFT is measured by the engine (request arrival to first sampled token). Stage timings come
from CUDA events around ``resume`` (the reload) on a separate run. The link ceiling is measured
in the same run (one pinned 1 GiB host-to-device copy). Tokens are compared with the dense path
by first-token logits (relative error, same argmax) and by the common prefix of a few greedy
tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from kvtier.cli.bench_machine import drop_page_cache, link_ceiling_gbps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-8b-shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    parser.add_argument("--prefixes", default="4096,16384,32768", help="prefix lengths in tokens")
    parser.add_argument("--suffix", type=int, default=128, help="new tokens after the prefix")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--greedy-tokens", type=int, default=4, help="tokens compared with the dense path")
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--primary-gib", type=float, default=24.0)
    parser.add_argument("--host-gib", type=float, default=8.0)
    parser.add_argument("--disk-gib", type=float, default=8.0)
    parser.add_argument("--disk-path", default=None, help="directory for the disk tier (default: a temp dir)")
    parser.add_argument("--chunk", type=int, default=8192, help="prefill chunk (max_num_tokens) when populating")


def run(args: argparse.Namespace) -> int:
    import torch

    from kvtier.models import build_model

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, device, dtype, seed=0)
    bench = _Bench(model, args)
    ceiling = link_ceiling_gbps(bench.device)
    rows = []
    for length in (int(x) for x in args.prefixes.split(",")):
        rows.extend(bench.prefix(length, ceiling))
    result = {"link_ceiling_gbps": ceiling, "rows": rows, "args": vars(args)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    _print_table(rows, ceiling)
    return 0


class _Bench:
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

    def prefix(self, length: int, ceiling: float) -> list[dict]:
        torch = self.torch
        from kvtier.engine import SamplingParams

        args = self.args
        prefix = self.tokens(length)
        # ``warm`` warms each path up (untimed); every case then times suffixes no request has
        # used yet, so each reuses exactly the prefix; the last suffix is the one compared.
        warm = self.tokens(args.suffix)
        fresh = {
            case: [self.tokens(args.suffix) for _ in range(args.repeats)]
            for case in ("recompute", "gpu", "host", "disk")
        }
        check = prefix + self.tokens(args.suffix)
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
        dense_logits = self.model.forward_dense(torch.tensor(check, device=self.device), "last")[0].float()
        dense_tokens = self._dense_greedy(check, args.greedy_tokens)
        recompute = statistics.median(times)
        rows.append(self._row(length, "recompute", times, None, None, ceiling, recompute))

        prefix_bytes = None
        with self._engine(host=True) as eng:
            eng.generate([prefix], SamplingParams(max_tokens=1))  # populate: the prefix's blocks are published
            prefix_bytes = (
                length
                // args.tokens_per_block
                * sum(eng.cache_manager.page_bytes(g.group_id) for g in eng.cache_manager.layer_groups)
            )
            eng.generate([prefix + warm], SamplingParams(max_tokens=1))  # warm-up, resident
            self._push_out(eng)
            eng.generate([prefix + warm], SamplingParams(max_tokens=1))  # warm-up, from host
            for case in ("gpu", "host"):
                ttfts, reloads, tiers = [], [], []
                for suffix in fresh[case]:
                    if case == "host":
                        self._push_out(eng)
                    out = eng.generate([prefix + suffix], SamplingParams(max_tokens=1))[0]
                    ttfts.append(out.ttft_s)
                    tiers.append(out.reused_tokens_by_tier)
                    if case == "host":
                        self._push_out(eng)
                        reloads.append(self._reload_time(eng, prefix + suffix))
                agreement = self._agreement(eng, check, dense_logits, dense_tokens, push=case == "host")
                rows.append(
                    self._row(length, case, ttfts, reloads, prefix_bytes, ceiling, recompute, tiers[-1], agreement)
                )
        with self._engine(host=False) as eng:
            eng.generate([prefix], SamplingParams(max_tokens=1))
            self._push_out(eng)
            eng.generate([prefix + warm], SamplingParams(max_tokens=1))  # warm-up, from disk
            ttfts, tiers, dropped = [], [], []
            for suffix in fresh["disk"]:
                self._push_out(eng)
                dropped.append(drop_page_cache())
                out = eng.generate([prefix + suffix], SamplingParams(max_tokens=1))[0]
                ttfts.append(out.ttft_s)
                tiers.append(out.reused_tokens_by_tier)
            agreement = self._agreement(eng, check, dense_logits, dense_tokens, push=True)
            row = self._row(length, "disk", ttfts, None, prefix_bytes, ceiling, recompute, tiers[-1], agreement)
            row["page_cache_dropped"] = all(dropped)
            rows.append(row)
        return rows

    def _engine(self, host: bool):
        import kvtier
        from kvtier.engine import LLMEngine, SchedulerConfig

        args = self.args
        gib = 1 << 30
        tiers = [kvtier.PrimaryTier(int(args.primary_gib * gib))]
        if host:
            tiers.append(kvtier.HostTier(int(args.host_gib * gib)))
        else:
            path = args.disk_path or tempfile.mkdtemp(prefix="kvtier-e2e-")
            tiers.append(kvtier.DiskTier(int(args.disk_gib * gib), os.path.join(path, "run")))
        config = kvtier.CacheConfig(args.tokens_per_block, tiers, device=str(self.device))
        return LLMEngine(self.model, config, SchedulerConfig(max_num_tokens=args.chunk, max_batch_size=4))

    def _push_out(self, eng) -> None:
        """Fill the primary tier with a request of its own, as other traffic would: the prefix moves down."""
        mgr = eng.cache_manager
        filler = mgr.create_cache([0])
        assert filler.resume()
        pages = min(mgr.stats().tiers["primary"].pages_total // len(mgr.layer_groups), 1 << 30)
        assert filler.resize(pages * mgr.tokens_per_block), "the primary tier could not be emptied"
        filler.close()
        self.sync()

    def _reload_time(self, eng, prompt: list[int]) -> float:
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

    def _dense_greedy(self, prompt: list[int], n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            logits = self.model.forward_dense(self.torch.tensor(prompt + out, device=self.device), "last")
            out.append(int(logits[0].argmax()))
        return out

    def _agreement(self, eng, prompt, dense_logits, dense_tokens, push: bool) -> dict:
        """First-token logits against the dense path, and the common prefix of greedy tokens."""
        from kvtier.engine import SamplingParams
        from kvtier.models import PagedSequence

        torch = self.torch
        if push:
            self._push_out(eng)
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
        if push:
            self._push_out(eng)
        tokens = eng.generate([prompt], SamplingParams(max_tokens=len(dense_tokens)))[0].token_ids
        common = next((i for i, (a, b) in enumerate(zip(tokens, dense_tokens, strict=True)) if a != b), len(tokens))
        return {
            "logit_rel_err": rel,
            "same_argmax": int(logits.argmax()) == int(dense_logits.argmax()),
            "common_prefix": common,
            "of": len(tokens),
            "reused_tokens": start,
        }

    def _row(self, length, case, ttfts, reloads, prefix_bytes, ceiling, recompute, tiers=None, agreement=None):
        ttft = statistics.median(ttfts)
        row = {"prefix": length, "case": case, "ttft_ms": ttft * 1e3, "ttft_all_ms": [t * 1e3 for t in ttfts]}
        row["speedup_vs_recompute"] = recompute / ttft
        if tiers is not None:
            row["reused_by_tier"] = tiers
        if agreement is not None:
            row["agreement"] = agreement
        if reloads:
            reload = statistics.median(reloads)
            row["reload_ms"] = reload * 1e3
            row["reload_gbps"] = prefix_bytes / reload / 1e9
            if ceiling:
                row["link_share"] = row["reload_gbps"] / ceiling
        if prefix_bytes is not None:
            row["prefix_bytes"] = prefix_bytes
        return row


def _print_table(rows: list[dict], ceiling: float) -> None:
    gpu = {r["prefix"]: r["ttft_ms"] for r in rows if r["case"] == "gpu"}
    print(f"link ceiling (pinned H2D, this run): {ceiling:.1f} GB/s")
    header = f"{'prefix':>7} {'case':<9} {'TTFT ms':>9} {'x recompute':>11} {'reload ms':>9} {'GB/s':>6} {'link':>5}"
    header += f" {'target ms':>9} {'logit err':>9} {'argmax':>6} {'greedy':>6}"
    print(header)
    for r in rows:
        target = ""
        if r["case"] == "host" and ceiling:
            target = f"{1.2 * r['prefix_bytes'] / (ceiling * 1e9) * 1e3 + gpu[r['prefix']]:.1f}"
        a = r.get("agreement", {})
        print(
            f"{r['prefix']:>7} {r['case']:<9} {r['ttft_ms']:>9.1f} {r['speedup_vs_recompute']:>11.2f} "
            f"{r.get('reload_ms', float('nan')):>9.1f} {r.get('reload_gbps', float('nan')):>6.1f} "
            f"{r.get('link_share', float('nan')):>5.2f} {target:>9} {a.get('logit_rel_err', float('nan')):>9.4f} "
            f"{a.get('same_argmax', '')!s:>6} {str(a.get('common_prefix', '')) + '/' + str(a.get('of', '')):>6}"
        )
