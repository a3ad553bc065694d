"""PageCopier("cpu"): the CPU path, argument checks, and calls that must change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.copy import PageCopier
from kvtier.copy.copy_request import _scan
from kvtier.copy.cpu import LOOP_MIN_PAGE_BYTES
from tests.test_tiers import run_python


def filled(slots: int, page: int, seed: int = 0) -> torch.Tensor:
    """A buffer whose every 8-byte word differs from every other (so from slot to slot too) and is non-zero."""
    words = -(-slots * page // 8)
    values = np.arange(seed + 1, seed + 1 + words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    values ^= values >> np.uint64(29)
    return torch.from_numpy(values.view(np.uint8)[: slots * page].copy())


@pytest.fixture
def copier() -> PageCopier:
    return PageCopier("cpu")


@pytest.mark.parametrize("page", [16, 48, 4096, LOOP_MIN_PAGE_BYTES - 16, LOOP_MIN_PAGE_BYTES, 65_536, 1 << 20])
def test_pages_land_in_their_slots(copier: PageCopier, page: int) -> None:
    src = filled(9, page)
    dst = torch.full((7 * page,), 0xA5, dtype=torch.uint8)
    pairs = np.array([[8, 0], [0, 6], [3, 2], [3, 4]], dtype=np.int32)
    assert copier.copy(src, dst, pairs, page) == "cpu"
    for s, d in pairs.tolist():
        assert torch.equal(dst[d * page : (d + 1) * page], src[s * page : (s + 1) * page])
    for d in (1, 3, 5):
        assert bool((dst[d * page : (d + 1) * page] == 0xA5).all())


@pytest.mark.parametrize("pairs", [[(1, 0), (0, 1)], ((1, 0), (0, 1)), np.array([[1, 0], [0, 1]], dtype=np.uint16)])
def test_pairs_as_lists_tuples_and_numpy(copier: PageCopier, pairs: object) -> None:
    src = filled(2, 64)
    dst = torch.zeros(128, dtype=torch.uint8)
    copier.copy(src, dst, pairs, 64)
    assert torch.equal(dst[:64], src[64:]) and torch.equal(dst[64:], src[:64])


def test_trailing_bytes_past_the_last_slot_are_not_a_slot(copier: PageCopier) -> None:
    src = filled(3, 100)[:250]  # two whole slots and half of a third
    dst = torch.zeros(300, dtype=torch.uint8)
    copier.copy(src, dst, [(1, 2)], 100)
    assert torch.equal(dst[200:], src[100:200])
    with pytest.raises(ValueError, match="source slot 2"):
        copier.copy(src, dst, [(2, 0)], 100)


@pytest.mark.parametrize("pairs", [[], np.empty((0, 2), dtype=np.int64), np.empty(0, dtype=np.int32)])
def test_empty_call_is_a_no_op(copier: PageCopier, pairs: object) -> None:
    src, dst = filled(2, 64), torch.zeros(128, dtype=torch.uint8)
    assert copier.copy(src, dst, pairs, 64) == "none"
    assert not dst.any()


def test_stream_is_ignored_on_the_cpu(copier: PageCopier) -> None:
    src, dst = filled(1, 64), torch.zeros(64, dtype=torch.uint8)
    assert copier.copy(src, dst, [(0, 0)], 64, stream=7) == "cpu"
    assert torch.equal(src, dst)


def test_warm_up_does_nothing_on_the_cpu(copier: PageCopier) -> None:
    """There is no kernel path to build without CUDA, whatever the page sizes."""
    assert copier.warm_up([16, 4096, 1 << 21]) is False


WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # as if it were not installed: importing it raises ImportError
import torch
from kvtier.copy import PageCopier
from kvtier.copy.kernel_args import kernel_refusal
buffer = torch.zeros(64, dtype=torch.uint8)
assert kernel_refusal(buffer, buffer, 16) is None
print("refused:", kernel_refusal(buffer, buffer, 24))
"""


