"""The kernel path: one Triton launch gathers/scatters every page of a call.

A call's runs of consecutive slots (``kvtier.copy.runs``) are cut into work items of rows so
that the whole call has about ``PROGRAMS_PER_SM`` programs per multiprocessor, one item each,
never one program per large page: a single program keeps only a few KiB in flight, which caps
one page at 10-24 GB/s on a 55 GB/s link (PERF.md). A program copies its item in steps of
``ROWS`` rows of 16 bytes (16 KiB),
each thread moving whole 16-byte vectors (``ld.global.v4.b32``/``st.global.v4.b32`` on sm_90).
On the H200 every setting tried (1-8 programs per SM, steps of 256-1024 rows, 4 or 8 warps)
moved the PERF.md shapes at 48-52 GB/s idle; 2 programs per SM of 1024 rows held up best under a
compute load (docs/copy.md).

Requirements, checked by ``check_kernel_args`` before any GPU work: the page size is a multiple
of 16 and both buffers start on a 16-byte boundary (then every slot does too). Host memory is
reached through its device-mapped (UVA) address, so it must be pinned or registered (the copier
checks that); Triton's launcher resolves the address. Under ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors.

This module imports Triton; ``kvtier.copy`` imports it only when a call takes the kernel path.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import torch
import triton
import triton.language as tl

ALIGN: Final = 16
ROWS: Final = 1024
NUM_WARPS: Final = 4
PROGRAMS_PER_SM: Final = 2


def plan_work(runs: np.ndarray, page_bytes: int, target_programs: int, rows: int = ROWS) -> np.ndarray:
    """The (k, 3) int64 work items ``(src_row, dst_row, num_rows)`` of a call, one program each.

    ``runs`` are ``(src_slot, dst_slot, pages)`` (``kvtier.copy.runs``); a row is 16 bytes, so slot
    ``s`` starts at row ``s * page_bytes // 16``. Each run is cut into items of at most ``per``
    rows, ``per`` chosen so the call has about ``target_programs`` items, and never below one step
    of ``rows`` rows (or a whole page, when smaller). Invariants: the items of a run tile it
    exactly, in order; none is empty; built with numpy, no Python object per item.
    """
    page_rows = page_bytes // ALIGN
    run_rows = runs[:, 2] * page_rows
    per = max(min(rows, page_rows), -(-int(run_rows.sum()) // max(target_programs, 1)))
    if (runs[:, 2] == runs[0, 2]).all():  # runs of one length (e.g. single pages): one cut for all
        length = int(run_rows[0])
        first = np.arange(-(-length // per), dtype=np.int64) * per
        items = np.empty((runs.shape[0], first.shape[0], 3), dtype=np.int64)
        items[:, :, 0] = (runs[:, 0] * page_rows)[:, None] + first
        items[:, :, 1] = (runs[:, 1] * page_rows)[:, None] + first
        items[:, :, 2] = np.minimum(per, length - first)
        return items.reshape(-1, 3)
    pieces = -(-run_rows // per)
    run_of = np.repeat(np.arange(runs.shape[0]), pieces)
    first_row = (np.arange(run_of.shape[0]) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * per
    work = np.empty((run_of.shape[0], 3), dtype=np.int64)
    work[:, 0] = runs[run_of, 0] * page_rows + first_row
    work[:, 1] = runs[run_of, 1] * page_rows + first_row
    work[:, 2] = np.minimum(per, run_rows[run_of] - first_row)
    return work


def check_kernel_args(src: torch.Tensor, dst: torch.Tensor, page_bytes: int) -> None:
    """``ValueError`` unless the kernel can move pages of ``page_bytes`` between these buffers."""
    if page_bytes % ALIGN:
        raise ValueError(
            f"the copy kernel needs a page size that is a multiple of {ALIGN} bytes, got {page_bytes}; "
            "pad the page or use the copy engines (KVTIER_COPY_ENGINE_MIN_BYTES=0)"
        )
    for name, buffer in (("src", src), ("dst", dst)):
        if buffer.data_ptr() % ALIGN:
            raise ValueError(f"the copy kernel needs {name} to start on a {ALIGN}-byte boundary")


@triton.jit
def _copy_rows(src, dst, work, ROWS: tl.constexpr):
    # Program ``pid`` copies rows [src_row, src_row + num_rows) of src to rows from dst_row of dst.
    pid = tl.program_id(0).to(tl.int64)
    src_row = tl.load(work + 3 * pid).to(tl.int64)
    dst_row = tl.load(work + 3 * pid + 1).to(tl.int64)
    num_rows = tl.load(work + 3 * pid + 2).to(tl.int64)
    # A row is 16 bytes = 4 int32 lanes; tiles of rows x lanes make the 16-byte vector accesses.
    src_words = src.to(tl.pointer_type(tl.int32), bitcast=True) + src_row * 4
    dst_words = dst.to(tl.pointer_type(tl.int32), bitcast=True) + dst_row * 4
    row = tl.arange(0, ROWS)[:, None]
    lane = tl.arange(0, 4)[None, :]
    for first in range(0, num_rows, ROWS):
        index = first + row
        inside = index < num_rows
        words = index * 4 + lane
        tl.store(dst_words + words, tl.load(src_words + words, mask=inside), mask=inside)


def launch_copy_kernel(
    src: torch.Tensor,
    dst: torch.Tensor,
    work: torch.Tensor,
    *,
    num_warps: int = NUM_WARPS,
    rows: int = ROWS,
) -> None:
    """Enqueue one launch that carries out every work item of ``plan_work`` (one program each).

    ``work`` is a contiguous (k, 3) int64 tensor that the kernel can read (on the GPU, or on the
    CPU under the interpreter), built from runs already checked against both buffers;
    ``check_kernel_args`` has passed. The launch goes to the current torch stream of the
    current device.
    """
    _copy_rows[(work.shape[0],)](src, dst, work, ROWS=rows, num_warps=num_warps)
