"""The data path between vLLM's paged KV blocks and kvtier's host pages. Imports neither vLLM nor
the cache manager, so it runs (and is tested) wherever torch does.

vLLM keeps one view per layer into one device allocation (with vLLM 0.34's extensible KV cache, one
reserved address range whose layers are segments, a storage each); in its block-contiguous layouts
block ``b`` of a layer is one contiguous page of ``page_bytes`` at ``base + b * block_stride``. A
kvtier host page of a layer group holds one block of every layer of the group, layer after layer:
layer ``k`` of host slot ``s`` is bytes ``[(s * L + k) * p, (s * L + k + 1) * p)`` of the group's
host buffer (``L`` layers of ``p`` bytes, no padding). So a batch of blocks moves as one
``PageCopier`` call per layer group over ``p``-byte slots of both buffers, with pairs
``(first[k] + block * stride[k], s * L + k)`` for every block and layer. Where the storages' starts
are not on page boundaries of the allocation (vLLM 0.34's padded segments), the layers fall into
*phases*, by how far past a page boundary their blocks start (a multiple of ``GroupRoute.unit_bytes``):
one call per phase, over the allocation from that phase's offset, so each page is still one pair.

A job names, per layer group, the host slots of its blocks and, per *column*, the vLLM block ids
of the same blocks (a kvtier group may gather layers from several vLLM KV cache groups, each with
its own block table: a column is one of them).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.copy import CopyPolicy, PageCopier
from kvtier.layout import PART_ALIGN

# A call of at least this many pages goes to ``bulk_copier`` when there is one. vLLM's pages are
# one layer of one block (64 KiB for a Llama-3-8B shape), so a call moves (blocks x layers) of
# them. Measured on the H200 (kvtier bench vllm, 32 layers): the copy engines' host cost grows by
# ~4 us a page (2,048 blocks: 260 ms to submit 80 ms of copies), the kernel's does not (4.8 ms),
# at the same GPU time within 5%; with 32 pages the copy engines submit faster (0.15-0.29 ms
# against 0.42-0.45 ms), with 2,048 the kernel (0.57-0.69 ms against 1.9-2.4 ms).
BULK_COPIES = 512
KERNEL_ONLY = CopyPolicy(copy_engine_min_bytes=None, coherent_copy_kernel=True)


class Direction(str, enum.Enum):
    LOAD = "load"  # host pages -> vLLM blocks
    SAVE = "save"  # vLLM blocks -> host pages


@dataclass(frozen=True, slots=True)
class LayerBlocks:
    """Where one layer's blocks are in the device allocation, counted in its route's copy units:
    block b starts at unit ``first_unit + b * unit_stride``."""

    name: str
    first_unit: int
    unit_stride: int
    column: int


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One kvtier layer group as vLLM sees it: its layers in host-page order and their block tables.

    ``columns[c]`` is the vLLM KV cache group whose block table feeds column c; layer i reads
    column ``layer_columns[i]``. Every layer's block is one page of ``page_bytes``.
    """

    group_id: int
    layer_names: tuple[str, ...]
    columns: tuple[int, ...]
    layer_columns: tuple[int, ...]
    page_bytes: int

    @property
    def host_page_bytes(self) -> int:
        """Bytes of one host page: one block of every layer."""
        return len(self.layer_names) * self.page_bytes


