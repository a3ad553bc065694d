"""The CPU path: pages between two host buffers with plain memory copies.

Two ways, chosen by page size (measured on a 2-core x86 machine, 4 KiB to 4 MiB pages, see
docs/copy.md): below ``LOOP_MIN_PAGE_BYTES`` one vectorised gather/scatter through numpy fancy
indexing (one pass into a temporary and one out, but no per-page cost; one pass when either
side's slots are consecutive, as a swap's scratch slots are); from it on one slice
assignment (a memcpy) per page, which reads and writes each byte once and beat the vectorised
form by 1.3-4x for 16 KiB to 4 MiB pages. torch's ``index_select``/``index_copy_`` were slower
than both at every size. The loop goes over runs of consecutive slots (``kvtier.copy.runs``): one
slice assignment a run, taken whenever a call's runs average ``LOOP_MIN_PAGE_BYTES`` or more.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from kvtier.copy.copy_request import CopyRequest

LOOP_MIN_PAGE_BYTES: Final = 8 * 1024


def copy_pages_cpu(request: CopyRequest, runs: np.ndarray) -> None:
    """Copy every (src_slot, dst_slot) page of ``request``; both buffers are in host memory.

    ``runs`` are the request's pairs as runs ``(src_slot, dst_slot, pages)`` (``build_runs``).
    """
    page = request.page_bytes
    src = request.src.numpy()
    dst = request.dst.numpy()
    if page * request.pairs.shape[0] < LOOP_MIN_PAGE_BYTES * runs.shape[0]:
        src_pages = src[: src.size // page * page].reshape(-1, page)
        dst_pages = dst[: dst.size // page * page].reshape(-1, page)
        src_slots, dst_slots = request.pairs[:, 0], request.pairs[:, 1]
        if _consecutive(dst_slots):  # gathered straight into place: one pass, no temporary
            first = int(dst_slots[0])
            np.take(src_pages, src_slots, axis=0, out=dst_pages[first : first + len(dst_slots)], mode="clip")
        elif _consecutive(src_slots):  # scattered straight from place
            first = int(src_slots[0])
            dst_pages[dst_slots] = src_pages[first : first + len(src_slots)]
        else:
            dst_pages[dst_slots] = src_pages[src_slots]
        return
    for src_byte, dst_byte, nbytes in (runs * np.int64(page)).tolist():
        dst[dst_byte : dst_byte + nbytes] = src[src_byte : src_byte + nbytes]


def _consecutive(slots: np.ndarray) -> bool:
    """Whether ``slots`` (checked: in range) are ``s, s + 1, ..., s + n - 1``."""
    return int(slots[-1]) - int(slots[0]) == len(slots) - 1 and bool((slots[1:] > slots[:-1]).all())
