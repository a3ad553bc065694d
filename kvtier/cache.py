"""``KVCache``: one request's pages, lengths and life cycle.

States: a new cache is SUSPENDED; ``resume`` makes it ACTIVE (every live page locked in the
primary tier), ``suspend`` returns it to SUSPENDED (pages may be demoted, never dropped),
``close`` makes it CLOSED (idempotent). Lengths always satisfy
``num_committed_tokens <= history_length <= capacity``; ``history_length`` never decreases.

Per attention group the cache keeps one entry per block of ``capacity`` (None where a
sliding-window block went stale); per recurrent group one live state page (allocated on first
resume). Blocks reused at creation are shared with the tree; a partly reused block and a reused
recurrent snapshot are *pending*: copied into private pages on the first resume.
"""

from __future__ import annotations

import enum
import logging
from array import array
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import CacheStateError
from kvtier.exclusive import exclusive
from kvtier.pages import BAD_PAGE_INDEX, Page
from kvtier.residency import PRIMARY, MovePlan
from kvtier.reuse import ReuseMatch, snapshot_at
from kvtier.spec import GroupKind
from kvtier.tree import encode_tokens

if TYPE_CHECKING:
    from kvtier.config import ReuseScope
    from kvtier.manager import KVCacheManager
    from kvtier.tree import Node

log = logging.getLogger(__name__)

MAX_TOKEN = (1 << 64) - 1


class CacheState(str, enum.Enum):
    SUSPENDED = "suspended"
    ACTIVE = "active"
    CLOSED = "closed"


_ACTIVE = CacheState.ACTIVE


