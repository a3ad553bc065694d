"""KVTierConnector's store below the disk tier (``store_url``): another engine finds the pages
there, puts them into host memory off vLLM's scheduler thread, a damaged value is recomputed, and
Redis serves like a shared directory."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 or 0.34 (bash .ci/vllm_env.sh)")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from kvtier.config import ReuseScope
from kvtier.connector.fs_store import FileSystemStore
from kvtier.vllm import KVTierConnector, host_pool, scheduler
from kvtier.vllm.store_tier import BlockChain, StoreTier
from tests.holding import hold
from tests.vllm.harness import (
    BLOCK,
    HOST_PAGE,
    Engine,
    MiB,
    attention_spec,
    kv_cache_config,
    layer_names,
    prompt,
    push_out_of_host_memory,
    run_until_computed,
    vllm_config,
)

_created: list[Engine] = []


def engine(tmp_path: Path, store_url: str, name: str, device_blocks: int = 64, **extra) -> Engine:
    config = vllm_config(tmp_path, {"host_bytes": 4 * MiB, "store_url": store_url, **extra}, name="model")
    config.kv_transfer_config.engine_id = name
    e = Engine(config, kv_cache_config(config, [(layer_names(3), attention_spec())], device_blocks))
    _created.append(e)
    return e


@pytest.fixture(autouse=True)
def shut_down_engines():
    """An engine a failed test left running is shut down, so the next test can use its id."""
    yield
    while _created:
        e = _created.pop()
        if host_pool.lookup(e.config.kv_transfer_config.engine_id) is not None:
            with contextlib.suppress(Exception):
                e.shutdown()


def wait_until(event: threading.Event, e: Engine, seconds: float = 60) -> None:
    """Step ``e`` until ``event`` is set (a background thread reached a held point)."""
    deadline = time.monotonic() + seconds
    while not event.is_set() and time.monotonic() < deadline:
        e.step()
        time.sleep(0.001)
    assert event.is_set()


def first_computed(e: Engine, rid: str) -> int:
    return next(step.computed[rid][0] for step in e.log if rid in step.computed)


def save_through(tmp_path: Path, url: str, tokens: list[int]) -> None:
    first = engine(tmp_path, url, "first")
    first.add("r1", tokens, max_tokens=2)
    first.run()
    first.assert_no_leaks()
    first.shutdown()  # waits for the writes in flight


@pytest.fixture
def file_url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


def test_another_engine_loads_the_prefix_from_the_store(tmp_path, file_url):
    shared = prompt(20, 120)
    save_through(tmp_path, file_url, shared)
    second = engine(tmp_path, file_url, "second")  # nothing in its host memory, no disk tier
    second.poison()
    request = second.add("r2", [*shared, 1, 2], max_tokens=2)
    for _ in range(1000):  # vLLM asks again each step until the fetch from the store is over
        second.step()
        if request.status is not RequestStatus.WAITING:
            break
        time.sleep(0.001)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert second.connector.get_external_cache_hit_sources(request, 112) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 112}
    second.run()
    assert first_computed(second, "r2") == 112
    assert second.kv_scheduler.manager.stats().tiers["primary"].pages_used == 7  # what came is kept in kvtier too
    second.assert_no_leaks()
    second.shutdown()


def test_a_request_whose_hit_in_vllms_own_cache_shrinks_while_it_waits_fetches_the_rest_from_the_store(
    tmp_path, file_url
):
    """When r2 is first asked, vLLM's own cache holds all 7 blocks of its prompt that the store
    holds (kvtier's host memory no longer does), so kvtier offers none; no device block is free for
    it (r0 holds them). While it waits, r0 grows and vLLM evicts those cached blocks one by one.
    kvtier then fetches them from the store: r2 starts at token 112. Before, the first ask gave up
    the store's blocks for good, and r2 recomputed what vLLM had evicted."""
    shared = prompt(22, 7 * BLOCK + 1)
    save_through(tmp_path, file_url, shared)
    e = engine(tmp_path, file_url, "second", device_blocks=11, host_bytes=8 * HOST_PAGE)
    e.poison()
    e.add("r1", shared, max_tokens=1)
    e.run()  # loaded from the store; its 7 full blocks kept in vLLM's cache
    assert first_computed(e, "r1") == 7 * BLOCK
    push_out_of_host_memory(e.kv_scheduler.manager, 8)
    e.add("r0", prompt(23, 3 * BLOCK - 1), max_tokens=40, images=[("image", 0, BLOCK)])  # keyed by nothing
    run_until_computed(e, "r0", 3 * BLOCK - 1)  # 3 device blocks: the 7 cached ones are all that is free
    e.add("r2", [*shared, 1], max_tokens=2)
    e.step()
    assert e.requests["r2"].num_computed_tokens == 0 and not e.log[-1].loaded
    e.run(max_steps=2000)
    assert first_computed(e, "r2") == 7 * BLOCK
    assert any("r2" in step.loaded for step in e.log)
    e.assert_no_leaks()
    e.shutdown()


def test_blocks_another_engine_stores_while_a_request_waits_are_fetched(tmp_path, file_url, monkeypatch):
    """The store lacks r2's prompt when r2 is first asked; r2 then waits for a slot (r0 holds the
    device blocks) while another engine computes the same prompt and stores it. A later ask, once
    ``STORE_ASK_AGAIN_S`` passed (0 here), finds the blocks there: r2 starts at token 112. Before,
    the store was asked only at the first ask, and r2 recomputed all of it."""
    monkeypatch.setattr(scheduler, "STORE_ASK_AGAIN_S", 0.0)
    shared = prompt(26, 7 * BLOCK + 1)
    e = engine(tmp_path, file_url, "second", device_blocks=11)
    e.poison()
    e.add("r0", prompt(27, 3 * BLOCK - 1), max_tokens=40, images=[("image", 0, BLOCK)])  # keyed by nothing
    run_until_computed(e, "r0", 3 * BLOCK - 1)  # 3 device blocks: 7 free, r2 needs 8
    e.add("r2", [*shared, 1], max_tokens=2)
    e.step()
    lease = e.kv_scheduler._leases["r2"]
    assert e.requests["r2"].num_computed_tokens == 0 and not lease.store_keys and len(lease.store_more) == 7
    save_through(tmp_path, file_url, shared)
    e.run()
    assert first_computed(e, "r2") == 7 * BLOCK
    e.assert_no_leaks()
    e.shutdown()


def test_a_waiting_request_asks_the_store_again_at_most_every_store_ask_again_s(tmp_path, file_url, monkeypatch):
    """r2 waits for a slot through some 40 steps, asked each step; with ``STORE_ASK_AGAIN_S`` longer
    than the run, the store is checked for it once (its first ask), and r2 is recomputed."""
    monkeypatch.setattr(scheduler, "STORE_ASK_AGAIN_S", 3600.0)
    checks: list[tuple[StoreTier, int]] = []
    present = StoreTier.present
    monkeypatch.setattr(
        StoreTier,
        "present",
        lambda self, chain, blocks: checks.append((self, len(blocks))) or present(self, chain, blocks),
    )
    shared = prompt(28, 7 * BLOCK + 1)
    e = engine(tmp_path, file_url, "second", device_blocks=11)
    e.add("r0", prompt(29, 3 * BLOCK - 1), max_tokens=40, images=[("image", 0, BLOCK)])  # keyed by nothing
    run_until_computed(e, "r0", 3 * BLOCK - 1)
    e.add("r2", [*shared, 1], max_tokens=2)
    e.step()
    save_through(tmp_path, file_url, shared)
    e.run()
    assert first_computed(e, "r2") == 0
    assert [blocks for store, blocks in checks if store is e.kv_scheduler._store] == [7]
    e.assert_no_leaks()
    e.shutdown()


def test_pages_a_store_write_reads_stay_locked_until_it_is_done(tmp_path, file_url, monkeypatch):
    """A running request's blocks are released once saved (vLLM holds them), but not while their
    write to the store runs: with host memory for 8 pages and r1's writes held, r2 finds r1's 7
    pages still locked, and the store serves r1's prefix byte for byte to another engine (the
    runner checks every loaded value). Released before its write, r1's pages would go to r2's
    blocks, and the store would hold r2's bytes under r1's keys."""
    started, release = hold(monkeypatch, StoreTier, "_write_batch")
    first = engine(tmp_path, file_url, "first", host_bytes=8 * HOST_PAGE)
    first.poison()
    one, two = prompt(35, 7 * BLOCK + 1), prompt(36, 7 * BLOCK + 1)
    first.add("r1", one, max_tokens=4)
    wait_until(started, first)
    first.add("r2", two, max_tokens=4)
    for _ in range(10):
        first.step()
    assert first.kv_scheduler.manager.cached_tokens(two) < 7 * BLOCK  # no room while r1's pages are read
    release.set()
    first.run()
    first.assert_no_leaks()
    first.shutdown()
    second = engine(tmp_path, file_url, "second")
    second.poison()
    second.add("r3", [*one, 1], max_tokens=2)
    second.run()
    assert first_computed(second, "r3") == 7 * BLOCK
    second.assert_no_leaks()
    second.shutdown()


def test_after_a_connector_reset_the_store_serves_this_engine_nothing_saved_before(tmp_path, file_url):
    """``reset_prefix_cache(reset_connector=True)`` after a weight update: this engine fetches no block
    the store had before, while an engine of the old weights still does."""
    shared = prompt(21, 120)
    save_through(tmp_path, file_url, shared)
    e = engine(tmp_path, file_url, "reset")
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    e.add("r2", [*shared, 1], max_tokens=2)
    e.run()
    assert first_computed(e, "r2") == 0
    e.assert_no_leaks()
    e.shutdown()
    old = engine(tmp_path, file_url, "old")
    old.add("r3", [*shared, 2], max_tokens=2)
    old.run()
    assert first_computed(old, "r3") == 112
    old.assert_no_leaks()
    old.shutdown()


def test_a_request_for_prompt_logprobs_asks_the_store_nothing(tmp_path, file_url, monkeypatch):
    """vLLM computes every prompt token of it: no lookup, no fetch; the next request still loads."""
    shared = prompt(21, 120)
    save_through(tmp_path, file_url, shared)
    asked = []
    present = StoreTier.present

    def counted(self, chain, keys):
        asked.append(len(keys))
        return present(self, chain, keys)

    monkeypatch.setattr(StoreTier, "present", counted)
    second = engine(tmp_path, file_url, "second")
    second.add("r2", [*shared, 1, 2], max_tokens=2, prompt_logprobs=1)
    second.run()
    assert first_computed(second, "r2") == 0 and asked == []
    second.add("r3", [*shared, 1, 3], max_tokens=2)
    second.run()
    assert first_computed(second, "r3") == 112 and asked == []  # from r2's blocks in host memory: nothing past them
    second.assert_no_leaks()
    second.shutdown()


def test_recompute_when_faster_stops_asking_a_store_slower_than_recomputing(tmp_path, file_url, monkeypatch):
    """With ``recompute_when_faster`` and a fast prefill: once a check and a fetch of a store 0.2 s
    away were timed, a prompt the store holds is recomputed without asking it (no check on vLLM's
    scheduler thread). Before, every new prompt's ask paid the store's round trip there."""
    first, second_prompt = prompt(24, 120), prompt(25, 120)
    save_through(tmp_path, file_url, first)
    save_through(tmp_path, file_url, second_prompt)
    asked = []
    present = StoreTier.present

    def slow(self, chain, keys):
        asked.append(len(keys))
        time.sleep(0.2)
        return present(self, chain, keys)

    read = StoreTier._read

    def slow_read(self, keys, sizes, groups):
        time.sleep(0.2)
        return read(self, keys, sizes, groups)

    monkeypatch.setattr(StoreTier, "present", slow)
    monkeypatch.setattr(StoreTier, "_read", slow_read)
    e = engine(tmp_path, file_url, "weighed", recompute_when_faster=True, prefill_tokens_per_s=1e6)
    e.add("r1", [*first, 1], max_tokens=2)
    e.run()
    assert first_computed(e, "r1") == 112 and len(asked) == 1  # unknown speed: asked, loaded
    e.add("r2", [*second_prompt, 1], max_tokens=2)
    e.run()
    assert first_computed(e, "r2") == 0 and len(asked) == 1  # 112 tokens recompute in 0.1 ms
    e.assert_no_leaks()
    e.shutdown()


def test_a_fetch_from_the_store_runs_while_the_others_do(tmp_path, file_url, monkeypatch):
    """While the store's pages are fetched on a background thread the request waits and another
    runs; an aborted one leaks nothing; then the prefix loads byte for byte."""
    shared = prompt(23, 120)
    save_through(tmp_path, file_url, shared)
    started, release = hold(monkeypatch, StoreTier, "_read")
    second = engine(tmp_path, file_url, "second")
    second.poison()
    second.add("r2", [*shared, 1, 2], max_tokens=2)
    second.add("gone", [*shared, 5], max_tokens=2)
    second.add("r3", prompt(24, 40), max_tokens=2)  # nothing stored: it needs nothing from the store
    for _ in range(3):
        second.step()
    assert started.wait(10)
    assert second.requests["r2"].status is RequestStatus.WAITING
    assert any("r3" in step.computed for step in second.log)  # scheduled while the fetch runs
    second.abort("gone")
    release.set()
    second.run()
    assert first_computed(second, "r2") == 112
    second.assert_no_leaks()
    second.shutdown()


def hold_placements(monkeypatch) -> tuple[threading.Event, threading.Event, list[str]]:
    """Make the writes of store pages into host memory wait for ``release``; ``started`` is set when
    one waits, and the names of the threads they ran on are listed. Returns (started, release, threads)."""
    started, release, threads = threading.Event(), threading.Event(), []
    real = StoreTier._place

    def held(self, pages, slots):
        threads.append(threading.current_thread().name)
        started.set()
        release.wait(10)
        return real(self, pages, slots)

    monkeypatch.setattr(StoreTier, "_place", held)
    return started, release, threads


def test_store_pages_go_into_host_memory_off_the_scheduler_thread_and_the_load_waits_for_them(
    tmp_path, file_url, monkeypatch
):
    """While the fetched pages are written into host pages the request waits and the others run;
    its load and its commit wait for the write: a request asking meanwhile matches nothing in host
    memory, and both load the prefix byte for byte (the runner checks every loaded value)."""
    shared = prompt(25, 120)
    save_through(tmp_path, file_url, shared)
    started, release, threads = hold_placements(monkeypatch)
    second = engine(tmp_path, file_url, "second")
    second.poison()
    r2 = second.add("r2", [*shared, 1, 2], max_tokens=2)
    wait_until(started, second)
    assert threads == ["kvtier-vllm-store-place_0"]
    second.add("r3", prompt(26, 40), max_tokens=6)  # nothing stored: it needs nothing from the store
    r4 = second.add("r4", [*shared, 3], max_tokens=2)  # the same prefix, asked while the pages are written
    for _ in range(5):
        second.step()
    assert r2.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not any("r2" in step.loaded for step in second.log)
    assert any("r3" in step.computed for step in second.log[-5:])  # scheduled meanwhile
    assert second.kv_scheduler._leases["r4"].matched == 0  # not committed before it is written
    release.set()
    second.run()
    assert first_computed(second, "r2") == 112
    assert first_computed(second, "r4") == 112
    assert r4.status is RequestStatus.FINISHED_LENGTH_CAPPED
    second.assert_no_leaks()
    second.shutdown()


def test_a_request_aborted_while_its_store_pages_are_written_leaks_nothing(tmp_path, file_url, monkeypatch):
    shared = prompt(27, 120)
    save_through(tmp_path, file_url, shared)
    started, release, _ = hold_placements(monkeypatch)
    second = engine(tmp_path, file_url, "second")
    second.poison()
    second.add("r2", [*shared, 1, 2], max_tokens=2)
    wait_until(started, second)
    second.abort("r2")
    second.step()
    release.set()
    second.run()
    second.assert_no_leaks()
    second.add("r3", [*shared, 4], max_tokens=2)  # what the aborted request wrote is reused, intact
    second.run()
    assert first_computed(second, "r3") == 112
    second.assert_no_leaks()
    second.shutdown()


def test_a_failed_write_of_store_pages_is_recomputed(tmp_path, file_url, monkeypatch, caplog):
    shared = prompt(28, 120)
    save_through(tmp_path, file_url, shared)

    def fail(self, pages, slots):
        raise MemoryError("no room to copy")

    monkeypatch.setattr(StoreTier, "_place", fail)
    second = engine(tmp_path, file_url, "second")
    second.poison()
    second.add("r2", [*shared, 1, 2], max_tokens=2)
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm.scheduler"):
        second.run()
    assert "writing store pages into host memory failed" in caplog.text
    assert first_computed(second, "r2") == 0  # the whole load failed: vLLM recomputed it
    assert second.kv_scheduler.manager.stats().tiers["primary"].pages_used == 0  # nothing committed
    second.assert_no_leaks()
    second.shutdown()


def damage_stored_block(tmp_path: Path, e: Engine, tokens: list[int], block: int) -> None:
    """Flip a byte of the value the store at ``tmp_path / "store"`` holds for ``tokens``' block
    ``block`` (the first layer group's page)."""
    chain = BlockChain(ReuseScope())
    key = e.kv_scheduler._store.keyspace.key(chain.scope, chain.upto(tokens, BLOCK, block + 1)[block], 0)
    path = FileSystemStore(str(tmp_path / "store")).path_of(key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_store_value_is_recomputed_not_served(tmp_path, file_url):
    shared = prompt(21, 120)
    save_through(tmp_path, file_url, shared)
    second = engine(tmp_path, file_url, "second")
    damage_stored_block(tmp_path, second, shared, 4)
    second.poison()
    second.add("r2", [*shared, 3], max_tokens=2)
    second.run()
    assert first_computed(second, "r2") == 4 * BLOCK  # blocks 0..3 from the store, the rest computed
    second.assert_no_leaks()
    second.shutdown()


def test_a_fetch_that_brought_nothing_is_not_repeated_while_the_request_waits_for_a_slot(
    tmp_path, file_url, monkeypatch
):
    """r2's first block in the store is damaged, so its fetch brings nothing; r2 then waits for a
    slot (r0 holds the device blocks) and is asked again each step: the store is not fetched again."""
    shared = prompt(24, 120)
    save_through(tmp_path, file_url, shared)
    e = engine(tmp_path, file_url, "second", device_blocks=11)
    damage_stored_block(tmp_path, e, shared, 0)
    fetches = []
    fetch = StoreTier.fetch
    monkeypatch.setattr(StoreTier, "fetch", lambda self, *args: fetches.append(args) or fetch(self, *args))
    e.add("r0", prompt(25, 3 * BLOCK - 1), max_tokens=40, images=[("image", 0, BLOCK)])  # keyed by nothing
    run_until_computed(e, "r0", 3 * BLOCK - 1)  # 3 device blocks: 7 free, r2 needs 8
    e.add("r2", [*shared, 3], max_tokens=2)
    e.run()
    assert first_computed(e, "r2") == 0
    assert len(fetches) == 1
    e.assert_no_leaks()
    e.shutdown()


def test_redis_serves_like_a_shared_directory(tmp_path, redis_url):
    shared = prompt(22, 100)
    save_through(tmp_path, redis_url, shared)
    second = engine(tmp_path, redis_url, "second")
    second.poison()
    second.add("r2", [*shared, 4], max_tokens=2)
    second.run()
    assert first_computed(second, "r2") == 96
    second.shutdown()


def test_store_settings_are_checked(tmp_path):
    """A refused store leaves nothing behind: the same engine builds with a good one at once (before:
    its host pages stayed published and the retry was refused). ``file://dir/x`` names a host
    (before: the store went to ``/x``)."""
    config = vllm_config(tmp_path, {"store_url": "ftp://somewhere"})
    kv_config = kv_cache_config(config, [(layer_names(3), attention_spec())], 16)
    with pytest.raises(ValueError, match="store_url must start with"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    config = vllm_config(tmp_path, {"store_url": "file://store/x"})
    with pytest.raises(ValueError, match="names the host 'store'; a shared directory is file:///absolute/path"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    config = vllm_config(tmp_path, {"store_url": (tmp_path / "store").as_uri()})
    KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_config).shutdown()
    config = vllm_config(tmp_path, {"store_url": "file:///tmp/x"}, name="swa")
    groups = [(layer_names(2), attention_spec()), (layer_names(2, first=2), attention_spec(window=32))]
    with pytest.raises(NotImplementedError, match="full-attention models only"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(config, groups, 16))
    disk = {"disk_bytes": 1 << 20, "disk_path": str(tmp_path / "disk")}
    config = vllm_config(tmp_path, {**disk, "store_url": "http://x"})
    with pytest.raises(ValueError, match="store_url must start with"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    assert not (tmp_path / "disk").exists()  # refused before the disk tier was made (before: its files stayed)
