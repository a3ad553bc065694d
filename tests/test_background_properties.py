"""The cache state machine with background work on: write-through copies in host memory, a free
reserve in the primary tier, prefetches from disk into host memory and disk write-behind batches
running on their threads while other operations go on, and ``maintain`` called at any point
between operations.

Every rule of ``CacheMachine`` runs as before (pages checked byte for byte against the oracle on
every resume, invariants after every step), with the host tier keeping copies of published
pages, so demotions that take a copy's slot, copies left behind by promotions, copies evicted to
make room, and duplex plans are all exercised on every tier configuration.
"""

from __future__ import annotations

import dataclasses
import tempfile

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

import kvtier
from tests.kvdata import small_spec
from tests.test_cache_properties import PREFIXES, SCOPES, SETTINGS, TPB, CacheMachine, PageOracle, tier_configs

FEWER = settings(SETTINGS, max_examples=15)  # the plain machines cover the rest of the space


class BackgroundMachine(CacheMachine):
    reserve = 0.2
    blocking_writes = True
    min_hits = 0  # HostTier.write_through_min_hits

    @initialize()
    def setup(self) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        spec = small_spec(self.kind)
        tiers = tier_configs(self.kind, self.pages, spec, self.tmp.name)
        tiers = [
            dataclasses.replace(t, free_reserve=self.reserve)
            if isinstance(t, kvtier.PrimaryTier)
            else dataclasses.replace(t, write_through=True, write_through_min_hits=self.min_hits)
            if isinstance(t, kvtier.HostTier)
            else dataclasses.replace(t, write_behind=True, blocking_writes=self.blocking_writes)
            for t in tiers
        ]
        config = kvtier.CacheConfig(tokens_per_block=TPB, tiers=tiers, snapshot_interval_blocks=2, device=self.device)
        self.mgr = kvtier.KVCacheManager(spec, config)
        self.oracle = PageOracle(self.mgr)
        self.live = []
        self.held = []  # prefetches holding what they landed, until ``cancel_held``

    @rule()
    def maintain(self):
        """Between steps; every copy that write-through makes is of a page reused ``min_hits`` times."""
        pool = self.mgr._pool
        host = pool.background.host
        before = set(host.copies) if host is not None else set()
        self.mgr.maintain()
        if host is not None:
            new = [original for original in host.copies if original not in before]
            assert all(original.hits >= self.min_hits for original in new)
        if not self.min_hits:
            assert not any(p.hits for owners in pool.tiers[0].owners for p in owners if p is not None)

    @rule()
    def finish_write_behind(self):
        """Let a running disk write-behind batch finish (``maintain`` lands it later)."""
        batch = self.mgr._pool.write_behind and self.mgr._pool.write_behind.active
        if batch:
            batch.future.exception(10)

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.integers(1, 30),
        scope=st.integers(0, 1),
        wait=st.booleans(),
        hold=st.booleans(),
    )
    def prefetch_to_host(self, prefix, prefix_len, scope, wait, hold):
        """Read a prefix from disk in the background, maybe holding what it lands in host memory
        (as the engine's queue does); other rules run while the read goes on."""
        job = self.mgr.prefetch_to_host(PREFIXES[prefix][:prefix_len], scope=SCOPES[scope], hold=hold)
        if job is not None:
            if hold:
                self.held.append(job)
            if wait:
                assert job.wait(10)

    @rule(index=st.integers(0, 50))
    def cancel_held(self, index):
        """Give up a held read: its pages are let go at the manager's next call that lands reads or
        makes room (the invariant check included)."""
        if self.held:
            self.held.pop(index % len(self.held)).cancel()

    @rule(scope=st.integers(0, 1))
    def forget_scope(self, scope):
        """Forget a scope, held pages included: they stay pinned, unpublished, until let go."""
        self.mgr.forget_scope(SCOPES[scope])


def machine(
    kind: str,
    pages: dict[str, int],
    reserve: float,
    device: str = "cpu",
    blocking_writes: bool = True,
    min_hits: int = 0,
) -> type[BackgroundMachine]:
    name = f"{kind}_{'_'.join(pages)}_background"
    attributes = {
        "kind": kind,
        "pages": pages,
        "reserve": reserve,
        "device": device,
        "blocking_writes": blocking_writes,
        "min_hits": min_hits,
    }
    return type(name, (BackgroundMachine,), attributes)


@pytest.mark.parametrize("kind", ["llama", "swa", "hybrid"])
def test_host_with_write_through(kind):
    m = machine(kind, {"primary": 10, "host": 12}, reserve=0.2)
    m.TestCase.settings = FEWER
    m.TestCase().runTest()


@pytest.mark.parametrize("kind", ["llama", "swa", "hybrid"])
def test_host_with_selective_write_through(kind):
    """Only pages reused at least once are copied: the others are demoted by copying, beside copies."""
    m = machine(kind, {"primary": 10, "host": 12}, reserve=0.2, min_hits=1)
    m.TestCase.settings = FEWER
    m.TestCase().runTest()


@pytest.mark.parametrize("kind", ["llama", "swa", "hybrid"])
def test_three_tiers_with_write_through(kind):
    m = machine(kind, {"primary": 8, "host": 6, "disk": 20}, reserve=0.0)
    m.TestCase.settings = FEWER
    m.TestCase().runTest()


@pytest.mark.parametrize("kind", ["llama", "swa", "hybrid"])
def test_reserve_without_host(kind):
    """No host tier: on the CPU the primary tier is host memory, read into and written behind; as in
    the vLLM connector, what was not written behind is dropped rather than written when pushed out."""
    m = machine(kind, {"primary": 10, "disk": 20}, reserve=0.3, blocking_writes=False)
    m.TestCase.settings = FEWER
    m.TestCase().runTest()
