"""``PageCopier``: moves a batch of pages between two tier buffers, on the path the policy picks.

One copier per device. A call checks everything first (``kvtier.copy.copy_request``), then:

- both buffers in host memory -> the CPU path, synchronously on the calling thread;
- otherwise ``policy.choose(page_bytes, coherent_link=..., runs=...)`` -> the copy engines (one
  batched driver call, or one async copy per run for a call of a few runs, whatever the page
  size, ``kvtier.copy.copy_engine``) or the Triton kernel (one launch over the call's pairs,
  ``kvtier.copy.kernel``), enqueued on the caller's stream after the work already there. The
  copy engines and the CPU path take runs of consecutive slots as single copies
  (``kvtier.copy.runs``; cut where a host buffer's registrations meet); the kernel needs no runs,
  and a call whose first pairs are scattered goes to it without building them.

Triton and cuda-bindings are imported on the first call that needs them. Where the kernel cannot
be built (no Triton, no C compiler for its launcher), its calls go to the copy engines. Where
cuda-bindings is missing, the kernel still runs (every launch Triton's own, its table ring on
torch's events) and the copy engines' calls go as one torch copy per run
(``kvtier.copy.torch_runs``), except a call of many short runs, which goes to the kernel where it
takes the call: a torch copy per short run would leave the link waiting for the host. Each is
logged once, as a WARNING naming the cause.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.copy.buffer_facts import BufferFacts, BufferFactsCache
from kvtier.copy.copy_engine import LEGACY_STREAM_HANDLES
from kvtier.copy.copy_request import CopyRequest, check_request
from kvtier.copy.cpu import copy_pages_cpu
from kvtier.copy.kernel_args import ALIGN, kernel_refusal
from kvtier.copy.link import LinkInfo, detect_link
from kvtier.copy.policy import SEPARATE_COPY_RUNS, CopyPath, CopyPolicy, DevicePath
from kvtier.copy.runs import build_runs, many_runs
from kvtier.copy.torch_runs import copy_runs_with_torch, torch_copies_keep_up

if TYPE_CHECKING:
    from kvtier.copy.copy_engine import BatchCopier
    from kvtier.copy.driver_api import DriverApi
    from kvtier.copy.kernel import FastLaunch

StreamArg = torch.cuda.Stream | int | None
logger = logging.getLogger(__name__)
_KNOWN_ADDRESSES = 64  # device addresses kept by buffer facts; a copier sees a few buffers


class PageCopier:
    """Copies pages between slots of two tier buffers on one device ("cpu", "cuda" or "cuda:N").

    ``copy`` returns the path it used: "copy_engine", "kernel", "cpu", or "none" for an empty
    call. Buffers may live in this device's memory or in host memory (pinned or registered, as
    ``kvtier.storage.pinned`` allocates it; the copy engines also take pageable memory, the kernel
    does not). ``policy`` defaults to ``CopyPolicy.from_env()``; ``link`` to the detected one.
    """

    def __init__(
        self, device: str | torch.device, *, policy: CopyPolicy | None = None, link: LinkInfo | None = None
    ) -> None:
        if not isinstance(device, str | torch.device):
            raise TypeError(f"device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}")
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {str(device)!r} asks for CUDA, which is not available here; use 'cpu'")
            index = torch.cuda.current_device() if dev.index is None else dev.index
            if not 0 <= index < torch.cuda.device_count():
                raise ValueError(f"no CUDA device {index}: this process sees {torch.cuda.device_count()}")
            dev = torch.device("cuda", index)
        elif dev.type != "cpu":
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {str(device)!r}")
        self.device = dev
        self.policy = CopyPolicy.from_env() if policy is None else policy
        if link is None:
            link = detect_link(dev.index) if dev.type == "cuda" else LinkInfo.cpu()
        self.link = link
        self._batch: BatchCopier | None = None
        self._kernel: _KernelPath | None = None
        self._kernel_unavailable: str | None = None  # why ``warm_up`` could not build the kernel path
        self._without_bindings = False  # cuda-bindings missing: the copy engines' calls go through torch
        self._building = threading.Lock()  # held while the kernel path or the batched copier is built
        self._facts = BufferFactsCache(dev)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._sm_count = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0

    def copy(
        self, src: torch.Tensor, dst: torch.Tensor, pairs: object, page_bytes: int, stream: StreamArg = None
    ) -> CopyPath:
        """Copy page ``src_slot`` of ``src`` to page ``dst_slot`` of ``dst`` for every row of ``pairs``.

        ``pairs``: (n, 2) integers (numpy array, or a list of tuples). Raises ``ValueError`` before
        any work for a bad page size, out-of-range or repeated destination slots, a buffer on
        another device, or (kernel path) a size or address that is not 16-byte aligned. ``stream``
        (CUDA only): None = the current stream of this device, a ``torch.cuda.Stream``, or a raw
        handle (0 and 1 are the legacy NULL stream). Record an event on that stream after the
        call to let another stream wait for the pages.
        """
        request = check_request(src, dst, pairs, page_bytes)
        if request is None:
            return "none"
        src_facts = self._facts.of("src", request.src)
        dst_facts = self._facts.of("dst", request.dst)
        if src_facts.host and dst_facts.host:
            copy_pages_cpu(request, build_runs(request.pairs, request.page_bytes))
            return "cpu"
        path, runs = self._route(request, src_facts, dst_facts)
        if path == "kernel" and self._copy_with_kernel(request, stream, src_facts, dst_facts):
            return path
        if runs is None:  # the copy engines' call, or the kernel's that cannot be built here (logged once)
            runs = build_runs(request.pairs, request.page_bytes, src_facts.grid, dst_facts.grid)
        return self._copy_with_engines(request, runs, stream, src_facts, dst_facts)

    def warm_up(self, page_sizes: Iterable[int]) -> bool:
        """Set the kernel path up now if the policy sends a call of many pages of one of
        ``page_sizes`` bytes to it: one launch over a scratch of two 16-byte pages on the device,
        which builds the Triton kernel (or loads it from Triton's disk cache) and the fast launch.

        So the first call that a request waits for does not pay for that: 0.6 s with Triton's disk
        cache warm, 1.3-1.9 s cold, on an H100 host (docs/benchmarks.md, section 62); once a
        process has built the kernel, another copier's first launch takes well under a millisecond.
        Returns whether it launched: False on the CPU, where the policy gives those pages to the
        copy engines (their batched copier is then made instead), or once this copier's kernel path
        exists. Ordered on the current stream; no buffer of a tier is touched. Without cuda-bindings
        the kernel is built whatever the sizes: it takes the copy engines' calls of many short runs.

        Where the kernel cannot be built (Triton not installed, or its launcher not compiled: no C
        compiler on the machine), it logs one WARNING naming the cause and returns False, and from
        then on this copier gives every call to the copy engines: slower for small pages, as exact.
        """
        if self.device.type != "cuda" or self._kernel is not None or self._kernel_unavailable is not None:
            return False
        coherent = self.link.coherent
        if (
            all(self.policy.choose(size, coherent_link=coherent) != "kernel" for size in page_sizes)
            and self._build_batch() is not None
        ):
            return False
        return self._build_kernel() is not None

    def _build_kernel(self) -> _KernelPath | None:
        """The kernel path, built once with one launch over a scratch of its own; None, with one
        WARNING and every later call routed to the copy engines, where it cannot be built.

        Without cuda-bindings every launch has Triton find its buffers' device addresses, so the
        scratch launch reads pinned host memory, as the calls will: a Triton that cannot reach it
        leaves the copies to the copy engines rather than failing a request's copy."""
        with self._building:  # one kernel path per copier: its ring's tables outlive the launches reading them
            if self._kernel is not None or self._kernel_unavailable is not None:
                return self._kernel
            try:
                api = _driver_api(self.device.index)
                kernel = _KernelPath(self.device.index, self._sm_count, api, self.torch_stream)
                scratch = torch.empty(2 * ALIGN, dtype=torch.uint8, device=self.device)
                source = scratch if api is not None else torch.ones(2 * ALIGN, dtype=torch.uint8, pin_memory=True)
                pairs = np.array([[0, 1]], dtype=np.int64)
                request = CopyRequest(src=source, dst=scratch, pairs=pairs, page_bytes=ALIGN)
                facts = self._facts.of("scratch", scratch)
                source_facts = facts if source is scratch else self._facts.of("scratch source", source)
                stream = _current_raw_stream(self.device.index)
                kernel.copy(request, source_facts, facts, stream, lambda: self.torch_stream(None))
                if source is not scratch:
                    self.torch_stream(None).synchronize()  # it ran; its pinned source may go
            except Exception as error:  # Triton's import, compiler and launcher raise many kinds
                self._kernel_unavailable = f"{type(error).__name__}: {error}"
                logger.warning(
                    "kvtier: the copy kernel cannot be built on %s (%s); every copy goes to the copy engines, "
                    "slower for small pages (install 'kvtier[gpu]' and a C compiler for Triton to use it)",
                    self.device,
                    self._kernel_unavailable,
                )
                return None
            self._kernel = kernel
            return kernel

    @property
    def kernel_unavailable(self) -> str | None:
        """Why the copy kernel could not be built (by ``warm_up`` or a first call that the policy gave
        it), the error named; then every call of this copier goes to the copy engines. Else None."""
        return self._kernel_unavailable

    def _route(self, request: CopyRequest, src: BufferFacts, dst: BufferFacts) -> tuple[DevicePath, np.ndarray | None]:
        """The policy's path for this call, and its runs when they had to be built to choose it.

        The runs decide only between the kernel and a few separate copies: they are not built where
        even a call of one run goes to the kernel, nor for a call whose first pairs are already
        scattered."""
        if self._kernel_unavailable is not None:
            return "copy_engine", None
        policy, page, coherent = self.policy, request.page_bytes, self.link.coherent
        pages = request.pairs.shape[0]
        path = policy.choose(page, coherent_link=coherent, runs=pages)  # runs <= pages
        if (
            path != "kernel"
            or pages <= SEPARATE_COPY_RUNS
            or policy.choose(page, coherent_link=coherent, runs=1) == "kernel"
            or many_runs(request.pairs, SEPARATE_COPY_RUNS)
        ):
            return path, None
        runs = build_runs(request.pairs, request.page_bytes, src.grid, dst.grid)
        return policy.choose(page, coherent_link=coherent, runs=runs.shape[0]), runs

    def _copy_with_engines(
        self, request: CopyRequest, runs: np.ndarray, stream: StreamArg, src: BufferFacts, dst: BufferFacts
    ) -> DevicePath:
        """Enqueue ``runs`` on the copy engines (one batched driver call, or one copy per run); the
        path taken. Without cuda-bindings a call of more than ``SEPARATE_COPY_RUNS`` runs shorter
        than ``TORCH_COPY_MIN_RUN_BYTES`` on average goes to the kernel where it takes the call (a
        torch copy per run would leave the link waiting for the host), else as torch copies."""
        pageable = (src.host and not src.pinned) or (dst.host and not dst.pinned)
        batch = self._batch or self._build_batch()
        if batch is None:
            if (
                runs.shape[0] > SEPARATE_COPY_RUNS
                and not torch_copies_keep_up(request, runs)
                and _kernel_refusal(request, src, dst) is None
                and self._copy_with_kernel(request, stream, src, dst)
            ):
                return "kernel"
            copy_runs_with_torch(request, runs, self.torch_stream(stream))
            return "copy_engine"
        batch.copy_runs(
            runs,
            request.page_bytes,
            src.address,
            dst.address,
            self._stream_handle(stream),
            src_host=src.host,
            dst_host=dst.host,
            pageable=pageable,
        )
        return "copy_engine"

    def _build_batch(self) -> BatchCopier | None:
        """The batched copier, made once; None without cuda-bindings (logged once): the copy
        engines' calls then go to the kernel or as torch copies (``_copy_with_engines``)."""
        if self._without_bindings:
            return None
        from kvtier.copy.copy_engine import BatchCopier

        with self._building:
            if self._batch is None and not self._without_bindings:
                try:
                    self._batch = BatchCopier(self.device.index)
                except ImportError as error:  # cuda-bindings is not installed
                    self._without_bindings = True
                    logger.warning(
                        "kvtier: the batched copy-engine call needs cuda-bindings (%s); a call of many short "
                        "runs of pages goes to the copy kernel instead where it can, any other as one torch "
                        "copy per run (install 'kvtier[gpu]')",
                        error,
                    )
            return self._batch

    def _copy_with_kernel(self, request: CopyRequest, stream: StreamArg, src: BufferFacts, dst: BufferFacts) -> bool:
        """Enqueue the call on the kernel, building it first if need be; False, with nothing done,
        where it cannot be built. ``ValueError`` before any GPU work for what the kernel refuses."""
        refusal = _kernel_refusal(request, src, dst)
        if refusal is not None:
            raise ValueError(refusal)
        kernel = self._kernel or self._build_kernel()
        if kernel is None:
            return False
        handle = self._stream_handle(stream)
        kernel.copy(request, src, dst, handle, lambda: self.torch_stream(stream))
        return True

    def _stream_handle(self, stream: StreamArg) -> int:
        if stream is None:
            return _current_raw_stream(self.device.index)
        if isinstance(stream, torch.cuda.Stream):
            self._check_stream_device(stream)
            return stream.cuda_stream
        return _raw_handle(stream)

    def torch_stream(self, stream: StreamArg) -> torch.cuda.Stream:
        """The torch stream a ``copy`` given ``stream`` runs on (None: the current one; a raw handle wrapped)."""
        if stream is None:
            return torch.cuda.current_stream(self.device)
        if isinstance(stream, torch.cuda.Stream):
            self._check_stream_device(stream)
            return stream
        handle = _raw_handle(stream)
        wrapped = self._streams.get(handle)
        if wrapped is None:
            default = torch.cuda.default_stream(self.device)
            if handle in LEGACY_STREAM_HANDLES and default.cuda_stream == 0:
                wrapped = default  # 0 and CU_STREAM_LEGACY both name the legacy NULL stream
            else:
                wrapped = torch.cuda.ExternalStream(handle, device=self.device)
            self._streams[handle] = wrapped
        return wrapped

    def _check_stream_device(self, stream: torch.cuda.Stream) -> None:
        if stream.device_index != self.device.index:
            raise ValueError(f"stream is on {stream.device} but this copier serves {self.device}")


class _KernelPath:
    """The kernel path's state on one device: its driver calls, its table ring, its fast launch.

    Invariant: a call's pairs go into a ring slot (``kvtier.copy.table_ring``) that no
    unfinished launch reads; the launch and the slot's event go to the same stream, under one lock.
    The first launch goes through Triton's normal launch (it compiles the kernel) inside torch's
    stream context; later ones through ``FastLaunch`` where this Triton allows it and cuda-bindings
    is installed (``api``). Without cuda-bindings every launch is Triton's normal one, which finds
    the buffers' device addresses itself, and the ring's events are torch's.
    """

    def __init__(
        self, device_index: int, sm_count: int, api: DriverApi | None, torch_stream: Callable[[int], torch.cuda.Stream]
    ) -> None:
        from kvtier.copy.kernel import PROGRAMS_PER_SM, plan_split
        from kvtier.copy.table_ring import TableRing
        from kvtier.copy.torch_events import TorchEvents

        self._plan_split = plan_split
        self._api = api
        self._ring = TableRing(TorchEvents(torch_stream) if api is None else api)
        self._target = PROGRAMS_PER_SM * sm_count
        self._fast: FastLaunch | None = None
        self._addresses: dict[int, tuple[BufferFacts, int]] = {}  # id(facts) -> (facts, device address)
        self._lock = threading.Lock()

    def copy(
        self,
        request: CopyRequest,
        src: BufferFacts,
        dst: BufferFacts,
        stream: int,
        torch_stream: Callable[[], torch.cuda.Stream],
    ) -> None:
        """Enqueue the copy of ``request`` (its buffers' facts ``src`` and ``dst``) on raw ``stream``
        (``torch_stream`` gives it as a torch stream)."""
        with self._lock:
            if self._fast is not None and self._launch_fast(request, src, dst, stream, self._fast):
                return
            with torch.cuda.stream(torch_stream()):  # also makes this device current
                self._launch(request, stream)

    def _launch_fast(
        self, request: CopyRequest, src: BufferFacts, dst: BufferFacts, stream: int, fast: FastLaunch
    ) -> bool:
        """One launch through ``fast`` at the buffers' device addresses; False (nothing enqueued)
        where it declined. Only made once ``_launch`` captured ``fast``, which needs ``_api``."""
        api = self._api
        assert api is not None, "a fast launch needs the driver's calls"
        pushed = api.enter_context()
        try:
            pairs = request.pairs
            pages = pairs.shape[0]
            split = self._plan_split(request.page_bytes, pages, self._target)
            index, array, _ = self._ring.take(pages)
            array[:pages] = pairs
            table = self._ring.address(index, api)
            src_address, dst_address = self._device_address(src, api), self._device_address(dst, api)
            if not fast(src_address, dst_address, table, request.page_bytes, split, pages, stream):
                return False
            self._ring.launched(index, stream)
            return True
        finally:
            if pushed:
                api.leave_context()

    def _launch(self, request: CopyRequest, stream: int) -> None:
        """One launch through Triton's normal one, on torch's current stream (raw ``stream``); the
        first captures the fast launch where cuda-bindings lets it be used."""
        from kvtier.copy.kernel import FastLaunch, launch_copy_kernel

        pairs = request.pairs
        pages = pairs.shape[0]
        split = self._plan_split(request.page_bytes, pages, self._target)
        index, array, table = self._ring.take(pages)
        array[:pages] = pairs
        compiled = launch_copy_kernel(request.src, request.dst, table, request.page_bytes, split, pages)
        if self._api is not None and self._fast is None:
            self._fast = FastLaunch.capture(compiled)
        self._ring.launched(index, stream)

    def _device_address(self, facts: BufferFacts, api: DriverApi) -> int:
        """Where the device reaches the buffer that ``facts`` describe, asked of the driver once per
        facts object (the copier's cache makes a new one whenever the buffer's registration or
        address may have changed)."""
        known = self._addresses.get(id(facts))
        if known is not None and known[0] is facts:
            return known[1]
        address = api.device_pointer(facts.address) if facts.host else facts.address
        if len(self._addresses) >= _KNOWN_ADDRESSES:
            self._addresses.clear()
        self._addresses[id(facts)] = (facts, address)
        return address


def _kernel_refusal(request: CopyRequest, src: BufferFacts, dst: BufferFacts) -> str | None:
    """Why the kernel cannot take this call (``kernel_refusal``, or a pageable host buffer, which
    it cannot reach), or None when it can."""
    refusal = kernel_refusal(request.src, request.dst, request.page_bytes)
    if refusal is not None:
        return refusal
    for name, facts in (("src", src), ("dst", dst)):
        if facts.host and not facts.pinned:
            return (
                f"{name} is pageable host memory, which the copy kernel cannot reach; "
                "allocate it with kvtier.storage.pinned.allocate_host_buffer"
            )
    return None


def _driver_api(device_index: int) -> DriverApi | None:
    """The device's driver calls, or None where cuda-bindings is not installed."""
    from kvtier.copy.driver_api import DriverApi

    try:
        return DriverApi(device_index)
    except ImportError:
        return None


def _current_raw_stream(device_index: int) -> int:
    """The raw handle of torch's current stream on the device, without making a stream object."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def _raw_handle(stream: object) -> int:
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError(f"stream must be None, a torch.cuda.Stream or an int handle, got {type(stream).__name__}")
    if stream < 0:
        raise ValueError(f"a raw stream handle is >= 0, got {stream}")
    return stream
