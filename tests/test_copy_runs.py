"""Runs of consecutive slots: built with numpy, cut at host registrations, copied byte for byte."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvtier.copy import PageCopier
from kvtier.copy.cpu import LOOP_MIN_PAGE_BYTES
from kvtier.copy.runs import build_runs, copy_order, many_runs
from kvtier.storage.pinned import RegistrationGrid


def expand(runs: np.ndarray) -> np.ndarray:
    """The pairs a list of runs stands for, in order."""
    rows = [(s + i, d + i) for s, d, n in runs.tolist() for i in range(n)]
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


def random_pairs(rng: np.random.Generator, n: int, slots: int, run_chance: float) -> np.ndarray:
    """n pairs with distinct destinations; each pair continues the previous one's run with ``run_chance``."""
    dst_order = rng.permutation(slots)
    pairs = np.empty((n, 2), dtype=np.int64)
    used: set[int] = set()
    k = 0
    for i in range(n):
        if i and rng.random() < run_chance and pairs[i - 1, 1] + 1 < slots and pairs[i - 1, 1] + 1 not in used:
            pairs[i] = (min(pairs[i - 1, 0] + 1, slots - 1), pairs[i - 1, 1] + 1)
        else:
            while int(dst_order[k]) in used:
                k += 1
            pairs[i] = (rng.integers(0, slots), dst_order[k])
        used.add(int(pairs[i, 1]))
    return pairs


def test_consecutive_slots_become_one_run() -> None:
    pairs = np.array([[10, 3], [11, 4], [12, 5], [13, 6]], dtype=np.int64)
    assert build_runs(pairs, 64).tolist() == [[10, 3, 4]]


def test_a_run_needs_both_sides_consecutive() -> None:
    pairs = np.array([[0, 0], [1, 1], [2, 5], [3, 6], [9, 7], [10, 9], [4, 2]], dtype=np.int64)
    assert build_runs(pairs, 64).tolist() == [[0, 0, 2], [2, 5, 2], [9, 7, 1], [10, 9, 1], [4, 2, 1]]


def test_slots_walking_down_on_both_sides_are_read_backwards_into_one_run() -> None:
    pairs = np.array([[1791, 7423], [1790, 7422], [1789, 7421], [1788, 7420]], dtype=np.int64)
    assert build_runs(pairs, 64).tolist() == [[1788, 7420, 4]]
    assert not many_runs(pairs, 1)
    downhill_then_scattered = np.array([[9, 9], [8, 8], [3, 1], [5, 0]], dtype=np.int64)
    assert np.array_equal(expand(build_runs(downhill_then_scattered, 64)), downhill_then_scattered[::-1])


def test_a_single_pair_is_one_run() -> None:
    assert build_runs(np.array([[7, 2]], dtype=np.int64), 16).tolist() == [[7, 2, 1]]


@pytest.mark.parametrize("run_chance", [0.0, 0.5, 0.95])
def test_runs_expand_back_to_the_pairs(run_chance: float) -> None:
    rng = np.random.default_rng(int(run_chance * 100) + 1)
    for _ in range(50):
        pairs = random_pairs(rng, int(rng.integers(1, 200)), 256, run_chance)
        runs = build_runs(pairs, 4096)
        assert runs.dtype == np.int64 and runs.shape[1] == 3 and (runs[:, 2] >= 1).all()
        assert np.array_equal(expand(runs), copy_order(pairs))
        assert runs[:, 2].sum() == pairs.shape[0]
        # maximal: no run could have joined the next one
        ends = runs[:-1, :2] + runs[:-1, 2:3]
        assert not (ends == runs[1:, :2]).all(axis=1).any()


