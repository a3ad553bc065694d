"""Reliability soaks over three tiers (primary + host + disk), and over the vLLM connector's layout
(host memory as the primary tier above a disk written behind, not blocking), bounded to a few
seconds each.

1. Random operations (create, prefill, keep, resume, decode, close, prefetch) under several
   scopes, with restarts: a manager closed and reopened on the same directory, or dropped
   without ``close``. After every restart every restored block is served back and checked byte
   for byte (``tests.kvdata``), no page fails its checksum, and the invariants hold.
2. A process writing to the disk tier is killed (SIGKILL) at random points; a new manager always
   starts on what it left, serves only exact bytes, and finds the hot system prompt's chains.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvtier
from tests.kvdata import PageOracle, small_spec
from tests.test_tiers import TPB, manager, page_demand

ROOT = Path(__file__).resolve().parents[1]
SCOPES = [kvtier.ReuseScope(), kvtier.ReuseScope(salt="tenant-a"), kvtier.ReuseScope(lora_id=3, salt=b"\x00b")]
SYSTEM = [900 + (i % 7) for i in range(12)]  # 3 blocks shared by most requests
TIERS = {"primary": 10, "host": 8, "disk": 48}


def new_manager(path: Path, kind: str, layout: str = "three-tiers", device: str = "cpu") -> kvtier.KVCacheManager:
    """Three tiers; the primary tier right above the disk ("primary-and-disk"); or, as in the vLLM
    connector, host memory as the primary tier above the disk, written behind and dropping what was
    not written behind yet when pushed out (on the CPU only: on CUDA write-behind needs a host tier)."""
    if layout == "three-tiers":
        return manager(path, kind=kind, snapshot_interval_blocks=2, device=device, **TIERS)
    if layout == "primary-and-disk":
        primary, disk = TIERS["primary"] + TIERS["host"], TIERS["disk"]
        return manager(path, kind=kind, primary=primary, host=0, disk=disk, snapshot_interval_blocks=2, device=device)
    d = page_demand(small_spec(kind))
    disk = kvtier.DiskTier(int(d * TIERS["disk"]) + 1, path, write_behind=True, blocking_writes=False)
    tiers = [kvtier.PrimaryTier(int(d * (TIERS["primary"] + TIERS["host"])) + 1), disk]
    config = kvtier.CacheConfig(TPB, tiers, snapshot_interval_blocks=2, device=device)
    return kvtier.KVCacheManager(small_spec(kind), config)


class Churn:
    """Random requests against one manager, checking every reused byte; ``kept`` caches are suspended."""

    def __init__(self, mgr: kvtier.KVCacheManager, rng: random.Random) -> None:
        self.mgr = mgr
        self.oracle = PageOracle(mgr)
        self.rng = rng
        self.kept: list[tuple[kvtier.KVCache, list[int]]] = []

    def prompt(self) -> tuple[list[int], kvtier.ReuseScope]:
        rng = self.rng
        head = SYSTEM if rng.random() < 0.7 else []
        family = [rng.randrange(3) * 100 + j for j in range(rng.choice([0, 4, 9]))]
        tail = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 8))]
        return head + family + tail, rng.choice(SCOPES)

    def step(self) -> None:
        rng = self.rng
        self.mgr.maintain()  # background work between steps, as an engine does
        op = rng.random()
        if op < 0.55 or not self.kept:
            self.serve()
        elif op < 0.75:
            self.decode(*self.kept[rng.randrange(len(self.kept))])
        elif op < 0.9:
            cache, _ = self.kept.pop(rng.randrange(len(self.kept)))
            cache.close()
        else:
            tokens, scope = self.prompt()
            self.mgr.prefetch(tokens, scope=scope)

    def serve(self) -> None:
        tokens, scope = self.prompt()
        cache = self.mgr.create_cache(tokens, scope=scope, priority=self.rng.choice([20, 35, 60]))
        if not cache.resume():
            cache.close()
            return
        self.oracle.check(cache, tokens)
        start = cache.num_committed_tokens
        if cache.resize(len(tokens)):
            while start < len(tokens):  # chunks end on snapshot points of recurrent groups
                end = min(len(tokens), (start // 8 + 1) * 8)
                self.oracle.write(cache, tokens, start, end)
                cache.commit(tokens[start:end])
                start = end
        if self.rng.random() < 0.3 and len(self.kept) < 4:
            cache.suspend()
            self.kept.append((cache, tokens))
        else:
            cache.close()

    def decode(self, cache: kvtier.KVCache, tokens: list[int]) -> None:
        """Resume a kept cache (its pages may be on any tier), check it, add a few tokens, suspend."""
        if not cache.resume():
            return
        self.oracle.check(cache, tokens)
        del tokens[cache.num_committed_tokens :]  # what a failed resize left uncomputed is not its sequence
        for _ in range(self.rng.randrange(1, 6)):
            token = self.rng.randrange(1, 50)
            if not cache.resize(max(cache.capacity, len(tokens) + 1)):
                break
            tokens.append(token)
            self.oracle.write(cache, tokens, len(tokens) - 1, len(tokens))
            cache.commit([token])
        cache.suspend()


def verify_restored(mgr: kvtier.KVCacheManager) -> int:
    """Serve every block the tree holds (after a restart: what the disk restored), byte for byte.

    Claims every scope's restored blocks first; each leaf's path of tokens is matched, resumed
    (reading its pages from disk) and checked. Returns the number of pages the disk restored.
    """
    restored = mgr.stats().tiers["disk"].pages_used
    for scope in SCOPES:
        mgr._pool.tree.root(scope)
    assert not mgr._pool.tree.dormant, "every restored scope is claimed by its first use"
    oracle = PageOracle(mgr)
    leaves = [n for n in mgr._pool.tree.nodes() if not n.children]
    for leaf in leaves:
        path, node = [], leaf
        while node.parent is not None:
            path.append(node.tokens)
            node = node.parent
        tokens = list(memoryview(b"".join(reversed(path))).cast("Q")) + [1]
        cache = mgr.create_cache(tokens, scope=leaf.scope)
        if cache.resume():
            oracle.check(cache, tokens)
        cache.close()
    stats = mgr.stats()
    assert stats.checksum_failures == 0, stats
    assert stats.disk_resets == 0, stats
    mgr.check_invariants()
    return restored


@pytest.mark.parametrize(
    "kind, seed, layout",
    [("llama", 1, "three-tiers"), ("swa", 2, "three-tiers"), ("hybrid", 3, "three-tiers")]
    + [("llama", 4, "host-memory-and-disk"), ("hybrid", 5, "host-memory-and-disk")],
)
def test_random_operations_with_restarts(tmp_path, kind, seed, layout):
    rng = random.Random(seed)
    mgr = new_manager(tmp_path, kind, layout)
    churn = Churn(mgr, rng)
    restored = 0
    for step in range(240):
        churn.step()
        if step % 40 == 39:
            if rng.random() < 0.5:
                for cache, _ in churn.kept:
                    cache.close()
                mgr.close()
            else:
                del churn, mgr  # dropped without close: the next manager must still start
                gc.collect()
            mgr = new_manager(tmp_path, kind, layout)
            restored += verify_restored(mgr)
            churn = Churn(mgr, rng)
        else:
            mgr.check_invariants()
    assert restored > 0
    mgr.close()


CHILD = """
import random, sys
from pathlib import Path
from kvtier.tiering import mover
from tests.test_reliability_soak import Churn, SYSTEM, new_manager
chunk_bytes = {chunk_bytes!r}
if chunk_bytes is not None:
    mover.DISK_CHUNK_BYTES = chunk_bytes