class KVCache:
    """The KV cache of one request. Create it with ``KVCacheManager.create_cache``."""

    __slots__ = (
        "_blocks",
        "_capacity",
        "_committed",
        "_guard",
        "_history",
        "_input_len",
        "_mgr",
        "_nodes",
        "_num_blocks",
        "_pending",
        "_pending_snapshot",
        "_priority",
        "_res",
        "_root",
        "_slots",
        "_stale_end",
        "_state",
        "_state_page",
        "_tokens",
        "_tpb",
        "num_reused_tokens",
        "reused_by_tier",
        "scope",
    )

    def __init__(self, mgr: KVCacheManager, tokens: array, scope: ReuseScope, priority: int) -> None:
        self._mgr = mgr
        self._guard = mgr._guard  # the manager's: calls that change shared state claim it
        self._res = mgr._residency
        self._tpb = mgr.tokens_per_block
        self.scope = scope
        self._root: Node | None = mgr._tree.root(scope) if mgr.config.enable_reuse else None
        self._priority = priority
        self._state = CacheState.SUSPENDED
        self._input_len = len(tokens)
        self._tokens = array("Q")
        self._capacity = self._history = self._committed = 0
        num_groups = len(mgr.layer_groups)
        self._blocks: list[list[Page | None]] = [[] for _ in range(num_groups)]
        self._slots = [np.full(16, BAD_PAGE_INDEX, dtype=np.int32) for _ in range(num_groups)]
        self._stale_end = [rule.sink_blocks for rule in mgr._rules]
        self._num_blocks = 0
        self._state_page: Page | None = None
        self._pending: list[tuple[int, Page]] = []  # (group, source page) to copy on first resume
        self._pending_snapshot: Page | None = None  # end-of-input snapshot waiting for its block
        self._nodes: list[Node] = []  # tree nodes of the committed full blocks (while reuse is on)
        self.num_reused_tokens = 0
        self.reused_by_tier = dict.fromkeys(mgr._tier_names, 0)

    # -- public state ------------------------------------------------------------------------

    @property
    def state(self) -> CacheState:
        return self._state

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def history_length(self) -> int:
        return self._history

    @property
    def num_committed_tokens(self) -> int:
        return self._committed

    @property
    def priority(self) -> int:
        return self._priority

    def page_indices(self, group_id: int) -> np.ndarray:
        """Slots of the group's pages in the primary tier (int32, ``BAD_PAGE_INDEX`` where absent).

        Attention groups: one entry per block of ``capacity``. Recurrent groups: one entry, the
        live state page. Valid only while ACTIVE.
        """
        rule = self._mgr._rule(group_id)
        if self._state is not _ACTIVE:
            raise CacheStateError(f"page indices are valid only while ACTIVE; the cache is {self._state.value}")
        if rule.kind is GroupKind.RECURRENT:
            assert self._state_page is not None
            return np.array([self._state_page.slot], dtype=np.int32)
        return self._slots[group_id][: self._num_blocks].copy()

    # -- reuse at creation -----------------------------------------------------------------------

    def _adopt(self, match: ReuseMatch, tokens: array) -> None:
        """Take ownership of a matched prefix: hold its pages, set the three lengths to it."""
        tpb = self._tpb
        p = match.tokens
        full = p // tpb
        nb = -(-p // tpb)
        res = self._res
        self._tokens = tokens[:p]
        self._capacity = self._history = self._committed = self.num_reused_tokens = p
        self._num_blocks = nb
        self._nodes = list(match.full_nodes)
        if self._nodes:
            self._nodes[-1].users += 1  # protects the whole path: every ancestor has a child
        for rule in self._mgr._rules:
            g = rule.group_id
            if rule.kind is GroupKind.RECURRENT:
                source = snapshot_at(match, tpb)
                res.hold(source)
                self._pending.append((g, source))
                continue
            live_from = rule.first_live_block(p, tpb)
            self._stale_end[g] = live_from
            if rule.kind is GroupKind.ATTENTION:
                blocks = [node.pages[g] for node in self._nodes]
            else:
                sink = rule.sink_blocks
                blocks = [n.pages[g] if b < sink or b >= live_from else None for b, n in enumerate(self._nodes)]
            res.hold_all(blocks)
            if match.partial is not None:
                source = match.partial.pages[g]
                assert source is not None
                res.hold(source)
                self._pending.append((g, source))
            if nb > full:
                blocks.append(None)
            self._blocks[g] = blocks
        self._count_reuse_by_tier(p)

    def _count_reuse_by_tier(self, reused: int) -> None:
        """Attribute each reused block's tokens to the coldest tier any of its pages came from."""
        names = self._mgr._tier_names
        tpb = self._tpb
        nb = self._num_blocks
        if len(names) == 1:
            self.reused_by_tier[names[0]] += reused
            return
        coldest = [0] * nb
        for blocks in self._blocks:
            for b, page in enumerate(blocks):
                if page is not None and page.tier > coldest[b]:
                    coldest[b] = page.tier
        for _, source in self._pending:
            coldest[nb - 1] = max(coldest[nb - 1], source.tier)
        for b, tier in enumerate(coldest):
            self.reused_by_tier[names[tier]] += min(tpb, reused - b * tpb)

    # -- life cycle ------------------------------------------------------------------------------

    @exclusive
    def resume(self, stream=None) -> bool:
        """Lock every live page into the primary tier, migrating from lower tiers in one batch.

        Returns False, leaving the cache SUSPENDED, when the primary tier cannot hold them. On
        CUDA the copies are ordered before later work on ``stream`` (default: current stream).
        """
        if self._state is _ACTIVE:
            return True
        self._check_open()
        res = self._res
        pages = self._live_pages()
        sources = [src for _, src in self._pending]
        need, damaged = res.lock_all(pages)
        _, damaged_source = res.lock_all(sources)  # e.g. found damaged by a prefetch meanwhile
        for g, _ in self._pending:
            need[g] = need.get(g, 0) + 1
        recurrent = self._mgr._recurrent_group
        if recurrent is not None and self._state_page is None and not any(g == recurrent for g, _ in self._pending):
            need[recurrent] = need.get(recurrent, 0) + 1
        plan = MovePlan()
        ok = res.promote(pages, plan, need)
        if ok:
            self._materialize_pending(plan)
        damaged = self._mgr._mover.run(plan, stream) > 0 or damaged or damaged_source
        if not ok:
            for page in pages:
                res.unlock(page)
            for page in sources:
                res.unlock(page)
            return False
        damaged = damaged and any(page.damaged for page in sources + self._live_pages())
        for page in sources:
            res.release(page, locked=True)
        self._pending = []
        if damaged:
            self._start_over()
            return self.resume(stream)
        for g in range(len(self._blocks)):
            self._refresh_slots(g)
        self._state = _ACTIVE
        self._mgr._debug_check()
        return True

    def _start_over(self) -> None:
        """A page of this cache failed its checksum on the way back: keep only the intact prefix.

        Every page is released (they are pinned by the resume in progress) and the cache adopts
        the longest prefix of its committed tokens that the tree still holds intact, as a new
        cache would. Its lengths drop to that prefix: the caller recomputes from
        ``num_committed_tokens``. This is the one case where ``history_length`` goes down.
        """
        res = self._res
        lost = self._committed
        for page in reversed(self._live_pages()):
            res.release(page, locked=True)
        if self._pending_snapshot is not None:
            res.release(self._pending_snapshot, locked=False)
        self._drop_path()
        tokens = self._tokens
        self._blocks = [[] for _ in self._blocks]
        self._state_page = self._pending_snapshot = None
        self._tokens = array("Q")
        self._num_blocks = self._capacity = self._history = self._committed = self.num_reused_tokens = 0
        self._stale_end = [rule.sink_blocks for rule in self._mgr._rules]
        self.reused_by_tier = dict.fromkeys(self.reused_by_tier, 0)
        match = self._mgr._match(tokens, self.scope, whole=True)
        if match is not None:
            self._adopt(match, tokens)
        log.warning(
            "kvtier: a page of a suspended cache failed its checksum; it restarts from %d of %d tokens",
            self._committed,
            lost,
        )

    def _materialize_pending(self, plan: MovePlan) -> None:
        """Allocate private pages for pending copies (and a fresh state page) and plan the copies."""
        res = self._res
        recurrent = self._mgr._recurrent_group
        for g, source in self._pending:
            page = res.new_page(g, self._priority, locked=True)
            assert page is not None, "promote() made room for pending pages"
            plan.add(source.tier, PRIMARY, g, source.slot, page.slot)
            if g == recurrent:
                self._state_page = page
            else:
                self._blocks[g][self._committed // self._tpb] = page
        if recurrent is not None and self._state_page is None:
            self._state_page = res.new_page(recurrent, self._priority, locked=True)
            assert self._state_page is not None, "promote() made room for the state page"

    @exclusive
    def suspend(self) -> None:
        """Make the cache's pages evictable (demotable, never droppable) until it resumes."""
        if self._state is not _ACTIVE:
            self._check_open()
            return
        res = self._res
        for page in reversed(self._live_pages()):
            res.unlock(page)
        self._state = CacheState.SUSPENDED
        self._mgr._debug_check()

    @exclusive
    def close(self) -> None:
        """Release every page; published blocks stay in the tree for reuse. Idempotent."""
        if self._state is CacheState.CLOSED:
            return
        locked = self._state is _ACTIVE
        res = self._res
        for page in reversed(self._live_pages()):
            res.release(page, locked)
        for _, source in self._pending:
            res.release(source, locked=False)
        if self._pending_snapshot is not None:
            res.release(self._pending_snapshot, locked=False)
        self._blocks = [[] for _ in self._blocks]
        self._state_page = self._pending_snapshot = None
        self._pending = []
        self._drop_path()
        self._num_blocks = 0
        self._state = CacheState.CLOSED
        self._mgr._caches.discard(self)
        self._mgr._debug_check()

    # -- growth ------------------------------------------------------------------------------------

    def resize(self, capacity: int, history: int | None = None) -> bool:
        """Set ``capacity`` (allocating or freeing blocks), optionally raising ``history_length``.

        Returns False and changes nothing when the pages cannot be had. ``ValueError`` for a
        capacity below history, or a history below the current one or above the capacity.
        """
        if self._state is not _ACTIVE:
            raise CacheStateError(f"resize needs an ACTIVE cache; this one is {self._state.value}")
        if (
            history is None
            and type(capacity) is int
            and capacity >= self._history
            and (capacity + self._tpb - 1) // self._tpb == self._num_blocks
        ):
            self._capacity = capacity  # the fast path: no block added or removed
            return True
        return self._resize(capacity, history)

    @exclusive
    def _resize(self, capacity: int, history: int | None) -> bool:
        _check_length("capacity", capacity)
        if history is None:
            history = self._history
        _check_length("history", history)
        if history < self._history:
            raise ValueError(f"history_length never decreases: it is {self._history}, asked {history}")
        if capacity < history:
            raise ValueError(f"capacity {capacity} is below history_length {history}")
        tpb = self._tpb
        old_nb, new_nb = self._num_blocks, -(-capacity // tpb)
        need: dict[int, int] = {}
        primary_slots = self._res.tiers[PRIMARY].storage.slots
        for rule in self._mgr._attention_rules:
            live_from = rule.first_live_block(history, tpb)
            # New blocks [old_nb, new_nb) less the stale ones [sink_blocks, live_from), counted in O(1):
            # a capacity beyond what the primary tier can ever hold fails at once, whatever its size.
            n = max(0, new_nb - old_nb) - max(0, min(new_nb, live_from) - max(old_nb, rule.sink_blocks))
            if n > primary_slots[rule.group_id].num_slots:
                return False
            if n:
                need[rule.group_id] = n
        res = self._res
        if need:
            plan = MovePlan()
            ok = all(res.make_room(PRIMARY, g, n, plan) for g, n in need.items())
            self._mgr._mover.run(plan, None)
            if not ok:
                return False
        if history > self._history:
            self._raise_history(history)
        for rule in self._mgr._attention_rules:
            g = rule.group_id
            blocks = self._blocks[g]
            if new_nb < old_nb:
                for _ in range(old_nb - new_nb):
                    page = blocks.pop()
                    if page is not None:
                        res.release(page, locked=True)
                continue
            live_from = rule.first_live_block(history, tpb)
            slots = self._slot_array(g, new_nb)
            for b in range(old_nb, new_nb):
                page = None
                if b < rule.sink_blocks or b >= live_from:
                    page = res.new_page(g, self._priority, locked=True)
                    assert page is not None, "make_room() made room for the new blocks"
                blocks.append(page)
                slots[b] = BAD_PAGE_INDEX if page is None else page.slot
            self._stale_end[g] = max(self._stale_end[g], min(live_from, new_nb))
        self._num_blocks = new_nb
        self._capacity = capacity
        self._mgr._debug_check()
        return True

    def commit(self, new_tokens) -> None:
        """Append tokens whose KV has been written; publish blocks that became full.

        The first token is at position ``num_committed_tokens``. Raises ``ValueError`` past
        ``capacity`` and ``TypeError`` for tokens that are not integers; nothing changes then.
        """
        if self._state is not _ACTIVE:
            raise CacheStateError(f"commit needs an ACTIVE cache; this one is {self._state.value}")
        c = self._committed + 1
        if (
            type(new_tokens) is list
            and len(new_tokens) == 1
            and type(new_tokens[0]) is int
            and c % self._tpb
            and c <= self._capacity
            and self._mgr._attention_only
            and 0 <= new_tokens[0] <= MAX_TOKEN
        ):
            # The decode step: one token inside a block of a model with full-attention layers only
            # changes nothing but this cache's own lengths, so it claims nothing (kvtier.exclusive).
            self._tokens.append(new_tokens[0])
            self._committed = c
            if c > self._history:
                self._history = c
            return
        self._commit(new_tokens)

    @exclusive
    def _commit(self, new_tokens) -> None:
        """``commit`` of anything that may publish a block, keep a snapshot or release stale pages."""
        tokens = as_token_array(new_tokens)
        count = len(tokens)
        if self._committed + count > self._capacity:
            raise ValueError(f"commit past capacity: {self._committed + count} tokens > capacity {self._capacity}")
        self._tokens.extend(tokens)
        c = self._committed = self._committed + count
        tpb = self._tpb
        if self._root is not None:
            if c // tpb > len(self._nodes):
                self._publish(c // tpb)
            if (
                count
                and self._mgr._recurrent_group is not None
                and (c % self._mgr._snapshot_tokens == 0 or c == self._input_len)
            ):
                self._snapshot(c)
        if c > self._history:
            if self._mgr._window_rules:
                self._raise_history(c)
            else:
                self._history = c

    # -- internals -------------------------------------------------------------------------------

    def _publish(self, full_blocks: int) -> None:
        """Publish committed full blocks ``len(_nodes) .. full_blocks - 1`` in the tree."""
        tree = self._mgr._tree
        tpb = self._tpb
        rules = self._mgr._attention_rules
        deepest = self._nodes[-1] if self._nodes else None
        parent = deepest or self._root
        assert parent is not None
        for b in range(len(self._nodes), full_blocks):
            node = tree.child(parent, encode_tokens(self._tokens[b * tpb : (b + 1) * tpb]))
            self._nodes.append(node)
            for rule in rules:
                page = self._blocks[rule.group_id][b]
                if page is not None and page.node is None and node.pages[rule.group_id] is None:
                    node.pages[rule.group_id] = page
                    page.node = node
            pending = self._pending_snapshot
            if pending is not None and (self._input_len - 1) // tpb == b:
                self._pending_snapshot = None
                self._attach_snapshot(pending, node, self._input_len - b * tpb)
            parent = node
        self._nodes[-1].users += 1  # the use moves to the new deepest node; the old one has a child now
        if deepest is not None:
            deepest.users -= 1

    def _snapshot(self, position: int) -> None:
        """Keep a copy of the live recurrent state after ``position`` tokens, for reuse."""
        tpb = self._tpb
        offset = position - (position - 1) // tpb * tpb
        block = (position - 1) // tpb
        node = self._nodes[block] if block < len(self._nodes) else None
        if node is not None and offset in node.snapshots:
            return
        group = self._mgr._recurrent_group
        assert group is not None and self._state_page is not None
        res = self._res
        plan = MovePlan()
        if not res.make_room(PRIMARY, group, 1, plan):
            self._mgr._mover.run(plan, None)
            return  # a snapshot is only for reuse: skip it rather than fail the commit
        page = res.new_page(group, self._priority, locked=False)
        assert page is not None
        plan.add(PRIMARY, PRIMARY, group, self._state_page.slot, page.slot)
        self._mgr._mover.run(plan, None)
        if node is not None:
            self._attach_snapshot(page, node, offset)
        else:
            if self._pending_snapshot is not None:
                res.release(self._pending_snapshot, locked=False)
            self._pending_snapshot = page

    def _attach_snapshot(self, page: Page, node: Node, offset: int) -> None:
        """Hand a snapshot page this cache holds over to the tree."""
        if offset in node.snapshots:
            self._res.release(page, locked=False)
            return
        node.snapshots[offset] = page
        page.node = node
        page.snapshot_offset = offset
        self._res.release(page, locked=False)

    def _raise_history(self, history: int) -> None:
        """Raise history and release sliding-window blocks that went stale."""
        res = self._res
        tpb = self._tpb
        locked = self._state is _ACTIVE
        for rule in self._mgr._window_rules:
            g = rule.group_id
            new_end = min(rule.first_live_block(history, tpb), self._num_blocks)
            old_end = self._stale_end[g]
            if new_end <= old_end:
                continue
            blocks = self._blocks[g]
            slots = self._slots[g]
            for b in range(new_end - 1, old_end - 1, -1):
                page = blocks[b]
                if page is not None:
                    blocks[b] = None
                    slots[b] = BAD_PAGE_INDEX
                    res.release(page, locked)
            self._stale_end[g] = new_end
        self._history = history

    def _drop_path(self) -> None:
        """Let go of the tree path (only its deepest node counts this cache as a user)."""
        if self._nodes:
            deepest = self._nodes[-1]
            deepest.users -= 1
            self._mgr._tree.prune(deepest)
        self._nodes = []

    def _live_pages(self) -> list[Page]:
        """Every page the cache holds that compute uses: its blocks and its state page."""
        pages = [p for blocks in self._blocks for p in blocks if p is not None]
        if self._state_page is not None:
            pages.append(self._state_page)
        return pages

    def _slot_array(self, group: int, num_blocks: int) -> np.ndarray:
        """The group's slot array, grown (doubling) to hold at least ``num_blocks`` entries."""
        slots = self._slots[group]
        if len(slots) < num_blocks:
            grown = np.full(max(num_blocks, 2 * len(slots)), BAD_PAGE_INDEX, dtype=np.int32)
            grown[: len(slots)] = slots
            slots = self._slots[group] = grown
        return slots

    def _refresh_slots(self, group: int) -> None:
        """Rewrite the group's slot array from its blocks (after pages moved)."""
        blocks = self._blocks[group]
        slots = self._slot_array(group, len(blocks))
        slots[: len(blocks)] = [BAD_PAGE_INDEX if p is None else p.slot for p in blocks]

    def _check_open(self) -> None:
        if self._state is CacheState.CLOSED:
            raise CacheStateError("the cache is closed")

    def __repr__(self) -> str:
        return (
            f"KVCache({self._state.value}, committed={self._committed}, history={self._history}, "
            f"capacity={self._capacity}, reused={self.num_reused_tokens})"
        )


def as_token_array(tokens) -> array:
    """Tokens as ``array('Q')`` (unsigned 64-bit); ``TypeError`` for non-integers, ``ValueError`` for negatives.

    Accepts a sequence of ints, an ``array``, a numpy integer array or a CPU torch tensor.
    """
    if isinstance(tokens, str | bytes):
        raise TypeError("tokens must be a sequence of integer token ids, not a string")
    if hasattr(tokens, "numpy") and hasattr(tokens, "dtype"):  # a torch tensor
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu" or tokens.ndim != 1:
            raise TypeError(f"tokens must be a 1-D integer array, got {tokens.dtype} with shape {tokens.shape}")
        if tokens.size and tokens.min() < 0:
            raise ValueError("token ids must be >= 0")
        out = array("Q")
        out.frombytes(tokens.astype("<u8", copy=False).tobytes())
        return out
    try:
        return array("Q", tokens)
    except OverflowError:
        raise ValueError("token ids must be in 0..2**64-1") from None
    except TypeError as exc:
        raise TypeError(f"tokens must be integer ids ({exc})") from None


def _check_length(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
