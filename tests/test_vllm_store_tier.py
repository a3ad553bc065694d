"""``kvtier.vllm.store_tier`` without vLLM: how many of a request's blocks a shared-directory store
holds, checked without a file lookup per block for a prompt the store has never seen."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtier.vllm.store_tier as store_tier_module
from kvtier.config import ReuseScope
from kvtier.connector.fs_store import FileSystemStore
from kvtier.connector.keys import BlockKeyspace
from kvtier.vllm.store_tier import FIRST_PROBE, BlockChain, StoreTier, open_store

TPB = 4
PAGES = (64, 32)  # bytes of a page of each of two layer groups


class CountingStore(FileSystemStore):
    """A real shared-directory store that also counts the keys its existence checks look up."""

    looked_up = 0

    def contains_many(self, keys):
        self.looked_up += len(keys)
        return super().contains_many(keys)


def store_tier(tmp_path, slots: int) -> tuple[StoreTier, CountingStore]:
    store = CountingStore(str(tmp_path / "store"))
    hosts = [torch.randint(1, 255, (slots * page,), dtype=torch.uint8) for page in PAGES]
    keyspace = BlockKeyspace("ab12", TPB)
    return StoreTier(store, keyspace, hosts, PAGES), store


def test_a_run_of_stored_blocks_is_counted_and_a_cold_prompt_costs_one_small_check(tmp_path):
    tier, store = store_tier(tmp_path, slots=32)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 50_000, 2000 * TPB).tolist()
    chain = BlockChain(ReuseScope())
    keys = chain.upto(tokens, TPB, 2000)
    slots = [np.arange(20, dtype=np.int64)] * len(PAGES)
    tier.put(chain, keys[:20], slots).result()  # the first 20 blocks are stored

    store.looked_up = 0
    assert tier.present(chain, keys[:30]) == 20
    assert store.looked_up == 30 * len(PAGES)  # the first probe, then the rest at once

    cold = BlockChain(ReuseScope(salt="never stored"))
    store.looked_up = 0
    assert tier.present(cold, cold.upto(tokens, TPB, 2000)) == 0
    assert store.looked_up == FIRST_PROBE * len(PAGES)  # not 2,000 blocks' worth

    store.looked_up = 0
    assert tier.present(chain, keys[:5]) == 5
    assert store.looked_up == 5 * len(PAGES)

    missing = store.path_of(tier.keyspace.key(chain.scope, keys[3], 1))  # block 3 of group 1 gone
    missing.unlink()
    store.looked_up = 0
    assert tier.present(chain, keys[:30]) == 3
    assert store.looked_up == FIRST_PROBE * len(PAGES)
    assert tier.present(chain, keys[:0]) == 0
    tier.close()


@pytest.mark.parametrize("as_array", [False, True], ids=["list", "array('i')"])
def test_keys_extended_a_few_blocks_at_a_time_are_the_keys_of_the_whole_chain(as_array):
    """A request's keys grow with it (``upto`` at each step); they are the keys the store's other
    users compute for the same blocks in one go (``block_chain``)."""
    from array import array

    from kvtier.reuse.block_keys import block_chain

    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 2**31, 403).tolist()
    scope = ReuseScope(salt="tenant")
    chain = BlockChain(scope)
    given = array("i", tokens) if as_array else tokens
    for count in (0, 1, 1, 7, 30, 100, 100):
        assert chain.upto(given, TPB, count) == block_chain(tokens, scope, TPB, count)


def test_a_store_url_of_another_scheme_is_refused_without_its_password():
    """vLLM logs a connector's error at start-up: a mistyped scheme must not put the password there."""
    with pytest.raises(ValueError, match="must start with one of") as refused:
        open_store("redis+tls://kv:s3cret@cache:6379/0")
    assert "s3cret" not in str(refused.value) and "kv:***@cache" in str(refused.value)


class SlowStore(CountingStore):
    """A real shared-directory store whose checks and reads answer 50 ms late (a distant store)."""

    def contains_many(self, keys):
        time.sleep(0.05)
        return super().contains_many(keys)

    def get_many(self, keys, expected_sizes=None):
        time.sleep(0.05)
        return super().get_many(keys, expected_sizes)


