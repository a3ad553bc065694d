"""Swaps through the mover's scratch memory (``kvtier.tiering.swap_scratch``).

The copies of a ``ScratchSwap``, run in their order on one stream, must leave every victim in its
lower slot and every promoted page in its primary slot, whatever the mix of victims that land in
free slots and victims that land in slots promoted pages leave. The scratch itself is allocated
when a swap first asks for it, and a failed allocation leaves swaps to their head start.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.tiering import duplex, mover
from kvtier.tiering.swap_scratch import SwapScratch, through_scratch
from tests.kvdata import small_spec
from tests.test_duplex import swap_pairs, swap_shapes
from tests.test_tiers import TPB, come_back_whole, full_tiers


def run_through_scratch(swap, down: np.ndarray, up: np.ndarray) -> None:
    """Copy page names through both tiers and the scratch in the swap's order; every page must end
    where its pair says, and no slot is read after this swap wrote it."""
    places = {"primary": {}, "lower": {}, "scratch": {}}
    for s, _ in down.tolist():
        places["primary"][s] = ("victim", s)
    for s, _ in up.tolist():
        places["lower"][s] = ("leaving", s)
    written = set()
    steps = [
        (swap.park, "primary", "scratch"),
        (swap.direct, "primary", "lower"),
        (swap.up, "lower", "primary"),
        (swap.unpark, "scratch", "lower"),
    ]
    for pairs, src, dst in steps:
        for s, d in pairs.tolist():
            assert (src, s) not in written or src == "scratch", (src, s)  # read before it is written
            places[dst][d] = places[src][s]
            written.add((dst, d))
    for s, d in down.tolist():
        assert places["lower"][d] == ("victim", s)
    for s, d in up.tolist():
        assert places["primary"][d] == ("leaving", s)
    assert sorted(swap.park[:, 1].tolist()) == list(range(swap.parked))  # scratch slots 0, 1, ...


@settings(max_examples=300, deadline=None)
@given(*swap_shapes(0), st.integers(0, 2**32 - 1))
def test_a_swap_through_the_scratch_leaves_every_page_where_it_belongs(n, m, free_up, free_down, lag, seed):
    if m - min(m, free_up) > n:  # the planner never promotes more pages into victims' slots than there are
        m = n + min(m, free_up)
    down, up = swap_pairs(n, m, free_up, free_down, lag, np.random.default_rng(seed))
    swap = through_scratch(down, up)
    chained = int(np.isin(down[:, 1], up[:, 0]).sum())
    if not chained:
        assert swap is None  # a race without a swap: ``duplex.schedule`` cuts it
        return
    assert swap.parked == chained and len(swap.direct) == n - chained
    run_through_scratch(swap, down, up)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.integers(1, 64), st.booleans(), st.integers(0, 2**32 - 1))
def test_victims_landing_in_slots_a_promotion_reads_are_found_in_any_order(n, m, ascending, seed):
    """Slots in any order, below, among and above the promoted pages' (the lookup sorts them, or
    searches them as they are when ascending, as ``MovePlanner._swap`` pairs them)."""
    rng = np.random.default_rng(seed)
    lower = rng.permutation(3 * (n + m))
    down = np.column_stack((rng.permutation(n), lower[:n]))
    read = lower[n // 2 : n // 2 + m]
    up = np.column_stack((np.sort(read) if ascending else rng.permutation(read), np.arange(m)))
    swap = through_scratch(down, up)
    chained = np.isin(down[:, 1], up[:, 0])
    if not chained.any():
        assert swap is None
        return
    assert swap.park[:, 0].tolist() == down[chained, 0].tolist()
    assert swap.direct.tolist() == down[~chained].tolist()


@pytest.mark.parametrize("order", ["ascending", "shuffled"])
def test_a_full_swap_parks_every_victim_in_order(order):
    """No free slot and no head start: every victim lands in a promoted page's slot, the pairs in
    the same order (found without a search); each is parked, in its order."""
    rng = np.random.default_rng(5)
    lower = np.sort(rng.choice(10_000, 300, replace=False)) if order == "ascending" else rng.permutation(300) + 7
    victims = rng.permutation(300)
    down, up = np.column_stack((victims, lower)), np.column_stack((lower, victims))
    swap = through_scratch(down, up)
    assert swap.parked == 300 and len(swap.direct) == 0
    assert swap.park[:, 0].tolist() == victims.tolist() and swap.unpark[:, 1].tolist() == lower.tolist()
    run_through_scratch(swap, down, up)


def test_the_scratch_holds_whole_pages_and_is_allocated_when_first_needed():
    scratch = SwapScratch(torch.device("cpu"), 10_000)
    assert scratch.pages(4096) == 2 and not scratch.allocated  # sizing allocates nothing
    assert scratch.pages(20_000) == 0  # a page larger than the scratch: the swap takes its head start
    assert scratch.allocate() and scratch.allocated and scratch.buffer.numel() == 10_000
    scratch.release()
    assert not scratch.allocated and SwapScratch(torch.device("cpu"), 0).pages(16) == 0


def test_a_scratch_that_cannot_be_allocated_leaves_swaps_their_head_start(caplog):
    scratch = SwapScratch(torch.device("cpu"), 1 << 62)  # more than any machine has
    with caplog.at_level(logging.WARNING, logger="kvtier.tiering.swap_scratch"):
        assert not scratch.allocate() and not scratch.allocate()
    assert len(caplog.records) == 1 and "head start" in caplog.text and not scratch.allocated
    assert scratch.pages(4096) == 0


def scratch_of(pages: int, monkeypatch) -> None:
    """Managers built from now on get a swap scratch of ``pages`` pages of the llama spec."""
    probe = kvtier.KVCacheManager(small_spec("llama"), kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    monkeypatch.setattr(mover, "SWAP_SCRATCH_BYTES", pages * probe.page_bytes(0))
    probe.close()


def resume_counting(cache) -> list:
    """Resume ``cache``; the swaps the mover took through its scratch."""
    swaps = []
    real = mover.Mover._swap_through_scratch
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mover.Mover, "_swap_through_scratch", lambda self, d, w, s: swaps.append(w) or real(self, d, w, s))
        assert cache.resume()
    return swaps


def test_a_swap_larger_than_the_scratch_allocates_none_and_takes_its_head_start(monkeypatch):
    scratch_of(2, monkeypatch)  # 12 victims: 10 would take a head start, more than the usual 3
    mgr, oracle, talks = full_tiers("llama", write_through=False)
    cache = mgr.create_cache(talks[2] + [7])
    drops = mgr.stats().drops
    assert not resume_counting(cache) and not mgr._pool.mover.scratch.allocated
    assert mgr.stats().drops - drops == duplex.swap_lag(12, mgr.page_bytes(0)) == 3
    oracle.check(cache, talks[2] + [7])
    mgr.close()


def test_a_swap_a_little_larger_than_the_scratch_parks_what_it_holds(monkeypatch):
    """12 victims, a scratch of 10 pages: a head start of 2 (not the usual 3), 10 parked."""
    scratch_of(10, monkeypatch)
    mgr, oracle, talks = full_tiers("llama", write_through=False)
    cache = mgr.create_cache(talks[2] + [7])
    drops = mgr.stats().drops
    swaps = resume_counting(cache)
    assert len(swaps) == 1 and swaps[0].parked == 10 and len(swaps[0].direct) == 2
    assert mgr.stats().drops - drops == 2
    oracle.check(cache, talks[2] + [7])
    cache.close()
    come_back_whole(mgr, oracle, talks, {4: 48, 5: 48})
    mgr.close()


def test_a_swap_with_more_victims_than_promoted_pages_parks_only_the_chained_ones():
    """A resume that reuses part of a block copies that block's page into a new one: it demotes a
    victim more than the pages it promotes make room for. That one lands in a slot freed below;
    the others wait in the scratch for the slots the promoted pages leave. Every page comes back
    byte for byte."""
    mgr, oracle, talks = full_tiers("llama", write_through=False)
    tokens = talks[2][:46] + [7]  # 11 whole blocks and half of the 12th
    cache = mgr.create_cache(tokens)
    assert cache.reused_by_tier.get("host") == 46
    swaps = resume_counting(cache)
    assert len(swaps) == 1 and swaps[0].parked == 11 and len(swaps[0].direct) == 1 and len(swaps[0].up) == 12
    oracle.check(cache, tokens)
    cache.close()
    come_back_whole(mgr, oracle, talks, {4: 48, 5: 48})
    mgr.close()
