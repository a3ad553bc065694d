"""The parts in which a demotion and a promotion of one group share the link
(``kvtier.tiering.duplex.schedule``).

Swaps are built as the planner builds them: victims land in free slots below first (the head
start), then in slots of promoted pages bound for free primary slots, then in slots of promoted
pages that take victims' slots. Run one copy after another, the parts must leave every page's
bytes where they belong; run as two streams, every slot must be read before it is written in
every interleaving the events allow.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import InvariantError
from kvtier.tiering import duplex
from kvtier.tiering.duplex import NO_WAIT, READY, schedule

PAGE = 4096


def swap_pairs(n: int, m: int, free_up: int, free_down: int, lag: int, rng: np.random.Generator):
    """Demotion and promotion pairs of a swap of ``n`` victims and ``m`` promoted pages, as the planner
    makes them (slots drawn at random, each side's slots distinct)."""
    ready = min(m, free_up)
    have = min(n, free_down)
    donors = min(ready, n - have)
    least = max(0, n - have - donors - (m - ready))
    seeds = have + max(least, min(n, lag) - have - donors)
    chained = n - seeds - donors
    primary = rng.permutation(n + ready + 50)
    lower = rng.permutation(m + seeds + 50)
    victim_slots, up_free = primary[:n], primary[n : n + ready]
    leaving_slots, seed_slots = lower[:m], lower[m : m + seeds]
    down_to = np.concatenate([seed_slots, leaving_slots[:donors], leaving_slots[ready : ready + chained]])
    up_to = np.concatenate([up_free, victim_slots[: m - ready]])
    down = np.stack([victim_slots, down_to], axis=1).astype(np.int64)
    up = np.stack([leaving_slots, up_to], axis=1).astype(np.int64)
    return down, up


def run_in_turn(plan, down: np.ndarray, up: np.ndarray) -> None:
    """Copy page names through both tiers in the schedule's order; every page must end where its pair says."""
    primary, lower = {}, {}
    for s, _ in down:
        primary[int(s)] = ("victim", int(s))
    for s, _ in up:
        lower[int(s)] = ("leaving", int(s))
    steps = [(plan.ready, lower, primary)]
    for part in plan.parts:
        steps += [(part.down, primary, lower), (part.up, lower, primary)]
    for pairs, src, dst in steps:
        for s, d in pairs.tolist():
            dst[d] = src[s]
    for s, d in down.tolist():
        assert lower[d] == ("victim", s)
    for s, d in up.tolist():
        assert primary[d] == ("leaving", s)


def ordered_on_two_streams(plan) -> None:
    """Every slot a part reads is read before any part writes it, whatever the two streams interleave."""
    ops = [("up", READY)] + [(side, k) for k in range(len(plan.parts)) for side in ("down", "up")]
    after = {op: set() for op in ops}  # op -> the ops it waits for directly
    for k, part in enumerate(plan.parts):
        after[("down", k)] |= {("down", k - 1)} if k else set()
        after[("up", k)] |= {("up", k - 1), ("down", k)}
        if part.after_up != NO_WAIT:
            after[("down", k)].add(("up", part.after_up))

    def before(op):  # every op that has finished when ``op`` starts
        seen, todo = set(), list(after[op])
        while todo:
            o = todo.pop()
            if o not in seen:
                seen.add(o)
                todo += after[o]
        return seen

    def pairs(op):
        side, k = op
        return (plan.ready if k == READY else plan.parts[k].up) if side == "up" else plan.parts[k].down

    reads = {op: {(("primary" if op[0] == "down" else "lower"), int(s)) for s in pairs(op)[:, 0]} for op in ops}
    writes = {op: {(("lower" if op[0] == "down" else "primary"), int(d)) for d in pairs(op)[:, 1]} for op in ops}
    for writer in ops:
        finished = before(writer)
        for reader in ops:
            if reader != writer and reads[reader] & writes[writer]:
                assert reader in finished, (reader, writer)


def same_pairs(parts: list[np.ndarray], pairs: np.ndarray) -> bool:
    return sorted(map(tuple, np.concatenate(parts).tolist())) == sorted(map(tuple, pairs.tolist()))


def swap_shapes(least_lag: int) -> tuple:
    """Strategies for ``swap_pairs``' sizes: victims, promoted pages, free slots up and down, the
    head start (at least ``least_lag``)."""
    return st.integers(1, 60), st.integers(0, 60), st.integers(0, 20), st.integers(0, 20), st.integers(least_lag, 30)


@settings(max_examples=300, deadline=None)
@given(*swap_shapes(1), st.sampled_from([PAGE, 2 << 20]), st.integers(0, 2**32 - 1))
def test_swaps_run_in_an_order_that_reads_every_slot_first(n, m, free_up, free_down, lag, page, seed):
    if m - min(m, free_up) > n:  # the planner never promotes more pages into victims' slots than there are
        m = n + min(m, free_up)
    down, up = swap_pairs(n, m, free_up, free_down, lag, np.random.default_rng(seed))
    in_turn = schedule(down, up, page, overlap=False)
    run_in_turn(in_turn, down, up)
    both = schedule(down, up, page, overlap=True)
    ordered_on_two_streams(both)
    run_in_turn(both, down, up)
    for plan in (in_turn, both):
        assert same_pairs([p.down for p in plan.parts], down)
        assert same_pairs([plan.ready] + [p.up for p in plan.parts], up)
        assert all(part.after_up < k for k, part in enumerate(plan.parts))


def test_a_race_without_a_swap_keeps_its_parts():
    n = 64
    down = np.stack([np.arange(n), np.arange(100, 100 + n)], axis=1)
    up = np.stack([np.arange(200, 200 + n), np.arange(n)[::-1]], axis=1)  # into the victims' slots
    big = schedule(down, up, 2 << 20, overlap=True)  # 128 MiB: four 32 MiB parts
    assert [len(p.down) for p in big.parts] == [16] * 4 and not big.swaps and not len(big.ready)
    assert [len(p.up) for p in big.parts] == [16] * 4
    small = schedule(down, up, PAGE, overlap=True)  # 256 KiB: one part
    assert len(small.parts) == 1 and len(small.parts[0].up) == n
    assert len(schedule(down, up, 2 << 20, overlap=False).parts) == 1  # one copy after the other


def test_a_small_swap_runs_in_turn_and_a_large_one_both_ways():
    rng = np.random.default_rng(1)
    down, up = swap_pairs(2048, 2048, 0, 0, duplex.swap_lag(2048, PAGE), rng)
    small = schedule(down, up, PAGE, overlap=True)
    assert duplex.swap_lag(2048, PAGE) == 512 and len(small.parts) == 4  # 8 MiB: a quarter at a time
    assert [p.after_up for p in small.parts] == [NO_WAIT, 0, 1, 2]
    lag = duplex.swap_lag(2048, 2 << 20)  # 4 GiB: 16 parts of 256 MiB, two of them ahead
    assert lag == 256
    down, up = swap_pairs(2048, 2048, 0, 0, lag, rng)
    large = schedule(down, up, 2 << 20, overlap=True)
    assert len(large.parts) == 16 and all(p.after_up <= k - 2 for k, p in enumerate(large.parts))


def test_victims_that_wait_for_their_own_promotions_are_refused():
    down = np.array([[0, 10], [1, 11]])
    up = np.array([[10, 0], [11, 1]])  # each promoted page goes where the victim in its slot came from
    with pytest.raises(InvariantError, match="wait"):
        schedule(down, up, PAGE, overlap=False)
