"""The copier's cheap submit path on CPU: small-call checks, cached buffer facts, launch hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtier.copy.kernel as kernel
from kvtier.copy import CopyPolicy, PageCopier
from kvtier.copy.buffer_facts import BufferFactsCache
from kvtier.copy.copy_request import SMALL_CALL, as_pairs, check_request
from kvtier.storage import pinned


@pytest.mark.parametrize("n", [1, SMALL_CALL, SMALL_CALL + 1, 100])
@pytest.mark.parametrize(
    ("bad", "match"),
    [((-1, 0), "negative"), ((64, 0), "source slot 64"), ((0, 64), "destination slot 64"), (None, "twice")],
)
def test_small_and_large_calls_give_the_same_errors(n: int, bad: tuple[int, int] | None, match: str) -> None:
    buffer = torch.zeros(64 * 16, dtype=torch.uint8)
    other = torch.zeros(64 * 16, dtype=torch.uint8)
    pairs = np.stack([np.arange(n) % 64, np.arange(n) % 64], 1)
    if bad is None:
        if n == 1:
            pytest.skip("one pair cannot repeat a destination")
        pairs[-1, 1] = pairs[0, 1]
    else:
        pairs[-1] = bad
    with pytest.raises(ValueError, match=match):
        check_request(buffer, other, pairs, 16)


def test_a_tiers_pairs_are_taken_as_they_are_and_others_converted() -> None:
    """A C-contiguous (n, 2) int64 array is used in place; any other layout, order or width of
    integers is converted (or refused) exactly as before, never read with the wrong strides."""
    rng = np.random.default_rng(7)
    pairs = rng.integers(1, 1000, (9, 2))
    assert as_pairs(pairs) is pairs
    for other in (pairs.astype(">i8"), np.asfortranarray(pairs), pairs.astype(np.int32), pairs[::-1], pairs.tolist()):
        converted = as_pairs(other)
        assert converted.dtype == np.int64 and converted.flags.c_contiguous
        assert np.array_equal(converted, np.asarray(other))
    column = pairs[:, :1]  # (n, 1) with the strides of an (n, 2) array
    with pytest.raises(ValueError, match="shape"):
        as_pairs(column)
    assert as_pairs(np.empty((0, 2), dtype=np.int64)).shape == (0, 2)


@pytest.mark.parametrize("slots", ["consecutive", "scattered"])
@pytest.mark.parametrize("n", [3, 12, 300])
def test_runs_are_built_only_where_they_can_change_the_path(n: int, slots: str) -> None:
    """A call's runs decide only whether a call of small pages goes to the kernel or as a few
    separate copies: a policy that sends even one run to the kernel routes without them."""
    src, dst = torch.zeros(400 * 64, dtype=torch.uint8), torch.zeros(400 * 64, dtype=torch.uint8)
    order = np.arange(n) if slots == "consecutive" else np.random.default_rng(n).permutation(n)
    request = check_request(src, dst, np.stack([order, order + 50], axis=1), 64)
    assert request is not None
    kernel_only = PageCopier("cpu", policy=CopyPolicy(copy_engine_min_bytes=None))
    facts = kernel_only._facts.of("src", src)
    assert kernel_only._route(request, facts, facts) == ("kernel", None)
    both = PageCopier("cpu", policy=CopyPolicy(copy_engine_min_bytes=1 << 20))
    path, runs = both._route(request, facts, facts)
    counted = slots == "consecutive" and n > 4  # one run: a separate copy on the copy engines
    assert path == ("copy_engine" if n <= 4 or counted else "kernel")
    assert (runs is not None) == counted
    if counted:
        assert runs.tolist() == [[0, 50, n]]


def test_buffer_facts_are_cached_until_a_registration_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = BufferFactsCache(torch.device("cpu"))
    buffer = torch.zeros(4096, dtype=torch.uint8)
    first = cache.of("src", buffer)
    assert first.host and not first.pinned and first.address == buffer.data_ptr()
    assert cache.of("src", buffer) is first
    monkeypatch.setattr(pinned, "_EPOCH", [pinned.registration_epoch() + 1])
    assert cache.of("src", buffer) is not first
    view = buffer[16:]
    assert cache.of("src", view).address == buffer.data_ptr() + 16


def test_buffer_facts_leave_with_their_tensor() -> None:
    cache = BufferFactsCache(torch.device("cpu"))
    buffer = torch.zeros(4096, dtype=torch.uint8)
    cache.of("src", buffer)
    del buffer
    assert not cache._facts


def test_buffer_on_another_device_is_an_error() -> None:
    cache = BufferFactsCache(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="copier serves"):
        cache.of("dst", torch.zeros(16, dtype=torch.uint8, device="meta"))


def test_launch_hooks_count_only_when_they_would_run() -> None:
    class Chain:
        def __init__(self, calls: list[object]) -> None:
            self.calls = calls

    assert not kernel._hook_active(None)
    assert not kernel._hook_active(Chain([]))
    assert kernel._hook_active(Chain([print]))
    assert kernel._hook_active(print)
