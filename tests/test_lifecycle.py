"""kvtier/lifecycle.py: the one owner of which blocks a layer group keeps live, checked by brute force."""

from __future__ import annotations

import random

import pytest

from kvtier import AttentionLayer, ModelSpec, RecurrentLayer
from kvtier.lifecycle import GroupRule
from kvtier.spec import GroupKind

TPB = 4


def rules(window: int | None, sink_tokens: int) -> list[GroupRule]:
    layers = [AttentionLayer(1, 4), RecurrentLayer(64)]
    if window is not None:
        layers.append(AttentionLayer(1, 4, window=window, sink_tokens=sink_tokens))
    return [GroupRule.of(g, TPB) for g in ModelSpec(layers).groups]


def attended_blocks(window: int | None, sink_tokens: int, history: int, num_blocks: int) -> set[int]:
    """Blocks holding a token that the next token (at ``history``) or a later one may attend to."""
    if window is None:
        return set(range(num_blocks))
    keep = {t // TPB for t in range(min(sink_tokens, num_blocks * TPB))}
    first_seen = max(0, history + 1 - window)  # the token at ``history`` sees [history + 1 - W, history]
    return keep | {b for b in range(num_blocks) if (b + 1) * TPB > first_seen}


@pytest.mark.parametrize("seed", range(8))
def test_live_blocks_are_those_a_next_token_attends_to(seed):
    rng = random.Random(seed)
    for _ in range(200):
        window = rng.choice([None, rng.randint(1, 40)])
        sink = rng.randint(0, 12) if window is not None else 0
        history = rng.randint(0, 120)
        num_blocks = rng.randint(0, 40)
        for rule in rules(window, sink):
            if rule.kind is GroupKind.RECURRENT:
                assert rule.pages_needed(num_blocks * TPB, history) == 1  # one live state, whatever the length
                continue
            expect = attended_blocks(rule.window, sink if rule.window else 0, history, num_blocks)
            live = {b for b in range(num_blocks) if rule.is_live(b, history)}
            assert live == expect
            assert rule.pages_needed(num_blocks * TPB, history) == len(live)


@pytest.mark.parametrize("seed", range(4))
def test_live_in_counts_the_live_blocks_of_any_range(seed):
    rng = random.Random(seed)
    for _ in range(300):
        window, sink = rng.randint(1, 30), rng.randint(0, 9)
        rule = rules(window, sink)[-1]
        history, start, end = rng.randint(0, 90), rng.randint(0, 30), rng.randint(0, 30)
        brute = sum(rule.is_live(b, history) for b in range(start, end))
        assert rule.live_in(start, end, history) == brute


def test_a_sliding_window_group_keeps_sinks_and_the_window():
    rule = rules(window=8, sink_tokens=5)[-1]  # two sink blocks of 4 tokens
    assert rule.sink_blocks == 2
    assert rule.first_live_block(history=20) == 3  # the token at 20 sees [13, 20]: blocks 3.. (and the sinks)
    assert [b for b in range(6) if rule.is_live(b, 20)] == [0, 1, 3, 4, 5]
    assert rule.pages_needed(24, 20) == 5
    assert rule.first_live_block(history=3) == 2  # nothing is stale before the sinks end
