"""``KVCache``: one request's pages, lengths and life cycle.

States: a new cache is SUSPENDED; ``resume`` makes it ACTIVE (every live page locked in the
primary tier), ``suspend`` returns it to SUSPENDED (pages may be demoted, never dropped),
``close`` makes it CLOSED (idempotent). Lengths always satisfy
``num_committed_tokens <= history_length <= capacity``; ``history_length`` never decreases
(except when a damaged page makes the cache start over, see ``resume``).

A cache stands on its manager's ``PagePool``: its pages are in a ``BlockTable`` (positional per
layer group), its published blocks in a ``PublishedChain``. Blocks reused at creation are shared
with the tree; a partly reused block and a reused recurrent snapshot are *pending*: copied into
private pages on the first resume.
"""

from __future__ import annotations

import enum
import logging
from array import array
from collections import Counter
from collections.abc import Callable
from itertools import zip_longest

import numpy as np

from kvtier.block_table import BlockTable
from kvtier.config import TIER_NAMES, ReuseScope, is_int
from kvtier.errors import CacheStateError, InvariantError
from kvtier.exclusive import exclusive
from kvtier.hit_count import HitCount, fill_from_later
from kvtier.invariants import Holdings
from kvtier.pages import Page
from kvtier.pool import PagePool
from kvtier.process_bound import ProcessBound
from kvtier.published_chain import PublishedChain
from kvtier.reuse.matching import ReuseMatch
from kvtier.reuse.tokens import MAX_TOKEN, as_token_array, encode_tokens

log = logging.getLogger(__name__)


class CacheState(str, enum.Enum):
    SUSPENDED = "suspended"
    ACTIVE = "active"
    CLOSED = "closed"


_ACTIVE = CacheState.ACTIVE


