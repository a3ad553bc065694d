"""``kvtier bench manager``: the manager's CPU overhead (target 2 of docs/benchmarks.md), through the public API.

1. Decode step: ``resize`` by one token and ``commit`` of it, for every one of 256 running
   requests, 16 tokens per block; reported per request per step (crossing block boundaries,
   so allocation and publishing are included in the average).
2. A cached 32K-token prompt: ``create_cache`` (encode + match), ``resume`` and the first
   ``resize`` (to the prompt's length: the slot of its last token, which is always computed) of
   a prompt whose 2,048 blocks are all cached in the primary tier; apart from that total, the
   ``suspend`` of its cache and, resumed again, its ``close`` (letting go of 2,049 pages).
3. Unless ``--no-tiers``, a demotion/promotion round trip per page on the CPU: pages of
   suspended caches demoted to host (and disk), then promoted back by ``resume``.
4. Unless ``--no-pressure``, planning a 2,048-page resume under pressure (issue 14: <= 2 ms), with
   write-through on and off: ``resume`` of a cache whose 2,048-block prefix is in host memory
   while the primary tier (3,072 pages) is full of other requests' published pages and the host
   tier (8,192 pages) is full as well, so every victim goes down, swapping places with the
   prefix (through the mover's swap scratch: no old host page is dropped); and ``prefetch`` of the same prefix
   in the same state (write-through off). 4 KiB pages on ``--pressure-device`` (default cpu,
   where the copies themselves are part of the figure; on cuda they run on the device after the
   call returns, so the figure is the host's planning and copy submission). Each of
   ``--pressure-repeats`` repeats builds the state in a new manager, runs the call once untimed
   (a serving manager has done such calls before: its copier, streams and driver entry points
   are set up), pushes the prefix back down, and times the call; the median is reported. About 12 s.

When vLLM is importable (and not ``--no-vllm``), its ``KVCacheManager`` runs 1 and 2 in the same
process (``bench_manager_vllm``: decode with its incremental block hashing, the cached prompt
with its hashing of the whole prompt), alternating with kvtier step by step and repeat by
repeat, so the machine's drift hits both alike; the ratios vLLM / kvtier are printed beside the
targets. The CPU's speed drifts, so the ratios, not the absolute figures, are judged.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

from kvtier.cli.arguments import at_least, device

DECODE_REQUESTS = 256
DECODE_CONTEXT = 512
TPB = 16
# Target 2 (docs/benchmarks.md): kvtier's own ceilings, and how many times cheaper than vLLM it must be.
DECODE_TARGET_US = 1.0
CACHED_PROMPT_TARGET_MS = 2.0
TARGET_PROMPT_TOKENS = 32768  # the cached prompt's targets are for this length
DECODE_TARGET_RATIO = 9.0
CACHED_PROMPT_TARGET_RATIO = 5.0
SAMPLED_TOKEN = 7
PRESSURE_TARGET_MS = 2.0  # issue 14: planning a 2,048-page resume on the host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=at_least(1), default=256, help="decode steps to time (default 256)")
    parser.add_argument(
        "--prompt-tokens",
        type=at_least(2 * TPB),
        default=TARGET_PROMPT_TOKENS,
        help=f"cached prompt length (default {TARGET_PROMPT_TOKENS}: the length its targets are for)",
    )
    parser.add_argument("--repeats", type=at_least(1), default=21, help="repeats of the cached-prompt measurement")
    parser.add_argument("--no-tiers", action="store_true", help="skip the demotion/promotion round trip")
    parser.add_argument("--no-vllm", action="store_true", help="skip the comparison with vLLM's KVCacheManager")
    parser.add_argument(
        "--no-pressure",
        action="store_true",
        help="skip the 2,048-page resume and prefetch with both tiers full (about 12 s)",
    )
    parser.add_argument(
        "--pressure-repeats", type=at_least(1), default=7, help="repeats of the resume under pressure (default 7)"
    )
    parser.add_argument(
        "--pressure-device",
        type=device,
        default="cpu",
        help="device of the resume under pressure: cpu (default) or cuda",
    )


def run(args: argparse.Namespace) -> int:
    vllm_side, vllm_missing = (None, "vLLM not measured (--no-vllm)") if args.no_vllm else _vllm_side()
    decode = bench_decode(args.steps, vllm_side)
    cached = bench_cached_prompt(args.prompt_tokens, args.repeats, vllm_side)
    results: dict = {"decode_us_per_request_step": decode["kvtier"], "cached_prompt_ms": cached["kvtier"]}
    if vllm_side is not None:
        results["vllm"] = {
            "version": vllm_side.VERSION,
            "hash": vllm_side.HASH_ALGO,
            "decode_us_per_request_step": decode["vllm"],
            "cached_prompt_ms": cached["vllm"],
        }
        results["ratios_vllm_over_kvtier"] = {
            "decode": decode["vllm"]["median"] / decode["kvtier"]["median"],
            "cached_prompt": cached["vllm"]["median"] / cached["kvtier"]["median"],
        }
    else:
        results["vllm"] = {"missing": vllm_missing}
    if not args.no_tiers:
        results["round_trip_us_per_page"] = bench_round_trip()
    if not args.no_pressure:
        results["pressure_resume_ms"] = bench_pressure_resume(args.pressure_repeats, device=args.pressure_device)
        results["pressure_device"] = args.pressure_device
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    _print_table(results, args.prompt_tokens)
    return 0


def _vllm_side() -> tuple[ModuleType | None, str]:
    """The vLLM workloads module, or None and why it is missing."""
    if importlib.util.find_spec("vllm") is None:
        return None, "vLLM was not found (install vllm 0.33 or 0.34, e.g. bash .ci/vllm_env.sh)"
    try:
        from kvtier.cli import bench_manager_vllm
    except ImportError as e:
        return None, f"vLLM was found but its KVCacheManager did not import: {e}"
    return bench_manager_vllm, ""


def _manager(pages: int, tiers: list | None = None):
    import torch

    import kvtier

    spec = kvtier.ModelSpec.uniform(1, 1, 8, torch.float16, model_id="kvtier-bench-manager")
    page = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)])).page_bytes(0)
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(page * pages), *(tiers or [])])
    return kvtier.KVCacheManager(spec, config), page


class KvtierDecode:
    """``requests`` active caches with ``context`` committed tokens; ``step()`` decodes one token in each.

    A step is ``resize(capacity + 1)`` + ``commit`` of the new token per cache, so a block that
    fills is published in the tree and the next step allocates a fresh page.
    """

    def __init__(self, requests: int, context: int, steps: int) -> None:
        blocks = (context + steps) // TPB + 2
        self.manager, _ = _manager(requests * blocks + 64)
        self.caches = []
        for r in range(requests):
            prompt = [r * 100_000 + i for i in range(context)]
            cache = self.manager.create_cache(prompt)
            assert cache.resume()
            assert cache.resize(context)
            cache.commit(prompt)
            self.caches.append(cache)

    def step(self) -> float:
        """One decode step over every cache; returns its seconds."""
        token = [SAMPLED_TOKEN]
        t0 = time.perf_counter()
        for cache in self.caches:
            cache.resize(cache.capacity + 1)
            cache.commit(token)
        return time.perf_counter() - t0

    def check(self) -> None:
        """Raise ``RuntimeError`` unless every cache committed every token it was given."""
        for cache in self.caches:
            if cache.num_committed_tokens != cache.capacity:
                raise RuntimeError("a decode cache did not commit its tokens")

    def close(self) -> None:
        self.manager.close()


class KvtierCachedPrompt:
    """A ``prompt_tokens``-token prompt committed once and closed; ``once()`` admits it again: create,
    resume, and resize to the prompt (vLLM's ``allocate_slots`` gives the same tokens their slots)."""

    def __init__(self, prompt_tokens: int) -> None:
        self.manager, _ = _manager(2 * (prompt_tokens // TPB) + 64)
        self.prompt = list(range(1, prompt_tokens + 1))
        first = self.manager.create_cache(self.prompt)
        assert first.resume()
        assert first.resize(prompt_tokens)
        first.commit(self.prompt)
        first.close()

    def once(self) -> dict[str, float]:
        """Seconds of ``create_cache`` (hash + match + hold), of ``resume``, of the first ``resize``,
        and their total; then, apart from the total, of ``suspend`` and, resumed again, ``close``."""
        t0 = time.perf_counter()
        cache = self.manager.create_cache(self.prompt)
        t1 = time.perf_counter()
        resumed = cache.resume()
        t2 = time.perf_counter()
        resized = resumed and cache.resize(len(self.prompt))
        t3 = time.perf_counter()
        if not resized or cache.num_reused_tokens != len(self.prompt) - 1:
            raise RuntimeError(f"kvtier reused {cache.num_reused_tokens} tokens of the cached prompt")
        cache.suspend()
        t4 = time.perf_counter()
        if not cache.resume():
            raise RuntimeError("the cached prompt did not resume after its suspend")
        t5 = time.perf_counter()
        cache.close()
        t6 = time.perf_counter()
        times = {"total": t3 - t0, "create": t1 - t0, "resume": t2 - t1, "resize": t3 - t2}
        return times | {"suspend": t4 - t3, "close": t6 - t5}

    def close(self) -> None:
        self.manager.close()


@contextmanager
def _frozen_heap() -> Iterator[None]:
    """The set-up objects of every side moved out of the collector's reach while timing, as a
    serving engine does after start-up (vLLM's engine freezes its heap), so a collection in one
    side's step does not scan the other side's requests."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def _collector_paused() -> Iterator[None]:
    """No collection while timing, and none forced before: the caches stay as the work before the
    call left them (``_frozen_heap``'s full collection reads the whole heap first). The collector
    is left as it was found."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def bench_decode(steps: int, vllm_side: ModuleType | None = None) -> dict[str, dict[str, float]]:
    """Per side, us per request per step: median, mean and max over ``steps`` steps.

    With ``vllm_side``, kvtier's and vLLM's steps alternate, each over its own requests.
    """
    sides = {"kvtier": KvtierDecode(DECODE_REQUESTS, DECODE_CONTEXT, steps)}
    if vllm_side is not None:
        sides["vllm"] = vllm_side.VllmDecode(DECODE_REQUESTS, DECODE_CONTEXT, steps, TPB, SAMPLED_TOKEN)
    per_step: dict[str, list[float]] = {name: [] for name in sides}
    try:
        with _frozen_heap():
            for _ in range(steps):
                for name, side in sides.items():
                    per_step[name].append(side.step() / DECODE_REQUESTS * 1e6)
        for side in sides.values():
            side.check()
    finally:
        for side in sides.values():
            side.close()
    return {
        name: {"median": statistics.median(v), "mean": statistics.fmean(v), "max": max(v)}
        for name, v in per_step.items()
    }


def bench_cached_prompt(
    prompt_tokens: int, repeats: int, vllm_side: ModuleType | None = None
) -> dict[str, dict[str, float]]:
    """Per side, ms: the median total and the median of each part, over ``repeats`` alternating repeats."""
    sides = {"kvtier": KvtierCachedPrompt(prompt_tokens)}
    if vllm_side is not None:
        sides["vllm"] = vllm_side.VllmCachedPrompt(prompt_tokens, TPB)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    try:
        with _frozen_heap():
            for _ in range(repeats):
                for name, side in sides.items():
                    samples[name].append(side.once())
    finally:
        for side in sides.values():
            side.close()
    return {
        name: {
            ("median" if part == "total" else f"{part}_median"): statistics.median(s[part] for s in runs) * 1e3
            for part in runs[0]
        }
        for name, runs in samples.items()
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


@dataclass(frozen=True, slots=True)
class Pressure:
    """The sizes of the resume under pressure, in pages (one page a block: one layer group)."""

    prefix_blocks: int = 2048
    primary_pages: int = 3072
    host_pages: int = 8192
    prompts: int = 26
    prompt_blocks: int = 128
    filler_blocks: int = 1024  # the older prompts that fill both tiers before the prefix comes


class PressureResume:
    """A manager whose tiers are both full, with a ``Pressure.prefix_blocks``-block prefix in host
    memory; ``once()`` creates a cache over the prefix and times its ``resume``.

    Filler prompts fill the primary and host tiers first; the prefix is published, then
    ``prompts`` prompts of random tokens (``maintain()`` after each) push it down to host memory,
    the most recent pages there. Resuming it demotes as many primary pages (the least recently
    used), which swap places with it through the mover's swap scratch (8 MiB of victims): no old
    host page is dropped to make room (without the scratch, the swap's head start, a quarter of
    them, would be). ``push_prefix_down()`` brings the same state back after a call.
    """

    def __init__(self, write_through: bool, sizes: Pressure = Pressure(), seed: int = 0, device: str = "cpu") -> None:
        import torch

        import kvtier

        spec = kvtier.ModelSpec.uniform(1, 1, 64, torch.float16, model_id="kvtier-bench-pressure")  # 4 KiB pages
        page = 2 * TPB * 64 * 2
        tiers = [
            kvtier.PrimaryTier(page * sizes.primary_pages),
            kvtier.HostTier(page * sizes.host_pages, write_through=write_through),
        ]
        self.manager = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers, device=device))
        self._sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        if self.manager.page_bytes(0) != page:
            raise RuntimeError(f"the pressure spec has {self.manager.page_bytes(0)}-byte pages, not {page}")
        rng = random.Random(seed)

        def tokens(blocks: int) -> list[int]:
            return [rng.getrandbits(31) for _ in range(blocks * TPB)]

        for _ in range(-(-(sizes.primary_pages + sizes.host_pages) // sizes.filler_blocks)):
            self._publish(tokens(sizes.filler_blocks))
        self.prefix = tokens(sizes.prefix_blocks)
        self._publish(self.prefix)
        self._tokens = tokens
        self.sizes = sizes
        self.push_prefix_down()

    def push_prefix_down(self) -> None:
        """Publish ``prompts`` new prompts, which push the prefix (back) down to host memory."""
        for _ in range(self.sizes.prompts):
            self._publish(self._tokens(self.sizes.prompt_blocks))

    def _publish(self, tokens: list[int]) -> None:
        cache = self.manager.create_cache(tokens)
        if not (cache.resume() and cache.resize(len(tokens))):
            raise RuntimeError("a pressure prompt did not fit in the primary tier")
        cache.commit(tokens)
        cache.close()
        self.manager.maintain()

    def once(self, prefetch: bool = False, collect: bool = True) -> dict[str, float]:
        """Seconds of ``resume`` of a cache over the prefix, or of ``prefetch`` of the prefix (call
        once), and the pages it moved and dropped. ``collect``: a full collection right before the
        call (``_frozen_heap``), else the collector is only paused (``_collector_paused``)."""
        stats = self.manager.stats()
        for name, tier in stats.tiers.items():
            if tier.pages_used != tier.pages_total:
                raise RuntimeError(f"the {name} tier is not full ({tier.pages_used} of {tier.pages_total} pages)")
        tokens = [*self.prefix, 1]
        cache = None
        if not prefetch:
            cache = self.manager.create_cache(tokens)
            host_tokens = self.sizes.prefix_blocks * TPB
            if cache.num_reused_tokens != host_tokens or cache.reused_by_tier.get("host") != host_tokens:
                raise RuntimeError(f"the prefix was not found in host memory: {cache.reused_by_tier}")
        self._sync()  # the background copies of the set-up are done: only the call is timed
        with _frozen_heap() if collect else _collector_paused():
            t0 = time.perf_counter()
            done = cache.resume() if cache is not None else self.manager.prefetch(tokens) == self.sizes.prefix_blocks
            seconds = time.perf_counter() - t0
        self._sync()
        if not done:
            raise RuntimeError(f"the {'prefetch' if prefetch else 'resume'} under pressure failed")
        after = self.manager.stats()
        if cache is not None:
            cache.close()
        return {
            "seconds": seconds,
            "promotions": after.promotions - stats.promotions,
            "demotions": after.demotions - stats.demotions,
            "drops": after.drops - stats.drops,
        }

    def close(self) -> None:
        self.manager.close()


PRESSURE_CASES = {"on": (True, False), "off": (False, False), "prefetch": (False, True)}  # (write-through, prefetch)


def bench_pressure_resume(
    repeats: int, sizes: Pressure = Pressure(), device: str = "cpu"
) -> dict[str, dict[str, float]]:
    """Per case of ``PRESSURE_CASES`` (a resume with write-through "on" or "off"; a "prefetch" of the
    prefix, write-through off), ms of the call on ``device``: median, min, max over ``repeats``
    repeats (alternating cases, the state rebuilt each time, the call timed the second time it
    runs in its manager), and the pages moved."""
    samples: dict[str, list[dict[str, float]]] = {label: [] for label in PRESSURE_CASES}
    for repeat in range(repeats):
        for label, (write_through, prefetch) in PRESSURE_CASES.items():
            side = PressureResume(write_through, sizes, seed=repeat, device=device)
            try:
                side.once(prefetch)  # untimed: the manager's first such call sets up its copier and streams
                side.push_prefix_down()
                samples[label].append(side.once(prefetch))
            finally:
                side.close()
    results = {}
    for label, runs in samples.items():
        ms = [r["seconds"] * 1e3 for r in runs]
        results[label] = {"median": statistics.median(ms), "min": min(ms), "max": max(ms)}
        results[label].update({k: runs[-1][k] for k in ("promotions", "demotions", "drops")})
    return results


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def _print_table(results: dict, prompt_tokens: int) -> None:
    """kvtier's figures, vLLM's beside them with the ratios when measured, each with its target."""
    decode = results["decode_us_per_request_step"]
    cached = results["cached_prompt_ms"]
    vllm = results["vllm"]
    ratios = results.get("ratios_vllm_over_kvtier")
    v_decode = vllm.get("decode_us_per_request_step", {})
    v_cached = vllm.get("cached_prompt_ms", {})

    def figure(side: dict, key: str, digits: int = 3) -> str:
        return f"{side[key]:.{digits}f}" if key in side else ""

    decode_target = f"<= {DECODE_TARGET_US} us ({_met(decode['median'] <= DECODE_TARGET_US)})"
    cached_target = f"<= {CACHED_PROMPT_TARGET_MS} ms ({_met(cached['median'] <= CACHED_PROMPT_TARGET_MS)})"
    if prompt_tokens != TARGET_PROMPT_TOKENS:
        cached_target = f"(the targets are for {TARGET_PROMPT_TOKENS:,} tokens: not judged)"
    decode_ratio = cached_ratio = ""
    if ratios is not None:
        decode_ratio = f"{ratios['decode']:.1f}x"
        cached_ratio = f"{ratios['cached_prompt']:.1f}x"
        decode_target += f"; ratio >= {DECODE_TARGET_RATIO:g}x ({_met(ratios['decode'] >= DECODE_TARGET_RATIO)})"
        if prompt_tokens == TARGET_PROMPT_TOKENS:
            cached_ok = ratios["cached_prompt"] >= CACHED_PROMPT_TARGET_RATIO
            cached_target += f"; ratio >= {CACHED_PROMPT_TARGET_RATIO:g}x ({_met(cached_ok)})"
    rows = [
        (
            f"decode step, us per request ({DECODE_REQUESTS} requests)",
            figure(decode, "median"),
            figure(v_decode, "median"),
            decode_ratio,
            decode_target,
        ),
        (
            f"cached {prompt_tokens}-token prompt, hashing included, ms",
            figure(cached, "median"),
            figure(v_cached, "median"),
            cached_ratio,
            cached_target,
        ),
        ("  kvtier: create_cache (hash + match + hold), ms", figure(cached, "create_median"), "", "", ""),
        ("  kvtier: resume (lock in primary), ms", figure(cached, "resume_median"), "", "", ""),
        ("  kvtier: first resize (the last token's slot), ms", figure(cached, "resize_median"), "", "", ""),
        ("  kvtier: then suspend (not in the total), ms", figure(cached, "suspend_median"), "", "", ""),
        ("  kvtier: then close, resumed again (not in the total), ms", figure(cached, "close_median"), "", "", ""),
    ]
    if v_cached:
        match_allocate = figure(v_cached, "match_allocate_median")
        rows.append((f"  vLLM: hashing the prompt ({vllm['hash']}), ms", "", figure(v_cached, "hash_median"), "", ""))
        rows.append(("  vLLM: get_computed_blocks + allocate_slots, ms", "", match_allocate, "", ""))
    for label, value in results.get("round_trip_us_per_page", {}).items():
        rows.append((f"demote + promote round trip via {label}, us per page", f"{value:.2f}", "", "", ""))
    for label, value in results.get("pressure_resume_ms", {}).items():
        resume = label in ("on", "off")
        target = f"<= {PRESSURE_TARGET_MS} ms ({_met(value['median'] <= PRESSURE_TARGET_MS)}); " if resume else ""
        call, through = ("resume", label) if resume else (label, "off")
        rows.append(
            (
                f"{call} of a 2,048-page prefix from host, both tiers full, write-through {through}, "
                f"{results['pressure_device']}, host ms",
                f"{value['median']:.2f}",
                "",
                "",
                f"{target}range {value['min']:.2f}-{value['max']:.2f}",
            )
        )
    width = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{width}}  {'kvtier':>8}  {'vLLM':>8}  {'vLLM/kvtier':>11}  target")
    for label, mine, theirs, ratio, target in rows:
        print(f"{label:<{width}}  {mine:>8}  {theirs:>8}  {ratio:>11}  {target}".rstrip())
    if ratios is not None:
        print(f"vLLM {vllm['version']} KVCacheManager measured in this process, alternating with kvtier")
    else:
        print(f"{vllm['missing']}: kvtier's figures only")
