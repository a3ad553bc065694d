"""KVTierConnector under vLLM's real Scheduler, with a stand-in runner over vLLM-laid-out CPU caches.

Every step the runner checks that each scheduled request's computed positions hold exactly its
own prefix's KV (``WrongKV`` otherwise), so a test passes only if nothing wrong was ever served.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 or 0.34 (bash .ci/vllm_env.sh)")

from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.request import Request, RequestStatus

from kvtier import BAD_PAGE_INDEX
from kvtier.cache import KVCache
from kvtier.tiering import disk_write_behind, host_prefetch, mover
from kvtier.vllm import settings
from kvtier.vllm.scheduler import token_ids
from kvtier.vllm.transfer import Direction
from tests.disk_speed import slow_disk_reads
from tests.holding import hold
from tests.vllm.harness import (
    BLOCK,
    HOST_PAGE,
    Engine,
    MiB,
    attention_spec,
    host_pages_engine,
    kv_cache_config,
    layer_names,
    lock_host_memory,
    prompt,
    push_out_of_host_memory,
    run_until_computed,
    vllm_config,
)


def engine(
    tmp_path: Path,
    *,
    disk: bool = False,
    blocks: int = 64,
    name: str = "model",
    disk_read_wait_s: float = 1.0,
    recompute_when_faster: bool = False,
    prefill_tokens_per_s: float | None = None,
    segmented: bool = False,
    **kwargs,
) -> Engine:
    extra: dict = {
        "host_bytes": 4 * MiB,
        "recompute_when_faster": recompute_when_faster,
        "prefill_tokens_per_s": prefill_tokens_per_s,
    }
    if disk:
        extra.update(disk_bytes=8 * MiB, disk_path=str(tmp_path / "disk"), disk_read_wait_s=disk_read_wait_s)
    config = vllm_config(tmp_path, extra, name=name, **kwargs)
    return Engine(config, kv_cache_config(config, [(layer_names(3), attention_spec())], blocks), segmented)


def refuse_disk_writes_on_the_scheduler_thread(monkeypatch) -> None:
    """A disk write by a plan (a demotion of pages not written behind) fails the test."""

    def refused(*args, **kwargs):
        raise AssertionError("the scheduler thread wrote pages to disk")

    monkeypatch.setattr(mover.Mover, "write_pages", refused)


def a_disk_that_keeps_up(monkeypatch) -> None:
    """Each write-behind batch is written before the step that started it ends (it lands at the next)."""
    started = disk_write_behind.DiskWriteBehind.start

    def keeping_up(self):
        batch = started(self)
        if batch is not None:
            batch.future.result()
        return batch

    monkeypatch.setattr(disk_write_behind.DiskWriteBehind, "start", keeping_up)


def reads_that_keep_up(monkeypatch) -> None:
    """Each read from disk into host memory is over as it starts (it lands at the next step)."""
    started = host_prefetch.HostPrefetcher.start

    def keeping_up(self, pages, hold=False):
        read = started(self, pages, hold)
        if read is not None:
            read.future.result()
        return read

    monkeypatch.setattr(host_prefetch.HostPrefetcher, "start", keeping_up)


def first_step_of(e: Engine, rid: str) -> tuple[int, int]:
    """The positions the runner computed for ``rid`` the first time it ran it."""
    return next(step.computed[rid] for step in e.log if rid in step.computed)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("segmented", [False, True], ids=["one allocation", "a storage per layer"])
def test_a_prefix_saved_by_one_request_is_loaded_by_the_next(tmp_path, async_scheduling, segmented):
    """Also with the caches given as vLLM 0.34's extensible KV cache gives them (a storage per
    layer, the storages' starts off page boundaries), which the worker refused before ("the KV
    caches live in 3 allocations"); nothing is written between the storages."""
    e = engine(tmp_path, async_scheduling=async_scheduling, segmented=segmented)
    shared = prompt(1, 100)
    e.add("r1", shared, max_tokens=4)
    run_until_computed(e, "r1", 100)
    written = e.blocks_bytes("r1", 6)
    e.run()
    assert e.kv_scheduler.manager.stats().tiers["primary"].pages_used == 6  # 6 full blocks of 103 tokens

    e.reset_prefix_cache()
    e.poison()
    e.add("r2", shared[:90] + [7, 8, 9], max_tokens=3)
    e.step()
    assert e.requests["r2"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "r2" in e.log[-1].loaded and not e.log[-1].invalid
    while "r2" not in {r for s in e.log for r in s.computed}:
        e.step()
    assert first_step_of(e, "r2")[0] == 80  # 5 full shared blocks came from kvtier, not the model
    assert e.blocks_bytes("r2", 5) == [b for i, b in enumerate(written) if i % 6 < 5]
    e.run()
    assert e.kv_scheduler.manager.stats().hit_tokens["primary"] == 80
    assert all(bool((gap == 0x5A).all()) for gap in e.segment_gaps)
    e.assert_no_leaks()
    e.shutdown()


INFLIGHT_KV_LOADS = pytest.mark.skipif(
    not hasattr(KVConnectorBase_V1, "may_load_async"), reason="vLLM 0.34's --max-num-inflight-kv-loads"
)


@INFLIGHT_KV_LOADS
@pytest.mark.parametrize("inflight", [None, 2], ids=["no flag", "max_num_inflight_kv_loads=2"])
def test_a_prefix_in_host_memory_starts_loading_while_the_running_batch_is_full(tmp_path, inflight):
    """With ``--max-num-inflight-kv-loads``, a request whose prefix kvtier holds in host memory
    starts its load while the running batch is full (``may_load_async``), so it is there when a
    slot frees; a request kvtier holds nothing of, and one whose prefix vLLM's own cache holds,
    wait as before (neither holds back the load behind it). Before, kvtier answered vLLM's
    default (remote prefills only), and the load started only once a slot was free."""
    e = engine(tmp_path, max_seqs=2, inflight_kv_loads=inflight)
    shared, on_gpu = prompt(1, 100), prompt(5, 100)
    e.add("r1", shared, max_tokens=2)
    e.run()
    e.reset_prefix_cache()  # kvtier alone holds ``shared``; vLLM and kvtier both ``on_gpu``
    e.add("r2", on_gpu, max_tokens=2)
    e.run()
    e.add("b1", prompt(2, 20), max_tokens=40)
    e.add("b2", prompt(3, 20), max_tokens=40)
    run_until_computed(e, "b1", 21)
    run_until_computed(e, "b2", 21)  # the running batch is full
    e.add("gpu hit", on_gpu[:90] + [7, 8, 9], max_tokens=3)
    e.add("new", prompt(4, 40), max_tokens=3)
    e.add("cached", shared[:90] + [7, 8, 9], max_tokens=3)
    e.step()
    assert {rid for rid, r in e.requests.items() if r.status is RequestStatus.RUNNING} == {"b1", "b2"}
    loading = RequestStatus.WAITING_FOR_REMOTE_KVS if inflight else RequestStatus.WAITING
    assert e.requests["cached"].status is loading
    assert e.requests["gpu hit"].status is e.requests["new"].status is RequestStatus.WAITING
    e.run()
    assert first_step_of(e, "cached")[0] == 80  # 5 full shared blocks came from kvtier
    assert first_step_of(e, "gpu hit")[0] == 80  # from vLLM's own cache
    e.assert_no_leaks()
    e.shutdown()


@INFLIGHT_KV_LOADS
def test_with_a_store_no_load_starts_before_a_slot_frees(tmp_path):
    """Blocks a store holds past kvtier's own would be fetched while no slot can take the request,
    into host memory the running requests fill: with a store set, every request loads once a slot
    frees, as without the flag, even one whose prefix is in host memory."""
    extra = {"host_bytes": 4 * MiB, "store_url": f"file://{tmp_path}/store"}
    config = vllm_config(tmp_path, extra, max_seqs=2, inflight_kv_loads=2)
    e = Engine(config, kv_cache_config(config, [(layer_names(3), attention_spec())], 64))
    shared = prompt(1, 100)
    e.add("r1", shared, max_tokens=2)
    e.run()
    e.reset_prefix_cache()
    e.add("b1", prompt(2, 20), max_tokens=40)
    e.add("b2", prompt(3, 20), max_tokens=40)
    run_until_computed(e, "b1", 21)
    run_until_computed(e, "b2", 21)
    e.add("cached", shared[:90] + [7, 8, 9], max_tokens=3)
    e.step()
    assert e.requests["cached"].status is RequestStatus.WAITING
    e.run()
    assert first_step_of(e, "cached")[0] == 80
    e.assert_no_leaks()
    e.shutdown()


@INFLIGHT_KV_LOADS
def test_a_prefix_on_disk_waits_for_a_slot_before_its_read_starts(tmp_path):
    """A request whose prefix is on disk, queued behind a running request whose pages fill host
    memory, is not loaded early: its read would start, and its ``disk_read_wait_s`` run out, while
    no slot could take it, and the disk part would be recomputed. It reads the disk once a slot
    frees, as without the flag. (A first version answered True for it: 0 of 112 tokens from disk.)"""
    shared = prefix_on_disk(tmp_path, 58)
    base = {"host_bytes": 10 * HOST_PAGE, "disk_bytes": 8 * MiB, "disk_path": str(tmp_path / "disk")}
    config = vllm_config(tmp_path, {**base, "disk_read_wait_s": 0.5}, max_seqs=1, inflight_kv_loads=1)
    e = Engine(config, kv_cache_config(config, [(layer_names(3), attention_spec())], 128))
    manager = e.kv_scheduler.manager
    assert manager.cached_tokens(shared) == 112 and manager.cached_tokens(shared, in_memory=True) == 0
    e.add("long", prompt(99, 160), max_tokens=60)  # its pages fill host memory while it runs
    run_until_computed(e, "long", 161)
    e.add("queued", shared + [5, 6], max_tokens=2)
    e.step()
    assert e.requests["queued"].status is RequestStatus.WAITING  # not asked while no slot is free
    time.sleep(0.6)  # longer than the wait: a read started now would have been given up
    e.run()
    assert first_step_of(e, "queued")[0] == 112
    assert manager.stats().hit_tokens["disk"] == 112
    e.assert_no_leaks()
    e.shutdown()


def test_after_vllm_sleeps_and_wakes_a_prefix_saved_before_is_loaded(tmp_path):
    """vLLM's sleep unregisters the KV caches, unmaps them (their contents lost) and maps them again
    at the same addresses on wake-up; kvtier's host pages still serve the prefix. (vLLM's pause
    before it resets the connector unless ``reset_connector=False``: a new weights epoch then.)"""
    e = engine(tmp_path, segmented=True)
    shared = prompt(3, 100)
    e.add("r1", shared, max_tokens=2)
    run_until_computed(e, "r1", 100)
    written = e.blocks_bytes("r1", 6)
    e.run()
    e.worker.unregister_kv_caches()
    e.reset_prefix_cache()
    e.poison()  # what the memory holds after it was mapped again
    e.worker.restore_kv_caches()
    e.add("r2", shared[:96] + [5], max_tokens=2)
    while "r2" not in {r for s in e.log for r in s.computed}:
        e.step()
    assert first_step_of(e, "r2")[0] == 96
    assert e.blocks_bytes("r2", 6) == written
    e.run()
    e.assert_no_leaks()
    e.shutdown()


def test_a_restart_on_the_same_disk_directory_serves_the_prefix(tmp_path):
    shared = prefix_on_disk(tmp_path, 2)
    second = engine(tmp_path, disk=True)  # a new process's engine: new engine id, empty host memory
    second.poison()
    second.add("r2", shared + [1, 2, 3], max_tokens=2)
    second.run()
    assert first_step_of(second, "r2")[0] == 112  # all 7 full blocks from disk
    assert second.kv_scheduler.manager.stats().hit_tokens["disk"] == 112
    second.assert_no_leaks()
    second.shutdown()


def test_engines_of_one_model_on_one_disk_path_take_a_directory_each(tmp_path, caplog):
    """Replicas configured alike (one per GPU of a machine) name the same ``disk_path``: the second
    engine keeps its pages in ``disk_path/replica-1`` instead of failing to start, and after both
    restart each one's prefix is served from disk."""
    engines = [engine(tmp_path, disk=True), engine(tmp_path, disk=True)]
    assert "replica-1" in caplog.text
    prompts = [prompt(6, 120), prompt(7, 120)]
    for e, shared in zip(engines, prompts, strict=True):
        e.add("r1", shared, max_tokens=2)
        e.run()
    for e in engines:
        e.shutdown()
    assert (tmp_path / "disk" / "replica-1").is_dir()
    again = [engine(tmp_path, disk=True), engine(tmp_path, disk=True)]  # they take the directories in turn
    for e, shared in zip(again, prompts, strict=True):
        e.poison()
        e.add("r2", shared + [1, 2, 3], max_tokens=2)
        e.run()
        assert first_step_of(e, "r2")[0] == 112  # all 7 full blocks from its own directory's disk
        assert e.kv_scheduler.manager.stats().hit_tokens["disk"] == 112
        e.assert_no_leaks()
    for e in again:
        e.shutdown()


def prefix_on_disk(tmp_path: Path, seed: int) -> list[int]:
    """A 120-token prompt that an engine computed and left in its disk tier (it shut down)."""
    first = engine(tmp_path, disk=True)
    shared = prompt(seed, 120)
    first.add("r1", shared, max_tokens=2)
    first.run()
    first.shutdown()
    return shared


def test_a_disk_prefix_larger_than_host_memory_loads_what_fits_without_waiting(tmp_path):
    """Host memory for 5 pages, a 7-block prefix on disk: 5 blocks are read, the rest recomputed at
    once. Before: the request waited ``disk_read_wait_s`` for room that its own pages held."""
    shared = prefix_on_disk(tmp_path, seed=57)
    e = host_pages_engine(tmp_path, 5, disk_read_wait_s=30.0)
    e.poison()
    e.add("r2", [*shared, 1, 2], max_tokens=3)
    began = time.monotonic()
    e.run()
    assert time.monotonic() - began < 10
    assert first_step_of(e, "r2")[0] == 5 * BLOCK  # each loaded position checked
    e.assert_no_leaks()
    e.shutdown()


def test_recompute_when_faster_recomputes_a_prefix_on_a_slow_disk_at_once(tmp_path, monkeypatch):
    """With ``recompute_when_faster`` and a given rate: the disk's speed is sampled when the engine
    opens its directory (and kept there), so its blocks are recomputed without a wait; without the
    setting they are read."""
    shared = prefix_on_disk(tmp_path, 8)
    slow_disk_reads(monkeypatch, 1e6)
    fast_model = {"recompute_when_faster": True, "prefill_tokens_per_s": 1e9}  # slower than any disk here
    for _ in range(2):  # a start that samples the disk, then one that finds its speed kept
        e = engine(tmp_path, disk=True, **fast_model)
        assert e.kv_scheduler.manager._pool.load_cost.bandwidth[1] is not None
        e.add("r", [*shared, 1, 2], max_tokens=2)
        e.step()
        assert e.log[-1].computed["r"][0] == 0  # scheduled at once, recomputed from its first token
        e.run()
        assert disk_bytes_read(e) == 0
        e.assert_no_leaks()
        e.shutdown()
    unweighed = engine(tmp_path, disk=True)  # not weighed: every cached block is read
    unweighed.add("r4", [*shared, 1, 4], max_tokens=2)
    unweighed.run()
    assert first_step_of(unweighed, "r4")[0] == 112
    unweighed.shutdown()


def test_recompute_when_faster_weighs_with_the_prefill_rate_the_worker_measures(tmp_path, monkeypatch):
    """Without a given rate the worker times the forwards of steps computing prompt tokens; the
    scheduler half weighs disk reads with that rate (kept in the directory for the next start)."""
    first = engine(tmp_path, disk=True, recompute_when_faster=True, max_batched=512)
    prompts = [prompt(20 + i, 300) for i in range(2)]
    for i, tokens in enumerate(prompts):
        first.add(f"p{i}", tokens, max_tokens=2)
        first.run()
    assert first.kv_scheduler.manager._pool.load_cost.prefill_rate is not None  # measured, reported
    first.shutdown()
    slow_disk_reads(monkeypatch, 1e6)
    second = engine(tmp_path, disk=True, recompute_when_faster=True, max_batched=512)
    for i, tokens in enumerate(prompts):
        second.add(f"r{i}", [*tokens, 1], max_tokens=2)
        second.step()
        assert second.log[-1].computed[f"r{i}"][0] == 0  # slower than this model computes: recomputed at once
        second.run()
    assert disk_bytes_read(second) == 0
    second.assert_no_leaks()
    second.shutdown()
    unweighed = engine(tmp_path, disk=True, max_batched=512)
    unweighed.add("r", [*prompts[0], 2], max_tokens=2)
    unweighed.run()
    assert first_step_of(unweighed, "r")[0] == 288
    unweighed.shutdown()


def disk_bytes_read(e: Engine) -> int:
    return sum(n for edge, n in e.kv_scheduler.manager.stats().bytes_copied.items() if edge.startswith("disk->"))


def test_the_token_ids_kvtier_reads_are_the_requests_own_prompt_and_output():
    """Read behind vLLM's read-only wrapper (an ``array('i')`` in 0.34, a list in 0.33): the same
    ids, and never an object vLLM appends to later where it is an array."""
    request = Request("r", list(range(7, 47)), SamplingParams(max_tokens=4), None, 0)
    request.append_output_token_ids([3, 9])
    ids = token_ids(request)
    assert list(ids) == list(request.all_token_ids) == [*range(7, 47), 3, 9]
    request.append_output_token_ids(5)  # (an array vLLM holds while its buffer is read cannot grow)
    assert list(token_ids(request))[-3:] == [3, 9, 5]


def test_a_request_for_prompt_logprobs_reads_nothing_waits_for_nothing_and_is_saved(tmp_path):
    """vLLM computes every prompt token of such a request: kvtier must not read its prefix from disk
    (nor make it wait for that); its new blocks are saved as any request's."""
    shared = prefix_on_disk(tmp_path, 4)
    e = engine(tmp_path, disk=True)
    longer = shared + prompt(5, 40)
    e.add("r2", longer, max_tokens=2, prompt_logprobs=1)
    e.step()
    assert e.log[-1].computed["r2"][0] == 0  # scheduled at once, from its first token
    e.run()
    assert disk_bytes_read(e) == 0
    e.reset_prefix_cache()  # vLLM's own cache only: r3's blocks come from kvtier
    e.add("r3", longer + [1], max_tokens=2)
    e.run()
    assert first_step_of(e, "r3")[0] == 160  # 7 blocks from disk, 3 that r2 saved
    assert disk_bytes_read(e) > 0
    e.assert_no_leaks()
    e.shutdown()


def test_a_request_whose_prefix_vllm_holds_itself_waits_for_no_disk_read(tmp_path, monkeypatch):
    """vLLM's own prefix cache holds the whole prefix that kvtier has only on disk: the request is
    scheduled at once, and nothing is read. Before, it waited for kvtier to read the same prefix
    into host memory, then was offered nothing."""
    shared = prefix_on_disk(tmp_path, seed=58)
    e = host_pages_engine(tmp_path, 8)
    e.add("r2", [*shared, 1], max_tokens=2)  # read from disk: vLLM's cache holds its blocks from now on
    e.run()
    for i in range(3):  # kvtier's host memory passes to other prompts: the prefix is on disk only
        e.add(f"o{i}", prompt(60 + i, 150), max_tokens=1)
        e.run()
    probe = e.kv_scheduler.manager.create_cache([*shared, 2])
    assert probe.reused_by_tier["disk"] > 0
    probe.close()
    read = disk_bytes_read(e)
    slow_disk_reads(monkeypatch, 1e4)  # a read would take seconds
    e.add("r3", [*shared, 2], max_tokens=2)
    e.step()
    assert e.log[-1].computed.get("r3", (None,))[0] == 112  # scheduled at once, on vLLM's own hit
    e.run()
    assert disk_bytes_read(e) == read
    e.assert_no_leaks()
    e.shutdown()


def test_a_multimodal_request_shares_the_text_before_its_first_image_only(tmp_path):
    """An image's KV is not decided by its placeholder tokens: kvtier keeps and serves only the blocks
    before a request's first image; a request with the same tokens and no image gets no more."""
    e = engine(tmp_path)
    text, picture = prompt(11, 40), [900] * 20
    e.add("r1", [*text, *picture, *prompt(12, 30)], max_tokens=2, images=[("a", 40, 20)])
    e.run()
    assert e.kv_scheduler.manager.stats().tiers["primary"].pages_used == 2  # the 2 full blocks before token 40
    e.reset_prefix_cache()
    e.add("r2", [*text, *picture, *prompt(13, 30)], max_tokens=2, images=[("b", 40, 20)])
    e.run()
    assert first_step_of(e, "r2")[0] == 32
    e.reset_prefix_cache()
    e.add("r3", [*text, *picture, *prompt(12, 30)], max_tokens=2)  # r1's tokens, without its image
    e.run()
    assert first_step_of(e, "r3")[0] == 32
    e.assert_no_leaks()
    e.shutdown()


def never_read_disk_on_the_scheduler_thread(monkeypatch) -> None:
    """A disk read by a plan (a resume of pages still on disk) fails the test: the scheduler half
    must leave them to its background reads."""

    def refused(*args, **kwargs):
        raise AssertionError("the scheduler thread read pages from disk")

    monkeypatch.setattr(mover.Mover, "_read_edge", refused)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_disk_hit_is_read_in_the_background_while_the_others_run(tmp_path, monkeypatch, async_scheduling):
    """A request whose prefix is on disk waits (vLLM asks again each step) while its pages are read
    on a background thread; another request runs meanwhile; then its blocks load byte for byte."""
    shared = prefix_on_disk(tmp_path, 2)
    started, release = hold(monkeypatch, host_prefetch.HostPrefetcher, "_read")
    never_read_disk_on_the_scheduler_thread(monkeypatch)
    second = engine(tmp_path, disk=True, async_scheduling=async_scheduling)
    second.poison()
    second.add("r2", shared + [1, 2, 3], max_tokens=2)
    second.add("r3", prompt(3, 40), max_tokens=2)  # nothing cached: it needs nothing from the disk
    for _ in range(3):
        second.step()
    assert started.wait(10)
    assert second.requests["r2"].status is RequestStatus.WAITING and "r2" not in second.log[-1].computed
    assert any("r3" in step.computed for step in second.log)  # scheduled while r2's pages are read
    release.set()
    second.run()
    assert first_step_of(second, "r2")[0] == 112  # all 7 full blocks from disk, through the background read
    assert second.kv_scheduler.manager.stats().hit_tokens["disk"] == 112
    second.assert_no_leaks()
    second.shutdown()


def waiting_for_a_held_read(tmp_path: Path, monkeypatch, shared: list[int]) -> tuple[Engine, threading.Event]:
    """An engine on the directory where request "r2" over ``shared`` waits for its disk read,
    which is held until the returned event is set."""
    started, release = hold(monkeypatch, host_prefetch.HostPrefetcher, "_read")
    e = engine(tmp_path, disk=True)
    e.add("r2", shared + [1, 2, 3], max_tokens=2)
    e.step()
    assert started.wait(10)
    assert e.kv_scheduler._leases["r2"].reads  # waiting for its read
    return e, release


def serves_the_prefix(e: Engine, shared: list[int]) -> None:
    """A request over the 7 full blocks of ``shared`` loads them all, byte for byte; then shut down."""
    e.poison()
    e.add("r3", shared + [4, 5], max_tokens=2)
    e.run()
    assert first_step_of(e, "r3")[0] == 112
    e.assert_no_leaks()
    e.shutdown()


def test_a_request_aborted_while_its_disk_pages_are_read(tmp_path, monkeypatch):
    """Aborted while its background read runs: nothing leaks, and the next request with the same
    prefix loads it."""
    shared = prefix_on_disk(tmp_path, 4)
    second, release = waiting_for_a_held_read(tmp_path, monkeypatch, shared)
    second.abort("r2")
    release.set()
    second.run()
    second.assert_no_leaks()
    serves_the_prefix(second, shared)


def test_a_shutdown_while_a_background_read_runs_leaves_the_disk_whole(tmp_path, monkeypatch):
    """The engine shuts down while a request waits for its disk pages: the read is stopped or
    landed, and the next engine on the directory serves the prefix."""
    shared = prefix_on_disk(tmp_path, 6)
    second, release = waiting_for_a_held_read(tmp_path, monkeypatch, shared)
    threading.Timer(0.05, release.set).start()  # shutdown cancels the read and waits for it
    second.shutdown()
    monkeypatch.undo()
    serves_the_prefix(engine(tmp_path, disk=True), shared)


def test_requests_sharing_a_disk_prefix_wait_for_the_one_read(tmp_path, monkeypatch):
    """Two requests over one prefix on disk: the second finds its pages taken by the first one's
    read and waits for it too, rather than reading them on the scheduler thread."""
    shared = prefix_on_disk(tmp_path, 5)
    started, release = hold(monkeypatch, host_prefetch.HostPrefetcher, "_read")
    never_read_disk_on_the_scheduler_thread(monkeypatch)
    second = engine(tmp_path, disk=True)
    second.poison()
    second.add("r2", shared + [1, 2, 3], max_tokens=2)
    second.add("r3", shared + [4, 5], max_tokens=2)
    for _ in range(3):
        second.step()
    assert started.wait(10)
    assert all(second.requests[r].status is RequestStatus.WAITING for r in ("r2", "r3"))
    release.set()
    second.run()
    assert first_step_of(second, "r2")[0] == first_step_of(second, "r3")[0] == 112
    second.assert_no_leaks()
    second.shutdown()


def test_pages_read_for_a_waiting_request_stay_in_host_memory_until_it_is_scheduled(tmp_path):
    """Between steps, other caches take every page of host memory they can get. The pages a
    request's read brought there stay for it: one read, and its whole prefix loads. Before, they
    were pushed back to disk before its next ask saw them, step after step; it read again at every
    ask, and after ``disk_read_wait_s`` recomputed the prefix."""
    shared = prefix_on_disk(tmp_path, 13)
    e = host_pages_engine(tmp_path, 8, disk_read_wait_s=0.3)
    manager = e.kv_scheduler.manager
    reads = []
    start_read = manager.prefetch_to_host

    def counted(tokens, scope, hold=False):
        read = start_read(tokens, scope, hold=hold)
        reads.append(read is not None)
        return read

    manager.prefetch_to_host = counted
    e.poison()
    e.add("r2", [*shared, 1], max_tokens=2)
    junk = 0
    while "r2" not in {r for step in e.log for r in step.computed}:
        assert len(e.log) < 100
        e.step()
        time.sleep(0.02)
        for blocks in range(8, 0, -1):  # other pages, as many as host memory can take
            junk += 1
            tokens = prompt(1000 + junk, blocks * BLOCK)
            cache = manager.create_cache(tokens)
            if cache.resume() and cache.resize(len(tokens)):
                cache.commit(tokens)
                cache.close()
                break
            cache.close()
    assert first_step_of(e, "r2")[0] == 112 and sum(reads) == 1
    e.run()
    e.assert_no_leaks()
    e.shutdown()


def test_a_request_whose_reads_bring_nothing_stops_reading_after_its_wait(tmp_path, monkeypatch, caplog):
    """Every read of the request's disk pages fails (its worker raises): each lands nothing. After
    ``disk_read_wait_s`` it reads no more and recomputes its prefix, and a DEBUG line says why;
    without that bound it would start a read at every ask for ever."""
    caplog.set_level(logging.DEBUG, logger="kvtier.vllm.scheduler")
    shared = prefix_on_disk(tmp_path, 13)
    e = host_pages_engine(tmp_path, 8, disk_read_wait_s=0.3)

    def failing(self, job):
        raise OSError("the disk went away")

    monkeypatch.setattr(host_prefetch.HostPrefetcher, "_read", failing)
    e.poison()
    e.add("r2", [*shared, 1], max_tokens=2)
    began = time.monotonic()
    while "r2" not in {r for step in e.log for r in step.computed}:
        assert time.monotonic() - began < 10
        e.step()
        time.sleep(0.02)
    [why] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvtier.vllm: request r2: ")]
    assert why.startswith("kvtier.vllm: request r2: 0 of its 112 cached tokens in host memory")
    assert why.endswith("past disk_read_wait_s: its last read brought none to stay)")
    assert first_step_of(e, "r2")[0] == 0
    e.run()
    assert e.outputs["r2"]
    e.assert_no_leaks()
    e.shutdown()


def test_a_request_aborted_while_its_read_is_held_leaves_the_room_to_others(tmp_path, monkeypatch):
    """A request's read of its 7 disk pages (of host memory's 8) is under way when the user aborts
    it: what the read lands is let go of, and the next request, another 7-block prefix on disk,
    reads and loads all of it. Holding them for a request that is gone would leave it one page."""
    aborted, wanted = prefix_on_disk(tmp_path, 13), prefix_on_disk(tmp_path, 14)
    e = host_pages_engine(tmp_path, 8, disk_read_wait_s=600.0)
    started, release = hold(monkeypatch, host_prefetch.HostPrefetcher, "_read")
    e.poison()
    e.add("r1", [*aborted, 1], max_tokens=2)
    e.step()
    assert started.wait(10)
    e.abort("r1")
    release.set()
    e.add("r2", [*wanted, 1], max_tokens=2)
    e.run(max_steps=200)
    assert "r1" not in e.outputs or not e.outputs["r1"]
    assert first_step_of(e, "r2")[0] == 112
    e.assert_no_leaks()
    e.shutdown()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_short_of_host_memory_gets_the_pages_that_requests_after_it_hold(tmp_path, monkeypatch, policy):
    """Host memory has 8 pages; two requests each need 7 from disk. The first read 3 (another
    cache held the other 5), the second then read 5 of its own: neither has its whole prefix and
    nothing is left to read into. The first in vLLM's order goes first: the other lets go of its
    pages, the first reads the rest and runs, then the other reads again. Both load all 7 blocks,
    long before their 600 s wait ends; before, holding their pages, each waited for the other.

    Under the priority policy the second request is of higher priority, so vLLM's order puts it
    first: it reads its other 2 pages and runs first. Before, turns went by first ask, and it
    waited behind the first request."""
    first_prefix, second_prefix = prefix_on_disk(tmp_path, 13), prefix_on_disk(tmp_path, 14)
    e = host_pages_engine(tmp_path, 8, policy, disk_read_wait_s=600.0)
    manager = e.kv_scheduler.manager
    other = prompt(999, 5 * BLOCK)
    holder = manager.create_cache(other)
    assert holder.resume() and holder.resize(len(other))
    holder.commit(other)
    started, release = hold(monkeypatch, host_prefetch.HostPrefetcher, "_read")
    e.poison()
    e.add("r1", [*first_prefix, 1], max_tokens=2, priority=1 if policy == "priority" else 0)
    e.step()
    assert started.wait(10)  # r1 reads 3 pages, the room there was
    holder.close()
    e.add("r2", [*second_prefix, 1], max_tokens=2)
    e.step()  # r1 still waits for its read; r2 reads 5 pages into the room the holder left
    release.set()
    e.run(max_steps=200)
    assert first_step_of(e, "r1")[0] == 112 and first_step_of(e, "r2")[0] == 112
    assert manager.stats().recomputed_tokens == 0
    runs = [rid for step in e.log for rid in step.computed if rid in ("r1", "r2")]
    assert runs[0] == ("r2" if policy == "priority" else "r1")
    e.assert_no_leaks()
    e.shutdown()


def test_running_requests_lock_only_their_blocks_in_flight_in_host_memory(tmp_path, monkeypatch, caplog):
    """Two requests of 7 full blocks each run together, with host memory for 8 pages. Each block a
    running request saved is released once saved (vLLM holds it): r1's blocks go down to disk to
    make room for r2's, and both prompts are reused whole by a later engine. Before, a running
    request kept its whole context locked in host memory until it finished: r2 found no room for
    its first block and saved nothing."""
    caplog.set_level(logging.DEBUG, logger="kvtier.vllm.scheduler")
    a_disk_that_keeps_up(monkeypatch)
    e = host_pages_engine(tmp_path, 8)
    e.poison()
    first, second = prompt(33, 7 * BLOCK + 1), prompt(34, 7 * BLOCK + 1)
    e.add("r1", first, max_tokens=8)
    run_until_computed(e, "r1", 7 * BLOCK + 1)
    e.add("r2", second, max_tokens=8)
    e.run()
    assert not not_saved(caplog)
    manager = e.kv_scheduler.manager
    assert manager.cached_tokens(first) == manager.cached_tokens(second) == 7 * BLOCK
    assert manager.cached_tokens(first, in_memory=True) == 0
    e.assert_no_leaks()
    e.shutdown()
    again = host_pages_engine(tmp_path, 8)
    again.poison()
    again.add("r3", [*first, 1], max_tokens=2)
    again.add("r4", [*second, 1], max_tokens=2)
    again.run()
    assert first_step_of(again, "r3")[0] == first_step_of(again, "r4")[0] == 7 * BLOCK
    again.assert_no_leaks()
    again.shutdown()


def test_a_request_whose_prefix_vllms_own_cache_holds_locks_none_of_it(tmp_path):
    """r2's prompt is r1's and one more token: vLLM's own cache holds the 7 blocks kvtier matched,
    so nothing is loaded, and once allocated r2's lease holds none of their pages (before, they
    stayed locked in host memory until r2 finished, since r2 saved no block to release them)."""
    e = host_pages_engine(tmp_path, 16)
    shared = prompt(37, 7 * BLOCK + 1)
    e.add("r1", shared, max_tokens=2)
    e.run()
    e.add("r2", [*shared, 5], max_tokens=4)
    run_until_computed(e, "r2", len(shared) + 1)
    lease = e.kv_scheduler._leases["r2"]
    assert lease.matched == 7 * BLOCK and not any("r2" in step.loaded for step in e.log)
    assert (lease.cache.page_indices(0)[:7] == BAD_PAGE_INDEX).all()
    e.run()
    e.assert_no_leaks()
    e.shutdown()


def test_a_preempted_request_reads_its_pages_back_before_requests_that_arrived_after_it(tmp_path, monkeypatch):
    """Under the priority policy, r1 (priority 1) runs with its 7 blocks saved (host memory has 8
    pages); another cache then locks host memory, pushing r1's pages, released once saved, to disk.
    r2 (priority 1, arrived after r1), a 7-block disk hit, is short of room. Then r0 (priority 0)
    arrives, grows and has vLLM preempt r1, and host memory frees. vLLM keeps r1's arrival time, so
    r1 is before r2 in its queue: r1 reads its pages back first and resumes by loading what vLLM's
    own cache lost of them before r2 runs. Before, turns went by first ask: r1's new lease came
    after r2's, so r1 waited while r2 read."""
    waiting = prefix_on_disk(tmp_path, 14)
    a_disk_that_keeps_up(monkeypatch)
    e = host_pages_engine(tmp_path, 8, "priority", device_blocks=11, disk_read_wait_s=600.0)
    manager = e.kv_scheduler.manager
    e.poison()
    e.add("r1", prompt(31, 7 * BLOCK + 1), max_tokens=12, priority=1)
    run_until_computed(e, "r1", 7 * BLOCK + 1)  # 8 of the 10 device blocks; its 7 full ones saved
    holder = lock_host_memory(manager, 8)
    assert manager.cached_tokens(e.tokens("r1")) == 7 * BLOCK
    assert manager.cached_tokens(e.tokens("r1"), in_memory=True) == 0
    e.add("r2", [*waiting, 1], max_tokens=2, priority=1)
    for _ in range(3):
        e.step()
    assert e.requests["r2"].status is RequestStatus.WAITING  # short of room: the holder locks host memory
    e.add("r0", prompt(32, 2 * BLOCK - 1), max_tokens=20, images=[("image", 0, BLOCK)])  # keyed by nothing
    while not e.requests["r1"].num_preemptions:
        e.step()
    assert len(e.tokens("r1")) < 8 * BLOCK  # its eighth block never filled: 7 blocks saved
    holder.close()
    before = len(e.log)
    e.run(max_steps=2000)
    runs = [rid for step in e.log[before:] for rid in step.computed if rid in ("r1", "r2")]
    assert runs[0] == "r1"
    resumed = next(step.computed["r1"] for step in e.log[before:] if "r1" in step.computed)
    assert resumed[0] == 7 * BLOCK and first_step_of(e, "r2")[0] == 7 * BLOCK
    assert manager.stats().recomputed_tokens == 0
    e.assert_no_leaks()
    e.shutdown()


def a_prefix_on_disk_and_in_vllms_cache(
    tmp_path: Path, monkeypatch, disk_read_wait_s: float
) -> tuple[Engine, list[int]]:
    """An engine with 10 usable vLLM blocks and 8 pages of host memory that has served a 113-token
    prompt (returned): its 7 full blocks are in vLLM's own cache and, pushed out of host memory,
    on kvtier's disk."""
    a_disk_that_keeps_up(monkeypatch)
    e = host_pages_engine(tmp_path, 8, device_blocks=11, disk_read_wait_s=disk_read_wait_s)
    e.poison()
    shared = prompt(41, 7 * BLOCK + 1)
    e.add("r1", shared, max_tokens=1)
    e.run()  # its 8 device blocks freed, the 7 full ones kept in vLLM's cache
    assert push_out_of_host_memory(e.kv_scheduler.manager, 8) == 7
    return e, shared


def test_a_request_whose_hit_in_vllms_own_cache_shrinks_while_it_waits_loads_the_rest(tmp_path, monkeypatch):
    """When r2 is first asked, vLLM's own cache holds all 7 blocks of its prompt that kvtier holds
    (on disk), so kvtier offers none; no device block is free for it (r0 holds them). While it
    waits, r0 grows and vLLM evicts those cached blocks one by one. kvtier then offers them: r2
    reads its pages and starts at token 112. Before, the first ask gave up kvtier's blocks on disk
    for good, and r2 recomputed what vLLM had evicted."""
    e, shared = a_prefix_on_disk_and_in_vllms_cache(tmp_path, monkeypatch, disk_read_wait_s=600.0)
    manager = e.kv_scheduler.manager
    e.add("r0", prompt(42, 3 * BLOCK - 1), max_tokens=40, images=[("image", 0, BLOCK)])  # keyed by nothing
    run_until_computed(e, "r0", 3 * BLOCK - 1)  # 3 device blocks: the 7 cached ones are all that is free
    e.add("r2", [*shared, 1], max_tokens=2)
    e.step()
    assert e.requests["r2"].num_computed_tokens == 0 and not e.log[-1].loaded
    e.run(max_steps=2000)
    assert first_step_of(e, "r2")[0] == 7 * BLOCK
    assert any("r2" in step.loaded for step in e.log)
    assert manager.stats().recomputed_tokens == 0
    e.assert_no_leaks()
    e.shutdown()


def test_the_wait_for_a_read_starts_when_vllms_own_cache_stops_holding_the_prefix(tmp_path, monkeypatch):
    """As above, but r2 waits for a slot longer than ``disk_read_wait_s`` (2 s) while vLLM's own
    cache holds its prefix, and when vLLM evicts a block of it host memory has no room for a read
    (another cache holds all 8 pages). r2 waits for room, which comes a step later: it loads every
    block. Before, its wait was counted from its first ask, so it was over at once, and r2
    recomputed all that vLLM no longer held."""
    e, shared = a_prefix_on_disk_and_in_vllms_cache(tmp_path, monkeypatch, disk_read_wait_s=2.0)
    manager = e.kv_scheduler.manager
    other = prompt(44, 8 * BLOCK)
    holder = manager.create_cache(other)  # all of host memory, locked
    assert holder.resume() and holder.resize(len(other))
    holder.commit(other)
    e.add("r0", prompt(45, 2 * BLOCK + 1), max_tokens=40, images=[("image", 0, BLOCK)])
    run_until_computed(e, "r0", 2 * BLOCK + 1)
    e.add("r2", [*shared, 1], max_tokens=2)
    began = time.monotonic()
    while e.requests["r0"].num_computed_tokens < 3 * BLOCK:  # 15 steps, r2 asked at each
        e.step()
        time.sleep(0.15)
    assert time.monotonic() - began > 2.0 and e.requests["r2"].num_computed_tokens == 0
    run_until_computed(e, "r0", 3 * BLOCK + 1)  # r0's fourth block: vLLM evicted r2's seventh
    holder.close()
    e.run(max_steps=2000)
    assert first_step_of(e, "r2")[0] == 7 * BLOCK
    assert manager.stats().recomputed_tokens == 0
    e.assert_no_leaks()
    e.shutdown()


def test_a_read_that_brought_what_room_there_was_is_followed_by_the_next_past_the_wait(tmp_path, monkeypatch):
    """Host memory has room for 3 of a 7-block prefix (another request's cache holds 5 of 8 pages),
    and the request's read takes longer than ``disk_read_wait_s``; the other lets go meanwhile.
    The read brought more of the prefix than there was, so the next reads the rest: all 7 blocks
    load. (Bounding reads that bring nothing to stay must not cost this.)"""
    shared = prefix_on_disk(tmp_path, 13)
    e = host_pages_engine(tmp_path, 8, disk_read_wait_s=0.3)
    manager = e.kv_scheduler.manager
    other = prompt(999, 5 * BLOCK)
    holder = manager.create_cache(other)
    assert holder.resume() and holder.resize(len(other))
    holder.commit(other)
    started, release = hold(monkeypatch, host_prefetch.HostPrefetcher, "_read")
    e.poison()
    e.add("r2", [*shared, 1], max_tokens=2)
    e.step()
    assert started.wait(10)
    time.sleep(0.4)  # past the wait, the read still running
    holder.close()
    release.set()
    e.run()
    assert first_step_of(e, "r2")[0] == 7 * BLOCK
    assert manager.stats().recomputed_tokens == 0
    e.assert_no_leaks()
    e.shutdown()


def test_a_request_waits_for_another_requests_read_only_so_long(tmp_path, monkeypatch):
    """The read that has a request's pages is another request's and takes longer than
    ``disk_read_wait_s``: the request stops waiting, recomputes its prefix and finishes while
    that read still runs; the other request then loads its blocks from disk."""
    shared = prefix_on_disk(tmp_path, 7)
    started, release = hold(monkeypatch, host_prefetch.HostPrefetcher, "_read")
    never_read_disk_on_the_scheduler_thread(monkeypatch)
    e = engine(tmp_path, disk=True, disk_read_wait_s=0.2)
    e.poison()
    e.add("r2", shared + [1, 2, 3], max_tokens=2)
    e.step()
    assert started.wait(10)
    e.add("r3", shared + [4, 5], max_tokens=2)
    while "r3" not in e.outputs or len(e.outputs["r3"]) < 2:
        e.step()
        time.sleep(0.01)
    assert first_step_of(e, "r3")[0] == 0 and not release.is_set()  # recomputed while r2's read was held
    release.set()
    e.run()
    assert first_step_of(e, "r2")[0] == 112
    e.assert_no_leaks()
    e.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_sliding_window_request_whose_vllm_hit_is_longer_than_kvtiers_still_saves(tmp_path, async_scheduling):
    """vLLM's own cache holds a longer prefix than kvtier's (kvtier evicted it; or, scheduling
    asynchronously, its saves were not committed yet), so vLLM's table has null sliding-window
    blocks where kvtier's cache still wanted pages. Before, the save stopped at the first of them
    and the request saved nothing for the rest of its life; now those blocks are stale in kvtier
    too, saved with the full-attention group's pages, and a later request loads past them."""
    config = vllm_config(tmp_path, {"host_bytes": 24 * HOST_PAGE}, async_scheduling=async_scheduling)
    groups = [(layer_names(2), attention_spec()), (layer_names(1, first=2), attention_spec(window=32))]
    e = Engine(config, kv_cache_config(config, groups, 160))
    shared = prompt(1, 130)
    e.add("r1", shared, max_tokens=1)
    e.run()
    e.add("x", prompt(2, 400), max_tokens=1)  # pushes r1's pages out of kvtier, not out of vLLM's cache
    e.run()
    longer = shared + prompt(3, 100)
    e.add("r2", longer, max_tokens=1)
    e.run()
    assert first_step_of(e, "r2")[0] == 128  # vLLM's own hit
    e.reset_prefix_cache()
    e.poison()
    e.add("r3", longer + [5], max_tokens=1)
    e.run()
    assert first_step_of(e, "r3")[0] == 224  # r2's blocks, saved by kvtier
    e.assert_no_leaks()
    e.shutdown()


@pytest.mark.parametrize("wait_s", [600.0, 0.0], ids=["waits-for-room", "no-wait"])
def test_many_disk_prefixes_through_little_host_memory(tmp_path, monkeypatch, caplog, wait_s):
    """Twelve requests whose prefixes are on disk, with host memory for five of them at once:
    background reads and their reserved pages compete with the leases, and every request still
    finishes with its own KV, nothing leaking, and no page is read on the scheduler thread. A
    request that finds no room waits for it (``disk_read_wait_s``) while the others run, then
    loads its whole prefix; without that wait, what host memory cannot take is recomputed (a
    DEBUG line says why, for each request that gave up some). The wait is longer than the run
    may take (20,000 steps, mostly pauses of 2 ms): a request that never finds room fails the run,
    and a machine that stalls the process for seconds does not end the wait. Runs take about 20
    steps. Before the pages read for a request were held for it, other requests' reads pushed them
    back to disk before its ask saw them: on a busy machine runs took thousands of steps, with
    thousands of reads (docs/benchmarks.md section 67)."""
    caplog.set_level(logging.DEBUG, logger="kvtier.vllm.scheduler")
    prefixes = prefixes_on_disk(tmp_path, range(30, 42))
    never_read_disk_on_the_scheduler_thread(monkeypatch)
    second = host_pages_engine(tmp_path, 40, disk_read_wait_s=wait_s)
    second.poison()
    for i, shared in enumerate(prefixes):
        second.add(f"b{i}", shared + [1, 2], max_tokens=3)
    second.run(max_steps=20_000)
    assert all(len(second.outputs[f"b{i}"]) == 3 for i in range(12))
    loaded = [first_step_of(second, f"b{i}")[0] for i in range(12)]
    stats = second.kv_scheduler.manager.stats()
    gave_up = [r.getMessage() for r in caplog.records if "is recomputed (" in r.getMessage()]
    why = (loaded, stats.recomputed_tokens, stats.checksum_failures, gave_up)
    if wait_s:
        assert loaded == [112] * 12 and stats.recomputed_tokens == 0 and not gave_up, why
    else:  # how many find room at their ask depends on the reads' timing (and recomputed requests' saves take room)
        assert 112 in loaded and stats.recomputed_tokens > 0, why
        short = {f"b{i}" for i, n in enumerate(loaded) if n < 112}
        assert {line.split()[2].rstrip(":") for line in gave_up} == short, why
    second.assert_no_leaks()
    second.shutdown()


def prefixes_on_disk(tmp_path: Path, seeds: range) -> list[list[int]]:
    """A 120-token prompt per seed, computed by an engine that left them all in its disk tier (its
    shutdown writes every prefix to disk)."""
    prefixes = [prompt(seed, 120) for seed in seeds]
    first = host_pages_engine(tmp_path, 200)
    for i, prefix in enumerate(prefixes):
        first.add(f"a{i}", prefix, max_tokens=2)
    first.run()
    first.shutdown()
    return prefixes


def beside_a_long_decode(tmp_path: Path, vllm_blocks: int, **extra) -> tuple[Engine, list[int]]:
    """An engine over ``tmp_path``'s disk tier with host memory for 40 pages, a running batch of two,
    ``vllm_blocks`` vLLM blocks and a 600 s ``disk_read_wait_s`` (``extra``: more of
    ``kv_connector_extra_config``), that has run one step of a 100-token prompt ("long",
    returned) which decodes 200 tokens."""
    base = {"host_bytes": 40 * HOST_PAGE, "disk_bytes": 8 * MiB, "disk_path": str(tmp_path / "disk")}
    config = vllm_config(tmp_path, {**base, "disk_read_wait_s": 600.0, **extra}, max_seqs=2)
    e = Engine(config, kv_cache_config(config, [(layer_names(3), attention_spec())], vllm_blocks))
    e.poison()
    long = prompt(500, 100)
    e.add("long", long, max_tokens=200)
    e.step()
    return e, long


def not_saved(caplog) -> list[str]:
    """The DEBUG lines of requests whose saves found no room in host memory."""
    return [r.getMessage() for r in caplog.records if r.getMessage().endswith("; they are not saved")]


@pytest.mark.parametrize("reads", ["as they come", "landing at once"])
def test_reads_for_queued_requests_leave_host_memory_for_the_running_requests_saves(
    tmp_path, monkeypatch, caplog, reads
):
    """A request decodes 200 tokens, saving a block every 16, while six requests whose prefixes
    are on disk queue behind a running batch of two: vLLM asks them all while a slot is free, and
    their reads would fill host memory (40 pages; six prefixes of 7 blocks) with pages held for
    requests that wait for a slot. The pages held for queued requests stay within half of host
    memory (the first of them may always read), so the running request saves every block; before,
    it found no room after its first few and saved nothing more. Every queued request still loads
    its whole prefix.

    With reads that land at once, vLLM starts the loads of several queued requests in one step (a
    loading request takes no slot of the batch), and they wait for a slot. Their prefixes count in
    the share while their loads run, and are released once loaded (vLLM holds them): before, they
    stayed locked in host memory until the requests finished, uncounted at first, and five such
    requests locked 35 pages; the running request's save past 64 tokens found no room."""
    caplog.set_level(logging.DEBUG, logger="kvtier.vllm.scheduler")
    prefixes = prefixes_on_disk(tmp_path, range(60, 66))
    if reads == "landing at once":
        reads_that_keep_up(monkeypatch)
    e, long = beside_a_long_decode(tmp_path, vllm_blocks=128)
    for i, prefix in enumerate(prefixes):
        e.add(f"q{i}", prefix + [1, 2], max_tokens=3)
    e.run(max_steps=5_000)
    assert [first_step_of(e, f"q{i}")[0] for i in range(6)] == [112] * 6
    assert not not_saved(caplog)
    assert e.kv_scheduler.manager.cached_tokens(long + e.outputs["long"]) == 288  # 300 tokens: every full block
    e.assert_no_leaks()
    e.shutdown()


@pytest.mark.parametrize("share", [0.25, 1.0])
def test_queued_reads_share_sets_how_much_host_memory_reads_for_queued_requests_hold(tmp_path, share):
    """Six requests whose 7-block prefixes are on disk queue behind a running batch of two, as in
    the test above. A read starts while the reads held for queued requests take less than the
    share of host memory (40 pages), so they hold less than the share plus one prefix (7 pages):
    with ``queued_reads_share`` 0.25 below 17 pages (14 in a run), where the default half let them
    reach 21; with 1.0 past the default's bound of 27 (36 in a run). Either way every queued
    request loads its whole prefix."""
    prefixes = prefixes_on_disk(tmp_path, range(60, 66))
    e, _ = beside_a_long_decode(tmp_path, vllm_blocks=128, queued_reads_share=share)
    for i, prefix in enumerate(prefixes):
        e.add(f"q{i}", prefix + [1, 2], max_tokens=3)
    most = 0
    while e.scheduler.has_requests():
        assert len(e.log) < 5_000
        e.step()
        most = max(most, e.kv_scheduler.queued_read_pages())
    assert [first_step_of(e, f"q{i}")[0] for i in range(6)] == [112] * 6
    if share < 0.5:
        assert most < 0.25 * 40 + 7
    else:
        assert most > 0.5 * 40 + 7
    e.assert_no_leaks()
    e.shutdown()


def test_a_running_requests_save_takes_the_pages_held_for_queued_requests(tmp_path, monkeypatch, caplog):
    """Two requests decode 200 tokens each, saving a block every 16, while two requests whose
    7-block prefixes are on disk cannot be scheduled: their prompts need more of vLLM's 42 blocks
    than the running ones leave. Another cache locks 33 of host memory's 40 pages meanwhile: a
    queued request's 7 pages, read and held for it, leave none for the running requests' blocks
    in flight. When a running request's save finds no room, the queued requests' reads are let go
    of, the last in vLLM's queue first: the running requests save every block, and the queued
    ones read their prefixes again once there is room, and load them whole."""
    caplog.set_level(logging.DEBUG, logger="kvtier.vllm.scheduler")
    prefixes = prefixes_on_disk(tmp_path, range(60, 63))
    reads_that_keep_up(monkeypatch)
    e, _ = beside_a_long_decode(tmp_path, vllm_blocks=42)
    run_until_computed(e, "long", 101)
    holder = lock_host_memory(e.kv_scheduler.manager, 33)
    e.add("q0", prefixes[0] + [1, 2], max_tokens=200)
    for i in (1, 2):
        e.add(f"q{i}", prefixes[i] + prompt(70 + i, 400), max_tokens=3)
    while not (e.requests["long"].is_finished() and e.requests["q0"].is_finished()):
        assert len(e.log) < 5_000
        e.step()
    holder.close()
    e.run(max_steps=5_000)
    assert [first_step_of(e, f"q{i}")[0] for i in range(3)] == [112] * 3
    assert not not_saved(caplog)
    e.assert_no_leaks()
    e.shutdown()


def test_host_memory_is_written_behind_so_pushing_blocks_out_writes_nothing_on_the_scheduler_thread(
    tmp_path, monkeypatch
):
    """Host memory full of published blocks: copies of its coldest pages are written to disk in the
    background (here by a disk that keeps up), so a request whose saves push them out of host
    memory writes nothing to disk on vLLM's scheduler thread; its blocks come back from disk."""
    a_disk_that_keeps_up(monkeypatch)
    e = host_pages_engine(tmp_path, 40)
    e.poison()
    for i in range(5):
        e.add(f"a{i}", prompt(60 + i, 120), max_tokens=2)
    e.run()
    for _ in range(3):
        e.step()  # idle steps: the background writes land
    writes = mover.Mover.write_pages
    refuse_disk_writes_on_the_scheduler_thread(monkeypatch)
    demotions = e.kv_scheduler.manager.stats().demotions
    e.add("b", prompt(99, 300), max_tokens=2)
    e.run()
    assert e.kv_scheduler.manager.stats().demotions >= demotions + 10  # 18 blocks saved: pages went to disk
    monkeypatch.setattr(mover.Mover, "write_pages", writes)
    e.add("a0-again", prompt(60, 120) + [7], max_tokens=2)
    e.run()
    assert first_step_of(e, "a0-again")[0] == 112  # back from disk
    e.assert_no_leaks()
    e.shutdown()


def test_a_disk_that_cannot_keep_up_costs_cache_not_scheduler_time(tmp_path, monkeypatch):
    """The write-behind never gets its batch written (a stalled disk): saves that push blocks out
    of full host memory drop the ones without a disk copy instead of writing them on vLLM's
    scheduler thread, and every request still gets its own KV."""
    started, release = hold(monkeypatch, disk_write_behind.DiskWriteBehind, "_write")
    refuse_disk_writes_on_the_scheduler_thread(monkeypatch)
    e = host_pages_engine(tmp_path, 40)
    e.poison()
    for i in range(8):
        e.add(f"a{i}", prompt(60 + i, 120), max_tokens=2)
    e.run()
    assert started.is_set() and e.kv_scheduler.manager.stats().drops > 0
    e.add("again", prompt(67, 120) + [7], max_tokens=2)  # the most recent prefix is still in host memory
    e.run()
    assert first_step_of(e, "again")[0] == 112
    release.set()
    monkeypatch.undo()  # the shutdown writes what host memory holds
    e.assert_no_leaks()
    e.shutdown()


def damage_disk_pages(disk: Path, from_block: int) -> int:
    """Overwrite the disk pages of blocks ``from_block`` and later; the number of pages damaged."""
    (directory,) = disk.glob("kvtier-*")
    with sqlite3.connect(directory / "index.sqlite") as db:
        rows = db.execute(
            "SELECT p.grp, p.slot FROM pages p JOIN nodes n ON p.block_key = n.block_key WHERE n.depth >= ?",
            (from_block,),
        ).fetchall()
    for group, slot in rows:
        with open(directory / f"group{group}.pages", "r+b") as f:
            f.seek(slot * HOST_PAGE + 100)
            f.write(b"\xff" * 64)
    return len(rows)


def test_a_page_that_fails_its_checksum_is_recomputed_not_served(tmp_path):
    first = engine(tmp_path, disk=True)
    shared = prompt(3, 120)
    first.add("r1", shared, max_tokens=2)
    first.run()
    first.shutdown()
    assert damage_disk_pages(tmp_path / "disk", from_block=3) == 4  # blocks 3..6 of 7

    second = engine(tmp_path, disk=True, disk_read_wait_s=30.0)
    second.poison()
    second.add("r2", shared + [4, 5], max_tokens=2)
    began = time.monotonic()
    second.run()
    assert time.monotonic() - began < 10  # no wait for host memory: the pages were damaged, not homeless
    assert not any(step.invalid for step in second.log)  # found by the background read: never offered
    assert first_step_of(second, "r2")[0] == 3 * BLOCK  # recomputed from the first damaged block
    assert second.kv_scheduler.manager.stats().checksum_failures >= 1
    second.assert_no_leaks()
    second.shutdown()


def test_an_abort_while_loading_frees_everything_once_the_load_is_done(tmp_path):
    e = engine(tmp_path)
    shared = prompt(4, 96)
    e.add("r1", shared, max_tokens=2)
    e.run()
    e.reset_prefix_cache()
    e.poison()
    e.add("r2", shared + [1], max_tokens=2)
    out = e.schedule()  # the load is issued: r2 waits for its blocks
    assert e.requests["r2"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    e.abort("r2")  # while the worker has not run the load yet
    e.update(out, e.execute(out))
    e.run()
    e.assert_no_leaks()
    e.add("r3", shared + [2], max_tokens=2)  # the prefix is still whole and served
    e.run()
    assert first_step_of(e, "r3")[0] == 96
    e.assert_no_leaks()
    e.shutdown()


def test_an_abort_while_saving_keeps_the_blocks_until_the_save_is_done(tmp_path):
    e = engine(tmp_path)
    shared = prompt(5, 64)
    e.add("r1", shared, max_tokens=40)
    run_until_computed(e, "r1", 95)
    out = e.schedule()  # this step fills block 5: its save is planned
    assert [job.req_id for job in out.kv_connector_metadata.jobs if job.direction is Direction.SAVE] == ["r1"]
    e.abort("r1")
    assert "r1" in e.scheduler.requests, "vLLM must keep an aborted request's blocks while its save runs"
    e.update(out, e.execute(out))
    e.run()
    e.assert_no_leaks()
    e.reset_prefix_cache()
    e.poison()
    e.add("r2", e.tokens("r1")[:96] + [3], max_tokens=2)
    e.run()
    assert first_step_of(e, "r2")[0] == 96
    e.assert_no_leaks()
    e.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_requests_resume_from_kvtier_and_nothing_wrong_is_served(tmp_path, async_scheduling):
    e = engine(tmp_path, blocks=14, async_scheduling=async_scheduling)  # 13 usable blocks for 2 x 11
    for i in range(2):
        e.add(f"r{i}", prompt(10 + i, 64), max_tokens=100)
    e.run(max_steps=2000)
    preempted = [r for r in e.requests.values() if r.num_preemptions]
    assert preempted, "the workload was meant to preempt"
    resumed_by_load = {rid for step in e.log for rid in step.loaded}
    assert {r.request_id for r in preempted} & resumed_by_load
    assert all(len(out) == 100 for out in e.outputs.values())
    e.assert_no_leaks()
    e.shutdown()


def test_a_request_preempted_between_steps_resumes_from_kvtier_and_goes_on_saving(tmp_path):
    """``reset_prefix_cache(reset_running_requests=True)`` preempts running requests between steps and
    the next step asks for them again before it reports them preempted. Before: the ask found the
    old lease and offered nothing, then the report released it: the request recomputed from 0 and
    saved nothing more for the rest of its life."""
    e = engine(tmp_path)
    e.add("r1", prompt(23, 100), max_tokens=60)
    run_until_computed(e, "r1", 120)
    saved = e.kv_scheduler.manager.stats().tiers["primary"].pages_used
    assert saved == 7
    assert e.scheduler.reset_prefix_cache(reset_running_requests=True)
    e.poison()
    before = len(e.log)
    e.run()
    assert next(step.computed["r1"] for step in e.log[before:] if "r1" in step.computed)[0] == 7 * BLOCK
    assert any("r1" in step.loaded for step in e.log[before:])  # each loaded position checked
    e.assert_no_leaks()
    tokens = e.tokens("r1")  # 160 tokens, the KV of 159 computed: 9 full blocks, saved as it went on
    assert len(tokens) == 160 and e.kv_scheduler.manager.stats().tiers["primary"].pages_used == 9
    e.reset_prefix_cache()
    e.poison()
    e.add("r2", [*tokens, 1], max_tokens=1)
    e.run()
    assert first_step_of(e, "r2")[0] == 9 * BLOCK
    e.assert_no_leaks()
    e.shutdown()


@pytest.mark.parametrize(
    ("disk", "async_scheduling"), [(False, False), (True, False), (False, True)], ids=["host", "disk", "async"]
)
def test_speculative_decoding_never_saves_the_kv_of_a_rejected_draft(tmp_path, disk, async_scheduling):
    """A step writes the KV of its draft tokens before they are verified; a rejected draft's KV stays
    in its block until that position is computed again, so saving it would serve another token's KV.
    Under asynchronous scheduling the scheduler counts a step's drafts as computed until it hears of
    their rejection, after scheduling the next step."""
    e = engine(tmp_path, disk=disk, spec_tokens=3, async_scheduling=async_scheduling)
    e.add("r1", prompt(21, 40), max_tokens=60)
    e.run()
    assert 0 < e.accepted < e.drafted, "drafts were meant to be both accepted and rejected"
    tokens = e.tokens("r1")  # 100 tokens: 6 full blocks, 4 of them completed while decoding
    assert len(tokens) == 100
    e.reset_prefix_cache()
    e.poison()
    e.add("r2", tokens + [5, 6], max_tokens=2)
    e.run()
    assert first_step_of(e, "r2")[0] == 96  # every full block came from kvtier, each position checked
    e.assert_no_leaks()
    e.shutdown()


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
def test_inside_vllms_multi_connector_prefixes_are_saved_and_loaded_and_nothing_leaks(tmp_path, disk, caplog):
    """kvtier as an entry of vLLM's ``MultiConnector`` (the way it sits beside a prefill/decode
    connector): saves, loads (from disk on a background thread), preemptions and aborts pass
    through vLLM's delegation as they do without it."""
    e = engine(tmp_path, disk=disk, blocks=24, multi_connector=True)
    assert type(e.connector).__name__ == "MultiConnector"
    shared = prompt(31, 100)
    e.add("r1", shared, max_tokens=4)
    e.run()
    if disk:  # a restart: the loads read the disk
        e.shutdown()
        e = engine(tmp_path, disk=True, blocks=24, multi_connector=True)
    else:
        e.reset_prefix_cache()
    e.poison()
    for i in range(3):  # 3 x 7 blocks on 23 usable: preempted while they decode
        e.add(f"r{i + 2}", shared[:90] + [7, 8, i], max_tokens=40)
    e.add("gone", shared[:50] + [5], max_tokens=40)
    e.step()
    e.abort("gone")
    e.run(max_steps=3000)
    assert first_step_of(e, "r2")[0] == 80  # 5 full shared blocks from kvtier, each position checked
    assert e.kv_scheduler.manager.stats().hit_tokens["disk" if disk else "primary"] >= 80
    assert any(r.num_preemptions for r in e.requests.values()), "the workload was meant to preempt"
    assert "r2" in {rid for step in e.log for rid in step.loaded}
    assert all(len(e.outputs[f"r{i + 2}"]) == 40 for i in range(3))
    assert not [r for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
    e.assert_no_leaks()
    e.shutdown()


def test_with_vllms_prefix_caching_off_kvtier_still_serves_prefixes(tmp_path):
    """``enable_prefix_caching=False`` (vLLM computes no block hashes and keeps no cached blocks):
    kvtier's own keys still find a prefix an earlier request left, without any reset."""
    config = vllm_config(tmp_path, {"host_bytes": 4 * MiB})
    config.cache_config.enable_prefix_caching = False
    e = Engine(config, kv_cache_config(config, [(layer_names(3), attention_spec())], 64))
    shared = prompt(32, 100)
    e.add("r1", shared, max_tokens=4)
    e.run()
    e.poison()
    e.add("r2", shared[:90] + [7, 8, 9], max_tokens=3)
    e.run()
    assert first_step_of(e, "r2")[0] == 80  # 5 full shared blocks from kvtier, each position checked
    e.assert_no_leaks()
    e.shutdown()


def test_a_request_that_waits_for_a_slot_matches_what_others_saved_meanwhile(tmp_path, monkeypatch):
    """r1 and r2 share a 7-block prompt and arrive together, with vLLM's prefix caching off and
    device blocks for one of them at a time. r2 is first asked while r1 computes the prompt (4 of
    its blocks saved), and waits for a slot; by the time it gets one, kvtier holds all 7 blocks and
    r2 loads them. Before, its match stayed as at its first ask and r2 recomputed the last 3.
    The tree is looked at again only after saves landed, not at every ask; the manager counts the
    request's lookup and hits once."""
    config = vllm_config(tmp_path, {"host_bytes": 4 * MiB})
    config.cache_config.enable_prefix_caching = False
    e = Engine(config, kv_cache_config(config, [(layer_names(3), attention_spec())], 12))
    e.poison()
    manager = e.kv_scheduler.manager
    looks = []
    match_again = KVCache.match_again
    monkeypatch.setattr(KVCache, "match_again", lambda *a: looks.append(1) or match_again(*a))
    shared = prompt(51, 7 * BLOCK + 1)
    e.add("r1", shared, max_tokens=2)
    e.add("r2", [*shared, 1], max_tokens=2)
    while "r2" not in e.kv_scheduler._leases:
        e.step()
    assert e.kv_scheduler._leases["r2"].matched == 4 * BLOCK
    assert e.requests["r2"].status is RequestStatus.WAITING
    e.run()
    assert first_step_of(e, "r2")[0] == 7 * BLOCK
    stats = manager.stats()
    assert stats.hit_tokens["primary"] == 7 * BLOCK and stats.lookup_tokens == 2 * len(shared) + 1
    assert 1 <= len(looks) <= e.kv_scheduler._saves_landed
    e.assert_no_leaks()
    e.shutdown()


def test_two_cache_salts_never_share(tmp_path):
    e = engine(tmp_path)
    shared = prompt(6, 80)
    e.add("a1", shared, max_tokens=2, salt="tenant-a")
    e.run()
    e.reset_prefix_cache()
    e.poison()
    e.add("b1", shared + [1], max_tokens=2, salt="tenant-b")
    e.run()
    assert first_step_of(e, "b1")[0] == 0
    e.reset_prefix_cache()
    e.add("a2", shared + [1], max_tokens=2, salt="tenant-a")
    e.run()
    assert first_step_of(e, "a2")[0] == 80
    e.assert_no_leaks()
    e.shutdown()


def test_another_model_never_reads_these_pages(tmp_path):
    first = engine(tmp_path, disk=True, name="model-a")
    shared = prompt(7, 64)
    first.add("r1", shared, max_tokens=2)
    first.run()
    first.shutdown()
    second = engine(tmp_path, disk=True, name="model-b")  # same shapes, other weights
    second.add("r2", shared + [1], max_tokens=2)
    second.run()
    assert first_step_of(second, "r2")[0] == 0
    second.shutdown()


@pytest.mark.parametrize(
    "overrides",
    [{"rope_theta": 1234.0}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}],
    ids=["rope_theta", "rope_scaling"],
)
def test_the_same_weights_with_other_rotary_settings_never_read_these_pages(tmp_path, overrides):
    """Keys depend on the rotary embedding's settings too: a restart on the same directory with
    ``hf_overrides`` that change them (a longer context by rope scaling) starts from nothing."""
    first = engine(tmp_path, disk=True)
    shared = prompt(7, 64)
    first.add("r1", shared, max_tokens=2)
    first.run()
    first.shutdown()
    again = engine(tmp_path, disk=True)  # the same settings: served from disk
    again.add("r2", shared + [1], max_tokens=2)
    again.run()
    assert first_step_of(again, "r2")[0] == 64
    again.shutdown()
    other = engine(tmp_path, disk=True, hf_overrides=overrides)
    other.add("r3", shared + [1], max_tokens=2)
    other.run()
    assert first_step_of(other, "r3")[0] == 0
    other.shutdown()


def test_after_an_upgrade_of_vllm_the_disk_serves_nothing_saved_before(tmp_path, monkeypatch):
    """vLLM's model code computes the keys and values, and a release may compute them otherwise:
    a restart under another version reads nothing its predecessor wrote."""
    first = engine(tmp_path, disk=True)
    shared = prompt(8, 64)
    first.add("r1", shared, max_tokens=2)
    first.run()
    first.shutdown()
    monkeypatch.setattr(settings, "vllm_version", lambda: "0.0.0-another")
    upgraded = engine(tmp_path, disk=True)
    upgraded.add("r2", shared + [1], max_tokens=2)
    upgraded.run()
    assert first_step_of(upgraded, "r2")[0] == 0
    upgraded.assert_no_leaks()
    upgraded.shutdown()


@pytest.mark.parametrize("change", ["kv_cache_layout", "cache_dtype"])
def test_a_named_model_shares_its_pages_only_with_engines_that_write_them_alike(tmp_path, change):
    """``model_id`` names the weights (a copy of the model in another directory shares its pages),
    not how an engine writes its pages: one with another KV layout or fp8 format reads nothing."""
    settings_of = {"kv_cache_layout": ("LBNHC", "LBHNC"), "cache_dtype": ("fp8_e4m3", "fp8_e5m2")}[change]
    extra = {"host_bytes": 4 * MiB, "disk_bytes": 8 * MiB, "disk_path": str(tmp_path / "disk"), "model_id": "m@1"}
    shared = prompt(8, 64)
    loaded = []
    for name, value in (("model", settings_of[0]), ("copy", settings_of[0]), ("copy", settings_of[1])):
        config = vllm_config(tmp_path, extra, name=name)
        setattr(config.cache_config, change, value)
        e = Engine(config, kv_cache_config(config, [(layer_names(3), attention_spec())], 64))
        e.add("r", shared + [len(loaded)], max_tokens=2)
        e.run()
        loaded.append(first_step_of(e, "r")[0])
        e.assert_no_leaks()
        e.shutdown()
    assert loaded == [0, 64, 0]


def test_a_connector_reset_after_a_weight_update_never_serves_a_block_saved_before(tmp_path):
    """RL loops update vLLM's weights in place, then ``reset_prefix_cache(reset_connector=True)``: no
    block saved before the reset is served after it, from host memory or disk, nor through an offer
    made before it; blocks saved after the reset are served as usual."""
    e = engine(tmp_path, disk=True)
    shared = prompt(7, 64)
    e.add("r1", shared, max_tokens=2)
    e.run()
    e.add("r2", shared + [1], max_tokens=2)
    waiting = e.scheduler.requests["r2"]
    assert e.kv_scheduler.get_num_new_matched_tokens(waiting, 0) == (64, True)  # an offer made before the reset
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    e.run()
    assert first_step_of(e, "r2")[0] == 0
    e.reset_prefix_cache()  # vLLM's own cache only: r2's blocks now come from kvtier
    e.add("r3", shared + [2], max_tokens=2)
    e.run()
    assert first_step_of(e, "r3")[0] == 64
    e.assert_no_leaks()
    e.shutdown()


def test_a_second_reset_drops_the_blocks_of_the_epoch_it_ends_from_host_memory_and_disk(tmp_path):
    """Blocks saved since a reset carry that epoch's random id: once the next reset ends it, nothing
    can match them again, so they leave at once instead of being written to disk when evicted.
    Blocks saved before the first reset stay (the same weights after a restart match them)."""
    e = engine(tmp_path, disk=True)
    e.add("before", prompt(3, 64), max_tokens=2)
    e.run()
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    for i in range(3):
        e.add(f"r{i}", prompt(10 + i, 64), max_tokens=2)
    e.run()
    manager = e.kv_scheduler.manager
    used = lambda: sum(t.pages_used for t in manager.stats().tiers.values())  # noqa: E731
    assert used() >= 4 * 4  # four prompts of four blocks (some on disk too)
    writes = manager.stats().bytes_copied.get("primary->disk:file", 0)
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    assert used() == 4  # the first prompt's blocks, saved before the first reset
    manager.check_invariants()
    for i in range(3):
        e.add(f"s{i}", prompt(20 + i, 64), max_tokens=2)
    e.run()
    assert manager.stats().bytes_copied.get("primary->disk:file", 0) == writes  # room was free: nothing written
    e.assert_no_leaks()
    e.shutdown()


def test_a_lora_adapter_written_again_at_its_path_is_another_scope(tmp_path):
    """An adapter retrained and saved at the same path computes other keys: its requests get
    another scope (across restarts too); the same files give the same scope."""
    from types import SimpleNamespace

    from vllm.lora.request import LoRARequest

    from kvtier.vllm.scheduler import lora_identity, scope_of

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"a" * 64)

    def scope(path: str = str(adapter), int_id: int = 1):
        return scope_of(SimpleNamespace(lora_request=LoRARequest("sql", int_id, path), cache_salt=None))

    first = scope()
    assert scope() == first
    weights.write_bytes(b"b" * 80)  # retrained in place
    assert scope() == first  # the weights vLLM loaded under id 1 are still the old ones
    assert scope(int_id=2) != first  # loaded again under a new id
    lora_identity.cache_clear()  # as a process started later
    assert scope() != first
    assert scope("org/sql-lora").lora_id == "sql:org/sql-lora"  # a hub name: no files to stamp
    assert scope(str(weights)) != scope(str(adapter))


def test_weights_saved_again_at_the_model_path_never_read_these_pages(tmp_path):
    """A model fine-tuned and saved over its directory computes other keys: a restart on the same
    disk directory starts from nothing; the same files again are served from disk."""
    weights = tmp_path / "model" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"a" * 64)
    shared = prompt(7, 64)
    first = engine(tmp_path, disk=True)
    first.add("r1", shared, max_tokens=2)
    first.run()
    first.shutdown()
    again = engine(tmp_path, disk=True)
    again.add("r2", shared + [1], max_tokens=2)
    again.run()
    assert first_step_of(again, "r2")[0] == 64
    again.shutdown()
    weights.write_bytes(b"b" * 64)  # trained again: the same size, a later modification time
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    other = engine(tmp_path, disk=True)
    other.add("r3", shared + [1], max_tokens=2)
    other.run()
    assert first_step_of(other, "r3")[0] == 0
    other.shutdown()


