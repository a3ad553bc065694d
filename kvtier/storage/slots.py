"""Slot allocation for one buffer: a free stack with O(1) allocate and free.

Invariant: every slot in ``0..num_slots-1`` is exactly one of: on the free stack (once), at or
above the high-water mark ``_next`` (never handed out: free), or allocated;
``num_free + num_used == num_slots``. The never-used slots are not listed, so making an
allocator costs no Python object per slot (a disk tier of small pages has tens of millions).
``times_freed(slot)`` only grows: a slot whose count did not change between two moments held the
same bytes in between (a slot handed to a holder with other bytes without being freed is counted
too: ``count_as_freed``).
"""

from __future__ import annotations

from array import array

import numpy as np

from kvtier.errors import InvariantError

BULK_SLOTS = 64  # from this many slots a call marks the free map with numpy instead of slot by slot


class SlotAllocator:
    """A LIFO free list of slot numbers: slots given back on a list, never-used ones above a high-water mark; O(1)."""

    __slots__ = ("_free", "_free_map", "_freed", "_freed_counts", "_is_free", "_next", "num_slots")

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = []  # slots given back, the last one on top (handed out first)
        self._next = 0  # slots from here up were never handed out: the lowest goes first
        self._is_free = bytearray(num_slots)  # zeroed, then filled: a failed ``bytearray(b"\x01") * n``
        self._free_map = np.frombuffer(self._is_free, dtype=np.uint8)  # prints a stray SystemError (CPython 3.11)
        self._free_map.fill(1)  # the same bytes as ``_is_free``, for bulk updates
        self._freed = array("Q", bytes(8 * num_slots))  # times each slot was freed
        self._freed_counts = np.frombuffer(self._freed, dtype=np.uint64)  # the same counts, for bulk updates

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_slots - self._next

    @property
    def num_used(self) -> int:
        return self._next - len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is in use."""
        if self._free:
            slot = self._free.pop()
        elif self._next < self.num_slots:
            slot = self._next
            self._next += 1
        else:
            return None
        self._is_free[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot``; freeing a slot that is not allocated (or not a slot) is a bug and raises."""
        if not 0 <= slot < self.num_slots or self._is_free[slot]:
            raise InvariantError(f"slot {slot} freed twice")
        self._is_free[slot] = 1
        self._freed[slot] += 1
        self._free.append(slot)

    def allocate_many(self, count: int) -> list[int] | None:
        """``count`` free slots, the ones ``count`` calls of ``allocate`` would give, in that order; None
        (nothing allocated) when fewer are free."""
        free = self._free
        if count > self.num_free or count < 0:
            return None
        if count == 0:
            return []
        given = min(count, len(free))
        slots = free[len(free) - given :]
        del free[len(free) - given :]
        slots.reverse()
        if given < count:
            fresh = count - given
            slots += range(self._next, self._next + fresh)
            self._next += fresh
        if count >= BULK_SLOTS:
            self._free_map[_index(slots)] = 0
        else:
            is_free = self._is_free
            for slot in slots:
                is_free[slot] = 0
        return slots

    def free_all(self, slots: list[int]) -> None:
        """``free`` every slot of a list, in order; a slot not allocated raises (those before it are freed)."""
        is_free, num_slots, free = self._is_free, self.num_slots, self._free
        if len(slots) >= BULK_SLOTS:
            index = _index(slots)
            free_map = self._free_map
            if index.min() >= 0 and index.max() < num_slots and not free_map[index].any():
                before = self.num_free
                free_map[index] = 1
                if np.count_nonzero(free_map) == before + len(slots):
                    self._freed_counts[index] += 1
                    free.extend(slots)
                    return
                free_map[index] = 0  # a slot repeated in the list: undone, the loop below names it
        freed = self._freed
        for slot in slots:
            if not 0 <= slot < num_slots or is_free[slot]:
                raise InvariantError(f"slot {slot} freed twice")
            is_free[slot] = 1
            freed[slot] += 1
            free.append(slot)

    def count_as_freed(self, slots: list[int] | np.ndarray) -> None:
        """Count these allocated slots as freed and allocated again: they pass to a holder with other
        bytes without going through the free stack (a swap), and ``times_freed`` must still tell
        that their bytes may have changed."""
        if len(slots):
            self._freed_counts[_index(slots)] += 1

    def reserve(self, slots: list[int]) -> None:
        """Mark these free slots as allocated (restoring a persisted state); rebuilds the stack once:
        the never-used slots below the highest one reserved are listed, lowest on top."""
        for slot in slots:
            if not 0 <= slot < self.num_slots or not self._is_free[slot]:
                raise InvariantError(f"slot {slot} reserved twice")
            self._is_free[slot] = 0
        top = max(slots, default=-1) + 1
        unlisted = [s for s in range(top - 1, self._next - 1, -1) if self._is_free[s]] if top > self._next else []
        self._free = unlisted + [s for s in self._free if self._is_free[s]]
        self._next = max(self._next, top)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])

    def times_freed(self, slot: int) -> int:
        """How many times ``slot`` was freed since the allocator was made."""
        return self._freed[slot]

    def check(self) -> None:
        """Raise ``InvariantError`` unless the free stack, the high-water mark and the free map agree."""
        if len(set(self._free)) != len(self._free):
            raise InvariantError("a slot is on the free stack twice")
        if sum(self._is_free) != self.num_free:
            raise InvariantError("free map and free stack disagree")
        if not all(self._is_free[s] and s < self._next for s in self._free):
            raise InvariantError("a slot on the free stack is marked used, or was never handed out")
        if not self._free_map[self._next :].all():
            raise InvariantError("a slot never handed out is marked used")


def _index(slots: list[int] | np.ndarray) -> np.ndarray:
    """``slots`` as an int64 index array, read in one pass (an int64 array as it is)."""
    if isinstance(slots, np.ndarray) and slots.dtype == np.int64:
        return slots
    return np.fromiter(slots, dtype=np.int64, count=len(slots))
