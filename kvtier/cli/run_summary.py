"""Figures the demos summarise a run with: TTFT percentiles, agreement of two runs' answers."""

from __future__ import annotations

import statistics


def common_prefix_share(a: list[list[int]], b: list[list[int]]) -> float:
    """The mean share of each answer of ``a`` that ``b``'s answer repeats from its first token."""
    shares = []
    for x, y in zip(a, b, strict=True):
        common = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        shares.append(common / max(len(x), 1))
    return statistics.fmean(shares)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (0 <= q <= 1)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
