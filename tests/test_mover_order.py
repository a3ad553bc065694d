"""The order a plan's edges run in (``kvtier.tiering.mover.edge_order``).

Every edge runs exactly once; demotions run before anything that writes into a warmer tier or
within one, so a slot a demotion reads is never written first. The regression: a copy within the
primary tier (a partly reused block's private copy) was taken for a demotion racing its own
promotion and ran before the demotion that read the slot it wrote (wrong bytes on the GPU).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.tiering.mover import edge_order

TIERS = 3  # primary, host, disk


def test_a_copy_within_the_primary_tier_runs_after_the_demotions():
    edges = [(0, 0, 1), (0, 1, 1), (1, 0, 1), (0, 1, 0), (0, 0, 0), (2, 0, 0), (1, 2, 0)]
    demotions, duplex, others = edge_order(edges, two_way={1})
    assert demotions == [(1, 2, 0), (0, 1, 0)]
    assert duplex == [(0, 1, 1)]  # with its promotion (1, 0, 1)
    assert others == [(0, 0, 1), (0, 0, 0), (2, 0, 0)]


edge = st.tuples(st.integers(0, TIERS - 1), st.integers(0, TIERS - 1), st.integers(0, 2))


@given(st.sets(edge, max_size=20), st.sampled_from([set(), {1}]))
def test_every_edge_runs_once_and_nothing_writes_before_the_demotions(edges, two_way):
    demotions, duplex, others = edge_order(edges, two_way)
    raced = [(e[1], 0, e[2]) for e in duplex]
    assert sorted(demotions + duplex + raced + others) == sorted(edges)
    assert all(e[1] > e[0] for e in demotions + duplex)  # demotions only
    assert all(e[0] == 0 and e[1] in two_way for e in duplex)
    assert all(e[1] <= e[0] for e in others)
    assert [e[0] for e in demotions] == sorted((e[0] for e in demotions), reverse=True)  # deepest first
