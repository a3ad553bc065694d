"""Random serving sessions through vLLM's real scheduler and kvtier's connector.

Each seed draws a configuration (host memory for 8 to 256 pages, a disk tier or none and the
share of host memory that reads for queued requests may hold, a shared store, a sliding-window
group, 24 to 128 vLLM blocks so that requests are preempted, synchronous or asynchronous
scheduling, speculative decoding or none, the store asked again at every ask of a waiting
request or at most every ``STORE_ASK_AGAIN_S``, a running batch of 2 to 8 requests, on
vLLM 0.34 ``--max-num-inflight-kv-loads`` or not, and first-come or priority scheduling, where
requests of higher priority preempt running ones) and a session:
requests that share prefixes of random lengths (or, in bursts, one prefix), with vLLM's own
prefix caching on or off, cache salts, aborts, vLLM's prefix cache reset,
and weight updates (the engine drained, new weights, then vLLM's and the connector's reset, as a
reinforcement-learning loop does). The stand-in model's KV is a function of the prefix, the
request's cache salt and the weights, and the runner checks before every forward that each
position a request counts as computed holds what this request's forward would have written
(``WrongKV``): a block served across salts or weights, or a rejected draft's KV, fails.
At the end nothing is left held, locked or in flight. ``shared_store_session`` runs two engines
of one model that share a store, checked the same way."""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 or 0.34 (bash .ci/vllm_env.sh)")

from vllm.config import SchedulerConfig

from kvtier.vllm import scheduler
from tests.vllm.harness import (
    BLOCK,
    HOST_PAGE,
    Engine,
    MiB,
    attention_spec,
    kv_cache_config,
    layer_names,
    prefix_hashes,
    prompt,
    vllm_config,
)

SEEDS_PER_CASE = 10
# vLLM 0.34's --max-num-inflight-kv-loads: loads of cached prefixes start while the batch is full
INFLIGHT_KV_LOADS = "max_num_inflight_kv_loads" in SchedulerConfig.__dataclass_fields__


class UpdatedWeights(Engine):
    """A stand-in model whose KV also depends on the request's cache salt and on its weights."""

    weights = 0

    def prefix_hashes(self, rid: str, tokens: Sequence[int]) -> np.ndarray:
        return prefix_hashes(tokens) ^ zlib.crc32(f"{self.requests[rid].cache_salt}|{self.weights}".encode())

    def update_weights(self) -> None:
        self.run(3000)  # drained: no request computes with both weights
        self.weights += 1
        assert self.scheduler.reset_prefix_cache(reset_connector=True)


