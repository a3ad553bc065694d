"""The copy-engine path: every page of a call in one ``cuMemcpyBatchAsync``, through cuda-bindings.

The driver's entry points are resolved once per device with ``cuGetProcAddress`` (cuda-bindings)
and called through ctypes with numpy arrays as the descriptor arrays, so the host cost of a call
does not grow by a Python object per page. Two ABIs exist: CUDA 12.8 has a ``failIdx``
out-parameter before the stream, CUDA 13 (``cuMemcpyBatchAsync_v2``) removed it; the newest one
the driver offers is used. Every copy has one attribute set: source access in stream order,
``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``, and location hints for host and device.

The batched call rejects the legacy NULL stream (handle 0 or ``CU_STREAM_LEGACY``). There the
batch runs on a side stream of this device joined to the caller's stream by two events, before
and after, so stream order holds as on any other stream.

No cap on the pages of one driver call is needed: 262,144 pages in one call were verified on the
H200 (docs/copy.md). The driver's own cost, 0.5-1 us per page, sets the host cost of a large
call.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

LEGACY_STREAM_HANDLES: Final = frozenset({0, 1})  # the NULL stream and CU_STREAM_LEGACY

_CU_GET_PROC_ADDRESS_LEGACY_STREAM: Final = 1
_CUDA_13_0: Final = 13000
_CUDA_12_8: Final = 12080

_c = ctypes
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
_CTX_GET = _c.CFUNCTYPE(_c.c_int, _c.POINTER(_c.c_void_p))
_CTX_PUSH = _c.CFUNCTYPE(_c.c_int, _c.c_void_p)
_CTX_POP = _c.CFUNCTYPE(_c.c_int, _c.POINTER(_c.c_void_p))
_EVENT_RECORD = _c.CFUNCTYPE(_c.c_int, _c.c_void_p, _c.c_void_p)
_STREAM_WAIT_EVENT = _c.CFUNCTYPE(_c.c_int, _c.c_void_p, _c.c_void_p, _c.c_uint)


class DriverError(RuntimeError):
    """A CUDA driver call of the copy-engine path failed; the message names the call and the error."""


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

    Invariants: the batch entry point and the helpers are resolved once, in ``__init__``; every
    call runs with the device's primary context current and leaves the calling thread's context
    as it found it. Not reentrant across threads on the legacy stream, which a lock serialises.
    """

    def __init__(self, device_index: int) -> None:
        from cuda.bindings import driver

        self._driver = driver
        _check(driver.cuInit(0), "cuInit")
        self.device_index = device_index
        driver_version = _check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
        if driver_version < _CUDA_12_8:
            raise DriverError(
                f"cuMemcpyBatchAsync needs a CUDA 12.8 or newer driver, this one is {driver_version}; "
                "use the kernel path (KVTIER_COPY_ENGINE_MIN_BYTES=-1)"
            )
        cuda_version = _CUDA_13_0 if driver_version >= _CUDA_13_0 else _CUDA_12_8
        self.abi = BatchAbi(driver_version=driver_version, cuda_version=cuda_version)
        batch_type = _BATCH_V12_8 if self.abi.has_fail_index else _BATCH_V13
        self._batch = batch_type(self._resolve("cuMemcpyBatchAsync", cuda_version))
        self._ctx_get = _CTX_GET(self._resolve("cuCtxGetCurrent", 4000))
        self._ctx_push = _CTX_PUSH(self._resolve("cuCtxPushCurrent", 4000))
        self._ctx_pop = _CTX_POP(self._resolve("cuCtxPopCurrent", 4000))
        self._event_record = _EVENT_RECORD(self._resolve("cuEventRecord", 2000))
        self._stream_wait_event = _STREAM_WAIT_EVENT(self._resolve("cuStreamWaitEvent", 3020))
        cu_device = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
        self._context = int(_check(driver.cuDevicePrimaryCtxRetain(cu_device), "cuDevicePrimaryCtxRetain"))
        # (src in host memory, dst in host memory) -> the attribute set, and its address for the call
        self._attrs = {(src, dst): self._attributes(src, dst) for src in (False, True) for dst in (False, True)}
        self._attr_ptrs = {key: attrs.getPtr() for key, attrs in self._attrs.items()}
        self._first_index = np.zeros(1, dtype=np.uint64)  # every copy uses attribute set 0
        self._fail_index = np.zeros(1, dtype=np.uint64)
        self._first_index_ptr = self._first_index.ctypes.data
        self._fail_index_ptr = self._fail_index.ctypes.data
        self._legacy_lock = threading.Lock()
        self._side: tuple[int, int, int] | None = None  # (stream, event before, event after)

    def copy(
        self,
        dst_addrs: np.ndarray,
        src_addrs: np.ndarray,
        nbytes: int | np.ndarray,
        stream: int,
        *,
        src_host: bool,
        dst_host: bool,
    ) -> None:
        """Enqueue ``nbytes`` (or ``nbytes[i]``) from each ``src_addrs[i]`` to ``dst_addrs[i]`` on ``stream``.

        ``dst_addrs`` and ``src_addrs`` are equal-length int64/uint64 arrays of addresses (UVA),
        ``nbytes`` one size for all or such an array of sizes; ``stream`` is a raw handle. The
        copies of one call must not overlap, and none may span two host registrations. They run
        after the work queued on ``stream``.
        """
        count = dst_addrs.shape[0]
        if count == 0:
            return
        dst = _as_uint64(dst_addrs)
        src = _as_uint64(src_addrs)
        sizes = np.full(count, nbytes, dtype=np.uint64) if isinstance(nbytes, int) else _as_uint64(nbytes)
        attrs = self._attr_ptrs[(src_host, dst_host)]
        pushed = self._enter_context()
        try:
            if stream in LEGACY_STREAM_HANDLES:
                with self._legacy_lock:
                    side, before, after = self._side_stream()
                    _check_raw(self._event_record(before, stream), "cuEventRecord")
                    _check_raw(self._stream_wait_event(side, before, 0), "cuStreamWaitEvent")
                    self._submit(dst, src, sizes, attrs, side)
                    _check_raw(self._event_record(after, side), "cuEventRecord")
                    _check_raw(self._stream_wait_event(stream, after, 0), "cuStreamWaitEvent")
            else:
                self._submit(dst, src, sizes, attrs, stream)
        finally:
            if pushed:
                _check_raw(self._ctx_pop(_c.byref(_c.c_void_p())), "cuCtxPopCurrent")

    def _submit(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, attrs: int, stream: int) -> None:
        count = dst.shape[0]
        args = (dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, count, attrs, self._first_index_ptr, 1)
        if self.abi.has_fail_index:
            result = self._batch(*args, self._fail_index_ptr, stream)
            if result:
                failed = int(self._fail_index[0])
                raise DriverError(f"cuMemcpyBatchAsync failed with {self._error_name(result)} at copy {failed}")
        else:
            result = self._batch(*args, stream)
            if result:
                raise DriverError(f"cuMemcpyBatchAsync failed with {self._error_name(result)}")

    def _enter_context(self) -> bool:
        """Make the primary context current if it is not; True when it was pushed (pop it after)."""
        current = _c.c_void_p()
        _check_raw(self._ctx_get(_c.byref(current)), "cuCtxGetCurrent")
        if current.value == self._context:
            return False
        _check_raw(self._ctx_push(self._context), "cuCtxPushCurrent")
        return True

    def _side_stream(self) -> tuple[int, int, int]:
        if self._side is None:
            driver = self._driver
            stream = _check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
            flags = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
            before = _check(driver.cuEventCreate(flags), "cuEventCreate")
            after = _check(driver.cuEventCreate(flags), "cuEventCreate")
            self._side = (int(stream), int(before), int(after))
        return self._side

    def _attributes(self, src_host: bool, dst_host: bool) -> Any:
        driver = self._driver
        attrs = driver.CUmemcpyAttributes()
        attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attrs.srcLocHint = self._location(src_host)
        attrs.dstLocHint = self._location(dst_host)
        attrs.flags = driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        return attrs

    def _location(self, host: bool) -> Any:
        driver = self._driver
        location = driver.CUmemLocation()
        if host:
            location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
        else:
            location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            location.id = self.device_index
        return location

    def _resolve(self, symbol: str, cuda_version: int) -> int:
        pfn = _check(
            self._driver.cuGetProcAddress(symbol.encode(), cuda_version, _CU_GET_PROC_ADDRESS_LEGACY_STREAM),
            f"cuGetProcAddress({symbol})",
        )
        if not pfn:
            raise DriverError(f"the CUDA driver has no {symbol} for CUDA {cuda_version}")
        return int(pfn)

    def _error_name(self, result: int) -> str:
        err, name = self._driver.cuGetErrorName(self._driver.CUresult(result))
        return name.decode() if not int(err) and name else f"CUresult {result}"


def _check(returned: tuple[Any, ...], call: str) -> Any:
    """The first value after the CUresult of a cuda-bindings call; ``DriverError`` on failure.

    cuda-bindings returns ``(err,)`` for calls without outputs and ``(err, out, ...)`` otherwise.
    """
    err = int(returned[0])
    if err:
        raise DriverError(f"{call} failed with CUresult {err}")
    return returned[1] if len(returned) > 1 else None


def _as_uint64(values: np.ndarray) -> np.ndarray:
    """``values`` (addresses or sizes) as a contiguous uint64 array, without a copy when int64 already."""
    if values.dtype == np.int64 and values.flags.c_contiguous:
        return values.view(np.uint64)
    return np.ascontiguousarray(values, dtype=np.uint64)


def _check_raw(result: int, call: str) -> None:
    if result:
        raise DriverError(f"{call} failed with CUresult {result}")
