"""The reuse points a match offers below its own, and the bytes each would load from each tier.

A cache may reuse less than the longest match (``kvtier.tiering.load_cost``: loading the rest
may be slower than recomputing it). The points it may stop at are the block boundaries
``c * tpb`` (``0 <= c <= len(full_nodes)``) at which every group has a hit (the rules of
``kvtier.reuse.matching``), and the match's own point. What a point loads is what a cache
created for it would use (``ReuseMatch.pages``), not a sum over blocks: a full-attention group
needs every block before the point, a sliding-window group only its sink blocks and the blocks
inside its window there, a recurrent group the one snapshot taken at the point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.lifecycle import GroupRule
from kvtier.pages import Page
from kvtier.reuse.matching import ReuseMatch
from kvtier.spec import GroupKind


@dataclass(frozen=True, slots=True)
class ReusePoints:
    """``tokens[k]``: the tokens reused at point ``k`` (ascending, from 0 to the match's own point);
    ``tier_bytes[k, t]``: the bytes of the pages in tier ``t`` that reusing them would use."""

    tokens: list[int]
    tier_bytes: np.ndarray


def reuse_points(match: ReuseMatch, rules: list[GroupRule], page_bytes: Sequence[int], num_tiers: int) -> ReusePoints:
    """Every point ``match`` may be cut back to, with what each would load (see the module's docstring)."""
    nodes = match.full_nodes
    n = len(nodes)
    tpb = rules[0].tokens_per_block
    boundaries = np.arange(n + 1)
    loads = np.zeros((n + 1, num_tiers), dtype=np.int64)
    valid = np.ones(n + 1, dtype=bool)
    for rule in rules:
        g = rule.group_id
        if rule.kind is GroupKind.RECURRENT:
            snapshots = [node.snapshots.get(tpb) for node in nodes]
            tiers = np.array([-1] + [-1 if page is None else page.tier for page in snapshots], dtype=np.int64)
            valid[1:] &= tiers[1:] >= 0
            held = np.flatnonzero(tiers >= 0)
            np.add.at(loads, (held, tiers[held]), [page_bytes[snapshots[c - 1].group] for c in held])
            continue
        pages = match.blocks(rule) if rule.window is None else [node.pages[g] for node in nodes]
        tiers = np.array([-1 if page is None else page.tier for page in pages], dtype=np.int64)
        before = _counts_before(tiers, num_tiers)  # row c: pages per tier in blocks [0, c), then misses
        if rule.window is None:
            loads += before[:, :num_tiers] * page_bytes[g]
            continue
        sinks_end = np.minimum(rule.sink_blocks, boundaries)
        first_live = np.array([rule.first_live_block(c * tpb) for c in range(n + 1)], dtype=np.int64)
        live_start = np.minimum(first_live, boundaries)
        live = before[sinks_end] + before[boundaries] - before[live_start]
        valid &= live[:, num_tiers] == 0
        loads += live[:, :num_tiers] * page_bytes[g]
    points = [int(c) for c in np.flatnonzero(valid)]
    tokens = [c * tpb for c in points]
    tier_bytes = loads[points]
    if match.tokens > n * tpb:  # the match reuses part of one more block
        tokens.append(match.tokens)
        tier_bytes = np.vstack([tier_bytes, _bytes_by_tier(match.pages(rules), page_bytes, num_tiers)])
    elif tokens[-1] != match.tokens:  # (every group has a hit at the match's own point)
        tokens.append(match.tokens)
        tier_bytes = np.vstack([tier_bytes, loads[n]])
    return ReusePoints(tokens, tier_bytes)


def _counts_before(tiers: np.ndarray, num_tiers: int) -> np.ndarray:
    """Row ``c``: how many of ``tiers[:c]`` are each tier (columns ``0..num_tiers-1``) and how many
    are missing (-1, the last column)."""
    onehot = np.zeros((len(tiers) + 1, num_tiers + 1), dtype=np.int64)
    onehot[np.arange(1, len(tiers) + 1), tiers] = 1  # -1 indexes the last column: a block without a page
    return np.cumsum(onehot, axis=0)


def _bytes_by_tier(pages: list[Page], page_bytes: Sequence[int], num_tiers: int) -> np.ndarray:
    out = np.zeros(num_tiers, dtype=np.int64)
    for page in pages:
        out[page.tier] += page_bytes[page.group]
    return out