def test_the_copier_and_the_kernels_checks_need_no_triton() -> None:
    """On a machine without Triton the copier imports and a call the kernel would refuse is refused
    by its checks, which import no Triton: only building the kernel needs it."""
    done = run_python(WITHOUT_TRITON)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("refused: the copy kernel needs a page size that is a multiple of 16")


def test_one_buffer_with_disjoint_reads_and_writes(copier: PageCopier) -> None:
    buffer = filled(4, 32)
    before = buffer.clone()
    copier.copy(buffer, buffer, [(0, 2), (1, 3)], 32)
    assert torch.equal(buffer[64:], before[:64]) and torch.equal(buffer[:64], before[:64])


BAD_CALLS = [
    ("negative page", [(0, 0)], -64, ValueError, "positive"),
    ("zero page", [(0, 0)], 0, ValueError, "positive"),
    ("page larger than a buffer", [(0, 0)], 1 << 20, ValueError, "larger than"),
    ("source out of range", [(4, 0)], 64, ValueError, "source slot 4"),
    ("destination out of range", [(0, 3)], 64, ValueError, "destination slot 3"),
    ("negative slot", [(-1, 0)], 64, ValueError, "negative"),
    ("destination twice", [(0, 1), (2, 1)], 64, ValueError, "twice"),
    ("wrong shape", [(0, 1, 2)], 64, ValueError, "shape"),
    ("float slots", [(0.0, 1.0)], 64, ValueError, "integers"),
    ("bool page", [(0, 0)], True, TypeError, "bool"),
    ("float page", [(0, 0)], 64.0, TypeError, "int"),
]