def test_a_hub_model_is_named_by_the_commit_of_its_cached_snapshot(tmp_path, monkeypatch):
    """A hub model's weights are those of the snapshot the local Hugging Face cache holds for its
    revision: a new commit is another model, the same commit the same on every machine."""
    from huggingface_hub import constants

    from kvtier.vllm.file_stamp import model_weights_stamp

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--tiny"
    assert model_weights_stamp("org/tiny", None) is None  # not downloaded: nothing to name
    for commit in ("c0ffee", "decade"):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    assert model_weights_stamp("org/tiny", None) == "commit:c0ffee"
    (repo / "refs" / "main").write_text("decade")  # the hub moved on, and this machine downloaded it
    assert model_weights_stamp("org/tiny", None) == "commit:decade"
    assert model_weights_stamp("org/tiny", "c0ffee") == "commit:c0ffee"


def test_a_sliding_window_model_keeps_its_hybrid_groups(tmp_path):
    config = vllm_config(tmp_path, {"host_bytes": 4 * MiB})
    groups = [(layer_names(2), attention_spec()), (layer_names(2, first=2), attention_spec(window=32))]
    e = Engine(config, kv_cache_config(config, groups, 64))
    assert len(e.kv_scheduler.plan.groups) == 2
    shared = prompt(8, 112)
    e.add("r1", shared, max_tokens=2)
    e.run()
    e.reset_prefix_cache()
    e.poison()
    e.add("r2", shared + [9], max_tokens=2)
    e.run()
    assert first_step_of(e, "r2")[0] == 112
    e.assert_no_leaks()
    e.shutdown()


def test_decode_steps_with_draft_tokens_are_not_timed_as_prefill(tmp_path):
    """With speculative decoding a decode step schedules a token per draft besides its own. Before,
    such steps counted as prompt tokens and dragged the measured prefill rate down."""
    e = engine(tmp_path, disk=True, recompute_when_faster=True, spec_tokens=3)
    timed = []
    schedule = e.schedule

    def recorded():
        out = schedule()
        timed.append((dict(out.num_scheduled_tokens), out.kv_connector_metadata.prefill_tokens))
        return out

    e.schedule = recorded
    e.add("r1", prompt(21, 40), max_tokens=12)
    e.run()
    assert timed[0] == ({"r1": 40}, 40)  # the prompt
    assert len(timed) > 2 and all(prefill == 0 for _, prefill in timed[1:])  # decode steps, drafts and all
    assert any(n.get("r1", 0) > 1 for n, _ in timed[1:])  # some scheduled a draft
    e.assert_no_leaks()
    e.shutdown()
