"""Checking one copy call's arguments before any work: buffers, slot pairs, page size.

A tier's buffer is a flat, contiguous ``torch.uint8`` tensor; slot i is bytes
``[i * page_bytes, (i + 1) * page_bytes)``. ``check_request`` turns the caller's arguments into a
``CopyRequest`` or raises ``ValueError`` (``TypeError`` for a wrong type). It reads the pairs with
numpy, creating no Python object per page, except in calls of at most ``SMALL_CALL`` pairs, which
plain Python checks faster.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

SMALL_CALL: Final = 16  # up to this many pairs are checked in plain Python
MONOTONE_CHECK_MIN: Final = 256  # from this many pairs monotone destinations skip the sort (smaller: it costs more)
_INT64: Final = np.dtype(np.int64)
_PAIR_STRIDES: Final = (2 * _INT64.itemsize, _INT64.itemsize)  # a C-contiguous (n, 2) int64 array's


@dataclass(slots=True)
class CopyRequest:
    """A checked call. ``pairs`` is a C-contiguous (n, 2) int64 array of (src_slot, dst_slot).

    Invariants: n >= 1; every source slot < ``src.numel() // page_bytes`` and every destination
    slot < ``dst.numel() // page_bytes``; destination slots are distinct; if both buffers are the
    same memory, no slot is both read and written.
    """

    src: torch.Tensor
    dst: torch.Tensor
    pairs: np.ndarray
    page_bytes: int


def check_page_bytes(page_bytes: object) -> int:
    """``page_bytes`` as a positive int, or ``ValueError``/``TypeError``."""
    if isinstance(page_bytes, bool):
        raise TypeError("page_bytes must be an int, got a bool")
    try:
        value = operator.index(page_bytes)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"page_bytes must be an int, got {type(page_bytes).__name__}") from None
    if value <= 0:
        raise ValueError(f"page_bytes must be positive, got {value}")
    return value


def check_buffer(name: str, buffer: object) -> torch.Tensor:
    """A tier buffer: a flat, contiguous ``torch.uint8`` tensor."""
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype != torch.uint8:
        raise ValueError(f"{name} must be a torch.uint8 tensor (a tier buffer), got {buffer.dtype}")
    if buffer.dim() != 1:
        raise ValueError(f"{name} must be a flat 1-D buffer (a tier's bytes), got shape {tuple(buffer.shape)}")
    if not buffer.is_contiguous():
        raise ValueError(f"{name} must be contiguous: pass the tier's flat buffer, not a strided view")
    return buffer


def as_pairs(pairs: object) -> np.ndarray:
    """The (n, 2) int64 array of (src_slot, dst_slot); an empty input (``[]``, or of shape (0, 2))
    gives shape (0, 2). A C-contiguous (n, 2) int64 array, what a tier passes, is returned as is."""
    if (
        type(pairs) is np.ndarray
        and pairs.dtype is _INT64
        and pairs.strides == _PAIR_STRIDES
        and pairs.shape[1:] == (2,)
    ):
        return pairs
    array = np.asarray(pairs)
    if array.size == 0 and array.shape in ((0,), (0, 2)):
        return np.empty((0, 2), dtype=np.int64)
    if array.ndim != 2 or array.shape[1] != 2:
        raise ValueError(f"pairs must have shape (n, 2) of (src_slot, dst_slot), got shape {array.shape}")
    if array.dtype.kind not in "iu" or array.dtype.itemsize > 8:
        raise ValueError(f"pairs must hold integers of at most 64 bits, got dtype {array.dtype}")
    if array.size == 0:
        return np.empty((0, 2), dtype=np.int64)
    if array.dtype == np.uint64 and int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"slot {int(array.max())} is out of range for any buffer")
    return np.ascontiguousarray(array, dtype=np.int64)


def check_request(src: object, dst: object, pairs: object, page_bytes: object) -> CopyRequest | None:
    """The checked request, or None for an empty call (whose buffers and page size are checked too)."""
    page = check_page_bytes(page_bytes)
    src_t = check_buffer("src", src)
    dst_t = check_buffer("dst", dst)
    table = as_pairs(pairs)
    n = table.shape[0]
    if n == 0:
        return None
    src_bytes, dst_bytes = src_t.numel(), dst_t.numel()
    src_slots, dst_slots = src_bytes // page, dst_bytes // page
    if src_slots == 0 or dst_slots == 0:
        smaller = "src" if src_slots == 0 else "dst"
        raise ValueError(f"page_bytes={page} is larger than the {smaller} buffer; pass the tier's page size")
    low, src_top, dst_top, repeated = _scan_small(table) if n <= SMALL_CALL else _scan(table)
    if low < 0:
        raise ValueError("pairs hold a negative slot; slots are indices >= 0")
    if src_top >= src_slots:
        raise ValueError(f"source slot {src_top} is out of range: src holds {src_slots} slots of {page} bytes")
    if dst_top >= dst_slots:
        raise ValueError(f"destination slot {dst_top} is out of range: dst holds {dst_slots} slots of {page} bytes")
    if repeated:
        raise ValueError("pairs name a destination slot twice; each destination slot may be written once per call")
    s0, d0 = src_t.data_ptr(), dst_t.data_ptr()
    if s0 < d0 + dst_bytes and d0 < s0 + src_bytes:  # the two address ranges meet
        _check_overlap(src_t, dst_t, table)
    return CopyRequest(src=src_t, dst=dst_t, pairs=table, page_bytes=page)


def _scan_small(table: np.ndarray) -> tuple[int, int, int, bool]:
    """``_scan`` in plain Python: cheaper than numpy's per-call overhead for a few pairs."""
    if table.shape[0] == 1:
        ((src, dst),) = table.tolist()
        return min(src, dst), src, dst, False
    src, dst = table.T.tolist()
    return min(min(src), min(dst)), max(src), max(dst), len(set(dst)) < len(dst)


