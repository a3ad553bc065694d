"""Splitting a tier's byte quota across layer groups.

Per block of history, an attention group (full or sliding window, whose stale blocks are still
kept for reuse) needs one page and a recurrent group ``1 / snapshot_interval_blocks`` pages (its
snapshots). A tier's bytes are split in proportion to those byte demands, so that the groups run
out of pages at about the same time; every group must get at least one page.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.layout import PageGeometry
from kvtier.spec import GroupKind


def slots_per_group(
    quota: int, geometries: Sequence[PageGeometry], snapshot_interval_blocks: int, tier: str
) -> list[int]:
    """Slots of each group in a tier of ``quota`` bytes; ``ValueError`` if a group gets none.

    Integer arithmetic throughout: weights are ``snapshot_interval_blocks`` for attention groups
    and 1 for recurrent ones, so a quota that holds an exact number of blocks loses no page.
    """
    weights = [1 if g.group.kind is GroupKind.RECURRENT else snapshot_interval_blocks for g in geometries]
    demand = sum(w * g.page_bytes for w, g in zip(weights, geometries, strict=True))
    slots = [quota * w // demand for w in weights]
    for n, geometry in zip(slots, geometries, strict=True):
        if n < 1:
            need = -(-demand // min(weights))
            split = (
                f"split across the {len(geometries)} layer groups by what they use per block, it leaves"
                if len(geometries) > 1
                else "it leaves"
            )
            raise ValueError(
                f"the {tier} tier's quota of {quota} bytes is too small: {split} layer group "
                f"{geometry.group_id} ({geometry.page_bytes}-byte pages) no page; give it at least {need} bytes"
            )
    return slots
