"""The kernel path: one Triton launch gathers/scatters every page of a call.

Each page is split over ``programs_per_page`` programs so that the whole call has about
``PROGRAMS_PER_SM`` programs per multiprocessor, never one program per large page: a single
program keeps only a few KiB in flight, which caps one page at 10-24 GB/s on a 55 GB/s link
(PERF.md). A program copies its share of a page in steps of ``ROWS`` rows of 16 bytes (16 KiB),
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

from dataclasses import dataclass
from typing import Final

import torch
import triton
import triton.language as tl

ALIGN: Final = 16
ROWS: Final = 1024
NUM_WARPS: Final = 4
PROGRAMS_PER_SM: Final = 2


@dataclass(frozen=True, slots=True)
class KernelSplit:
    """How a call's pages are cut: ``programs_per_page`` programs of ``rows_per_program`` rows."""

    programs_per_page: int
    rows_per_program: int

    def grid(self, num_pages: int) -> int:
        return num_pages * self.programs_per_page


def plan_split(num_pages: int, page_bytes: int, target_programs: int, rows: int = ROWS) -> KernelSplit:
    """Split pages so the call has about ``target_programs`` programs, none with less than one step.

    ``page_bytes`` is a multiple of 16. Every program gets at least one row and the last one of a
    page the remainder; no program is empty.
    """
    page_rows = page_bytes // ALIGN
    wanted = -(-max(target_programs, 1) // num_pages)
    most = -(-page_rows // rows)  # one step of ``rows`` rows per program at least
    programs = max(1, min(wanted, most))
    rows_per_program = -(-page_rows // programs)
    return KernelSplit(programs_per_page=-(-page_rows // rows_per_program), rows_per_program=rows_per_program)


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


@triton.jit(do_not_specialize=["page_rows", "rows_per_program", "programs_per_page"])
def _copy_pages(src, dst, pairs, page_rows, rows_per_program, programs_per_page, ROWS: tl.constexpr):
    # Program ``pid`` copies rows [part * rows_per_program, ...) of page ``pid // programs_per_page``.
    pid = tl.program_id(0).to(tl.int64)
    page = pid // programs_per_page
    part = pid - page * programs_per_page
    src_slot = tl.load(pairs + 2 * page).to(tl.int64)
    dst_slot = tl.load(pairs + 2 * page + 1).to(tl.int64)
    row_begin = part * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, page_rows)
    # A row is 16 bytes = 4 int32 lanes; tiles of rows x lanes make the 16-byte vector accesses.
    src_words = src.to(tl.pointer_type(tl.int32), bitcast=True) + src_slot * page_rows * 4
    dst_words = dst.to(tl.pointer_type(tl.int32), bitcast=True) + dst_slot * page_rows * 4
    row = tl.arange(0, ROWS)[:, None]
    lane = tl.arange(0, 4)[None, :]
    for first in range(row_begin, row_end, ROWS):
        index = first + row
        inside = index < row_end
        words = index * 4 + lane
        tl.store(dst_words + words, tl.load(src_words + words, mask=inside), mask=inside)


def launch_copy_kernel(
    src: torch.Tensor,
    dst: torch.Tensor,
    pairs: torch.Tensor,
    page_bytes: int,
    sm_count: int,
    *,
    programs_per_sm: int = PROGRAMS_PER_SM,
    rows: int = ROWS,
    num_warps: int = NUM_WARPS,
) -> KernelSplit:
    """Enqueue one launch copying page ``pairs[i, 0]`` of ``src`` to page ``pairs[i, 1]`` of ``dst``.

    ``pairs`` is a contiguous (n, 2) int64 tensor that the kernel can read (on the GPU, or on the
    CPU under the interpreter), already checked against both buffers; ``check_kernel_args`` has
    passed. The call gets about ``programs_per_sm * sm_count`` programs. The launch goes to the
    current torch stream of the current device.
    """
    num_pages = pairs.shape[0]
    split = plan_split(num_pages, page_bytes, programs_per_sm * sm_count, rows)
    _copy_pages[(split.grid(num_pages),)](
        src,
        dst,
        pairs,
        page_bytes // ALIGN,
        split.rows_per_program,
        split.programs_per_page,
        ROWS=rows,
        num_warps=num_warps,
    )
    return split
