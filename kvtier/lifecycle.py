"""A layer group's life cycle in blocks: which blocks it keeps live at a history, and the pages that takes.

With ``tpb`` tokens per block, at history ``h`` (tokens whose KV is written or promised):

- a full-attention group keeps every block;
- a sliding-window group with window ``W`` and ``s = ceil(sink_tokens / tpb)`` sink blocks keeps
  the sink blocks and the blocks from ``max(s, (h + 1 - W) // tpb)`` on; the blocks in between
  are *stale* (their pages are released, ``page_indices`` reports ``BAD_PAGE_INDEX`` there);
- a recurrent group keeps one live state page, whatever the length.

This is the one place that arithmetic is written: the caches, the pool, reuse matching, the
invariant check, the engine's admission and the connectors all ask a ``GroupRule``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvtier.spec import GroupId, GroupKind


class LifeCycle(Protocol):
    """What decides a group's life cycle: a ``kvtier.LayerGroup`` or a ``kvtier.GroupLayout``."""

    @property
    def group_id(self) -> int: ...

    @property
    def kind(self) -> GroupKind: ...

    @property
    def window(self) -> int | None: ...

    @property
    def sink_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class GroupRule:
    """The life cycle of one layer group, in blocks of ``tokens_per_block`` tokens."""

    group_id: GroupId
    kind: GroupKind
    window: int | None
    sink_blocks: int
    tokens_per_block: int

    @classmethod
    def of(cls, group: LifeCycle, tokens_per_block: int) -> GroupRule:
        sink_blocks = -(-group.sink_tokens // tokens_per_block)
        return cls(GroupId(group.group_id), group.kind, group.window, sink_blocks, tokens_per_block)

    def first_live_block(self, history: int) -> int:
        """End of the stale range ``[sink_blocks, end)`` at this history (``sink_blocks`` if none is stale)."""
        if self.window is None:
            return self.sink_blocks
        return max(self.sink_blocks, (history + 1 - self.window) // self.tokens_per_block)

    def is_live(self, block: int, history: int) -> bool:
        """Whether block ``block`` needs a page at this history (a sink block, or one inside the window)."""
        return block < self.sink_blocks or block >= self.first_live_block(history)

    def live_in(self, start: int, end: int, history: int) -> int:
        """How many blocks of ``[start, end)`` are live at this history, in O(1)."""
        stale = max(0, min(end, self.first_live_block(history)) - max(start, self.sink_blocks))
        return max(0, end - start) - stale

    def pages_needed(self, length: int, history: int) -> int:
        """Pages the group holds for ``length`` tokens of capacity at this history (1 for a recurrent state)."""
        if self.kind is GroupKind.RECURRENT:
            return 1
        return self.live_in(0, -(-length // self.tokens_per_block), history)