@dataclass(frozen=True, slots=True)
class GroupRoute:
    """One kvtier layer group: its layers in host-page order, each found in the device allocation.

    Layers are located in ``unit_bytes`` units: the page itself where every layer's blocks lie on
    page boundaries of the allocation, a divisor of it where the allocation spans storages whose
    starts do not (vLLM 0.34 pads each layer's segment to its memory granule, a power of two: a
    12 KiB page's blocks may start 0, 4 or 8 KiB past a page boundary). Copies move whole pages,
    one call per phase (``phases``).
    """

    group_id: int
    page_bytes: int
    layers: tuple[LayerBlocks, ...]
    num_columns: int
    unit_bytes: int

    @property
    def units_per_page(self) -> int:
        return self.page_bytes // self.unit_bytes

    def phases(self) -> list[Phase]:
        """The layers grouped by how many units past a page boundary their blocks start, in pages
        of the allocation from that offset; one phase (offset 0) where every page is on a boundary."""
        k = self.units_per_page
        firsts = np.array([layer.first_unit for layer in self.layers], dtype=np.int64)
        strides = np.array([layer.unit_stride for layer in self.layers], dtype=np.int64)
        columns = np.array([layer.column for layer in self.layers], dtype=np.int64)
        phases = []
        for offset in sorted(set((firsts % k).tolist())):
            mine = np.flatnonzero(firsts % k == offset)
            phases.append(
                Phase(offset * self.unit_bytes, mine, (firsts[mine] - offset) // k, strides[mine] // k, columns[mine])
            )
        return phases


@dataclass(frozen=True, slots=True, eq=False)
class Phase:
    """Layers of a route whose blocks start ``offset_bytes`` past a page boundary of the allocation:
    layer ``layers[i]`` (its place in host pages) has block b at page ``first_page[i] + b *
    page_stride[i]`` of the allocation from ``offset_bytes``, and reads column ``columns[i]``."""

    offset_bytes: int
    layers: np.ndarray
    first_page: np.ndarray
    page_stride: np.ndarray
    columns: np.ndarray


@dataclass(slots=True)
class GroupBlocks:
    """One group's share of a job: block i moves between host slot ``host_slots[i]`` and device
    block ``device_blocks[i, c]`` for the layers of column c."""

    group_id: int
    host_slots: np.ndarray  # (n,) int64
    device_blocks: np.ndarray  # (n, num_columns) int64


@dataclass(slots=True)
class TransferJob:
    """One request's load or save of one step.

    ``failed_block_ids`` (loads): vLLM block ids the scheduler already knows it cannot fill (the
    pages were lost); they are reported as load errors with the job. ``failed`` (loads): the
    whole load is reported failed.
    """

    job_id: int
    req_id: str
    direction: Direction
    groups: list[GroupBlocks] = field(default_factory=list)
    failed_block_ids: list[int] = field(default_factory=list)
    failed: bool = False

    @property
    def num_blocks(self) -> int:
        return sum(len(g.host_slots) for g in self.groups)


def locate_layer(
    name: str, cache: torch.Tensor, num_blocks: int, page_bytes: int, column: int, shift: int = 0, unit: int = 0
) -> LayerBlocks:
    """Find ``name``'s blocks in its device allocation (``cache`` is the view vLLM registered), in
    units of ``unit`` bytes (default: the page); ``cache``'s storage starts ``shift`` bytes into the
    allocation (a multiple of ``unit``).

    ``cache``'s first dimension holds ``num_blocks`` blocks, or a multiple of it (kernel blocks
    that split a block evenly). ``ValueError`` unless each block is one contiguous page of
    ``page_bytes`` bytes at a page-aligned offset with a page-multiple stride.
    """
    if cache.dim() < 1 or cache.shape[0] % num_blocks:
        raise ValueError(f"layer {name}: a cache of shape {tuple(cache.shape)} does not hold {num_blocks} blocks")
    blocks = cache.unflatten(0, (num_blocks, -1)) if cache.shape[0] != num_blocks else cache
    itemsize = cache.element_size()
    if not _is_dense(blocks[0]) or blocks[0].numel() * itemsize != page_bytes:
        raise ValueError(
            f"layer {name}: a block is not one contiguous page of {page_bytes} bytes (shape {tuple(blocks.shape)}, "
            f"strides {blocks.stride()}); kvtier.vllm needs a block-contiguous KV cache layout such as LBNHC, "
            "LBHNC or BLNHC (VLLM_KV_CACHE_LAYOUT)"
        )
    offset = cache.storage_offset() * itemsize
    stride = blocks.stride(0) * itemsize
    if offset % page_bytes or stride % page_bytes or stride == 0:
        raise ValueError(
            f"layer {name}: blocks at byte offset {offset} with stride {stride} are not on {page_bytes}-byte page "
            "boundaries of their allocation"
        )
    unit = unit or page_bytes
    return LayerBlocks(name, (shift + offset) // unit, stride // unit, column)


def route_groups(
    plans: Sequence[GroupPlan], caches: dict[str, torch.Tensor], num_blocks: int
) -> tuple[torch.Tensor, list[GroupRoute]]:
    """The device memory behind ``caches`` (vLLM's registered views, ``device_span``) and a route per
    plan.

    ``ValueError`` if a planned layer is missing, or the layers are on more than one device.
    """
    missing = [name for plan in plans for name in plan.layer_names if name not in caches]
    if missing:
        raise ValueError(f"no KV cache registered for layers {missing[:4]}")
    allocation = device_span([caches[name] for plan in plans for name in plan.layer_names])
    base = allocation.data_ptr()
    routes = []
    for plan in plans:
        shifts = [caches[name].untyped_storage().data_ptr() - base for name in plan.layer_names]
        unit = math.gcd(plan.page_bytes, *shifts)
        if unit % PART_ALIGN:
            raise ValueError(
                f"the KV caches' storages start {sorted(set(shifts))} bytes apart, not on {PART_ALIGN}-byte boundaries"
            )
        layers = tuple(
            locate_layer(name, caches[name], num_blocks, plan.page_bytes, column, shift, unit)
            for name, column, shift in zip(plan.layer_names, plan.layer_columns, shifts, strict=True)
        )
        routes.append(GroupRoute(plan.group_id, plan.page_bytes, layers, len(plan.columns), unit))
    return allocation, routes


def _is_dense(view: torch.Tensor) -> bool:
    """Whether ``view`` covers one gap-free run of memory in some dimension order ([H, N, C] of an [N, H, C] block)."""
    expected = 1
    for size, stride in sorted(zip(view.shape, view.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def device_span(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """The device memory behind vLLM's layer views, as one flat uint8 tensor.

    Their one storage, when they share one (vLLM's single allocation). Otherwise (vLLM 0.34's
    extensible KV cache: one reserved address range, each layer a segment mapped as its own
    storage) a tensor over the addresses from the lowest storage's first byte to the highest one's
    last, which keeps every storage alive. Addresses between the storages may be unmapped: a
    route only ever names the pages of its layers' blocks, inside their storages.
    """
    devices = {view.device for view in views}
    if len(devices) != 1:
        raise ValueError(f"the KV caches are on {len(devices)} devices; kvtier.vllm needs them on one")
    (device,) = devices
    storages = {view.untyped_storage().data_ptr(): view.untyped_storage() for view in views}
    if len(storages) == 1:
        ((_, storage),) = storages.items()
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))
    start = min(storages)
    end = max(ptr + storage.nbytes() for ptr, storage in storages.items())
    return bytes_at(start, end - start, device, list(storages.values()))


class _Bytes:
    """Bytes ``[ptr, ptr + size)`` of one device, in the array interface torch (CUDA) or numpy (CPU)
    reads; holds ``owner``, whatever keeps that memory alive, for as long as a tensor over it lives."""

    def __init__(self, ptr: int, size: int, device: torch.device, owner: object) -> None:
        interface = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}
        if device.type == "cuda":
            self.__cuda_array_interface__ = interface
        else:
            self.__array_interface__ = interface
        self.owner = owner


def bytes_at(ptr: int, size: int, device: torch.device, owner: object = None) -> torch.Tensor:
    """A flat uint8 tensor over ``size`` bytes at ``ptr`` of ``device`` (cuda or cpu), with a storage
    of its own; it keeps ``owner`` (the storages of that memory) alive."""
    memory = _Bytes(ptr, size, device, owner)
    if device.type == "cuda":
        return torch.as_tensor(memory, device=device)
    if device.type == "cpu":
        return torch.from_numpy(np.asarray(memory))
    raise ValueError(f"the KV caches' segments are on a {device.type} device; kvtier.vllm reads them on cuda or cpu")


def copy_pairs(phase: Phase, num_layers: int, blocks: GroupBlocks, direction: Direction) -> np.ndarray:
    """The (src, dst) pairs of one group's blocks in the layers of ``phase`` (of a route of
    ``num_layers`` layers), in pages of both buffers: the allocation's from ``phase.offset_bytes``,
    the group's host buffer's.

    Vectorised over blocks and layers: no Python object per page.
    """
    device = phase.first_page[None, :] + blocks.device_blocks[:, phase.columns] * phase.page_stride[None, :]
    host = blocks.host_slots[:, None] * num_layers + phase.layers[None, :]
    src, dst = (host, device) if direction is Direction.LOAD else (device, host)
    return np.stack([src.reshape(-1), dst.reshape(-1)], axis=1)


class BlockTransfer:
    """Runs jobs between one device allocation and the host buffers of the layer groups.

    On CUDA every batch runs on this object's own stream, after the work already queued on the
    caller's current stream (so a save reads what the forward wrote, and a load lands after any
    zeroing of fresh blocks); completion is an event per batch. On the CPU copies run in the
    calling thread and are done on return.

    Invariants: jobs complete in submission order (``poll`` returns them so); a job whose copy
    call was refused (``ValueError`` from the copier) is reported failed (where its group has
    several phases, those before the refused call may have copied: a failed load's blocks are
    recomputed, a failed save's pages never published), the other jobs of its batch are retried
    one by one.
    """

    def __init__(
        self,
        allocation: torch.Tensor,
        routes: Sequence[GroupRoute],
        host_buffers: Sequence[torch.Tensor],
        copier: PageCopier | None = None,
        bulk_copier: PageCopier | None = None,
    ) -> None:
        """``copier`` (default: the automatic policy) moves every call, except calls of at least
        ``BULK_COPIES`` pages when ``bulk_copier`` is given (e.g. ``PageCopier(device,
        policy=KERNEL_ONLY)`` where the host buffers are registered and the kernel can reach them)."""
        if len(routes) != len(host_buffers):
            raise ValueError(f"{len(routes)} group routes but {len(host_buffers)} host buffers")
        self.allocation = allocation
        self.routes = {route.group_id: route for route in routes}
        # per group, its phases and the allocation from each phase's offset (one tensor each: the
        # copier learns a buffer's facts once per tensor object)
        self.phases = {
            route.group_id: [(phase, allocation[phase.offset_bytes :]) for phase in route.phases()] for route in routes
        }
        self.host_buffers = {route.group_id: buf for route, buf in zip(routes, host_buffers, strict=True)}
        self.device = allocation.device
        self.copier = copier if copier is not None else PageCopier(self.device)
        self.bulk_copier = bulk_copier
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._batches: list[tuple[torch.cuda.Event | None, list[int]]] = []
        self._events: dict[int, torch.cuda.Event] = {}
        self._failed: set[int] = set()

    def submit(self, jobs: Sequence[TransferJob]) -> None:
        """Enqueue the copies of ``jobs`` (all of one direction or mixed); one copier call per (direction, group)."""
        if not jobs:
            return
        event = None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for direction in Direction:
            self._run([j for j in jobs if j.direction is direction and not j.failed], direction)
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            for job in jobs:
                self._events[job.job_id] = event
        self._batches.append((event, [job.job_id for job in jobs]))
        self._failed.update(job.job_id for job in jobs if job.failed)

    def poll(self) -> list[tuple[int, bool]]:
        """(job id, succeeded) of every job that has completed since the last call, in submission order."""
        done = []
        while self._batches:
            event, job_ids = self._batches[0]
            if event is not None and not event.query():
                break
            self._batches.pop(0)
            for job_id in job_ids:
                self._events.pop(job_id, None)
                done.append((job_id, job_id not in self._failed))
                self._failed.discard(job_id)
        return done

    def fence(self, job_ids: Sequence[int]) -> None:
        """Make the caller's current stream wait until ``job_ids`` have completed (no host wait)."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        for event in {id(e): e for j in job_ids if (e := self._events.get(j)) is not None}.values():
            current.wait_event(event)

    def synchronize(self) -> None:
        """Wait on the host until every submitted job has completed."""
        if self.stream is not None:
            self.stream.synchronize()

    def _run(self, jobs: list[TransferJob], direction: Direction) -> None:
        if not jobs:
            return
        by_group: dict[int, list[GroupBlocks]] = {}
        owners: dict[int, list[TransferJob]] = {}
        for job in jobs:
            for blocks in job.groups:
                if len(blocks.host_slots):
                    by_group.setdefault(blocks.group_id, []).append(blocks)
                    owners.setdefault(blocks.group_id, []).append(job)
        for group_id, parts in by_group.items():
            try:
                self._copy(group_id, parts, direction)
            except ValueError:
                for part, job in zip(parts, owners[group_id], strict=True):
                    try:
                        self._copy(group_id, [part], direction)
                    except ValueError:
                        self._failed.add(job.job_id)

    def _copy(self, group_id: int, parts: list[GroupBlocks], direction: Direction) -> None:
        route = self.routes.get(group_id)
        if route is None:
            raise ValueError(f"no layer group {group_id} in this transfer")
        merged = GroupBlocks(
            group_id,
            np.concatenate([p.host_slots for p in parts]),
            np.concatenate([p.device_blocks for p in parts]),
        )
        host = self.host_buffers[group_id]
        for phase, device in self.phases[group_id]:
            pairs = copy_pairs(phase, len(route.layers), merged, direction)
            src, dst = (host, device) if direction is Direction.LOAD else (device, host)
            bulk = self.bulk_copier is not None and len(pairs) >= BULK_COPIES
            (self.bulk_copier if bulk else self.copier).copy(src, dst, pairs, route.page_bytes, self.stream)
