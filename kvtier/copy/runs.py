"""Runs of consecutive slots: a call's pairs merged into fewer, larger copies.

A promoted prefix's slots are usually consecutive on both sides, so pairs ``(s, d), (s+1, d+1),
...`` become one run ``(s, d, pages)``: one copy-engine descriptor, one memcpy. Victims leave in
least-recently-used order, which often walks both sides down, ``(s, d), (s-1, d-1), ...``; the
copies of one call may run in any order (a call writes each slot once and reads none it writes),
so such a call is read backwards and merges as well. A run never spans two host registrations
(``KVTIER_HOST_REGISTER_CHUNK_BYTES``): one driver copy may not, so a run is cut where either
side's registration grid has a boundary. Everything is computed with numpy over the whole call,
never a Python object per page.
"""

from __future__ import annotations

import itertools

import numpy as np

from kvtier.storage.pinned import RegistrationGrid


def build_runs(
    pairs: np.ndarray,
    page_bytes: int,
    src_grid: RegistrationGrid | None = None,
    dst_grid: RegistrationGrid | None = None,
) -> np.ndarray:
    """The (m, 3) int64 array of runs ``(src_slot, dst_slot, pages)`` covering ``pairs`` in order.

    ``pairs`` is a checked (n, 2) int64 array (n >= 1), read in ``copy_order``. Row i + 1 joins
    row i's run when both its slots follow row i's by one and, on each side that has a grid, the
    two pages lie in the same registration. Invariants: the runs' pages sum to n, and expanding
    the runs gives ``copy_order(pairs)`` back row for row; no run spans a registration boundary
    of either side.
    """
    n = pairs.shape[0]
    if n == 1:  # the common small call: no numpy pass needed
        return np.array([[pairs[0, 0], pairs[0, 1], 1]], dtype=np.int64)
    pairs = copy_order(pairs)
    src, dst = pairs[:, 0], pairs[:, 1]
    joins = (src[1:] == src[:-1] + 1) & (dst[1:] == dst[:-1] + 1)
    for grid, slots in ((src_grid, src), (dst_grid, dst)):
        if grid is not None:
            joins &= grid.chunk_of(slots[:-1], page_bytes) == grid.chunk_of(slots[1:], page_bytes, last=True)
    runs = np.empty((n, 3), dtype=np.int64)
    if not joins.any():  # scattered slots: one run a pair
        runs[:, :2] = pairs
        runs[:, 2] = 1
        return runs
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    runs = runs[: starts.shape[0]]
    runs[:, 0] = src[starts]
    runs[:, 1] = dst[starts]
    runs[:-1, 2] = starts[1:] - starts[:-1]
    runs[-1, 2] = n - starts[-1]
    return runs


def copy_order(pairs: np.ndarray) -> np.ndarray:
    """``pairs`` backwards (a view) when its first step goes down by one on both sides, else ``pairs``."""
    if pairs.shape[0] > 1 and pairs[1, 0] == pairs[0, 0] - 1 and pairs[1, 1] == pairs[0, 1] - 1:
        return pairs[::-1]
    return pairs


def many_runs(pairs: np.ndarray, limit: int) -> bool:
    """Whether the first ``limit + 2`` pairs alone already make more than ``limit`` runs (read in
    ``copy_order``, registration cuts aside): a call of scattered slots is told in plain Python,
    without a numpy pass. False says nothing about the rest of the call: ``build_runs`` counts it."""
    head = pairs[: limit + 2].tolist()
    if len(head) > 1 and head[1][0] == head[0][0] - 1 and head[1][1] == head[0][1] - 1:
        head = pairs[::-1][: limit + 2].tolist()  # ``copy_order``, read off the head already in hand
    breaks = sum(1 for a, b in itertools.pairwise(head) if b[0] != a[0] + 1 or b[1] != a[1] + 1)
    return breaks >= limit
