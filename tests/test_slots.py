"""kvtier/storage/slots.py: the O(1) slot allocator (free stack + free map)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.storage.slots import BULK_SLOTS, SlotAllocator


def test_fresh_allocator_hands_out_low_slots_first():
    slots = SlotAllocator(4)
    assert (slots.num_slots, slots.num_free, slots.num_used) == (4, 4, 0)
    assert [slots.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert (slots.num_free, slots.num_used) == (0, 4)
    slots.check()


def test_exhaustion_returns_none_and_changes_nothing():
    slots = SlotAllocator(2)
    assert (slots.allocate(), slots.allocate()) == (0, 1)
    assert slots.allocate() is None
    assert slots.allocate() is None
    assert (slots.num_free, slots.num_used) == (0, 2)
    slots.free(1)
    assert slots.allocate() == 1
    slots.check()


def test_empty_allocator():
    slots = SlotAllocator(0)
    assert slots.allocate() is None
    assert (slots.num_free, slots.num_used) == (0, 0)
    slots.check()


def test_negative_size():
    with pytest.raises(ValueError, match="num_slots must be >= 0, got -1"):
        SlotAllocator(-1)


def test_free_is_lifo():
    slots = SlotAllocator(6)
    got = [slots.allocate() for _ in range(6)]
    assert got == [0, 1, 2, 3, 4, 5]
    for s in (4, 1, 3):
        slots.free(s)
    assert [slots.is_free(s) for s in range(6)] == [False, True, False, True, True, False]
    assert [slots.allocate() for _ in range(4)] == [3, 1, 4, None]


def test_double_free_raises_invariant_error():
    slots = SlotAllocator(3)
    s = slots.allocate()
    slots.free(s)
    with pytest.raises(kvtier.InvariantError, match=f"slot {s} freed twice"):
        slots.free(s)
    assert slots.num_free == 3
    slots.check()


def test_freeing_a_never_allocated_slot_raises():
    slots = SlotAllocator(3)
    slots.allocate()
    with pytest.raises(kvtier.InvariantError):
        slots.free(2)
    assert slots.num_free == 2


def test_freeing_bad_page_index_raises():
    slots = SlotAllocator(3)
    assert [slots.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(kvtier.InvariantError):
        slots.free(kvtier.BAD_PAGE_INDEX)


def test_reserve():
    slots = SlotAllocator(6)
    slots.reserve([1, 4, 2])
    assert (slots.num_free, slots.num_used) == (3, 3)
    assert [slots.is_free(s) for s in range(6)] == [True, False, False, True, False, True]
    slots.check()
    # The remaining free slots keep their order: lowest first.
    assert [slots.allocate() for _ in range(4)] == [0, 3, 5, None]
    slots.free(4)  # a reserved slot is allocated: it can be freed
    assert slots.allocate() == 4
    slots.check()


def test_reserve_twice_raises():
    slots = SlotAllocator(4)
    slots.reserve([2])
    with pytest.raises(kvtier.InvariantError, match="slot 2 reserved twice"):
        slots.reserve([2])
    with pytest.raises(kvtier.InvariantError, match="slot 3 reserved twice"):
        slots.reserve([3, 3])
    allocated = SlotAllocator(4)
    allocated.allocate()
    with pytest.raises(kvtier.InvariantError, match="slot 0 reserved twice"):
        allocated.reserve([0])


def test_reserve_nothing():
    slots = SlotAllocator(3)
    slots.allocate()
    slots.reserve([])
    assert [slots.allocate() for _ in range(3)] == [1, 2, None]


def test_check_detects_a_broken_stack_or_map():
    dup = SlotAllocator(3)
    dup.free(dup.allocate())
    dup._free.append(dup._free[-1])
    with pytest.raises(kvtier.InvariantError, match="on the free stack twice"):
        dup.check()

    used_never_handed_out = SlotAllocator(3)
    used_never_handed_out._is_free[0] = 0
    with pytest.raises(kvtier.InvariantError, match="free map and free stack disagree"):
        used_never_handed_out.check()

    swapped = SlotAllocator(3)
    swapped.allocate()
    swapped.free(swapped.allocate())  # slot 0 is used, 1 is on the stack, 2 never handed out
    swapped._is_free[0], swapped._is_free[1] = 1, 0  # map says 0 free, 1 used; stack still holds 1
    with pytest.raises(AssertionError, match="a slot on the free stack is marked used"):
        swapped.check()

    marked = SlotAllocator(3)
    marked._is_free[2] = 0  # never handed out, marked used
    marked._next, marked._free = 2, [1]  # (and the counts made to agree)
    marked._is_free[1] = 1
    with pytest.raises(kvtier.InvariantError, match="never handed out is marked used"):
        marked.check()


def test_a_huge_allocator_is_made_at_once_and_hands_out_low_slots_first():
    """Before, the free stack listed every slot: 2**24 slots took 5.7 s and 1 GB (a disk tier of
    small pages); now the never-used slots are a high-water mark."""
    slots = SlotAllocator(1 << 24)
    assert slots.num_free == 1 << 24 and slots.num_used == 0
    assert slots.allocate_many(3) == [0, 1, 2] and slots.allocate() == 3
    slots.free(1)
    assert slots.allocate_many(3) == [1, 4, 5]
    slots.reserve([9])
    assert [slots.allocate() for _ in range(4)] == [6, 7, 8, 10]
    slots.check()


ops = st.lists(st.one_of(st.just(("alloc", 0)), st.tuples(st.just("free"), st.integers(0, 11))), max_size=80)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 12), ops)
def test_against_a_set_model(num_slots, steps):
    slots = SlotAllocator(num_slots)
    used: set[int] = set()
    stack = list(range(num_slots - 1, -1, -1))  # the model's free stack: the last freed comes back first
    for op, n in steps:
        if op == "alloc":
            got = slots.allocate()
            if not stack:
                assert got is None
                continue
            assert got == stack.pop()
            assert got not in used and 0 <= got < num_slots
            used.add(got)
        elif num_slots:
            slot = n % num_slots
            if slot in used:
                slots.free(slot)
                used.discard(slot)
                stack.append(slot)
            else:
                with pytest.raises(kvtier.InvariantError):
                    slots.free(slot)
        assert slots.num_used == len(used)
        assert slots.num_free == num_slots - len(used)
        assert all(slots.is_free(s) == (s not in used) for s in range(num_slots))
        slots.check()


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=40), st.sampled_from([1, 10]))
@settings(max_examples=200, deadline=None)
def test_batched_allocate_and_free_match_one_slot_at_a_time(ops, scale):
    # scale 10: calls of up to 90 slots, past BULK_SLOTS, where the free map is updated with numpy
    ops = [(allocating, count * scale) for allocating, count in ops]
    num_slots = 16 * scale
    batched, single = SlotAllocator(num_slots), SlotAllocator(num_slots)
    held: list[int] = []
    for allocating, count in ops:
        if allocating:
            got = batched.allocate_many(count)
            if count > single.num_free:
                assert got is None
                continue
            assert got == [single.allocate() for _ in range(count)]
            held.extend(got)
        else:
            some, held = held[:count], held[count:]
            batched.free_all(some)
            for slot in some:
                single.free(slot)
        assert batched.allocate_many(0) == [] and batched.num_free == single.num_free
    batched.check()
    assert [batched.allocate() for _ in range(num_slots)] == [single.allocate() for _ in range(num_slots)]


def test_free_all_refuses_a_slot_freed_twice():
    slots = SlotAllocator(4)
    taken = slots.allocate_many(3)
    with pytest.raises(kvtier.InvariantError, match="slot 1 freed twice"):
        slots.free_all([taken[1], taken[1]])
    with pytest.raises(kvtier.InvariantError, match="slot 9 freed twice"):
        slots.free_all([9])


@pytest.mark.parametrize("bad", ["repeated", "out of range", "never allocated"])
def test_a_bulk_free_all_refuses_a_bad_slot_as_the_loop_does(bad):
    slots = SlotAllocator(300)
    taken = slots.allocate_many(200)
    assert BULK_SLOTS <= 100
    batch = taken[:100]
    wrong = {"repeated": taken[50], "out of range": 300, "never allocated": 250}[bad]
    batch.insert(70, wrong)  # slots before it are freed, the bad one raises, the rest stay allocated
    with pytest.raises(kvtier.InvariantError, match=f"slot {wrong} freed twice"):
        slots.free_all(batch)
    slots.check()
    assert slots.num_free == 100 + 70
    assert all(slots.is_free(s) for s in taken[:70]) and not any(slots.is_free(s) for s in taken[70:])


def test_times_freed_counts_every_free_of_a_slot():
    slots = SlotAllocator(300)
    taken = slots.allocate_many(200)
    slots.free(taken[0])
    slots.free_all(taken[1:3])  # slot by slot
    slots.free_all(taken[100:200])  # with numpy
    assert [slots.times_freed(s) for s in taken[:4]] == [1, 1, 1, 0]
    assert all(slots.times_freed(s) == 1 for s in taken[100:200])
    again = slots.allocate_many(150)
    slots.free_all(again)
    assert slots.times_freed(taken[150]) == 2 and slots.times_freed(taken[50]) == 0


def test_a_slot_handed_to_other_bytes_counts_as_freed_and_stays_allocated():
    slots = SlotAllocator(8)
    taken = slots.allocate_many(4)
    slots.count_as_freed(taken[1:3])
    assert [slots.times_freed(s) for s in taken] == [0, 1, 1, 0]
    assert slots.num_free == 4 and not any(slots.is_free(s) for s in taken)
    slots.count_as_freed([])
    slots.check()


def test_freed_counts_take_slots_as_a_list_or_an_array_of_any_integer_type():
    allocator = SlotAllocator(8)
    assert allocator.allocate_many(8) == list(range(8))
    allocator.count_as_freed([1, 2])
    allocator.count_as_freed(np.array([2, 3], dtype=np.int64))
    allocator.count_as_freed(np.array([3, 4], dtype=np.int32))
    allocator.count_as_freed(np.array([], dtype=np.int64))
    assert [allocator.times_freed(s) for s in range(8)] == [0, 1, 2, 2, 1, 0, 0, 0]
