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
SMALL_PLAN_ITEMS: Final = 32  # calls of at most this many work items are planned in plain Python


def max_work_items(num_runs: int, target_programs: int) -> int:
    """An upper bound on the items ``plan_work`` makes of ``num_runs`` runs: room for its ``out``."""
    return num_runs + max(target_programs, 1)


def plan_work(
    runs: np.ndarray, page_bytes: int, target_programs: int, rows: int = ROWS, out: np.ndarray | None = None
) -> np.ndarray:
    """The (k, 3) int64 work items ``(src_row, dst_row, num_rows)`` of a call, one program each.

    ``runs`` are ``(src_slot, dst_slot, pages)`` (``kvtier.copy.runs``); a row is 16 bytes, so slot
    ``s`` starts at row ``s * page_bytes // 16``. Each run is cut into items of at most ``per``
    rows, ``per`` chosen so the call has about ``target_programs`` items, and never below one step
    of ``rows`` rows (or a whole page, when smaller). Invariants: the items of a run tile it
    exactly, in order; none is empty; k <= ``max_work_items``; built with numpy, no Python object
    per item. ``out``: a C-contiguous (>= ``max_work_items``, 3) int64 array to fill; the answer is
    then its first k rows.
    """
    page_rows = page_bytes // ALIGN
    num_runs = runs.shape[0]
    if num_runs <= SMALL_PLAN_ITEMS:
        small = _plan_small(runs.tolist(), page_rows, target_programs, rows)
        if small is not None:
            work = _items(out, len(small))
            work[:] = small
            return work
    pages = runs[:, 2]
    uniform = num_runs == 1 or bool((pages == pages[0]).all())
    length = int(pages[0]) * page_rows  # rows of every run, when uniform
    total = length * num_runs if uniform else int(pages.sum()) * page_rows
    per = max(min(rows, page_rows), -(-total // max(target_programs, 1)))
    if uniform:  # runs of one length (e.g. single pages): one cut for all
        first = np.arange(0, length, per, dtype=np.int64)
        items = _items(out, num_runs * first.shape[0]).reshape(num_runs, first.shape[0], 3)
        np.add((runs[:, 0] * page_rows)[:, None], first, out=items[:, :, 0])
        np.add((runs[:, 1] * page_rows)[:, None], first, out=items[:, :, 1])
        np.minimum(per, length - first, out=items[:, :, 2])
        return items.reshape(-1, 3)
    run_rows = pages * page_rows
    pieces = -(-run_rows // per)
    run_of = np.repeat(np.arange(num_runs), pieces)
    first_row = (np.arange(run_of.shape[0]) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * per
    work = _items(out, run_of.shape[0])
    work[:, 0] = runs[run_of, 0] * page_rows + first_row
    work[:, 1] = runs[run_of, 1] * page_rows + first_row
    work[:, 2] = np.minimum(per, run_rows[run_of] - first_row)
    return work


def _plan_small(runs: list[list[int]], page_rows: int, target_programs: int, rows: int) -> list[list[int]] | None:
    """``plan_work``'s items in plain Python (cheaper than numpy's per-call overhead for a few),
    or None when they would be more than ``SMALL_PLAN_ITEMS``."""
    total = sum(pages for _, _, pages in runs) * page_rows
    per = max(min(rows, page_rows), -(-total // max(target_programs, 1)))
    if sum(-(-pages * page_rows // per) for _, _, pages in runs) > SMALL_PLAN_ITEMS:
        return None
    return [
        [src * page_rows + first, dst * page_rows + first, min(per, pages * page_rows - first)]
        for src, dst, pages in runs
        for first in range(0, pages * page_rows, per)
    ]


def _items(out: np.ndarray | None, count: int) -> np.ndarray:
    return np.empty((count, 3), dtype=np.int64) if out is None else out[:count]


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
    programs: int | None = None,
    *,
    num_warps: int = NUM_WARPS,
    rows: int = ROWS,
) -> object:
    """Enqueue one launch that carries out the first ``programs`` work items of ``plan_work``.

    ``work`` is a contiguous (>= programs, 3) int64 tensor that the kernel can read (on the GPU,
    in pinned host memory, or on the CPU under the interpreter), built from runs already checked
    against both buffers; ``check_kernel_args`` has passed. ``programs`` defaults to every row of
    ``work``. The launch goes to the current torch stream of the current device. Returns what
    Triton's launch returns (the compiled kernel; None under the interpreter), for ``FastLaunch``.
    """
    count = work.shape[0] if programs is None else programs
    return _copy_rows[(count,)](src, dst, work, ROWS=rows, num_warps=num_warps)


class FastLaunch:
    """Launches of an already compiled ``_copy_rows`` straight through its launcher.

    Triton's ``kernel[grid](...)`` binds and specialises the arguments, looks the kernel up and
    asks torch for the device and stream on every call (17-27 us on the H200 machine's host); the
    compiled kernel's own launcher takes the stream as a raw handle and skips all that. Its
    argument convention is Triton's since 3.3 (every bound argument, constexprs included, after
    the launch metadata and hooks); ``capture`` answers None for an older Triton, for the
    interpreter, or where the compiled kernel lacks the attributes, and the caller keeps the
    normal launch. Valid only for arguments specialised as at the capturing launch: 16-byte
    aligned pointers (``check_kernel_args``, pinned or device tables) and the same ``rows`` and
    ``num_warps``; the primary context of the kernel's device must be current.
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

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, work: torch.Tensor, programs: int, stream: int) -> bool:
        """Enqueue the launch on raw ``stream``; False (nothing launched) while launch hooks are set."""
        if _launch_hooks_set():
            return False
        self._run(programs, 1, 1, stream, self._function, self._metadata, None, None, None, src, dst, work, self._rows)
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
