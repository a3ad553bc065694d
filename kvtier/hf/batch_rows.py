"""The rows of a left-padded batch, and how much of each row is taken from kvtier.

A batch of ``L`` columns is reused as one rectangle: its first ``width`` columns come from kvtier
for every row (row i holds ``width - pad_i`` of its tokens there, or padding only), the rest is
computed. So ``width = L - (the longest part of any row that kvtier does not hold)``, never more
than ``L - 1``. A row that needs a shorter prefix than the longest one kvtier matched for it gets
it exactly: from the same pages when the model has only full-attention layers, else from a
cache matched on that shorter prompt (a sliding window or a recurrent state is only valid at the
point where it was kept); when kvtier cannot give exactly that, the width shrinks and the choice
starts over. Every reusing row's pages are resumed together, so the primary tier must hold them
all at once (a row that cannot be resumed reuses nothing). Each row keeps a ``write`` cache
created on its whole prompt, which receives the new blocks after generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier.cache import KVCache
from kvtier.config import ReuseScope
from kvtier.manager import KVCacheManager
from kvtier.spec import GroupKind


@dataclass(slots=True)
class Row:
    """One batch row: its padding, its prompt tokens, and its kvtier caches."""

    index: int
    pad: int
    prompt: np.ndarray  # int64 token ids (a view of the call's ids on the host: kvtier reads it without a list)
    write: KVCache  # created on the whole prompt: holds the matched prefix, receives the new blocks
    scope: ReuseScope  # the row's reuse scope (its adapter's, with per-row adapters)
    read: KVCache | None = None  # resumed, holds exactly ``reused`` tokens' pages: write itself or a shorter match
    reused: int = 0  # prompt tokens taken from kvtier
    bound: int | None = None  # prompt tokens whose KV depends on token ids alone (``token_bound``); None: all


def left_pads(mask: torch.Tensor) -> list[int] | None:
    """Padding columns per row when every row is ``[0] * pad + [1] * rest`` with ``rest >= 1``, else None."""
    host = mask.detach().to("cpu", torch.int64)
    ones = host.sum(dim=1)
    pads = host.shape[1] - ones
    if (ones == 0).any():
        return None
    columns = torch.arange(host.shape[1], device=host.device).expand_as(host)
    if not torch.equal(host, (columns >= pads[:, None]).to(torch.int64)):
        return None
    return pads.tolist()


def choose_width(mgr: KVCacheManager, rows: list[Row], num_columns: int, stream=None) -> int:
    """The number of leading columns every row takes from kvtier; each row's ``read`` cache is then
    ACTIVE and holds exactly ``row.reused`` tokens (or is None when the row reuses nothing). What
    a row's ``write`` matched past ``row.reused`` is counted as recomputed (``KVCache.recompute_from``)."""
    only_full = all(g.kind is GroupKind.ATTENTION for g in mgr.layer_groups)
    limit = [row.write.num_reused_tokens for row in rows]
    while True:
        width = max(0, min(num_columns - 1, *(row.pad + n for row, n in zip(rows, limit, strict=True))))
        failed: tuple[int, int] | None = None
        for i, row in enumerate(rows):
            reused = max(0, width - row.pad)
            row.reused = reused
            if reused == 0:
                continue
            read = row.write
            if reused != read.num_reused_tokens and not only_full:
                read = row.write.cache_for_prefix(reused + 1)  # the row's request: counted once, by ``write``
                if read.num_reused_tokens < reused:
                    failed = (i, read.num_reused_tokens)
                    read.close()
                    break
            if not read.resume(stream):
                failed = (i, 0)
                if read is not row.write:
                    read.close()
                break
            if read.num_committed_tokens < reused:  # a page failed its checksum on the way in
                failed = (i, read.num_committed_tokens)
                row.read = read
                break
            row.read = read
        if failed is None:
            for row in rows:
                row.write.recompute_from(row.reused)
            return width
        release_reads(rows)
        limit[failed[0]] = min(limit[failed[0]], failed[1])


def release_reads(rows: list[Row]) -> None:
    """Let go of every read cache: a row's write cache is suspended, a separate read cache closed."""
    for row in rows:
        if row.read is row.write:
            row.write.suspend()
        elif row.read is not None:
            row.read.close()
        row.read = None


def close_rows(rows: list[Row]) -> None:
    """Close every cache of every row (idempotent)."""
    for row in rows:
        if row.read is not None and row.read is not row.write:
            row.read.close()
        row.read = None
        row.write.close()
