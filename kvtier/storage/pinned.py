"""Host memory for a host tier: page-locked and registered with CUDA when the device is a GPU.

For a CUDA device the buffer is anonymous memory of exactly ``num_bytes`` (``mmap``, transparent
huge pages requested), touched by several threads over disjoint ranges, then registered with
``cudaHostRegister`` (portable, mapped). torch's ``pin_memory=True`` is not used: its caching host
allocator rounds every block up to a power of two, up to twice the tier's quota.

``KVTIER_HOST_REGISTER_CHUNK_BYTES`` (read once per process) registers the buffer in several
chunks instead of one, for hosts where one large registration fails or is slow. Chunk boundaries
fall on page boundaries (and on OS-page boundaries, so that no two registrations share an OS
page): one page never spans two registrations, so the copy engines still copy page by page and
the kernel reaches every chunk at its host address. A value that is not a positive integer that
fits 64 bits logs a WARNING and is ignored (one registration). One ``cudaMemcpy`` may not span two
registrations: a torch copy of a whole chunked buffer fails, copy page by page or chunk by chunk.
``registration_grid`` tells a copier where a buffer's registrations begin and end, so that it
merges consecutive pages only within one registration. Chunks need cuda-bindings, which checks that
each maps at its host address; without it such a buffer is refused.

For a CPU device the buffer is plain memory. Costs measured on the H200 machine are in
docs/copy.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

from kvtier.knobs import parse_int64

logger = logging.getLogger(__name__)

HOST_REGISTER_CHUNK_BYTES_ENV: Final = "KVTIER_HOST_REGISTER_CHUNK_BYTES"

_CUDA_HOST_REGISTER_PORTABLE: Final = 1
_CUDA_HOST_REGISTER_MAPPED: Final = 2
_TOUCH_THREADS: Final = 16
# base address -> (bytes, chunk bytes) of every live buffer registered in more than one chunk
_CHUNKED: dict[int, tuple[int, int]] = {}
_EPOCH = [0]  # counts registrations and releases of host buffers made here


def parse_chunk_bytes(raw: str | None) -> int | None:
    """``KVTIER_HOST_REGISTER_CHUNK_BYTES`` from its raw value: bytes per registration, None = one."""
    instead = "registering host buffers in one piece"
    value = parse_int64(HOST_REGISTER_CHUNK_BYTES_ENV, raw, instead)
    if value is not None and value <= 0:
        logger.warning(
            "%s=%r is out of range (a positive 64-bit integer); %s", HOST_REGISTER_CHUNK_BYTES_ENV, raw, instead
        )
        return None
    return value


@functools.cache
def chunk_bytes_from_env() -> int | None:
    """The process's registration chunk size: the environment at the first call (read once)."""
    return parse_chunk_bytes(os.environ.get(HOST_REGISTER_CHUNK_BYTES_ENV))


