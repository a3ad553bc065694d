"""The few CUDA driver calls the GPU copy paths make per call, through ctypes.

Entry points are resolved once per device with ``cuGetProcAddress`` (cuda-bindings) and called
through ctypes, which costs well under a microsecond a call where cuda-bindings' wrappers or
torch's stream and event objects cost several. Handles (contexts, streams, events) are plain ints.
"""

from __future__ import annotations

import ctypes
from typing import Any, Final

_CU_GET_PROC_ADDRESS_LEGACY_STREAM: Final = 1
_CUDA_ERROR_NOT_READY: Final = 600

_c = ctypes
_CTX_GET = _c.CFUNCTYPE(_c.c_int, _c.POINTER(_c.c_void_p))
_CTX_PUSH = _c.CFUNCTYPE(_c.c_int, _c.c_void_p)
_CTX_POP = _c.CFUNCTYPE(_c.c_int, _c.POINTER(_c.c_void_p))
_EVENT_RECORD = _c.CFUNCTYPE(_c.c_int, _c.c_void_p, _c.c_void_p)
_EVENT_ONE = _c.CFUNCTYPE(_c.c_int, _c.c_void_p)
_STREAM_WAIT_EVENT = _c.CFUNCTYPE(_c.c_int, _c.c_void_p, _c.c_void_p, _c.c_uint)


class DriverError(RuntimeError):
    """A CUDA driver call of a copy path failed; the message names the call and the error."""


class DriverApi:
    """One device's primary context and the driver calls made per copy.

    Invariants: every entry point is resolved in ``__init__``; ``enter_context`` / ``leave_context``
    leave the calling thread's context as they found it.
    """

    def __init__(self, device_index: int) -> None:
        from cuda.bindings import driver

        self.driver = driver
        check(driver.cuInit(0), "cuInit")
        self.device_index = device_index
        self.driver_version: int = check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
        self._ctx_get = _CTX_GET(self.resolve("cuCtxGetCurrent", 4000))
        self._ctx_push = _CTX_PUSH(self.resolve("cuCtxPushCurrent", 4000))
        self._ctx_pop = _CTX_POP(self.resolve("cuCtxPopCurrent", 4000))
        self._event_record = _EVENT_RECORD(self.resolve("cuEventRecord", 2000))
        self._event_query = _EVENT_ONE(self.resolve("cuEventQuery", 2000))
        self._event_synchronize = _EVENT_ONE(self.resolve("cuEventSynchronize", 2000))
        self._stream_wait_event = _STREAM_WAIT_EVENT(self.resolve("cuStreamWaitEvent", 3020))
        cu_device = check(driver.cuDeviceGet(device_index), "cuDeviceGet")
        self.context = int(check(driver.cuDevicePrimaryCtxRetain(cu_device), "cuDevicePrimaryCtxRetain"))

    def resolve(self, symbol: str, cuda_version: int) -> int:
        """The address of ``symbol`` as of ``cuda_version`` (e.g. 12080), legacy-stream flavour."""
        pfn = check(
            self.driver.cuGetProcAddress(symbol.encode(), cuda_version, _CU_GET_PROC_ADDRESS_LEGACY_STREAM),
            f"cuGetProcAddress({symbol})",
        )
        if not pfn:
            raise DriverError(f"the CUDA driver has no {symbol} for CUDA {cuda_version}")
        return int(pfn)

    def context_is_current(self) -> bool:
        """Whether this device's primary context is the calling thread's current one."""
        current = _c.c_void_p()
        check_raw(self._ctx_get(_c.byref(current)), "cuCtxGetCurrent")
        return current.value == self.context

    def enter_context(self) -> bool:
        """Make the primary context current if it is not; True when it was pushed (``leave_context`` after)."""
        if self.context_is_current():
            return False
        check_raw(self._ctx_push(self.context), "cuCtxPushCurrent")
        return True

    def leave_context(self) -> None:
        """Pop the context that ``enter_context`` pushed."""
        check_raw(self._ctx_pop(_c.byref(_c.c_void_p())), "cuCtxPopCurrent")

    def create_event(self) -> int:
        """A new event without timing (cheapest to record and wait for), in the current context."""
        driver = self.driver
        return int(check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate"))

    def create_stream(self) -> int:
        """A new stream that does not synchronise with the legacy NULL stream, in the current context."""
        driver = self.driver
        return int(check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate"))

    def record(self, event: int, stream: int) -> None:
        check_raw(self._event_record(event, stream), "cuEventRecord")

    def wait(self, stream: int, event: int) -> None:
        """``stream`` runs its later work after ``event`` has completed."""
        check_raw(self._stream_wait_event(stream, event, 0), "cuStreamWaitEvent")

    def synchronize(self, event: int) -> None:
        """Block until ``event`` has completed; returns at once when it has (or was never recorded)."""
        result = self._event_query(event)
        if result == _CUDA_ERROR_NOT_READY:
            result = self._event_synchronize(event)
        check_raw(result, "cuEventSynchronize")

    def device_pointer(self, address: int) -> int:
        """The address at which this device reaches ``address`` (device memory, or pinned or registered
        host memory); ``DriverError`` for memory the device cannot reach."""
        driver = self.driver
        attribute = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        return int(check(driver.cuPointerGetAttribute(attribute, address), "cuPointerGetAttribute"))

    def error_name(self, result: int) -> str:
        err, name = self.driver.cuGetErrorName(self.driver.CUresult(result))
        return name.decode() if not int(err) and name else f"CUresult {result}"


def check(returned: tuple[Any, ...], call: str) -> Any:
    """The first value after the CUresult of a cuda-bindings call; ``DriverError`` on failure.

    cuda-bindings returns ``(err,)`` for calls without outputs and ``(err, out, ...)`` otherwise.
    """
    err = int(returned[0])
    if err:
        raise DriverError(f"{call} failed with CUresult {err}")
    return returned[1] if len(returned) > 1 else None


def check_raw(result: int, call: str) -> None:
    if result:
        raise DriverError(f"{call} failed with CUresult {result}")