mgr = new_manager(Path({path!r}), "llama", {layout!r}, {device!r})
churn = Churn(mgr, random.Random({seed}))
hot = mgr.create_cache(SYSTEM + [1])  # the system prompt, computed once and kept ACTIVE: never demoted
assert hot.resume() and hot.resize(13)
start = hot.num_committed_tokens
churn.oracle.write(hot, SYSTEM + [1], start, 13)
hot.commit((SYSTEM + [1])[start:])
for _ in range(30):
    churn.step()
print("ready", flush=True)
while True:
    churn.step()
"""


def kill_writers_and_restart(path: Path, layout: str, device: str = "cpu", chunk_bytes: int | None = None) -> int:
    """Four rounds: a child process churning requests over ``path`` is killed (SIGKILL) at a random
    point, then a new manager on the directory serves back every restored block, byte for byte,
    and is closed (persisting or not) for the next child. ``chunk_bytes``: the child's
    ``mover.DISK_CHUNK_BYTES`` (a GPU tier's disk I/O in parts of that size). Returns the rounds
    whose restart found the hot system prompt on disk."""
    rng = random.Random(7)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with_system = 0
    for round_ in range(4):
        code = CHILD.format(path=str(path), seed=round_, layout=layout, device=device, chunk_bytes=chunk_bytes)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
        try:
            assert child.stdout.readline().strip() == b"ready"
            time.sleep(rng.uniform(0.1, 0.8))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        mgr = new_manager(path, "llama", layout, device)
        assert verify_restored(mgr) > 0
        probe = mgr.create_cache(SYSTEM + [1, 2])
        with_system += probe.num_reused_tokens == len(SYSTEM)  # the hot prefix survived on disk
        probe.close()
        mgr.close(persist=round_ % 2 == 0)  # the next child starts on what this one left
    return with_system


@pytest.mark.parametrize("layout", ["three-tiers", "primary-and-disk", "host-memory-and-disk"])
def test_killed_mid_write_always_restarts_with_exact_pages(tmp_path, layout):
    assert kill_writers_and_restart(tmp_path, layout) >= 3