def session(seed: int, tmp_path: Path, vary_batch: bool = True) -> None:
    """``vary_batch=False``: a running batch of 8 without early loads, as before they were drawn."""
    rng = random.Random(seed)
    extra: dict = {"host_bytes": rng.choice([8, 24, 64, 256]) * HOST_PAGE}
    if rng.random() < 0.6:
        extra |= {
            "disk_bytes": rng.choice([1, 8]) * MiB,
            "disk_path": str(tmp_path / "disk"),
            "disk_read_wait_s": rng.choice([0.0, 1.0]),
            "queued_reads_share": random.Random(seed * 31 + 3).choice([0.25, 0.5, 1.0]),  # drawn apart
        }
    window = rng.random() < 0.3
    if not window and rng.random() < 0.3:  # a store serves full-attention models
        extra["store_url"] = f"file://{tmp_path}/store"
    asynchronous = rng.random() < 0.5
    max_batched = rng.choice([32, 64, 128])
    spec_tokens = rng.choice([0, 0, 2, 4])
    batch = random.Random(seed * 7919 + 1)  # drawn apart: each seed's other draws stay as they were
    order = random.Random(seed * 104_729 + 2)  # the policy and priorities, likewise
    policy = order.choice(["fcfs", "priority"])
    config = vllm_config(
        tmp_path,
        extra,
        async_scheduling=asynchronous,
        max_batched=max_batched,
        spec_tokens=spec_tokens,
        max_seqs=batch.choice([2, 4, 8, 8]) if vary_batch else 8,
        inflight_kv_loads=batch.choice([None, 1, 2]) if INFLIGHT_KV_LOADS and vary_batch else None,
        policy=policy,
    )
    # vLLM's own prefix caching off (kvtier alone finds prefixes, also for requests that wait)
    config.cache_config.enable_prefix_caching = random.Random(seed * 257 + 5).random() >= 0.25  # drawn apart
    if window:
        groups = [(layer_names(2), attention_spec()), (layer_names(1, first=2), attention_spec(window=32))]
    else:
        groups = [(layer_names(3), attention_spec())]
    # a waiting request asks the store again at every ask, or at most every STORE_ASK_AGAIN_S
    ask_again = random.Random(seed * 65_537 + 4).choice([0.0, scheduler.STORE_ASK_AGAIN_S])  # drawn apart
    with mock.patch.object(scheduler, "STORE_ASK_AGAIN_S", ask_again):
        blocks = rng.choice([24, 40, 64, 128])
        e = UpdatedWeights(config, kv_cache_config(config, groups, blocks))
        prefixes = [prompt(seed * 100 + i, rng.choice([16, 40, 64, 100, 150])) for i in range(4)]
        added: list[str] = []
        bursts = random.Random(seed * 6_151 + 6)  # drawn apart
        for _ in range(rng.randint(5, 15)):
            # a burst: the round's requests share one prefix (those waiting for a slot match again
            # what the first computes meanwhile)
            burst = bursts.choice(prefixes)[: bursts.randint(32, 150)] if bursts.random() < 0.3 else None
            for _ in range(rng.randint(1, 4)):
                shared = rng.choice(prefixes)[: rng.randint(1, 150)]
                tokens = (burst or shared) + prompt(seed * 1000 + len(added), rng.randint(1, 40))
                rid = f"r{len(added)}"
                priority = order.randint(0, 2) if policy == "priority" else 0
                e.add(
                    rid,
                    tokens[: blocks * BLOCK // 3],
                    max_tokens=rng.randint(1, 20),
                    salt=rng.choice([None, None, "s"]),
                    priority=priority,
                )
                added.append(rid)
            for _ in range(rng.randint(0, 6)):
                if e.scheduler.has_requests():
                    e.step()
            draw = rng.random()
            if draw < 0.15:
                rid = rng.choice(added)
                if rid in e.scheduler.requests:
                    e.abort(rid)
            elif draw < 0.22:
                e.scheduler.reset_prefix_cache()
            elif draw < 0.27:
                e.update_weights()
        e.run(3000)
        e.assert_no_leaks()
        e.shutdown()


@pytest.mark.parametrize("first", range(0, 4 * SEEDS_PER_CASE, SEEDS_PER_CASE))
def test_random_sessions_serve_only_each_requests_own_kv_and_leave_nothing_behind(first, tmp_path):
    for seed in range(first, first + SEEDS_PER_CASE):
        (tmp_path / str(seed)).mkdir()
        session(seed, tmp_path / str(seed))


def shared_store_session(seed: int, tmp_path: Path) -> None:
    """Two engines of one model that share a store (and a disk directory, each taking a replica
    directory under it, or none), requests that share prefixes sent to either, steps taken in turn:
    a request of one engine loads blocks the other stored, also while it waits for a slot (the
    store asked again at every ask or at most every ``STORE_ASK_AGAIN_S``). Aborts, prefix cache
    resets of one engine, and weight updates of both (each drained, then updated)."""
    rng = random.Random(seed)
    ask_again = rng.choice([0.0, scheduler.STORE_ASK_AGAIN_S])
    extra: dict = {"store_url": f"file://{tmp_path}/store"}
    if rng.random() < 0.5:
        extra |= {"disk_bytes": rng.choice([1, 8]) * MiB, "disk_path": str(tmp_path / "disk"), "disk_read_wait_s": 1.0}
    engines: list[UpdatedWeights] = []
    with mock.patch.object(scheduler, "STORE_ASK_AGAIN_S", ask_again):
        for name in ("one", "two"):
            config = vllm_config(
                tmp_path,
                {**extra, "host_bytes": rng.choice([8, 24, 64]) * HOST_PAGE},
                async_scheduling=rng.random() < 0.5,
                max_batched=rng.choice([32, 64, 128]),
                max_seqs=rng.choice([2, 4, 8]),
            )
            config.kv_transfer_config.engine_id = name
            blocks = rng.choice([24, 40, 64])
            engines.append(
                UpdatedWeights(config, kv_cache_config(config, [(layer_names(3), attention_spec())], blocks))
            )
        prefixes = [prompt(seed * 100 + i, rng.choice([16, 40, 64, 100])) for i in range(3)]
        added: list[tuple[UpdatedWeights, str]] = []
        for _ in range(rng.randint(5, 15)):
            for _ in range(rng.randint(1, 4)):
                e = rng.choice(engines)
                tokens = rng.choice(prefixes)[: rng.randint(1, 100)] + prompt(
                    seed * 1000 + len(added), rng.randint(1, 30)
                )
                rid = f"r{len(added)}"
                e.add(rid, tokens[: 20 * BLOCK // 3], max_tokens=rng.randint(1, 20), salt=rng.choice([None, None, "s"]))
                added.append((e, rid))
            for _ in range(rng.randint(0, 6)):
                for e in engines:
                    if e.scheduler.has_requests():
                        e.step()
            draw = rng.random()
            if draw < 0.15:
                e, rid = rng.choice(added)
                if rid in e.scheduler.requests:
                    e.abort(rid)
            elif draw < 0.22:
                rng.choice(engines).scheduler.reset_prefix_cache()
            elif draw < 0.27:
                for e in engines:
                    e.update_weights()
        for e in engines:
            e.run(3000)
            e.assert_no_leaks()
        for e in engines:
            e.shutdown()


def test_engines_sharing_a_store_serve_only_each_requests_own_kv(tmp_path):
    for seed in range(SEEDS_PER_CASE):
        (tmp_path / str(seed)).mkdir()
        shared_store_session(seed, tmp_path / str(seed))


def test_a_request_whose_prefill_ends_with_draft_placeholders_is_served(tmp_path):
    """Seed 128: a prompt loaded from the connector but for its last token is scheduled, under
    asynchronous scheduling with speculative decoding, with draft placeholders in its first step,
    before the runner ever drafted for it (the runner once failed on the missing drafts)."""
    session(128, tmp_path, vary_batch=False)
