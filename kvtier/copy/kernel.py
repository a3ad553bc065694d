"""The kernel path: one Triton launch copies every page of a call, reading the call's pairs in place.

The launch reads the call's ``(src_slot, dst_slot)`` pairs as they are, from a pinned table
(``kvtier.copy.table_ring``): no per-call work plan is built on the host. Each page is split into
``programs_per_page`` equal parts so that the whole call has about ``PROGRAMS_PER_SM`` programs
per multiprocessor (``plan_split``), never one program per large page: a single program keeps only
a few KiB in flight, which caps one page at 10-24 GB/s on a 55 GB/s link (measured on the H200). Program
``pid`` copies part ``pid % programs_per_page`` of pair ``pid // programs_per_page``, in steps of
``ROWS`` rows of 16 bytes (16 KiB), each thread moving whole 16-byte vectors
(``ld.global.v4.b32``/``st.global.v4.b32`` on sm_90). On the H200 every setting tried (1-8 programs
per SM, steps of 256-1024 rows, 4 or 8 warps) moved the reference shapes (docs/copy.md) at 48-52 GB/s idle; 2
programs per SM of 1024 rows held up best under a compute load (docs/copy.md).

Requirements, which ``kvtier.copy.kernel_args.kernel_refusal`` names before any GPU work: the page size is a multiple
of 16 and below ``MAX_PAGE_BYTES``, and both buffers start on a 16-byte boundary (then every slot
does too). Host memory is reached through its device-mapped (UVA) address, so it must be pinned or
registered (the copier checks that); the copier resolves that address once per buffer and passes
it to ``FastLaunch`` (Triton's normal launch resolves it from the tensor). Under
``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors.

This module imports Triton; ``kvtier.copy`` imports it only when a call takes the kernel path.
"""

from __future__ import annotations

import functools
from typing import Final, NamedTuple

import torch
import triton
import triton.language as tl

from kvtier.copy.kernel_args import ALIGN

ROWS: Final = 1024
NUM_WARPS: Final = 4
PROGRAMS_PER_SM: Final = 2


class Split(NamedTuple):
    """How a call's pages are cut: each into ``programs_per_page`` parts of ``rows_per_program`` rows
    (the last part of a page may be shorter, never empty)."""

    rows_per_program: int
    programs_per_page: int


@functools.lru_cache(maxsize=1024)
def plan_split(page_bytes: int, pages: int, target_programs: int, rows: int = ROWS) -> Split:
    """The split that gives a call of ``pages`` pages about ``target_programs`` programs in all.

    A program copies at least one step of ``rows`` rows (or a whole page, when smaller) and never
    more than a page: so a call of many small pages gets one program a page, and a single large
    page ``target_programs`` programs. Plain integer arithmetic, remembered for the sizes a copier
    sees again and again.
    """
    page_rows = page_bytes // ALIGN
    total = page_rows * pages
    per = min(page_rows, max(min(rows, page_rows), -(-total // max(target_programs, 1))))
    return Split(per, -(-page_rows // per))


@triton.jit(do_not_specialize=["page_rows", "rows_per_program", "programs_per_page"])
def _copy_pages(src, dst, pairs, page_rows, rows_per_program, programs_per_page, ROWS: tl.constexpr):
    # Program ``pid`` copies part ``pid % programs_per_page`` of page pair ``pid // programs_per_page``.
    pid = tl.program_id(0).to(tl.int64)
    pair = pid // programs_per_page
    first_row = (pid - pair * programs_per_page) * rows_per_program
    num_rows = tl.minimum(rows_per_program, page_rows - first_row)
    src_row = tl.load(pairs + 2 * pair).to(tl.int64) * page_rows + first_row
    dst_row = tl.load(pairs + 2 * pair + 1).to(tl.int64) * page_rows + first_row
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
    pairs: torch.Tensor,
    page_bytes: int,
    split: Split,
    pages: int | None = None,
    *,
    num_warps: int = NUM_WARPS,
    rows: int = ROWS,
) -> object:
    """Enqueue one launch that copies the first ``pages`` pairs of ``pairs`` as ``split`` cuts them.

    ``pairs`` is a contiguous (>= pages, 2) int64 tensor of checked ``(src_slot, dst_slot)`` that
    the kernel can read (on the GPU, in pinned host memory, or on the CPU under the interpreter);
    ``kernel_refusal`` has no objection. ``pages`` defaults to every row of ``pairs``. The launch goes
    to the current torch stream of the current device. Returns what Triton's launch returns (the
    compiled kernel; None under the interpreter), for ``FastLaunch``.
    """
    count = pairs.shape[0] if pages is None else pages
    per, parts = split
    grid = (count * parts,)
    return _copy_pages[grid](src, dst, pairs, page_bytes // ALIGN, per, parts, ROWS=rows, num_warps=num_warps)


class FastLaunch:
    """Launches of an already compiled ``_copy_pages`` straight through its launcher.

    Triton's ``kernel[grid](...)`` binds and specialises the arguments, looks the kernel up and
    asks torch for the device and stream on every call (17-27 us on the H200 machine's host); the
    compiled kernel's own launcher takes the stream as a raw handle and skips all that. Buffers are
    passed as the device-mapped addresses the caller resolved once (a tensor would cost the
    launcher a driver query each). Its argument convention is Triton's since 3.3 (every bound
    argument, constexprs included, after the launch metadata and hooks); ``capture`` answers None
    for an older Triton, for the interpreter, or where the compiled kernel lacks the attributes,
    and the caller keeps the normal launch. Valid only for arguments specialised as at the
    capturing launch: 16-byte aligned addresses (``kernel_refusal``, pinned or device tables),
    32-bit integer arguments (the kernel does not specialise on their values; pages below
    ``MAX_PAGE_BYTES`` keep them 32-bit) and the same ``rows`` and ``num_warps``; the primary
    context of the kernel's device must be current.
    """

    def __init__(self, compiled: object, rows: int) -> None:
        self._run = compiled.run  # type: ignore[attr-defined]
        self._function = compiled.function  # type: ignore[attr-defined]
        self._metadata = compiled.packed_metadata  # type: ignore[attr-defined]
        self._rows = rows

    @classmethod
    def capture(cls, compiled: object, rows: int = ROWS) -> FastLaunch | None:
        """A ``FastLaunch`` of ``compiled`` (what ``launch_copy_kernel`` returned), or None where unknown."""
        if compiled is None or _triton_version() < (3, 3) or _launch_hooks_set():
            return None
        try:
            return cls(compiled, rows)
        except AttributeError:
            return None

    def __call__(self, src: int, dst: int, pairs: int, page_bytes: int, split: Split, pages: int, stream: int) -> bool:
        """``launch_copy_kernel`` on raw ``stream``, the buffers and the pairs given by their
        device-mapped addresses; False (nothing launched) while launch hooks are set."""
        if _launch_hooks_set():
            return False
        per, parts = split
        args = (src, dst, pairs, page_bytes // ALIGN, per, parts, self._rows)
        self._run(pages * parts, 1, 1, stream, self._function, self._metadata, None, None, None, *args)
        return True


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _launch_hooks_set() -> bool:
    """Whether a profiler asked Triton for launch hooks (the fast launch would skip them)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return True
    return _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def _hook_active(hook: object) -> bool:
    """A hook that would do something: set, and not an empty chain (Triton 3.6 keeps a ``HookChain``)."""
    return hook is not None and bool(getattr(hook, "calls", True))
