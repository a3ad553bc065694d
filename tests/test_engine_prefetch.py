"""The engine prefetches waiting requests' disk prefixes into host memory (``prefetch_policy``).

Token-identical to the float64 oracle under every policy; with a queue ahead of it, a request
whose prefix is on disk finds it in host memory when its turn comes.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import kvtier
from kvtier.engine import LLMEngine, SamplingParams, SchedulerConfig
from kvtier.models import build_model
from kvtier.tiering import host_prefetch
from tests.holding import hold

TPB = 8


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama", torch.device("cpu"), torch.float64, seed=3)


def engine(model, tmp, prefetch, host=True, primary_pages=40, **kw):
    probe = kvtier.KVCacheManager(model.spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    page = sum(probe.page_bytes(g.group_id) for g in probe.layer_groups)
    probe.close()
    tiers = [kvtier.PrimaryTier(primary_pages * page), kvtier.DiskTier(400 * page, os.path.join(tmp, "disk"))]
    if host:
        tiers.insert(1, kvtier.HostTier(24 * page, write_through=False))
    kw.setdefault("recompute_when_faster", False)  # the tests count what came from each tier
    kw.setdefault("max_batch_size", 1)
    kw.setdefault("max_num_tokens", 64)
    config = SchedulerConfig(prefetch_policy=prefetch, **kw)
    return LLMEngine(model, kvtier.CacheConfig(TPB, tiers), config)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 300, (n,), generator=g).tolist()


def in_memory_prefix(eng, seed: int) -> list[int]:
    """An 80-token prefix published, then another 160-token prompt: the prefix is in memory, none
    of it on disk, when the request the test sends next arrives."""
    base = prompt(1, 80)
    eng.generate([base], SamplingParams(max_tokens=1))
    eng.generate([prompt(seed, 160)], SamplingParams(max_tokens=1))
    cache = eng.cache_manager.create_cache(base + [0])
    assert cache.reused_by_tier["disk"] == 0
    cache.close()
    return base


@pytest.mark.parametrize(
    ("policy", "max_prefetches"),
    [("off", 4), ("best_effort", 4), ("timeout", 4), ("wait_complete", 4), ("wait_complete", 0)],
    ids=["off", "best_effort", "timeout", "wait_complete", "none-at-a-time"],
)
def test_queued_disk_prefix_is_prefetched(model, policy, max_prefetches):
    """``max_prefetches=0`` reads nothing ahead, as ``"off"``."""
    with tempfile.TemporaryDirectory() as tmp:
        eng = engine(model, tmp, policy, prefetch_timeout_s=30.0, max_prefetches=max_prefetches)
        base = prompt(1, 160)
        eng.generate([base], SamplingParams(max_tokens=1))
        for k in range(8):  # push it through host memory onto disk
            eng.generate([prompt(100 + k, 160)], SamplingParams(max_tokens=1))
        queue = [prompt(200 + k, 200) for k in range(3)]
        target = base + prompt(2, 5)
        outs = eng.generate([*queue, target], SamplingParams(max_tokens=4))
        expected = [model.reference_generate(p, 4) for p in [*queue, target]]
        assert [o.token_ids for o in outs] == expected
        reused = outs[-1].reused_tokens_by_tier
        assert sum(reused.values()) == 160
        if policy in ("timeout", "wait_complete") and max_prefetches:
            assert reused["disk"] == 0 and reused["host"] == 160
        if policy == "off" or not max_prefetches:
            assert reused["disk"] == 160
        eng.cache_manager.check_invariants()
        eng.close()


def test_a_request_whose_turn_is_now_reads_its_disk_prefix_while_the_others_run(model, monkeypatch):
    """Under wait_complete a request admitted at once still reads its disk prefix in the background:
    the running request decodes meanwhile, and the prefix then comes from host memory."""
    with tempfile.TemporaryDirectory() as tmp:
        eng = engine(model, tmp, "wait_complete", max_batch_size=2)
        base = prompt(1, 160)
        eng.generate([base], SamplingParams(max_tokens=1))
        for k in range(8):  # push it onto disk
            eng.generate([prompt(100 + k, 160)], SamplingParams(max_tokens=1))
        started, release = hold(monkeypatch, host_prefetch.HostPrefetcher, "_read")
        busy = prompt(3, 40)
        eng.add_request(busy, SamplingParams(max_tokens=12))
        eng.step()  # the busy request is running
        target = base + prompt(2, 5)
        eng.add_request(target, SamplingParams(max_tokens=4))
        running = eng.scheduler.running[0]
        before = len(running.tokens)
        for _ in range(3):
            eng.step()
        assert started.wait(10)
        assert len(running.tokens) == before + 3  # decoding went on while the prefix was read
        assert len(eng.scheduler.running) == 1  # the target waits for its read
        release.set()
        outs = {}
        while eng.has_unfinished_requests():
            outs.update({o.request_id: o for o in eng.step()})
        out = outs[max(outs)]
        assert out.token_ids == model.reference_generate(target, 4)
        assert out.reused_tokens_by_tier.get("host") == 160 and not out.reused_tokens_by_tier.get("disk")
        eng.cache_manager.check_invariants()
        eng.close()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete"])
def test_an_engine_without_a_host_tier_serves_every_request_from_its_disk(model, policy):
    """A CPU engine with only a primary and a disk tier, restarted on the directory, serves many
    prompts whose prefixes are on disk, a few at a time: every one finishes, equal to the oracle
    (reads into the primary tier must never take the slots the running requests need)."""
    with tempfile.TemporaryDirectory() as tmp:
        first = engine(model, tmp, policy, host=False, max_batch_size=3)
        prefixes = [prompt(10 + k, 120) for k in range(10)]
        for prefix in prefixes:
            first.generate([prefix], SamplingParams(max_tokens=2))
        first.close()
        again = engine(model, tmp, policy, host=False, max_batch_size=3)
        prompts = [prefix + prompt(50 + k, 7) for k, prefix in enumerate(prefixes)] + [prompt(99, 60)]
        outs = again.generate(prompts, SamplingParams(max_tokens=4))
        assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
        assert [o.token_ids for o in outs] == [model.reference_generate(p, 4) for p in prompts]
        assert sum(o.reused_tokens_by_tier.get("disk", 0) for o in outs) > 0
        again.cache_manager.check_invariants()
        again.close()


def test_a_prefetched_prefix_stays_in_host_memory_until_its_turn(model):
    """Under wait_complete the target waits for its read; then the short prompts admitted before it
    need host room. Before, they pushed 32 of its 160 prefetched tokens back to disk, which it
    then read on its admission; now the read pages stay until its cache is resumed."""
    with tempfile.TemporaryDirectory() as tmp:
        eng = engine(model, tmp, "wait_complete")
        base = prompt(1, 160)
        eng.generate([base], SamplingParams(max_tokens=1))
        for k in range(8):  # push it onto disk
            eng.generate([prompt(100 + k, 160)], SamplingParams(max_tokens=1))
        queue = [prompt(200 + k, 64) for k in range(3)]
        target = base + prompt(2, 5)
        outs = eng.generate([*queue, target], SamplingParams(max_tokens=4))
        assert [o.token_ids for o in outs] == [model.reference_generate(p, 4) for p in [*queue, target]]
        assert outs[-1].reused_tokens_by_tier["host"] == 160 and outs[-1].reused_tokens_by_tier["disk"] == 0
        eng.cache_manager.check_invariants()
        eng.close()


def test_a_prefix_pushed_to_disk_while_its_request_waits_is_read_at_the_head_of_the_queue(model):
    """The target's prefix is in memory when it arrives (nothing to prefetch); the prompts ahead
    push it to disk while it waits. Before, it was never tried again and read its 80 tokens from
    disk on admission; now its read starts when it reaches the head of the queue."""
    with tempfile.TemporaryDirectory() as tmp:
        eng = engine(model, tmp, "wait_complete")
        mgr = eng.cache_manager
        base = in_memory_prefix(eng, 100)
        queue = [prompt(200 + k, 160) for k in range(3)]
        target = base + [9, 9]
        outs = eng.generate([*queue, target], SamplingParams(max_tokens=4))
        assert [o.token_ids for o in outs] == [model.reference_generate(p, 4) for p in [*queue, target]]
        assert outs[-1].reused_tokens_by_tier["host"] == 80 and outs[-1].reused_tokens_by_tier["disk"] == 0
        mgr.check_invariants()
        eng.close()


def test_a_request_resumed_then_blocked_lets_go_of_its_read_and_the_running_one_finishes(model):
    """Under max_utilization a request whose read landed is resumed, then blocked (no pages to
    grow into) and suspended. Before, its read still pinned its pages, now in the primary tier: the
    running request could not push them down to grow, preempted itself, and failed with "it cannot
    run even alone" (a cancel let go only at the pool's next read-landing call)."""
    with tempfile.TemporaryDirectory() as tmp:
        first = engine(model, tmp, "wait_complete", primary_pages=10)
        prefix = prompt(1, 32)
        first.generate([prefix], SamplingParams(max_tokens=1))
        first.close()  # persisted: on disk only
        eng = engine(model, tmp, "wait_complete", primary_pages=10, max_batch_size=2, policy="max_utilization")
        running = prompt(3, 40)
        eng.add_request(running, SamplingParams(max_tokens=30))
        for _ in range(3):
            eng.step()
        target = prefix + prompt(2, 9)
        eng.add_request(target, SamplingParams(max_tokens=4))
        outs = {}
        while eng.has_unfinished_requests():
            outs.update({o.request_id: o for o in eng.step()})
        assert [outs[k].finish_reason for k in sorted(outs)] == ["length", "length"]
        assert [outs[k].token_ids for k in sorted(outs)] == [
            model.reference_generate(running, 30),
            model.reference_generate(target, 4),
        ]
        eng.cache_manager.check_invariants()
        eng.close()