@pytest.mark.parametrize(("pairs", "page", "error", "match"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_raise_and_change_nothing(copier, pairs, page, error, match) -> None:
    src = filled(4, 64)
    dst = torch.full((3 * 64,), 0xA5, dtype=torch.uint8)
    with pytest.raises(error, match=match):
        copier.copy(src, dst, pairs, page)
    assert bool((dst == 0xA5).all())


def test_bad_buffers(copier: PageCopier) -> None:
    good = torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        copier.copy(torch.zeros(64, dtype=torch.int32), good, [(0, 0)], 64)
    with pytest.raises(ValueError, match="contiguous"):
        copier.copy(good[::2], good, [(0, 0)], 64)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        copier.copy(np.zeros(256, dtype=np.uint8), good, [(0, 0)], 64)
    with pytest.raises(ValueError, match="also writes"):
        copier.copy(good, good, [(0, 1), (1, 2)], 64)
    many = torch.zeros(64 * 64, dtype=torch.uint8)
    chained = [(i, 40 + i) for i in range(17)] + [(40, 63)]  # more pairs than the small-call check takes
    with pytest.raises(ValueError, match="also writes"):
        copier.copy(many, many, chained, 64)
    with pytest.raises(ValueError, match="overlap"):
        copier.copy(good[:128], good[64:], [(0, 0)], 64)


def test_device_names() -> None:
    assert PageCopier("cpu").device == torch.device("cpu")
    assert (
        PageCopier(torch.device("cpu")).copy(filled(1, 16), torch.zeros(16, dtype=torch.uint8), [(0, 0)], 16) == "cpu"
    )
    with pytest.raises(ValueError, match="device"):
        PageCopier("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            PageCopier("cuda")


@settings(max_examples=60, deadline=None)
@given(
    page=st.sampled_from([8, 16, 40, 4096, LOOP_MIN_PAGE_BYTES, 3 * LOOP_MIN_PAGE_BYTES + 8]),
    src_slots=st.integers(1, 12),
    dst_slots=st.integers(1, 12),
    data=st.data(),
)
def test_matches_a_page_by_page_reference(page: int, src_slots: int, dst_slots: int, data) -> None:
    destinations = data.draw(st.lists(st.integers(0, dst_slots - 1), unique=True, max_size=dst_slots))
    sources = data.draw(st.lists(st.integers(0, src_slots - 1), min_size=len(destinations), max_size=len(destinations)))
    src = filled(src_slots, page, seed=7)
    dst = filled(dst_slots, page, seed=1 << 20)
    expected = dst.clone()
    for s, d in zip(sources, destinations, strict=True):
        expected[d * page : (d + 1) * page] = src[s * page : (s + 1) * page]
    path = PageCopier("cpu").copy(src, dst, list(zip(sources, destinations, strict=True)), page)
    assert path == ("cpu" if destinations else "none")
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("shape", [(16384, 2), ()], ids=["2-d", "0-d"])
def test_a_buffer_that_is_not_flat_is_refused(shape):
    """Before: a 2-D buffer was taken, and the CPU path cut its slices by rows, not bytes (a copy
    wrote a slot it was not asked to, or nothing); a 0-d one raised IndexError."""
    src = torch.randint(1, 256, shape, dtype=torch.uint8)
    dst = torch.zeros(shape, dtype=torch.uint8)
    with pytest.raises(ValueError, match="must be a flat 1-D buffer"):
        PageCopier("cpu").copy(src, dst, np.array([[0, 0]]), 8192 if shape else 1)
    assert not dst.any()


@pytest.mark.parametrize("pairs", [np.empty((3, 0), np.int64), np.empty((2, 0, 2), np.int64), np.empty((0, 3))])
def test_malformed_pairs_are_refused_even_when_empty(pairs):
    """Before: any pairs array without elements was an empty call, whatever its shape (``[]`` and
    shape (0, 2) still are)."""
    with pytest.raises(ValueError, match="pairs must"):
        PageCopier("cpu").copy(torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8), pairs, 8)


def test_a_slot_past_int64_is_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        pairs = np.array([[2**64 - 1, 0]], dtype=np.uint64)
        PageCopier("cpu").copy(torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8), pairs, 8)


@settings(max_examples=300, deadline=None)
@given(st.integers(17, 600), st.sampled_from(["rising", "falling", "shuffled", "repeated"]), st.integers(0, 2**32 - 1))
def test_the_scan_of_a_large_call_finds_its_extremes_and_repeats_in_any_order(n, order, seed):
    """A call of more pairs than the small-call check takes: the scan (from ``MONOTONE_CHECK_MIN``
    pairs on, no sort when the destination slots rise or fall at every step) answers as a sort of
    both columns would."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 10_000, n)
    dst = np.sort(rng.choice(10_000, n, replace=False))
    if order == "falling":
        dst = dst[::-1]
    elif order == "shuffled":
        dst = rng.permutation(dst)
    elif order == "repeated":
        dst[rng.integers(1, n)] = dst[0]
    table = np.ascontiguousarray(np.stack([src, dst], axis=1), dtype=np.int64)
    low = min(int(src.min()), int(dst.min()))
    assert _scan(table) == (low, int(src.max()), int(dst.max()), order == "repeated")


@settings(max_examples=80, deadline=None)
@given(
    page=st.sampled_from([16, 4096]),
    side=st.sampled_from(["src", "dst"]),
    n=st.integers(1, 40),
    same_buffer=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_consecutive_slots_on_one_side_copy_as_the_reference(page, side, n, same_buffer, seed) -> None:
    """Calls whose source or destination slots run consecutively (gathered or scattered in place)
    copy what a page-by-page reference copies, also within one buffer."""
    rng = np.random.default_rng(seed)
    slots = 4 * n + 8
    start = int(rng.integers(0, slots - 2 * n))  # a run of n slots, and n others outside it
    run = np.arange(start, start + n)
    others = rng.permutation(np.setdiff1d(np.arange(slots), run))[:n]
    sources, destinations = (run, others) if side == "src" else (others, run)
    src = filled(slots, page, seed=seed % 1000)
    dst = src if same_buffer else filled(slots, page, seed=seed % 1000 + 1)
    expected = dst.clone()
    for s, d in zip(sources.tolist(), destinations.tolist(), strict=True):
        expected[d * page : (d + 1) * page] = src[s * page : (s + 1) * page].clone()
    PageCopier("cpu").copy(src, dst, np.stack([sources, destinations], axis=1), page)
    assert torch.equal(dst, expected)
