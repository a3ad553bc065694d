"""A plan's copies per edge (``kvtier.tiering.plan.EdgeCopies``): pairs come back in the order they
were added, whether one at a time or a batch (lists or arrays) at a time."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvtier.tiering.plan import EdgeCopies, MovePlan

pair = st.tuples(st.integers(0, 10_000), st.integers(0, 10_000))
step = st.one_of(
    pair.map(lambda p: ("one", [p])),
    st.lists(pair, max_size=6).map(lambda ps: ("list", ps)),
    st.lists(pair, max_size=6).map(lambda ps: ("array", ps)),
)


@given(st.lists(step, max_size=12))
def test_pairs_come_back_in_the_order_they_were_added(steps):
    copies = EdgeCopies()
    expected = []
    for kind, pairs in steps:
        if kind == "one":
            copies.add(*pairs[0])
        else:
            src, dst = [s for s, _ in pairs], [d for _, d in pairs]
            copies.add_batch(
                *((np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)) if kind == "array" else (src, dst))
            )
        expected += pairs
    got = copies.pairs()
    assert got.dtype == np.int64 and got.shape == (len(expected), 2)
    assert [tuple(p) for p in got.tolist()] == expected
    assert bool(copies) == bool(expected)  # an empty batch adds nothing


def test_a_plan_keys_its_copies_by_edge():
    plan = MovePlan()
    plan.add(1, 0, 2, 5, 7)
    plan.edges[(1, 0, 2)].add_batch([8, 9], [10, 11])
    assert list(plan.edges) == [(1, 0, 2)]
    assert plan.edges[(1, 0, 2)].pairs().tolist() == [[5, 7], [8, 10], [9, 11]]
