"""The Triton copy kernel: how it splits a call's pages, and its bytes under ``TRITON_INTERPRET=1``.

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
import triton

from kvtier.copy.kernel import ROWS, Split, _triton_version, plan_split
from kvtier.copy.kernel_args import ALIGN, MAX_PAGE_BYTES, kernel_refusal

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Triton's interpreter before 3.7 takes a tensor used as a loop bound to an int with ``int()`` of a
# one-element array, which numpy 2.4 refuses (Triton 3.7 squeezes it first). The compiled kernel
# is not concerned: tests/gpu check its bytes.
INTERPRETER_BROKEN = _triton_version() < (3, 7) and tuple(map(int, np.__version__.split(".")[:2])) >= (2, 4)
BROKEN_REASON = (
    f"Triton {triton.__version__}'s interpreter cannot run under numpy {np.__version__} (fixed in Triton 3.7)"
)
interpreted = pytest.mark.skipif(
    not INTERPRETED or INTERPRETER_BROKEN,
    reason=BROKEN_REASON if INTERPRETER_BROKEN else "runs in the TRITON_INTERPRET=1 child process",
)
REPO = Path(__file__).resolve().parents[1]


def covered_rows(pages: int, page_bytes: int, split: Split) -> np.ndarray:
    """Every (page, row) the programs of a launch copy, in program order."""
    page_rows = page_bytes // ALIGN
    per, parts = split
    cells = []
    for program in range(pages * parts):
        page, part = divmod(program, parts)
        first = part * per
        rows = np.arange(first, min(first + per, page_rows))
        cells.append(np.stack([np.full_like(rows, page), rows], 1))
    return np.concatenate(cells)


@pytest.mark.parametrize(
    ("pages", "page_bytes", "target"),
    [
        (1, 217_055_232, 528),
        (12, 15_261_696, 528),
        (140, 884_736, 528),
        (512, 65_536, 528),
        (300, 16, 528),
        (4096, 4096, 528),
        (3, 4096 + 48, 64),
        (3, 16 * 1007, 32),
        (5, 65_536, 1),
    ],
)
def test_the_split_fills_the_gpu_and_covers_every_row_once(pages: int, page_bytes: int, target: int) -> None:
    split = plan_split(page_bytes, pages, target)
    page_rows = page_bytes // ALIGN
    per, parts = split
    assert min(ROWS, page_rows) <= per <= page_rows  # never less than one step (or a page), never more than a page
    assert (parts - 1) * per < page_rows <= parts * per  # the parts tile a page, none empty
    if page_bytes * pages <= 1 << 26:
        cells = covered_rows(pages, page_bytes, split)
        expected = np.stack([np.repeat(np.arange(pages), page_rows), np.tile(np.arange(page_rows), pages)], 1)
        assert np.array_equal(cells, expected)
    programs = pages * parts
    assert programs <= max(target, pages) + pages  # about ``target`` programs, or one a page
    if page_rows * pages >= ROWS * 2 * target:
        assert programs >= target // 2  # large calls: enough programs to fill the GPU


def test_a_large_page_is_never_one_program() -> None:
    per, parts = plan_split(217_055_232, 1, 4 * 132)
    assert parts >= 4 * 132 * 0.9
    assert per * ALIGN < 512 * 1024


def test_many_small_pages_get_one_program_each() -> None:
    assert plan_split(16 * 1024, 140, 528) == (1024, 1)
    assert plan_split(4096, 4096, 528) == (256, 1)


def test_pages_too_large_for_the_kernel_are_refused() -> None:
    buffer = torch.zeros(64, dtype=torch.uint8)
    assert "copy engines" in kernel_refusal(buffer, buffer, MAX_PAGE_BYTES)


@pytest.mark.parametrize(("page", "offset"), [(24, 0), (4 * 1024 * 1024 + 8, 0), (4096, 8)])
def test_a_page_size_or_buffer_off_16_bytes_is_refused(page: int, offset: int) -> None:
    buffer = torch.zeros(4 * page + 64, dtype=torch.uint8)
    assert "16" in kernel_refusal(buffer[offset:], buffer[offset:], page)  # what a copier asks before routing


def test_what_the_kernel_takes_is_not_refused() -> None:
    """Aligned buffers and a page size that is a multiple of 16 below the limit: no refusal (a
    copier without the batched copy-engine call then gives the kernel calls of many runs)."""
    buffer = torch.zeros(8 * 4096, dtype=torch.uint8)
    assert kernel_refusal(buffer, buffer[4096:], 4096) is None
    assert kernel_refusal(buffer, buffer, ALIGN) is None


def test_kernel_under_the_interpreter() -> None:
    if INTERPRETED:
        pytest.skip("this process is the interpreter run")
    if INTERPRETER_BROKEN:
        pytest.skip(BROKEN_REASON)
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


def launch(src: torch.Tensor, dst: torch.Tensor, pairs: object, page: int, target: int, rows: int = ROWS) -> Split:
    """Split the call and launch the kernel over its pairs on CPU tensors, as the copier does."""
    from kvtier.copy.kernel import launch_copy_kernel

    table = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    assert kernel_refusal(src, dst, page) is None
    split = plan_split(page, table.shape[0], target, rows)
    launch_copy_kernel(src, dst, torch.from_numpy(table), page, split, rows=rows)
    return split


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
        launch(src, dst, pairs, page, int(rng.integers(1, 40)), rows=64)
        expected = torch.full((slots * page,), 0x5A, dtype=torch.uint8)
        for s, d in pairs.tolist():
            expected[d * page : (d + 1) * page] = src[s * page : (s + 1) * page]
        assert torch.equal(dst, expected)


@interpreted
def test_interpreted_parts_of_a_remainder_row_count_cover_every_row() -> None:
    """Many programs per page with a remainder row count: every byte still lands once."""
    page = 16 * 1000 + 16 * 7  # 1007 rows: not a multiple of any step
    src = filled(3, page, seed=3)
    dst = torch.zeros(3 * page, dtype=torch.uint8)
    per, parts = launch(src, dst, [[2, 0], [0, 1], [1, 2]], page, 32, rows=32)
    assert parts > 1 and 1007 % per
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