def plan_chunks(num_bytes: int, page_bytes: int, chunk_bytes: int | None) -> list[tuple[int, int]]:
    """(offset, size) of each registration of a ``num_bytes`` buffer of ``page_bytes`` pages.

    Every boundary between chunks is a multiple of ``page_bytes`` and of the OS page size; the
    chunk size is rounded down to such a multiple, and up to one such unit if smaller.
    """
    if chunk_bytes is None or chunk_bytes >= num_bytes:
        return [(0, num_bytes)]
    unit = math.lcm(page_bytes, mmap.PAGESIZE)
    step = max(unit, chunk_bytes // unit * unit)
    return [(offset, min(step, num_bytes - offset)) for offset in range(0, num_bytes, step)]


@dataclass(frozen=True, slots=True)
class RegistrationGrid:
    """Where the registrations of a chunked buffer fall, seen from a tensor inside it.

    Registration k covers bytes ``[k * chunk_bytes, (k + 1) * chunk_bytes)`` counted from the
    buffer's base; ``offset`` is where the tensor starts, counted from the same base.
    """

    offset: int
    chunk_bytes: int

    def chunk_of(self, slots: np.ndarray, page_bytes: int, *, last: bool = False) -> np.ndarray:
        """The registration holding the first byte (``last``: the last byte) of each slot of the tensor."""
        return (self.offset + slots * page_bytes + (page_bytes - 1 if last else 0)) // self.chunk_bytes


def registration_epoch() -> int:
    """A number that changes whenever a buffer of this module is registered or released.

    What was learnt about a host tensor's registration (pinned or not, its grid) holds while this
    number stays the same, for registrations made through this module.
    """
    return _EPOCH[0]


def registration_grid(tensor: torch.Tensor) -> RegistrationGrid | None:
    """The grid of the chunked buffer that ``tensor`` starts in; None for memory registered in one piece."""
    if not _CHUNKED:
        return None
    address = tensor.data_ptr()
    for base, (num_bytes, chunk_bytes) in list(_CHUNKED.items()):
        if base <= address < base + num_bytes:
            return RegistrationGrid(address - base, chunk_bytes)
    return None


class HostBuffer:
    """A host tier's buffer: ``tensor`` is a flat ``torch.uint8`` tensor of ``num_bytes``.

    ``chunks`` lists the registered (offset, size) ranges; it is empty for plain memory.
    ``release()`` (also on exit of a ``with`` block, or when the handle is collected) unregisters
    them; keep the handle alive for as long as the GPU copies to or from the buffer.
    """

    __slots__ = ("_base", "chunks", "page_bytes", "tensor")

    def __init__(self, tensor: torch.Tensor, page_bytes: int, chunks: list[tuple[int, int]]) -> None:
        self.tensor = tensor
        self.page_bytes = page_bytes
        self.chunks = tuple(chunks)
        self._base = tensor.data_ptr()

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel()

    @property
    def pinned(self) -> bool:
        return bool(self.chunks)

    def release(self) -> None:
        """Unregister every chunk (idempotent). The tensor stays readable as plain memory."""
        chunks, self.chunks = self.chunks, ()
        _CHUNKED.pop(self._base, None)
        _EPOCH[0] += 1
        if chunks:
            cudart = torch.cuda.cudart()
            for offset, _ in chunks:
                _check(cudart.cudaHostUnregister(self._base + offset), "cudaHostUnregister")

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if self.chunks:
            with contextlib.suppress(Exception):  # at interpreter exit CUDA may already be gone
                self.release()


def allocate_host_buffer(
    num_bytes: int, page_bytes: int, device: str | torch.device = "cpu", *, chunk_bytes: int | None = None
) -> HostBuffer:
    """A host buffer of ``num_bytes`` for pages of ``page_bytes``, pinned if ``device`` is CUDA.

    ``chunk_bytes`` (CUDA only) overrides ``KVTIER_HOST_REGISTER_CHUNK_BYTES``: register in chunks of
    at most this size, boundaries on page boundaries.
    """
    if num_bytes <= 0 or page_bytes <= 0:
        raise ValueError(f"num_bytes and page_bytes must be positive, got {num_bytes} and {page_bytes}")
    if page_bytes > num_bytes:
        raise ValueError(f"page_bytes={page_bytes} is larger than the buffer ({num_bytes} bytes)")
    if chunk_bytes is not None and chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive (or None for the environment), got {chunk_bytes}")
    dev = torch.device(device)
    if dev.type == "cpu":
        return HostBuffer(torch.empty(num_bytes, dtype=torch.uint8, device="cpu"), page_bytes, [])
    if dev.type != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")
    tensor = _touched_anonymous_memory(num_bytes)
    chunks = plan_chunks(num_bytes, page_bytes, chunk_bytes if chunk_bytes is not None else chunk_bytes_from_env())
    buffer = HostBuffer(tensor, page_bytes, [])
    cudart = torch.cuda.cudart()
    flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
    for offset, size in chunks:
        _check(cudart.cudaHostRegister(tensor.data_ptr() + offset, size, flags), "cudaHostRegister")
        buffer.chunks += ((offset, size),)
    if len(chunks) > 1:
        _check_mapped_at_host_address(buffer)
        _CHUNKED[buffer.tensor.data_ptr()] = (num_bytes, chunks[0][1])
    _EPOCH[0] += 1
    return buffer


def _touched_anonymous_memory(num_bytes: int) -> torch.Tensor:
    """Page-aligned anonymous memory, every OS page faulted in by threads on disjoint ranges."""
    memory = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a hint: fewer faults to touch, fewer pages to lock
            memory.madvise(mmap.MADV_HUGEPAGE)
    view = np.frombuffer(memory, dtype=np.uint8)
    threads = max(1, min(_TOUCH_THREADS, os.cpu_count() or 1, num_bytes // (64 << 20)))
    step = -(-num_bytes // threads // mmap.PAGESIZE) * mmap.PAGESIZE

    def touch(begin: int) -> None:
        view[begin : begin + step : mmap.PAGESIZE] = 0

    starts = range(0, num_bytes, step)
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(touch, starts))
    except RuntimeError:  # no new threads at interpreter exit (a manager closed by its atexit hook)
        for begin in starts:
            touch(begin)
    return torch.frombuffer(memory, dtype=torch.uint8)


def _check_mapped_at_host_address(buffer: HostBuffer) -> None:
    """Chunks must map to the device at their host addresses, so one base address reaches all.

    Only the driver can tell: without cuda-bindings the buffer is released and refused."""
    try:
        from cuda.bindings import driver
    except ImportError as error:
        buffer.release()
        raise RuntimeError(
            f"a host buffer registered in chunks needs cuda-bindings to check where they map ({error}); "
            f"install kvtier[gpu] or unset {HOST_REGISTER_CHUNK_BYTES_ENV}"
        ) from None

    for offset, _ in buffer.chunks:
        host = buffer.tensor.data_ptr() + offset
        err, device_ptr = driver.cuMemHostGetDevicePointer(host, 0)
        if int(err) or int(device_ptr) != host:
            buffer.release()
            raise RuntimeError(
                "this device maps registered host memory at other addresses than the host's, so a buffer "
                f"registered in chunks cannot be addressed as one; unset {HOST_REGISTER_CHUNK_BYTES_ENV}"
            )


def _check(result: object, call: str) -> None:
    code = int(result)  # type: ignore[call-overload]
    if code:
        raise RuntimeError(f"{call} failed with cudaError {code}")