class KVCache(ProcessBound):
    """The KV cache of one request. Create it with ``KVCacheManager.create_cache``."""

    __slots__ = (
        "__weakref__",
        "_block_tiers",
        "_capacity",
        "_chain",
        "_fast_commits",
        "_guard",
        "_history",
        "_hits",
        "_input_len",
        "_num_blocks",
        "_pending",
        "_pool",
        "_priority",
        "_res",
        "_reuse_counted",
        "_state",
        "_stream",
        "_table",
        "_tokens",
        "_tpb",
        "num_reused_tokens",
        "reused_by_tier",
        "scope",
    )
    remedy = "create another with KVCacheManager.create_cache (it reuses this one's published prefix)"
    _CLOSED = CacheState.CLOSED  # read by ``__del__``, which may run after interpreter exit cleared the module's names

    def __init__(
        self,
        pool: PagePool,
        tokens: array,
        scope: ReuseScope,
        priority: int,
        counted: bool = True,
        forgotten: bool = False,
    ) -> None:
        """A SUSPENDED cache for ``tokens`` holding their longest reusable prefix (on any tier).

        ``counted``: its reuse counts as the request's hits (at its first commit or its close:
        ``kvtier.hit_count``), and tokens the match cuts because loading them is slower than recomputing count in
        ``recomputed_tokens``; False for a second cache of a request already counted.
        ``forgotten``: a cache of a request whose scope was forgotten meanwhile: it matches nothing
        and publishes nothing (the scope's tree holds the new weights' blocks)."""
        self._pool = pool
        self._guard = pool.guard  # calls that change the pool claim it (kvtier.exclusive)
        self._res = pool.residency
        self._tpb = pool.tokens_per_block
        self.scope = scope
        self._priority = priority
        self._state = CacheState.CLOSED  # until built: a cache cut short here is never queued as dropped
        self._input_len = len(tokens)
        self._tokens = array("Q")
        self._capacity = self._history = self._num_blocks = 0
        self._table = BlockTable(pool.rules, pool.residency)
        self._chain = PublishedChain(pool, None if forgotten or not pool.config.enable_reuse else scope)
        self._pending: list[Page] = []  # pages to copy into private ones on first resume
        self._reuse_counted = False  # the reused pages' hits were counted (at the first resume)
        self._stream = None  # the stream of the last resume, where the caller writes the pages (CUDA)
        self.num_reused_tokens = 0
        self.reused_by_tier = dict.fromkeys(TIER_NAMES, 0)
        self._block_tiers: list[int] | None = None  # per reused block, the tier it is counted for (None: one tier)
        self._hits = HitCount(pool.counters, pool.tier_names, self._tpb, 0, None)  # (a cache cut short: none)
        self._fast_commits = False  # one-token commits skip the claim: full attention only, the reuse settled
        self._state = CacheState.SUSPENDED
        match = None if forgotten else pool.match(tokens, scope, count_recomputed=counted)
        if match is not None:
            try:
                self._adopt(match, tokens)
            except BaseException:  # an interrupt: nothing stays held by a cache that never was
                self._state = CacheState.CLOSED
                self._release_holds(locked=False)
                raise
        # the reuse counted as hits at the first commit or at close; what is given up before is recomputed
        counted_end = self.num_reused_tokens if counted else 0
        self._hits = HitCount(pool.counters, pool.tier_names, self._tpb, counted_end, self._block_tiers)
        self._fast_commits = self._hits.settled and pool.attention_only  # (settled at once without reuse)
        pool.holders.add(self)

    def __del__(self) -> None:
        """Dropped without ``close``: kept alive in the pool's ``dropped`` list, closed at its next
        claimed call (this may run on any thread, at any point of another operation)."""
        if getattr(self, "_state", self._CLOSED) is not self._CLOSED and not self._pool.orphaned:
            self._pool.dropped.append(self)

    # -- public state ------------------------------------------------------------------------------

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
        return len(self._tokens)

    @property
    def priority(self) -> int:
        return self._priority

    def page_indices(self, group_id: int) -> np.ndarray:
        """Slots of the group's pages in the primary tier (int32, ``BAD_PAGE_INDEX`` where absent).

        Attention groups: one entry per block of ``capacity``. Recurrent groups: one entry, the
        live state page. Valid only while ACTIVE.
        """
        self._check_open()  # first: after close every call is a ``CacheStateError``, whatever it is given
        self._pool.rule(group_id)
        if self._state is not _ACTIVE:
            raise CacheStateError(f"page indices are valid only while ACTIVE; the cache is {self._state.value}")
        return self._table.page_indices(group_id, self._num_blocks)

    # -- reuse at creation -------------------------------------------------------------------------

    def _adopt(self, match: ReuseMatch, tokens: array) -> None:
        """Take ownership of a matched prefix: hold its pages, set the three lengths to it."""
        p = match.tokens
        self._tokens = tokens[:p]
        self._capacity = self._history = self.num_reused_tokens = p
        self._num_blocks = -(-p // self._tpb)
        self._chain.adopt(match.full_nodes)
        self._table.adopt(match, self._num_blocks)
        for rule in self._pool.rules:
            source = match.copy_source(rule)
            if source is not None:
                self._res.hold(source)
                self._pending.append(source)
        self._count_reuse_by_tier(p)

    def _count_reuse_by_tier(self, reused: int) -> None:
        """Attribute each reused block's tokens to the coldest tier any of its pages came from; a block
        with no page (stale in a sliding window, between recurrent snapshots) is reused through the
        pages after it: it counts for the coldest tier of those. Keeps the blocks' tiers in
        ``_block_tiers`` (None with a single tier)."""
        names = self._pool.tier_names
        tpb = self._tpb
        nb = self._num_blocks
        self._block_tiers = None
        if len(names) == 1:
            self.reused_by_tier[names[0]] += reused
            return
        if nb == 0:
            return
        absent = 0 if self._pool.full_attention else -1  # (a full-attention group: every block has a page)
        per_group = [[absent if page is None else page.tier for page in blocks] for blocks in self._table.blocks]
        if len(per_group) == 1:  # (comprehensions and C-level maps: this runs per block of a long prompt)
            coldest = per_group[0]
        else:
            coldest = list(map(max, zip_longest(*per_group, fillvalue=absent)))
        coldest += [absent] * (nb - len(coldest))
        coldest[-1] = max([coldest[-1], *[source.tier for source in self._pending]])
        if absent and min(coldest) < 0:
            fill_from_later(coldest)
        self._block_tiers = coldest
        for tier, blocks in Counter(coldest).items():
            self.reused_by_tier[names[tier]] += blocks * tpb
        self.reused_by_tier[names[coldest[-1]]] -= nb * tpb - reused  # the last block may hold fewer tokens

    # -- life cycle --------------------------------------------------------------------------------

    @exclusive
    def resume(self, stream=None) -> bool:
        """Lock every live page into the primary tier, migrating from lower tiers in one batch.

        Returns False, leaving the cache SUSPENDED, when the primary tier cannot hold them. On
        CUDA the copies are ordered before later work on ``stream`` (default: current stream),
        the stream the caller then writes the pages on: while active, this cache's evictions
        (``resize``) and state snapshots (``commit``) run there, and copies that read its
        published pages start after the work queued there; once it suspends or closes, every copy
        that moves its pages starts after the work queued there by then (``kvtier.tiering.mover``).
        A page that fails its checksum on the way makes the cache start over from the longest
        intact prefix of its committed tokens (``num_committed_tokens`` and ``history_length`` go
        down to it, the one case where ``history_length`` decreases; recompute).
        """
        if self._state is _ACTIVE:
            return True
        self._check_open()
        table = self._table
        recurrent = self._pool.recurrent_group
        fresh = []
        if recurrent is not None and table.state_page is None and all(p.group != recurrent for p in self._pending):
            fresh.append(recurrent)
        live, sources = table.live_pages(), self._pending
        stream = self._pool.caller_stream(stream)
        promoted = self._pool.lock_in_primary(live, sources, fresh, self._priority, stream)
        if promoted is None:
            return False
        self._stream = stream
        if not self._reuse_counted:  # the first resume: the reused prefix, as given up to now, is used
            self._reuse_counted = True
            if self._res.count_hits:
                self._res.add_hits(live + sources)
        new_pages, damaged = promoted
        for source, page in zip(self._pending, new_pages[: len(self._pending)], strict=True):
            if source.group == recurrent:
                table.state_page = page
            else:
                table.blocks[source.group][len(self._tokens) // self._tpb] = page
        if fresh:
            table.state_page = new_pages[-1]
        self._pending = []
        if damaged:
            self._start_over()
            return self.resume(stream)
        table.refresh_slots()
        self._hits.used = True
        self._state = _ACTIVE
        self._pool.cache_active(stream)
        self._pool.debug_check()
        return True

    def _start_over(self) -> None:
        """A page of this cache failed its checksum on the way back: keep only the intact prefix.

        Every page is released (they are locked by the resume in progress) and the cache adopts
        the longest prefix of its committed tokens that the tree still holds intact, as a new
        cache would. Its lengths drop to that prefix: the caller recomputes from
        ``num_committed_tokens``. This is the one case where ``history_length`` goes down.
        """
        lost = len(self._tokens)
        tokens = self._tokens
        self._let_go(locked=True)
        match = self._match_again(tokens, weigh_load_cost=True)
        if match is not None:
            self._adopt(match, tokens)
        if not self._hits.used:  # the reuse lost before the request took it: recomputed, not a hit
            self._hits.cut(self.num_reused_tokens)
            # the intact prefix was found where the count says (its pages were promoted since)
            self._block_tiers, counted = self._hits.counted()
            self.reused_by_tier = {**dict.fromkeys(self.reused_by_tier, 0), **counted}
        log.warning(
            "kvtier: a page of a suspended cache failed its checksum; it restarts from %d of %d tokens",
            len(self._tokens),
            lost,
        )

    @exclusive
    def shorten_to_memory(self) -> int:
        """Give up the reused blocks from the first one with a page on the disk tier, for a caller
        that must not wait for the disk now (vLLM's scheduler thread): they are recomputed instead.

        Only for a SUSPENDED cache that holds nothing but its reused prefix (nothing committed
        since creation), else ``CacheStateError``. The cache keeps the reuse a new cache over its
        first ``reused_in_memory`` tokens would have (a sliding window or a recurrent state may end
        it sooner), so a ``resume`` after it reads nothing from disk. Returns the reused tokens
        given up (0: none was on disk); they leave ``reused_by_tier`` and count in the manager's
        ``recomputed_tokens`` (never in its ``hit_tokens``).
        """
        return self._give_up_reuse("shorten_to_memory", lambda: self.reused_in_memory)

    @exclusive
    def shorten_reuse(self, max_tokens: int) -> int:
        """Give up the reused tokens past ``max_tokens``, for a caller that cannot fit the reuse (a
        partly reused block's copy needs one more primary page than the block itself): they are
        recomputed instead.

        As ``shorten_to_memory``, only for a SUSPENDED cache holding nothing but its reused prefix;
        the cache keeps the reuse a new cache over its first ``max_tokens`` tokens would have (a
        sliding window or a recurrent state may end it sooner). Returns the reused tokens given up.
        """
        self._check_open()
        limit = _check_length("max_tokens", max_tokens)
        return self._give_up_reuse("shorten_reuse", lambda: min(limit, self.num_reused_tokens))

    def _give_up_reuse(self, caller: str, keep: Callable[[], int]) -> int:
        """Adopt again what the tree holds of the first ``keep()`` reused tokens until ``keep()`` is
        all of them; the tokens given up count in ``recomputed_tokens``, not in ``hit_tokens``."""
        if self._state is not CacheState.SUSPENDED or len(self._tokens) != self.num_reused_tokens:
            raise CacheStateError(
                f"{caller} needs a SUSPENDED cache holding only its reused prefix; this one is "
                f"{self._state.value} with {len(self._tokens)} committed of {self.num_reused_tokens} reused tokens"
            )
        reused = self.num_reused_tokens
        while (kept := keep()) < self.num_reused_tokens:
            tokens = self._tokens[:kept]
            self._let_go(locked=False)
            match = self._match_again(tokens, weigh_load_cost=False)
            if match is not None:
                self._adopt(match, tokens)
        given_up = reused - self.num_reused_tokens
        if given_up:
            self._hits.keep(self.num_reused_tokens, self._block_tiers)
            self._pool.debug_check()
        return given_up

    @exclusive
    def match_again(self, input_tokens) -> int:
        """Reuse more of the request's input if the tree holds more of it now (blocks published since
        the cache was made: another request computing the same prompt), for a caller whose request
        still waits to run. Returns the reused tokens gained; 0 changes nothing.

        Only for a SUSPENDED cache holding nothing but its reused prefix (else ``CacheStateError``);
        ``input_tokens`` are those it was made for (``ValueError`` for other ones: another length,
        or a start other than its reused tokens). The cache then holds what a new cache for them
        would (its load cost weighed as at creation). The manager counts no lookup for it; the
        hits, still unsettled, grow with the reuse. A cache resumed before (its reuse taken), one
        that gave up reuse (``shorten_to_memory``, ``shorten_reuse``, ``recompute_from``: counted
        as recomputed) and one whose scope was forgotten keep what they have. Tokens a load-cost
        cut left out at creation were counted as recomputed then, and stay counted there if reused
        now."""
        self._check_open()
        tokens = as_token_array(input_tokens)
        if self._state is not CacheState.SUSPENDED or len(self._tokens) != self.num_reused_tokens:
            raise CacheStateError(
                f"match_again needs a SUSPENDED cache holding only its reused prefix; this one is "
                f"{self._state.value} with {len(self._tokens)} committed of {self.num_reused_tokens} reused tokens"
            )
        if len(tokens) != self._input_len or tokens[: len(self._tokens)] != self._tokens:
            raise ValueError("match_again takes the input tokens the cache was made for")
        if self._hits.given_up or self._hits.used or self._chain.scope is None or not self._reuse_may_grow(tokens):
            return 0
        match = self._pool.match(tokens, self.scope, count_recomputed=False)
        if match is None or match.tokens <= self.num_reused_tokens:
            return 0
        before = self.num_reused_tokens
        self._let_go(locked=False)
        self._adopt(match, tokens)
        self._hits = HitCount(
            self._pool.counters, self._pool.tier_names, self._tpb, self.num_reused_tokens, self._block_tiers
        )
        self._fast_commits = False  # (reuse to settle now)
        self._pool.debug_check()
        return self.num_reused_tokens - before

    def _reuse_may_grow(self, tokens: array) -> bool:
        """Whether the tree may hold more of ``tokens`` than the cache reuses: a node for the block
        after its full reused blocks (with partial reuse, any node there). One lookup, where a match
        walks the whole prefix (about a millisecond for 32K tokens)."""
        parent = self._chain.deepest or self._pool.tree.find_root(self.scope)
        if parent is None:
            return False
        if self._pool.config.enable_partial_reuse:
            return bool(parent.children)
        start = len(self._chain.nodes) * self._tpb
        return encode_tokens(tokens[start : start + self._tpb]) in parent.children

    @exclusive
    def recompute_from(self, tokens: int) -> int:
        """The caller recomputes this cache's reused tokens from ``tokens`` on, though the cache keeps
        their pages (a batch row cut to the batch's common width): they are counted in the manager's
        ``recomputed_tokens``, not in its ``hit_tokens``. Counts only: the cache, its lengths and
        ``reused_by_tier`` stay as they are. A later call can only move more. Returns the tokens
        moved. After the first ``commit`` the reuse was used, and counted as hits: a call that
        would move any raises ``CacheStateError``."""
        self._check_open()
        kept = _check_length("tokens", tokens)
        if self._hits.settled and kept < self._hits.end:
            raise CacheStateError("recompute_from after the cache's first commit: its reuse was used, and counted")
        return self._hits.keep(kept, self._block_tiers)

    @exclusive
    def cache_for_prefix(self, num_tokens: int) -> KVCache:
        """Another SUSPENDED cache of the same request, over this cache's first ``num_tokens``
        committed tokens: it holds the reuse a new cache over them would have (up to ``num_tokens -
        1`` tokens; a sliding window or a recurrent state may end it sooner). The manager counts no
        lookup or hit for it: they were counted for this cache (``recompute_from`` settles what
        this one's reuse was used for)."""
        self._check_open()
        n = _check_length("num_tokens", num_tokens)
        if n > len(self._tokens):
            raise ValueError(f"num_tokens ({n}) is more than the cache's {len(self._tokens)} committed tokens")
        self._pool.release_let_go()
        forgotten = self._chain.scope is None  # its scope was forgotten (or reuse is off: nothing to match)
        cache = KVCache(self._pool, self._tokens[:n], self.scope, self._priority, counted=False, forgotten=forgotten)
        self._pool.debug_check()
        return cache

    @property
    def reused_in_memory(self) -> int:
        """Of the reused tokens, those before the first block with a page on the disk tier (a
        pending copy source counts for the block it completes): all of them when none is there,
        so a ``resume`` reads nothing from disk for them. (A page found damaged stays on disk.)"""
        disk = self._pool.disk_tier
        if disk is None or self._state is _ACTIVE:
            return self.num_reused_tokens
        found = [
            next((b for b, p in enumerate(blocks) if p is not None and p.tier == disk), None)
            for blocks in self._table.blocks
        ]
        if any(source.tier == disk for source in self._pending):
            found.append((self.num_reused_tokens - 1) // self._tpb)
        first = min((b for b in found if b is not None), default=None)
        return self.num_reused_tokens if first is None else min(first * self._tpb, self.num_reused_tokens)

    def _match_again(self, tokens: array, weigh_load_cost: bool) -> ReuseMatch | None:
        """What the tree holds of the cache's own ``tokens``, to adopt after letting go of its pages;
        None once its scope was forgotten (the tree then holds blocks of other weights, which a
        cache of the old ones must not take: it reuses nothing, as with reuse off)."""
        if self._chain.scope is None:
            return None
        return self._pool.match(tokens, self.scope, whole=True, weigh_load_cost=weigh_load_cost, count_recomputed=False)

    def _stop_publishing(self) -> None:
        """Its scope was forgotten (``KVCacheManager.forget_scope``): the blocks it commits from now on
        are published nowhere, as with reuse off; what it holds stays with it."""
        self._chain.stop()

    def _let_go(self, locked: bool) -> None:
        """Release every page (``locked``: the cache's locks too), pending source and the chain: the
        cache holds nothing after, as a new cache that matched nothing."""
        self._release_holds(locked)
        self._tokens = array("Q")
        self._num_blocks = self._capacity = self._history = self.num_reused_tokens = 0
        self.reused_by_tier = dict.fromkeys(self.reused_by_tier, 0)
        self._block_tiers = None

    def _release_holds(self, locked: bool) -> None:
        """Release the table's pages (``locked``: their locks too), the pending sources and the chain.

        Each hold is detached from the cache before it is released, and every release is tried
        even when one is interrupted: an interrupt never releases a page twice nor leaves one held.
        """
        pending, self._pending = self._pending, []
        try:
            self._table.release_all(locked)
        finally:
            try:
                self._res.release_all(pending, locked=False)
            finally:
                self._chain.drop()

    @exclusive
    def suspend(self) -> None:
        """Make the cache's pages evictable (demotable, never droppable) until it resumes."""
        if self._state is not _ACTIVE:
            self._check_open()
            return
        self._state = CacheState.SUSPENDED  # first: an interrupt below never unlocks twice
        self._pool.cache_let_go(self._stream)
        self._res.unlock_all(self._table.live_pages()[::-1])
        self._pool.debug_check()

    @exclusive
    def close(self) -> None:
        """Release every page; published blocks stay in the tree for reuse. Idempotent."""
        if self._state is CacheState.CLOSED:
            return
        locked = self._state is _ACTIVE
        self._state = CacheState.CLOSED  # first: a close retried after an interrupt releases nothing twice
        self._hits.settle()
        if locked:
            self._pool.cache_let_go(self._stream)
        self._num_blocks = 0
        self._pool.holders.discard(self)
        self._release_holds(locked)
        self._pool.debug_check()

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
        capacity = _check_length("capacity", capacity)
        history = _check_length("history", self._history if history is None else history)
        if history < self._history:
            raise ValueError(f"history_length never decreases: it is {self._history}, asked {history}")
        if capacity < history:
            raise ValueError(f"capacity {capacity} is below history {history}, the history length it would have")
        pool = self._pool
        old_nb, new_nb = self._num_blocks, -(-capacity // self._tpb)
        need: dict[int, int] = {}
        for rule in pool.attention_rules:
            # Counted in O(1): a capacity beyond what the primary tier can ever hold fails at once.
            n = rule.live_in(old_nb, new_nb, history)
            if n > pool.primary_slots(rule.group_id):
                return False
            if n:
                need[rule.group_id] = n
        if need and not pool.reserve(need, self._stream):
            return False
        if history > self._history:
            self._raise_history(history)
        if new_nb < old_nb:
            self._table.remove_blocks(old_nb - new_nb)
        else:
            self._table.add_blocks(old_nb, new_nb, history, self._priority)
        self._num_blocks = new_nb
        self._capacity = capacity
        pool.debug_check()
        return True

    def commit(self, new_tokens) -> None:
        """Append tokens whose KV has been written; publish blocks that became full.

        The first token is at position ``num_committed_tokens``. Raises ``ValueError`` past
        ``capacity`` and ``TypeError`` for tokens that are not integers; nothing changes then.
        """
        if self._state is not _ACTIVE:
            raise CacheStateError(f"commit needs an ACTIVE cache; this one is {self._state.value}")
        c = len(self._tokens) + 1
        if (
            type(new_tokens) is list
            and len(new_tokens) == 1
            and type(new_tokens[0]) is int
            and c % self._tpb
            and c <= self._capacity
            and self._fast_commits
            and 0 <= new_tokens[0] <= MAX_TOKEN
        ):
            # The decode step: one token inside a block of a model with full-attention layers only,
            # once the reuse is settled, changes nothing but this cache's own lengths, so it claims
            # nothing (kvtier.exclusive).
            # The history first: a check on another thread, reading the committed length before
            # the history, sees the lengths in order at every step.
            if c > self._history:
                self._history = c
            self._tokens.append(new_tokens[0])
            return
        self._commit(new_tokens)

    @exclusive
    def _commit(self, new_tokens) -> None:
        """``commit`` of anything that may publish a block, keep a snapshot or release stale pages, or
        the first of any token: the reuse is settled (counted as hits) once the request computed past it."""
        tokens = as_token_array(new_tokens)
        count = len(tokens)
        if len(self._tokens) + count > self._capacity:
            raise ValueError(f"commit past capacity: {len(self._tokens) + count} tokens > capacity {self._capacity}")
        if count and not self._hits.settled:
            self._hits.settle()
            self._fast_commits = self._pool.attention_only
        self._tokens.extend(tokens)
        c = len(self._tokens)
        pool = self._pool
        chain = self._chain
        if chain.scope is not None:
            if c // self._tpb > len(chain.nodes):
                chain.publish(self._tokens, self._table, c // self._tpb, self._input_len)
            state_page = self._table.state_page
            if count and state_page is not None and (c % pool.snapshot_tokens == 0 or c == self._input_len):
                chain.snapshot(c, state_page, self._priority, self._stream)
        if c > self._history:
            if pool.window_rules:
                self._raise_history(c)
            else:
                self._history = c

    @exclusive
    def release_prefix(self, num_tokens: int) -> int:
        """Release the pages of the committed full blocks before ``num_tokens``, for a caller that
        keeps their KV elsewhere and never reads them from this cache again (vLLM holds a running
        request's blocks on its GPU): locked no more, they may be demoted like any cached page.

        Published blocks stay in the tree for reuse; ``page_indices`` reports ``BAD_PAGE_INDEX``
        for the released ones (lists stay positional), and a later ``resume`` locks none of them.
        The released prefix only grows: a call below it changes nothing. ``ValueError`` past
        ``num_committed_tokens``. Returns the blocks released before ``num_tokens`` in all.
        """
        self._check_open()
        n = _check_length("num_tokens", num_tokens)
        if n > len(self._tokens):
            raise ValueError(f"num_tokens ({n}) is more than the cache's {len(self._tokens)} committed tokens")
        end = n // self._tpb
        if end > self._table.released_end:
            self._table.release_before(end, locked=self._state is _ACTIVE)
            self._pool.debug_check()
        return self._table.released_end

    def _raise_history(self, history: int) -> None:
        """Raise history and release sliding-window blocks that went stale."""
        self._table.release_stale(history, self._num_blocks, locked=self._state is _ACTIVE)
        self._history = history

    # -- checks ------------------------------------------------------------------------------------

    def _holdings(self) -> Holdings:
        """The pages this cache holds and the tree node it uses, for the pool's invariant check."""
        unlocked = list(self._pending)
        if self._chain.pending_snapshot is not None:
            unlocked.append(self._chain.pending_snapshot)
        return Holdings(self._table.live_pages(), self._state is _ACTIVE, unlocked, self._chain.deepest)

    def _check_invariants(self) -> None:
        """``InvariantError`` unless the lengths keep their order and the blocks match them."""
        tpb = self._tpb
        committed = len(self._tokens)  # read before the history: the decode step raises the history first
        if not committed <= self._history <= self._capacity:
            raise InvariantError(f"{self}: lengths out of order")
        if self._num_blocks != -(-self._capacity // tpb):
            raise InvariantError(f"{self}: {self._num_blocks} blocks for capacity {self._capacity}")
        if self._chain.scope is not None and len(self._chain.nodes) != committed // tpb:
            raise InvariantError(f"{self}: {len(self._chain.nodes)} published blocks")
        active = self._state is _ACTIVE
        if active and self._pending:
            raise InvariantError(f"{self}: active with pending copies")
        waiting = {page.group: committed // tpb for page in self._pending}
        try:
            self._table.check(self._num_blocks, self._history, waiting, active)
        except InvariantError as exc:
            raise InvariantError(f"{self}: {exc}") from None

    def _check_open(self) -> None:
        if self._state is CacheState.CLOSED:
            raise CacheStateError("the cache is closed")

    def __repr__(self) -> str:
        return (
            f"KVCache({self._state.value}, committed={len(self._tokens)}, history={self._history}, "
            f"capacity={self._capacity}, reused={self.num_reused_tokens})"
        )


def _check_length(name: str, value: object) -> int:
    """``value`` as a Python int (a numpy integer too: its own arithmetic would wrap or overflow)."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)
