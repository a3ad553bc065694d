"""kvtier/tiering/eviction.py: eviction order (lowest priority, then least recently added) and priority checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.pages import Page
from kvtier.tiering.eviction import MAX_PRIORITY, MIN_PRIORITY, EvictionIndex, check_priority


def page(priority: int, slot: int = 0) -> Page:
    return Page(group=0, tier=0, slot=slot, priority=priority)


def test_empty_index():
    index = EvictionIndex()
    assert len(index) == 0
    assert index.first() is None
    assert list(index) == []
    assert page(35) not in index


def test_lowest_priority_first_then_least_recently_added():
    index = EvictionIndex()
    a, b, c, d, e = page(50, 1), page(10, 2), page(50, 3), page(10, 4), page(100, 5)
    for p in (a, b, c, d, e):
        index.add(p)
    assert list(index) == [b, d, a, c, e]
    assert index.first() is b
    assert len(index) == 5
    assert all(p in index for p in (a, b, c, d, e))


def test_redundant_pages_go_before_every_priority():
    index = EvictionIndex()
    low, copy, high, other_copy = page(0, 1), page(100, 2), page(100, 3), page(50, 4)
    index.add(low)
    index.add(copy, redundant=True)
    index.add(high)
    index.add(other_copy, redundant=True)
    assert list(index) == [copy, other_copy, low, high] and len(index) == 4
    index.add(copy)  # no longer redundant (e.g. it took over its original's place): back to its priority
    assert list(index) == [other_copy, low, high, copy] and len(index) == 4
    index.discard(other_copy)
    assert other_copy not in index and index.first() is low and len(index) == 3


def test_pages_are_distinct_records_even_when_equal_fields():
    index = EvictionIndex()
    twins = [page(20, 7), page(20, 7)]
    for p in twins:
        index.add(p)
    assert len(index) == 2
    assert list(index) == twins
    index.discard(twins[0])
    assert list(index) == [twins[1]]


def test_add_of_a_present_page_moves_it_to_the_most_recent_end():
    index = EvictionIndex()
    a, b, c, low = page(40, 1), page(40, 2), page(40, 3), page(0, 4)
    for p in (a, b, c, low):
        index.add(p)
    index.add(a)
    assert list(index) == [low, b, c, a]
    assert len(index) == 4  # re-adding does not count twice
    index.add(a)
    assert list(index) == [low, b, c, a]
    index.add(low)  # alone in its level: stays first
    assert index.first() is low


def test_discard():
    index = EvictionIndex()
    a, b, c = page(5, 1), page(5, 2), page(6, 3)
    for p in (a, b, c):
        index.add(p)
    index.discard(a)
    assert list(index) == [b, c] and len(index) == 2 and a not in index
    index.discard(a)  # absent: nothing happens
    index.discard(page(5, 9))
    assert list(index) == [b, c] and len(index) == 2
    index.discard(b)
    assert index.first() is c
    index.discard(c)
    assert index.first() is None and len(index) == 0 and list(index) == []


def test_take_skips_and_removes_stale_entries_and_keeps_unwanted_ones():
    index = EvictionIndex()
    a, b, c, d = page(10, 1), page(10, 2), page(20, 3), page(30, 4)
    for p in (a, b, c, d):
        index.add(p)
    b.locks = 1  # locked since it was indexed: its entry is stale
    c.refs = 1  # held: evictable here, but not what this search wants
    found = index.take(2, unheld_only=True)
    assert found == [a, d]
    assert list(index) == [a, c, d]  # the stale entry passed on the way is gone, the unwanted one stays
    assert len(index) == 3
    assert index.take(5) == [a, c, d]
    assert index.take(0) == []
    b.locks = 0
    index.add(b)  # evictable again: indexed as the most recently used
    assert list(index) == [a, b, c, d] and len(index) == 4


def test_take_reads_past_windows_of_stale_entries_in_order():
    index = EvictionIndex()
    pages = [page(10, i) for i in range(300)]
    for p in pages:
        index.add(p)
    for p in pages[:150]:
        p.locks = 1  # stale: more than one window of them before the first page that may leave
    for p in pages[150:200:2]:
        p.refs = 1  # held: may leave a memory tier, not the last one
    assert index.take(30) == pages[150:180]
    assert list(index) == pages[150:]  # every stale entry passed is gone
    found = index.take(30, held_stale=True)
    assert found == pages[151:200:2] + pages[200:205]
    assert list(index) == pages[151:200:2] + pages[200:]  # held entries were stale for this search
    assert index.take(1000, held_stale=True) == pages[151:200:2] + pages[200:]
    assert len(index) == len(list(index)) == 125


def test_a_stale_entry_is_indexed_again_at_the_most_recent_end():
    index = EvictionIndex()
    a, b = page(10, 1), page(10, 2)
    index.add(a)
    index.add(b)
    a.refs = 1  # held, entry left in place; released later
    a.refs = 0
    index.add(a)
    assert list(index) == [b, a] and len(index) == 2


def test_extreme_priorities():
    index = EvictionIndex()
    top, bottom = page(MAX_PRIORITY), page(MIN_PRIORITY)
    index.add(top)
    index.add(bottom)
    assert list(index) == [bottom, top]


@pytest.mark.parametrize("value", [0, 1, 35, 99, 100])
def test_check_priority_accepts(value):
    assert check_priority(value) == value


@pytest.mark.parametrize(
    ("value", "error"),
    [(-1, ValueError), (101, ValueError), (1000, ValueError), (True, TypeError), (False, TypeError), (3.0, TypeError)]
    + [("35", TypeError), (None, TypeError)],
)
def test_check_priority_rejects(value, error):
    with pytest.raises(error, match=r"priority must be (an int )?in 0\.\.100"):
        check_priority(value)


ops = st.lists(st.tuples(st.sampled_from(["add", "discard"]), st.integers(0, 9)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4).map(lambda x: x * 25), min_size=10, max_size=10), ops)
def test_against_a_sorted_list_model(priorities, steps):
    pages = [page(p, i) for i, p in enumerate(priorities)]
    index = EvictionIndex()
    model: list[Page] = []  # in the order pages were (last) added
    for op, i in steps:
        p = pages[i]
        if p in model:
            model.remove(p)
        if op == "add":
            index.add(p)
            model.append(p)
        else:
            index.discard(p)
        expected = sorted(model, key=lambda x: x.priority)  # stable: ties stay in order of addition
        assert list(index) == expected
        assert len(index) == len(expected)
        assert index.first() is (expected[0] if expected else None)
        assert all((q in index) == (q in model) for q in pages)


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 2), st.booleans()), max_size=30))
@settings(max_examples=200, deadline=None)
def test_batched_add_and_discard_match_one_page_at_a_time(ops):
    pages = [page(p % 3 * 40, slot) for slot, p in enumerate(range(8))]
    batched, single = EvictionIndex(), EvictionIndex()
    for first, action, redundant in ops:
        some = pages[first : first + 3]
        if action == 2:
            batched.discard_all(some)
            for p in some:
                single.discard(p)
        else:
            new = [p for p in some if p not in single]  # add_new takes pages without an entry only
            batched.add_new(new, redundant=redundant)
            for p in new:
                single.add(p, redundant=redundant)
        assert list(batched) == list(single) and len(batched) == len(single)