def _scan(table: np.ndarray) -> tuple[int, int, int, bool]:
    """(lowest slot, highest source slot, highest destination slot, a destination slot repeated).

    From ``MONOTONE_CHECK_MIN`` pairs on, destination slots that rise or fall at every step (the
    planner pairs slots in slot order) are distinct and their ends the extremes: no sort. Otherwise
    one sort of both columns answers all four (a repeat sits beside its twin once sorted).
    """
    src, dst = table[:, 0], table[:, 1]
    step = int(dst[1]) - int(dst[0]) if len(dst) >= MONOTONE_CHECK_MIN else 0
    if (step > 0 and (dst[1:] > dst[:-1]).all()) or (step < 0 and (dst[1:] < dst[:-1]).all()):
        low, top = (int(dst[0]), int(dst[-1])) if step > 0 else (int(dst[-1]), int(dst[0]))
        return min(int(src.min()), low), int(src.max()), top, False
    ordered = np.sort(table.T)  # row 0: the source slots, row 1: the destination slots, each ascending
    src, dst = ordered[0], ordered[1]
    return int(min(src[0], dst[0])), int(src[-1]), int(dst[-1]), bool((dst[1:] == dst[:-1]).any())


def _check_overlap(src: torch.Tensor, dst: torch.Tensor, pairs: np.ndarray) -> None:
    """For buffers whose address ranges meet: copies inside one buffer must not read a slot that
    the same call writes (no order holds); buffers on two devices may share addresses."""
    if src.device != dst.device:
        return
    if src.data_ptr() != dst.data_ptr():
        raise ValueError("src and dst overlap at different offsets; pass two distinct buffers or the same one")
    if pairs.shape[0] <= SMALL_CALL:
        reads_written = not set(pairs[:, 0].tolist()).isdisjoint(pairs[:, 1].tolist())
    else:
        reads_written = np.intersect1d(pairs[:, 0], pairs[:, 1]).size > 0
    if reads_written:
        raise ValueError("within one buffer, a call must not read a slot that it also writes; split the call")
