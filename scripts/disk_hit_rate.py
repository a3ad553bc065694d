"""Share of prompt tokens reused, by tier, for documents asked again over three small tiers.

A manager on the CPU (one layer group, 4 KiB pages, 16 tokens a block) has 192 primary pages, 384
host pages and 1,024 disk pages (``--model swa``: a second group, of sliding-window layers;
``--model hybrid``: a recurrent group beside the attention one, its snapshots every 4 blocks,
where the commits stop; the tiers then hold as many blocks). 120 documents of 8-64 blocks are
asked 1,500 times, each pick drawn by popularity (Zipf, exponent 0.9), each followed by 1-4
blocks of its own that are never asked again (a question, an answer). Every request is created,
resumed, computed, closed, then ``maintain()`` runs. After 300 requests of warm-up, prints the
reused share of the documents' tokens, in all and by tier, per seed and on average. The disk is
what decides the ranking: its least recently used order, and what it keeps for a restart.

With ``--write-through-min-hits N`` the host tier is written through (``HostTier.write_through``,
``write_through_min_hits=N``; ``maintain()`` copies), and the MiB written through after the
warm-up are printed too, beside the MiB that demotions from the primary tier copied on the
caller's thread: a selective policy trades the one for the other. ``--host-pages`` sizes host memory (384).

    PYTHONPATH=. python scripts/disk_hit_rate.py [--model llama|swa|hybrid] [--write-behind]
        [--write-through-min-hits N] [--host-pages P] [--seeds 4]
"""

from __future__ import annotations

import argparse
import collections
import random
import tempfile

import torch

import kvtier

TPB = 16
SNAPSHOT_BLOCKS = 4
MODELS = ("llama", "swa", "hybrid")


def model_spec(model: str) -> kvtier.ModelSpec:
    """One attention group (llama); with a sliding-window group beside it (swa); with a recurrent one (hybrid)."""
    full = kvtier.AttentionLayer(1, 64)
    layers = {"llama": [full], "swa": [full, kvtier.AttentionLayer(1, 64, window=64)]}
    layers["hybrid"] = [full, kvtier.RecurrentLayer(4096)]
    return kvtier.ModelSpec(layers[model], torch.float16, model_id=f"disk-hit-rate-{model}")


def block_bytes(spec: kvtier.ModelSpec) -> int:
    """Bytes a tier spends per block of history, summed over the layer groups (a recurrent group's
    snapshot every ``SNAPSHOT_BLOCKS`` blocks)."""
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 24)], device="cpu"))
    recurrent = kvtier.GroupKind.RECURRENT
    total = sum(
        probe.page_bytes(g.group_id) // (SNAPSHOT_BLOCKS if g.kind is recurrent else 1) for g in probe.layer_groups
    )
    probe.close()
    return total


def run(
    seed: int,
    write_behind: bool,
    min_hits: int | None = None,
    host_pages: int = 384,
    requests: int = 1500,
    warm_up: int = 300,
    model: str = "llama",
) -> tuple[float, dict[str, float], dict[str, float]]:
    """(reused share of the documents' tokens, the same by tier, and with write-through (``min_hits``
    not None) the MiB moved from the primary tier to host memory after the warm-up: "written
    through" in the background, "demoted with a copy" on the caller's thread) for one seed."""
    spec = model_spec(model)
    page = block_bytes(spec)
    with tempfile.TemporaryDirectory() as path:
        tiers = [
            kvtier.PrimaryTier(page * 192),
            kvtier.HostTier(
                page * host_pages, write_through=min_hits is not None, write_through_min_hits=min_hits or 0
            ),
            kvtier.DiskTier(page * 1024, path, write_behind=write_behind),
        ]
        config = kvtier.CacheConfig(TPB, tiers, device="cpu", snapshot_interval_blocks=SNAPSHOT_BLOCKS)
        manager = kvtier.KVCacheManager(spec, config)
        page = manager.page_bytes(0)
        stops = SNAPSHOT_BLOCKS * TPB if model == "hybrid" else None  # commits end where snapshots are kept
        rng = random.Random(seed)
        docs = [[rng.getrandbits(31) for _ in range(TPB * rng.randint(8, 64))] for _ in range(120)]
        weights = [1 / (i + 1) ** 0.9 for i in range(len(docs))]
        asked = reused = written = down_before = 0
        by_tier: collections.Counter[str] = collections.Counter()
        for step in range(requests):
            if step == warm_up:
                down_before = _bytes_down(manager)
            doc = rng.choices(docs, weights)[0]
            tokens = doc + [rng.getrandbits(31) for _ in range(TPB * rng.randint(1, 4))]
            cache = manager.create_cache(tokens)
            if step >= warm_up:
                asked += len(doc)
                reused += cache.num_reused_tokens
                by_tier.update(cache.reused_by_tier)
            if not (cache.resume() and cache.resize(len(tokens))):
                raise RuntimeError("a request did not fit in the primary tier")
            start = cache.num_reused_tokens
            ends = [len(tokens)]
            if stops is not None:
                ends = [*range(stops, len(tokens), stops), len(tokens)]
            for end in ends:
                if end > start:
                    cache.commit(tokens[start:end])
                    start = end
            cache.close()
            copied = manager.maintain()  # pages copied by write-through (no free reserve here)
            written += copied if step >= warm_up else 0
        moved: dict[str, float] = {}
        if min_hits is not None:
            moved["written through"] = written * page / 2**20
            moved["demoted with a copy"] = (_bytes_down(manager) - down_before - written * page) / 2**20
        manager.close()
    return reused / asked, {tier: count / asked for tier, count in by_tier.items()}, moved


def _bytes_down(manager: kvtier.KVCacheManager) -> int:
    """Bytes copied from the primary tier to host memory so far, in the background or not."""
    return sum(n for key, n in manager.stats().bytes_copied.items() if key.startswith("primary->host"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="llama", help="the layer groups (see above)")
    parser.add_argument("--write-behind", action="store_true", help="the disk tier writes behind")
    parser.add_argument("--write-through-min-hits", type=int, default=None, help="write host memory through")
    parser.add_argument("--host-pages", type=int, default=384)
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()
    if args.write_through_min_hits is not None and args.model != "llama":
        parser.error("--write-through-min-hits reports MiB of one group's pages: use it with --model llama")
    results = [
        run(seed, args.write_behind, args.write_through_min_hits, args.host_pages, model=args.model)
        for seed in range(args.seeds)
    ]
    for seed, (share, tiers, moved) in enumerate(results):
        line = f"seed {seed}: reused {share:.4f}  " + "  ".join(f"{t} {v:.3f}" for t, v in sorted(tiers.items()))
        if moved:
            line += "  | MiB " + "  ".join(f"{what} {mib:.2f}" for what, mib in moved.items())
        print(line)
    print(f"mean reused share: {sum(share for share, _, _ in results) / len(results):.4f}")


if __name__ == "__main__":
    main()