def test_checks_and_fetches_are_timed_and_weighed_against_recomputing(tmp_path, monkeypatch, caplog):
    """A slow check is also a WARNING: it runs on vLLM's scheduler thread, which waits for it."""
    monkeypatch.setattr(store_tier_module, "SLOW_CALL_S", 0.04)  # the store answers 50 ms late
    store = SlowStore(str(tmp_path / "store"))
    hosts = [torch.randint(1, 255, (8 * page,), dtype=torch.uint8) for page in PAGES]
    tier = StoreTier(store, BlockKeyspace("ab12", TPB), hosts, PAGES)
    chain = BlockChain(ReuseScope())
    keys = chain.upto(list(range(1, 8 * TPB + 1)), TPB, 8)
    tier.put(chain, keys, [np.arange(8, dtype=np.int64)] * len(PAGES)).result()
    assert not tier.faster_to_recompute(8, TPB, 1e6)  # nothing timed yet: asked
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm.store_tier"):
        assert tier.present(chain, keys) == 8
    assert "scheduler thread" in caplog.text and "recompute_when_faster=True" in caplog.text
    assert tier.faster_to_recompute(8, TPB, 1e6)  # 32 tokens in 32 us against two 50 ms round trips
    assert len(tier.fetch(chain, keys).result()) == 8
    assert tier.faster_to_recompute(8, TPB, 1e6)  # and against about 0.1 s once a fetch was timed
    assert not tier.faster_to_recompute(8, TPB, 10.0)  # 3.2 s to recompute: asked
    assert not tier.faster_to_recompute(8, TPB, None)  # no rate: asked
    tier.close()


class SlowWritesStore(CountingStore):
    """A real shared-directory store whose writes answer 0.2 s late; ``writes`` counts its write calls."""

    writes = 0

    def put_many(self, items):
        self.writes += 1
        time.sleep(0.2)
        return super().put_many(items)


def test_puts_queued_behind_a_write_go_together_in_the_next(tmp_path):
    """Six requests' write-throughs queued at once cost one or two writes, not six (the block they
    all share is written once), and every page reads back. Before, each put
    made its own check and write, one after the other: over a distant store they piled up, each
    holding its host pages."""
    store = SlowWritesStore(str(tmp_path / "store"))
    hosts = [torch.randint(1, 255, (16 * page,), dtype=torch.uint8) for page in PAGES]
    tier = StoreTier(store, BlockKeyspace("ab12", TPB), hosts, PAGES)
    rng = np.random.default_rng(6)
    shared = rng.integers(1, 50_000, TPB).tolist()
    chains, keys = [], []
    for _ in range(6):
        chain = BlockChain(ReuseScope())
        chains.append(chain)
        keys.append(chain.upto(shared + rng.integers(1, 50_000, TPB).tolist(), TPB, 2))
    slots = [[np.array([0, 1 + r], dtype=np.int64)] * len(PAGES) for r in range(6)]
    futures = [tier.put(chain, k, s) for chain, k, s in zip(chains, keys, slots, strict=True)]
    for future in futures:
        future.result()
    assert store.writes <= 2
    fetched = [tier.fetch(chain, k).result() for chain, k in zip(chains, keys, strict=True)]
    for r, run in enumerate(fetched):
        assert len(run) == 2
        for b, row in enumerate(run):
            for g, page in enumerate(PAGES):
                slot = int(slots[r][g][b])
                assert row[g] == hosts[g][slot * page : (slot + 1) * page].numpy().tobytes()
    assert len(list((tmp_path / "store").rglob("*.page"))) == (1 + 6) * len(PAGES)
    tier.close()


EXITS_WITHOUT_CLOSE = """
import sys, time
import numpy as np, torch
from kvtier.config import ReuseScope
from kvtier.connector.fs_store import FileSystemStore
from kvtier.connector.keys import BlockKeyspace
from kvtier.vllm.store_tier import BlockChain, StoreTier

class SlowWrites(FileSystemStore):
    def put_many(self, items):
        time.sleep(0.3)
        return super().put_many(items)

tier = StoreTier(SlowWrites(sys.argv[1]), BlockKeyspace("ab12", 4), [torch.ones(4 * 64, dtype=torch.uint8)], [64])
chain = BlockChain(ReuseScope())
tier.put(chain, chain.upto(list(range(1, 17)), 4, 4), [np.arange(4, dtype=np.int64)])
"""


def test_a_process_that_exits_without_closing_still_writes_its_queued_puts(tmp_path):
    """The writer is a daemon thread (an exit never hangs on a dead store), so the exit waits for the
    puts queued (at most ``EXIT_WAIT_S``). Before, those writes were dropped."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", EXITS_WITHOUT_CLOSE, str(tmp_path)], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert len(list(tmp_path.rglob("*.page"))) == 4