@pytest.mark.parametrize("run_chance", [0.0, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("limit", [1, 4])
def test_many_runs_is_told_from_the_head_and_never_wrong(run_chance: float, limit: int) -> None:
    rng = np.random.default_rng(int(run_chance * 100) + limit)
    told = 0
    for _ in range(200):
        pairs = random_pairs(rng, int(rng.integers(1, 40)), 64, run_chance)
        runs = build_runs(pairs, 64).shape[0]
        head = copy_order(pairs)[: limit + 2].tolist()
        head_runs = 1 + sum(b[0] != a[0] + 1 or b[1] != a[1] + 1 for a, b in itertools.pairwise(head))
        assert many_runs(pairs, limit) == (head_runs > limit), (pairs.tolist(), runs, head_runs)
        if many_runs(pairs, limit):
            assert runs > limit
            told += 1
    assert told or run_chance >= 0.99  # scattered calls are told without building their runs


@pytest.mark.parametrize(("offset", "chunk_pages"), [(0, 4), (0, 5), (3 * 256, 4), (0, 1)])
def test_runs_are_cut_where_registrations_meet(offset: int, chunk_pages: int) -> None:
    page = 256
    grid = RegistrationGrid(offset=offset, chunk_bytes=chunk_pages * page)
    pairs = np.array([[s, 100 + s] for s in range(20)], dtype=np.int64)  # one run of 20 without a grid
    for src_grid, dst_grid in ((grid, None), (None, grid), (grid, grid)):
        runs = build_runs(pairs, page, src_grid, dst_grid)
        assert np.array_equal(expand(runs), pairs)
        for side, g in ((0, src_grid), (1, dst_grid)):
            if g is not None:
                first = g.chunk_of(runs[:, side], page)
                last = g.chunk_of(runs[:, side] + runs[:, 2] - 1, page, last=True)
                assert (first == last).all(), "a run spans two registrations"
        ends = runs[:-1, :2] + runs[:-1, 2:3]  # cut only at boundaries: each cut is a real boundary
        for end in ends:
            cuts = [
                g.chunk_of(np.array([end[i] - 1]), page) != g.chunk_of(np.array([end[i]]), page)
                for i, g in ((0, src_grid), (1, dst_grid))
                if g is not None
            ]
            assert any(bool(c[0]) for c in cuts)
    src_runs = build_runs(pairs, page, grid, None)
    boundaries = {(offset + s * page) // grid.chunk_bytes for s in range(20)}
    assert src_runs.shape[0] == len(boundaries)


def test_a_chunk_boundary_inside_a_page_keeps_the_page_whole() -> None:
    """A tensor that starts mid-page of the grid: the page across the boundary is cut from both neighbours."""
    page = 256
    grid = RegistrationGrid(offset=128, chunk_bytes=4 * page)  # boundary at byte 1024 - 128 of the tensor
    pairs = np.array([[s, s] for s in range(8)], dtype=np.int64)
    runs = build_runs(pairs, page, grid, None)
    assert np.array_equal(expand(runs), pairs)
    assert [3, 3, 1] in runs.tolist()  # slot 3 spans bytes 768..1023 of the tensor: 896..1151 of the grid


def filled(slots: int, page: int, seed: int) -> torch.Tensor:
    values = np.arange(seed + 1, seed + 1 + slots * page // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    values ^= values >> np.uint64(29)
    return torch.from_numpy(values.view(np.uint8).copy())


@pytest.mark.parametrize("page", [16, 512, LOOP_MIN_PAGE_BYTES, 65_536])
@pytest.mark.parametrize("run_chance", [0.0, 0.6, 1.0])
def test_cpu_copies_of_random_pair_sets_are_byte_exact(page: int, run_chance: float) -> None:
    rng = np.random.default_rng(page + int(run_chance * 10))
    copier = PageCopier("cpu")
    slots = 64
    for trial in range(6):
        src = filled(slots, page, seed=trial)
        dst = torch.full((slots * page,), 0xA5, dtype=torch.uint8)
        pairs = random_pairs(rng, int(rng.integers(1, 48)), slots, run_chance)
        assert copier.copy(src, dst, pairs, page) == "cpu"
        expected = torch.full((slots * page,), 0xA5, dtype=torch.uint8)
        for s, d in pairs.tolist():
            expected[d * page : (d + 1) * page] = src[s * page : (s + 1) * page]
        assert torch.equal(dst, expected)


def test_cpu_copy_of_a_run_inside_one_buffer() -> None:
    page = 4096
    buffer = filled(16, page, seed=9)
    before = buffer.clone()
    PageCopier("cpu").copy(buffer, buffer, [(0, 8), (1, 9), (2, 10), (3, 11)], page)
    assert torch.equal(buffer[8 * page : 12 * page], before[: 4 * page])
    assert torch.equal(buffer[: 8 * page], before[: 8 * page]) and torch.equal(buffer[12 * page :], before[12 * page :])


@pytest.mark.parametrize(
    ("page", "run", "keep_up"),
    [(4096, 1, False), (64 * 1024, 8, False), (64 * 1024, 16, True), (2 << 20, 1, True), (512 * 1024, 1, False)],
)
def test_torch_copies_keep_up_with_runs_of_a_mebibyte_on_average(page: int, run: int, keep_up: bool) -> None:
    """Without cuda-bindings a call's runs go as torch copies when they average at least
    ``TORCH_COPY_MIN_RUN_BYTES`` (else a copy-engine call of many runs goes to the kernel)."""
    from kvtier.copy.copy_request import check_request
    from kvtier.copy.torch_runs import TORCH_COPY_MIN_RUN_BYTES, torch_copies_keep_up

    assert TORCH_COPY_MIN_RUN_BYTES == 1 << 20
    starts = np.arange(8) * (run + 1)  # 8 runs of ``run`` pages with a gap between them
    slots = (starts[:, None] + np.arange(run)).ravel()
    buffer = torch.empty((slots[-1] + 1) * page, dtype=torch.uint8)
    request = check_request(buffer, torch.empty_like(buffer), np.stack([slots, slots], axis=1), page)
    runs = build_runs(request.pairs, page)
    assert runs.shape[0] == 8
    assert torch_copies_keep_up(request, runs) is keep_up
