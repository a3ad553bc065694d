"""The copy-engine path: every page of a call in one ``cuMemcpyBatchAsync``, through cuda-bindings.

The driver's entry points are resolved once per device with ``cuGetProcAddress`` (cuda-bindings,
``kvtier.copy.driver_api``) and called through ctypes with numpy arrays as the descriptor arrays,
filled in place with a few vector operations, so the host cost of a call does not grow by a
Python object per page. Two ABIs exist: CUDA 12.8 has a ``failIdx``
out-parameter before the stream, CUDA 13 (``cuMemcpyBatchAsync_v2``) removed it; the newest one
the driver offers is used. Every copy has one attribute set: source access in stream order,
``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``, and location hints for host and device.

The batched call rejects the legacy NULL stream (handle 0 or ``CU_STREAM_LEGACY``). There the
batch runs on a side stream of this device joined to the caller's stream by two events, before
and after, so stream order holds as on any other stream.

No cap on the pages of one driver call is needed: 262,144 pages in one call were verified on the
H200 (docs/copy.md). The driver's own cost, 0.5-1 us per page, sets the host cost of a large
call. A small call is cheaper as separate copies: the batched call costs about 26 us for one
page, ``cuMemcpyAsync`` a few. A call of at most ``SEPARATE_COPY_RUNS`` runs between memory the
GPU can reach (device, pinned or registered) is therefore submitted as one ``cuMemcpyAsync`` per
run, which every stream takes, the legacy one included; pageable host memory always goes to the
batched call (``cuMemcpyAsync`` from pageable memory may wait for the stream's earlier work).

A driver older than CUDA 12.8 has no batched call: there every call is submitted as one
``cuMemcpyAsync`` per run (``abi`` is ``None``). The copies stay on the copy engines, so a large
page never takes the SMs a prefill runs on; the host cost grows by a driver call per run.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from kvtier.copy.driver_api import DriverApi, DriverError
from kvtier.copy.policy import SEPARATE_COPY_RUNS

LEGACY_STREAM_HANDLES: Final = frozenset({0, 1})  # the NULL stream and CU_STREAM_LEGACY

_CUDA_13_0: Final = 13000
_CUDA_12_8: Final = 12080

_c = ctypes
_MEMCPY_ASYNC = _c.CFUNCTYPE(_c.c_int, _c.c_uint64, _c.c_uint64, _c.c_size_t, _c.c_void_p)
_BATCH_V13 = _c.CFUNCTYPE(
    _c.c_int, _c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_size_t, _c.c_void_p, _c.c_void_p, _c.c_size_t, _c.c_void_p
)
_BATCH_V12_8 = _c.CFUNCTYPE(
    _c.c_int,
    _c.c_void_p,
    _c.c_void_p,
    _c.c_void_p,
    _c.c_size_t,
    _c.c_void_p,
    _c.c_void_p,
    _c.c_size_t,
    _c.c_void_p,
    _c.c_void_p,
)


@dataclass(frozen=True, slots=True)
class BatchAbi:
    """Which ``cuMemcpyBatchAsync`` the driver gave: ``cuda_version`` 13000 (no failIdx) or 12080."""

    driver_version: int
    cuda_version: int

    @property
    def has_fail_index(self) -> bool:
        return self.cuda_version < _CUDA_13_0


class BatchCopier:
    """Submits batches of copies on one device's streams; create one per device.

    Invariants: the entry points are resolved once, in ``__init__`` (the batched one only on a
    driver of CUDA 12.8 or newer: ``abi`` is ``None`` without it); every
    call runs with the device's primary context current and leaves the calling thread's context
    as it found it; the descriptor arrays are reused from call to call (grown, never shrunk), so
    a call allocates nothing for a batch no larger than an earlier one. Not reentrant across
    threads: a lock serialises calls (the arrays and the legacy stream's side stream are shared).
    """

    def __init__(self, device_index: int) -> None:
        self.api = DriverApi(device_index)
        driver = self.api.driver
        self.device_index = device_index
        driver_version = self.api.driver_version
        self.abi: BatchAbi | None = None
        self._batch: Any = None
        self._batch_has_fail_index = False
        if driver_version >= _CUDA_12_8:
            cuda_version = _CUDA_13_0 if driver_version >= _CUDA_13_0 else _CUDA_12_8
            self.abi = BatchAbi(driver_version=driver_version, cuda_version=cuda_version)
            batch_type = _BATCH_V12_8 if self.abi.has_fail_index else _BATCH_V13
            self._batch = batch_type(self.api.resolve("cuMemcpyBatchAsync", cuda_version))
            self._batch_has_fail_index = self.abi.has_fail_index
        self._memcpy_async = _MEMCPY_ASYNC(self.api.resolve("cuMemcpyAsync", 4000))
        # (src in host memory, dst in host memory) -> the attribute set, and its address for the call
        self._attrs = {(src, dst): self._attributes(driver, src, dst) for src in (False, True) for dst in (False, True)}
        self._attr_ptrs = {key: attrs.getPtr() for key, attrs in self._attrs.items()}
        self._first_index = np.zeros(1, dtype=np.uint64)  # every copy uses attribute set 0
        self._fail_index = np.zeros(1, dtype=np.uint64)
        self._first_index_ptr = self._first_index.ctypes.data
        self._fail_index_ptr = self._fail_index.ctypes.data
        self._descriptors = np.empty((3, 0), dtype=np.int64)  # rows: destinations, sources, sizes
        self._lock = threading.Lock()
        self._side: tuple[int, int, int] | None = None  # (stream, event before, event after)

    def copy_runs(
        self,
        runs: np.ndarray,
        page_bytes: int,
        src_base: int,
        dst_base: int,
        stream: int,
        *,
        src_host: bool,
        dst_host: bool,
        pageable: bool = False,
    ) -> None:
        """Enqueue one copy per run ``(src_slot, dst_slot, pages)`` of pages of ``page_bytes`` on ``stream``.

        Run i copies ``pages * page_bytes`` bytes from ``src_base + src_slot * page_bytes`` to
        ``dst_base + dst_slot * page_bytes`` (addresses in UVA). The copies of one call must not
        overlap, and none may span two host registrations (``kvtier.copy.runs`` cuts them so).
        ``stream`` is a raw handle; the copies run after the work queued on it. ``pageable``: a
        side is pageable host memory (the batched call is then used for any number of runs, when
        the driver has it).
        """
        count = runs.shape[0]
        if self.abi is None or (count <= SEPARATE_COPY_RUNS and not pageable):
            self._copy_separately(runs.tolist(), page_bytes, src_base, dst_base, stream)
            return
        with self._lock:
            table = self._table(count)
            np.multiply(runs[:, 1], page_bytes, out=table[0])
            table[0] += dst_base
            np.multiply(runs[:, 0], page_bytes, out=table[1])
            table[1] += src_base
            np.multiply(runs[:, 2], page_bytes, out=table[2])
            self._submit_locked(table, count, self._attr_ptrs[(src_host, dst_host)], stream)

    def _copy_separately(
        self, runs: list[list[int]], page_bytes: int, src_base: int, dst_base: int, stream: int
    ) -> None:
        """One ``cuMemcpyAsync`` per run, in order, on ``stream`` (any stream, the legacy one too)."""
        api = self.api
        pushed = api.enter_context()
        try:
            for src_slot, dst_slot, pages in runs:
                result = self._memcpy_async(
                    dst_base + dst_slot * page_bytes, src_base + src_slot * page_bytes, pages * page_bytes, stream
                )
                if result:
                    raise DriverError(f"cuMemcpyAsync failed with {api.error_name(result)}")
        finally:
            if pushed:
                api.leave_context()

    def _table(self, count: int) -> np.ndarray:
        """The (3, count) view of the reused descriptor arrays; each row is contiguous."""
        if self._descriptors.shape[1] < count:
            self._descriptors = np.empty((3, max(count, 2 * self._descriptors.shape[1], 64)), dtype=np.int64)
        return self._descriptors[:, :count]

    def _submit_locked(self, table: np.ndarray, count: int, attrs: int, stream: int) -> None:
        api = self.api
        pushed = api.enter_context()
        try:
            if stream in LEGACY_STREAM_HANDLES:
                side, before, after = self._side_stream()
                api.record(before, stream)
                api.wait(side, before)
                self._submit(table, count, attrs, side)
                api.record(after, side)
                api.wait(stream, after)
            else:
                self._submit(table, count, attrs, stream)
        finally:
            if pushed:
                api.leave_context()

    def _submit(self, table: np.ndarray, count: int, attrs: int, stream: int) -> None:
        data = self._descriptors.ctypes.data
        row = self._descriptors.strides[0]
        args = (data, data + row, data + 2 * row, count, attrs, self._first_index_ptr, 1)
        if self._batch_has_fail_index:
            result = self._batch(*args, self._fail_index_ptr, stream)
            if result:
                failed = int(self._fail_index[0])
                raise DriverError(f"cuMemcpyBatchAsync failed with {self.api.error_name(result)} at copy {failed}")
        else:
            result = self._batch(*args, stream)
            if result:
                raise DriverError(f"cuMemcpyBatchAsync failed with {self.api.error_name(result)}")

    def _side_stream(self) -> tuple[int, int, int]:
        if self._side is None:
            self._side = (self.api.create_stream(), self.api.create_event(), self.api.create_event())
        return self._side

    def _attributes(self, driver: Any, src_host: bool, dst_host: bool) -> Any:
        attrs = driver.CUmemcpyAttributes()
        attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attrs.srcLocHint = self._location(driver, src_host)
        attrs.dstLocHint = self._location(driver, dst_host)
        attrs.flags = driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        return attrs

    def _location(self, driver: Any, host: bool) -> Any:
        location = driver.CUmemLocation()
        if host:
            location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
        else:
            location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            location.id = self.device_index
        return location