def test_the_head_of_the_queue_gets_its_read_while_the_requests_behind_it_hold_theirs(model):
    """``max_prefetches=1``, held by the read of a request behind the target. Before, the target's
    retry at the head never started: 72 of its 80 tokens came from disk."""
    with tempfile.TemporaryDirectory() as tmp:
        eng = engine(model, tmp, "wait_complete", max_prefetches=1)
        mgr = eng.cache_manager
        behind_prefix = prompt(7, 16)
        eng.generate([behind_prefix], SamplingParams(max_tokens=1))
        for k in range(8):  # push it onto disk
            eng.generate([prompt(100 + k, 160)], SamplingParams(max_tokens=1))
        base = in_memory_prefix(eng, 99)
        prompts = [*[prompt(200 + k, 160) for k in range(3)], base + [9, 9], behind_prefix + [5, 5]]
        outs = eng.generate(prompts, SamplingParams(max_tokens=4))
        assert [o.token_ids for o in outs] == [model.reference_generate(p, 4) for p in prompts]
        assert outs[3].reused_tokens_by_tier["host"] == 80 and outs[3].reused_tokens_by_tier["disk"] == 0
        assert outs[4].reused_tokens_by_tier["host"] == 16
        mgr.check_invariants()
        eng.close()


def test_a_read_over_that_holds_nothing_leaves_its_place_to_the_next(model, monkeypatch):
    """``max_prefetches=1``; request A's read fails, so it lands nothing. Before, A still counted
    as a read holding its pages until its admission, and B (behind it) read its 32 tokens from
    disk on admission; now B's read starts once A's is over."""
    with tempfile.TemporaryDirectory() as tmp:
        pa, pb = prompt(1, 32), prompt(2, 32)
        first = engine(model, tmp, "best_effort")
        first.generate([pa + [1], pb + [1]], SamplingParams(max_tokens=1))
        first.close()  # persisted: both prefixes on disk only
        eng = engine(model, tmp, "best_effort", max_prefetches=1)
        real, reads = host_prefetch.HostPrefetcher._read, []

        def read(self, job):
            reads.append(len(job.pages))
            if len(reads) == 1:
                raise OSError("A's read fails")
            return real(self, job)

        monkeypatch.setattr(host_prefetch.HostPrefetcher, "_read", read)
        busy = prompt(3, 20)
        eng.add_request(busy, SamplingParams(max_tokens=25))
        eng.step()
        prompts = [busy, pa + [7, 7], pb + [8, 8]]
        for p in prompts[1:]:
            eng.add_request(p, SamplingParams(max_tokens=2))
        outs = {}
        while eng.has_unfinished_requests():
            outs.update({o.request_id: o for o in eng.step()})
        done = [outs[k] for k in sorted(outs)]
        expected = [model.reference_generate(p, n) for p, n in zip(prompts, (25, 2, 2), strict=True)]
        assert [o.token_ids for o in done] == expected
        assert reads == [4, 4] and done[2].reused_tokens_by_tier["host"] == 32
        eng.cache_manager.check_invariants()
        eng.close()


def test_bad_prefetch_settings():
    with pytest.raises(ValueError, match="prefetch_policy"):
        SchedulerConfig(prefetch_policy="eager")
    with pytest.raises(ValueError, match="prefetch_timeout_s"):
        SchedulerConfig(prefetch_timeout_s=-1)
    with pytest.raises(ValueError, match="max_prefetches"):
        SchedulerConfig(max_prefetches=-2)
