"""RecentKeys: what a connector has lately seen in its store, in bounded memory."""

from __future__ import annotations

import pytest

from kvtier.connector.recent_keys import RecentKeys


def test_a_key_added_is_remembered_and_another_is_not():
    recent = RecentKeys(per_generation=8)
    recent.add(["kvtier/a", "kvtier/b"])
    assert "kvtier/a" in recent and "kvtier/b" in recent
    assert "kvtier/c" not in recent


def test_keys_are_forgotten_two_generations_later_and_memory_stays_bounded():
    recent = RecentKeys(per_generation=4)
    first = [f"first/{i}" for i in range(4)]
    recent.add(first)  # fills the newer generation: it becomes the older
    assert all(key in recent for key in first)
    second = [f"second/{i}" for i in range(4)]
    recent.add(second)  # the first generation is forgotten
    assert not any(key in recent for key in first)
    assert all(key in recent for key in second)
    recent.add(f"many/{i}" for i in range(1000))
    assert len(recent._newer) < 4 and len(recent._older) == 4


def test_a_generation_must_hold_a_key():
    with pytest.raises(ValueError, match="per_generation"):
        RecentKeys(per_generation=0)
