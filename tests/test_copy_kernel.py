"""The Triton copy kernel: its work items over runs of slots, and its bytes under ``TRITON_INTERPRET=1``.

The interpreter is chosen when Triton decorates the kernel, i.e. when ``kvtier.copy.kernel`` is
first imported, and a process imports it once. So the kernel's tests run in a child pytest of
this file with ``TRITON_INTERPRET=1`` set (``test_kernel_under_the_interpreter``), where the tests
marked ``interpreted`` run on CPU tensors; in a process that already has the variable set (CI may
export it) they run directly and the child is not needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.copy.kernel import ALIGN, ROWS, check_kernel_args, plan_work
from kvtier.copy.runs import build_runs
from kvtier.storage.pinned import RegistrationGrid

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process")
REPO = Path(__file__).resolve().parents[1]


def covered_rows(work: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (src_row, dst_row) the work items copy, in item order."""
    src = np.concatenate([np.arange(s, s + n) for s, _, n in work.tolist()])
    dst = np.concatenate([np.arange(d, d + n) for _, d, n in work.tolist()])
    return src, dst


def page_rows_of(runs: np.ndarray, page_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (src_row, dst_row) the runs ask for, in order."""
    r = page_bytes // ALIGN
    src = np.concatenate([np.arange(s * r, (s + n) * r) for s, _, n in runs.tolist()])
    dst = np.concatenate([np.arange(d * r, (d + n) * r) for _, d, n in runs.tolist()])
    return src, dst


@pytest.mark.parametrize(
    ("pages", "page_bytes", "target", "run"),
    [
        (1, 217_055_232, 528, 1),
        (12, 15_261_696, 528, 1),
        (140, 884_736, 528, 1),
        (140, 884_736, 528, 140),
        (512, 65_536, 528, 1),
        (512, 65_536, 528, 8),
        (300, 16, 528, 1),
        (300, 16, 528, 300),
        (4096, 4096, 528, 3),
        (3, 4096 + 48, 64, 1),
    ],
)
def test_work_items_fill_the_gpu_and_cover_every_row_once(pages: int, page_bytes: int, target: int, run: int) -> None:
    starts = np.arange(0, pages, run)
    runs = np.stack([starts * 3, starts + 7, np.minimum(run, pages - starts)], axis=1).astype(np.int64)
    work = plan_work(runs, page_bytes, target)
    assert work.dtype == np.int64 and (work[:, 2] > 0).all()
    if page_bytes * pages <= 1 << 28:
        want_src, want_dst = page_rows_of(runs, page_bytes)
        got_src, got_dst = covered_rows(work)
        assert np.array_equal(got_src, want_src) and np.array_equal(got_dst, want_dst)
    else:
        assert work[:, 2].sum() == pages * page_bytes // ALIGN
    page_rows = page_bytes // ALIGN
    per = int(work[:, 2].max())
    assert per >= min(ROWS, page_rows)  # never less than one step (or a page)
    assert work.shape[0] <= target + runs.shape[0]  # about ``target`` programs, one more per run at most
    if page_rows * run >= ROWS * 2 * -(-target // runs.shape[0]):
        assert work.shape[0] >= target // 2  # large runs: enough programs to fill the GPU


def test_a_large_page_is_never_one_program() -> None:
    work = plan_work(np.array([[0, 0, 1]], dtype=np.int64), 217_055_232, 4 * 132)
    assert work.shape[0] >= 4 * 132 * 0.9
    assert work[:, 2].max() * ALIGN < 512 * 1024


def test_a_run_of_small_pages_is_few_items() -> None:
    """140 consecutive 16 KiB pages: a handful of large items, not one (or more) per page."""
    runs = np.array([[0, 0, 140]], dtype=np.int64)
    assert plan_work(runs, 16 * 1024, 528).shape[0] == 140  # one step of 1024 rows = one page per item
    assert plan_work(runs, 16 * 1024, 8).shape[0] == 8


@pytest.mark.parametrize(("page", "offset"), [(24, 0), (4 * 1024 * 1024 + 8, 0), (4096, 8)])
def test_alignment_is_checked_before_any_work(page: int, offset: int) -> None:
    buffer = torch.zeros(4 * page + 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="16"):
        check_kernel_args(buffer[offset:], buffer[offset:], page)


def test_kernel_under_the_interpreter() -> None:
    if INTERPRETED:
        pytest.skip("this process is the interpreter run")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    child = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-k", "interpreted", "-p", "no:cacheprovider"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout.splitlines()[-1]


def filled(slots: int, page: int, seed: int) -> torch.Tensor:
    """Non-zero 8-byte words, each different from every other (so every slot differs too)."""
    values = np.arange(seed + 1, seed + 1 + slots * page // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    values ^= values >> np.uint64(31)
    return torch.from_numpy(values.view(np.uint8).copy())


def launch(src: torch.Tensor, dst: torch.Tensor, pairs: object, page: int, target: int, rows: int = ROWS, grid=None):
    """Build runs and work items as the copier does, then launch the kernel on CPU tensors."""
    from kvtier.copy.kernel import launch_copy_kernel

    table = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    check_kernel_args(src, dst, page)
    runs = build_runs(table, page, grid, grid)
    work = plan_work(runs, page, target, rows)
    launch_copy_kernel(src, dst, torch.from_numpy(work), rows=rows)
    return runs, work


@interpreted
@pytest.mark.parametrize(
    ("page", "target", "rows"),
    [(16, 16, ROWS), (48, 16, ROWS), (4096, 4, 64), (4096 + 48, 64, 64), (65_536, 8, ROWS), (65_536, 32, 128)],
)
def test_interpreted_pages_land_byte_exact(page: int, target: int, rows: int) -> None:
    src = filled(9, page, seed=page)
    dst = torch.full((7 * page,), 0xA5, dtype=torch.uint8)
    pairs = [[8, 0], [0, 6], [3, 2], [5, 4]]
    launch(src, dst, pairs, page, target, rows)
    for s, d in pairs:
        assert torch.equal(dst[d * page : (d + 1) * page], src[s * page : (s + 1) * page]), (s, d)
    for d in (1, 3, 5):
        assert bool((dst[d * page : (d + 1) * page] == 0xA5).all()), f"slot {d} was written"


@interpreted
@pytest.mark.parametrize("run_chance", [0.0, 0.7, 1.0])
def test_interpreted_random_pair_sets_land_byte_exact(run_chance: float) -> None:
    from tests.test_copy_runs import random_pairs

    rng = np.random.default_rng(int(run_chance * 10) + 3)
    page, slots = 4096 + 48, 24
    for trial in range(3):
        src = filled(slots, page, seed=trial + 11)
        dst = torch.full((slots * page,), 0x5A, dtype=torch.uint8)
        pairs = random_pairs(rng, int(rng.integers(1, 16)), slots, run_chance)
        runs, _ = launch(src, dst, pairs, page, int(rng.integers(1, 40)), rows=64)
        if run_chance == 1.0:
            assert runs.shape[0] < pairs.shape[0] or pairs.shape[0] == 1
        expected = torch.full((slots * page,), 0x5A, dtype=torch.uint8)
        for s, d in pairs.tolist():
            expected[d * page : (d + 1) * page] = src[s * page : (s + 1) * page]
        assert torch.equal(dst, expected)


@interpreted
def test_interpreted_runs_cut_at_registrations_land_byte_exact() -> None:
    page = 256
    src = filled(16, page, seed=21)
    dst = torch.zeros(16 * page, dtype=torch.uint8)
    pairs = [[s, s] for s in range(1, 15)]
    runs, work = launch(src, dst, pairs, page, 4, rows=32, grid=RegistrationGrid(offset=0, chunk_bytes=4 * page))
    assert runs.tolist() == [[1, 1, 3], [4, 4, 4], [8, 8, 4], [12, 12, 3]]
    item_chunks = [(s * ALIGN // (4 * page), (s + n - 1) * ALIGN // (4 * page)) for s, _, n in work.tolist()]
    assert all(a == b for a, b in item_chunks), "a work item spans two registrations"
    assert torch.equal(dst[page : 15 * page], src[page : 15 * page])
    assert not dst[:page].any() and not dst[15 * page :].any()


@interpreted
def test_interpreted_items_of_a_remainder_row_count_cover_every_row() -> None:
    """Many items per page with a remainder row count: every byte still lands once."""
    page = 16 * 1000 + 16 * 7  # 1007 rows: not a multiple of any step
    src = filled(3, page, seed=3)
    dst = torch.zeros(3 * page, dtype=torch.uint8)
    _, work = launch(src, dst, [[2, 0], [0, 1], [1, 2]], page, 32, rows=32)
    assert work.shape[0] > 3 and 1007 % int(work[0, 2])
    assert torch.equal(dst[:page], src[2 * page :])
    assert torch.equal(dst[page : 2 * page], src[:page])
    assert torch.equal(dst[2 * page :], src[page : 2 * page])


@interpreted
def test_interpreted_copy_inside_one_buffer() -> None:
    page = 256
    buffer = filled(6, page, seed=5)
    before = buffer.clone()
    launch(buffer, buffer, [[0, 4], [1, 5]], page, 8)
    assert torch.equal(buffer[4 * page :], before[: 2 * page])
    assert torch.equal(buffer[: 4 * page], before[: 4 * page])
