"""The Triton copy kernel: its split of pages over programs, and its bytes under ``TRITON_INTERPRET=1``.

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

from kvtier.copy.kernel import ALIGN, ROWS, check_kernel_args, plan_split

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process")
REPO = Path(__file__).resolve().parents[1]


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
    ],
)
def test_split_fills_the_gpu_and_covers_every_row(pages: int, page_bytes: int, target: int) -> None:
    split = plan_split(pages, page_bytes, target)
    page_rows = page_bytes // ALIGN
    # every row of a page is owned by exactly one program, and no program is empty
    assert split.programs_per_page * split.rows_per_program >= page_rows
    assert (split.programs_per_page - 1) * split.rows_per_program < page_rows
    # about ``target`` programs, unless a page is too small for that many steps of ROWS rows
    programs = max(1, min(-(-target // pages), -(-page_rows // ROWS)))
    assert programs // 2 < split.programs_per_page <= programs


def test_a_large_page_is_never_one_program() -> None:
    split = plan_split(1, 217_055_232, 4 * 132)
    assert split.programs_per_page >= 4 * 132 * 0.9
    assert split.rows_per_program * ALIGN < 512 * 1024


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


@interpreted
@pytest.mark.parametrize(
    ("page", "sm_count", "rows"),
    [(16, 4, ROWS), (48, 4, ROWS), (4096, 1, 64), (4096 + 48, 16, 64), (65_536, 2, ROWS), (65_536, 8, 128)],
)
def test_interpreted_pages_land_byte_exact(page: int, sm_count: int, rows: int) -> None:
    from kvtier.copy.kernel import launch_copy_kernel

    src = filled(9, page, seed=page)
    dst = torch.full((7 * page,), 0xA5, dtype=torch.uint8)
    pairs = torch.tensor([[8, 0], [0, 6], [3, 2], [5, 4]], dtype=torch.int64)
    check_kernel_args(src, dst, page)
    split = launch_copy_kernel(src, dst, pairs, page, sm_count, programs_per_sm=4, rows=rows)
    assert split == plan_split(4, page, 4 * sm_count, rows)
    for s, d in pairs.tolist():
        assert torch.equal(dst[d * page : (d + 1) * page], src[s * page : (s + 1) * page]), (s, d)
    for d in (1, 3, 5):
        assert bool((dst[d * page : (d + 1) * page] == 0xA5).all()), f"slot {d} was written"


@interpreted
def test_interpreted_split_pages_cover_every_row() -> None:
    """Many programs per page with a remainder row count: every byte still lands once."""
    from kvtier.copy.kernel import launch_copy_kernel

    page = 16 * 1000 + 16 * 7  # 1007 rows: not a multiple of any step
    src = filled(3, page, seed=3)
    dst = torch.zeros(3 * page, dtype=torch.uint8)
    split = launch_copy_kernel(src, dst, torch.tensor([[2, 0], [0, 1], [1, 2]]), page, 8, programs_per_sm=4, rows=32)
    assert split.programs_per_page > 1 and 1007 % split.rows_per_program
    assert torch.equal(dst[:page], src[2 * page :])
    assert torch.equal(dst[page : 2 * page], src[:page])
    assert torch.equal(dst[2 * page :], src[page : 2 * page])


@interpreted
def test_interpreted_copy_inside_one_buffer() -> None:
    from kvtier.copy.kernel import launch_copy_kernel

    page = 256
    buffer = filled(6, page, seed=5)
    before = buffer.clone()
    launch_copy_kernel(buffer, buffer, torch.tensor([[0, 5], [1, 4]]), page, 4)
    assert torch.equal(buffer[5 * page :], before[:page]) and torch.equal(
        buffer[4 * page : 5 * page], before[page : 2 * page]
    )
    assert torch.equal(buffer[: 4 * page], before[: 4 * page])
