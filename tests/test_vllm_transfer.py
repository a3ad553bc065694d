"""The vLLM connector's data path (``kvtier.vllm.transfer``), without vLLM: vLLM-laid-out caches
to and from kvtier host pages, byte for byte, on the CPU (and on a GPU where there is one)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvtier.copy import PageCopier
from kvtier.vllm.paged_views import paged_layer_views
from kvtier.vllm.transfer import (
    BlockTransfer,
    Direction,
    GroupBlocks,
    GroupPlan,
    TransferJob,
    bytes_at,
    copy_pairs,
    route_groups,
)

LAYERS, BLOCKS, HEADS, TOKENS, CONTENT = 4, 24, 2, 16, 32  # float32: a 4 KiB page per layer and block
PAGE = HEADS * TOKENS * CONTENT * 4
SLOTS = 10


def caches(layout: str, device: str = "cpu") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Layer views in ``layout`` over one allocation filled with fresh, non-zero bytes."""
    raw = torch.randint(1, 256, (LAYERS * BLOCKS * PAGE,), dtype=torch.uint8, device=device)
    views = paged_layer_views(raw, LAYERS, BLOCKS, HEADS, TOKENS, CONTENT, torch.float32, layout)
    return {f"layer{i}": v for i, v in enumerate(views)}, raw


def one_group(names: list[str]) -> GroupPlan:
    return GroupPlan(0, tuple(names), (0,), (0,) * len(names), PAGE)


def block_bytes(view: torch.Tensor, block: int) -> bytes:
    """The page of one layer's block as it lies in memory (vLLM's physical order, not the view's)."""
    start = view[block].storage_offset() * view.element_size()
    page = torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage(), start, (PAGE,), (1,))
    return page.cpu().numpy().tobytes()


def job(job_id: int, direction: Direction, slots: list[int], blocks: list[int], group: int = 0) -> TransferJob:
    rows = GroupBlocks(group, np.array(slots, dtype=np.int64), np.array(blocks, dtype=np.int64)[:, None])
    return TransferJob(job_id, f"req{job_id}", direction, [rows])


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC"])
def test_save_then_load_moves_every_byte_of_every_layer(layout):
    views, raw = caches(layout)
    plan = one_group(list(views))
    allocation, routes = route_groups([plan], views, BLOCKS)
    host = torch.zeros(SLOTS * plan.host_page_bytes, dtype=torch.uint8)
    transfer = BlockTransfer(allocation, routes, [host])
    saved = {b: [block_bytes(v, b) for v in views.values()] for b in (5, 2, 9)}

    transfer.submit([job(1, Direction.SAVE, [0, 3, 1], [5, 2, 9])])
    assert transfer.poll() == [(1, True)]
    pages = host.view(SLOTS, LAYERS, PAGE).numpy()
    for slot, block in ((0, 5), (3, 2), (1, 9)):
        assert [pages[slot, k].tobytes() for k in range(LAYERS)] == saved[block]

    raw.fill_(0xA5)  # vLLM's blocks are overwritten: a load must bring every byte back
    transfer.submit([job(2, Direction.LOAD, [0, 3, 1], [11, 20, 0])])
    assert transfer.poll() == [(2, True)]
    for block, source in ((11, 5), (20, 2), (0, 9)):
        assert [block_bytes(v, block) for v in views.values()] == saved[source]
    assert block_bytes(views["layer0"], 1) == bytes([0xA5]) * PAGE  # nothing else was written


def test_a_group_gathers_layers_of_several_block_tables():
    views, _ = caches("LBNHC")
    names = list(views)
    plan = GroupPlan(0, tuple(names), (0, 1), (0, 1, 0, 1), PAGE)  # layers 1 and 3 follow another table
    allocation, routes = route_groups([plan], views, BLOCKS)
    host = torch.zeros(SLOTS * plan.host_page_bytes, dtype=torch.uint8)
    transfer = BlockTransfer(allocation, routes, [host])
    rows = GroupBlocks(0, np.array([4], dtype=np.int64), np.array([[7, 13]], dtype=np.int64))
    transfer.submit([TransferJob(1, "r", Direction.SAVE, [rows])])
    pages = host.view(SLOTS, LAYERS, PAGE).numpy()
    tables = dict(zip(names, plan.layer_columns, strict=True))
    want = [block_bytes(views[n], 7 if tables[n] == 0 else 13) for n in names]
    assert [pages[4, k].tobytes() for k in range(LAYERS)] == want


def test_pairs_match_the_layout_formula():
    views, _ = caches("BLNHC")
    _, (route,) = route_groups([one_group(list(views))], views, BLOCKS)
    rows = GroupBlocks(0, np.array([2, 0], dtype=np.int64), np.array([[3], [8]], dtype=np.int64))
    (phase,) = route.phases()
    pairs = copy_pairs(phase, LAYERS, rows, Direction.SAVE)
    want = [(block * LAYERS + k, slot * LAYERS + k) for slot, block in ((2, 3), (0, 8)) for k in range(LAYERS)]
    assert pairs.tolist() == [list(p) for p in want]
    assert copy_pairs(phase, LAYERS, rows, Direction.LOAD).tolist() == [[d, s] for s, d in want]


def test_a_job_the_copier_refuses_fails_alone():
    views, _ = caches("LBNHC")
    plan = one_group(list(views))
    allocation, routes = route_groups([plan], views, BLOCKS)
    host = torch.zeros(SLOTS * plan.host_page_bytes, dtype=torch.uint8)
    transfer = BlockTransfer(allocation, routes, [host])
    good, bad = job(1, Direction.SAVE, [2], [6]), job(2, Direction.SAVE, [SLOTS + 5], [7])  # past the host pages
    transfer.submit([good, bad])
    assert transfer.poll() == [(1, True), (2, False)]
    assert host.view(SLOTS, LAYERS, PAGE)[2, 0].numpy().tobytes() == block_bytes(views["layer0"], 6)


def test_a_job_marked_failed_copies_nothing_and_reports_failure():
    views, _ = caches("LBNHC")
    plan = one_group(list(views))
    allocation, routes = route_groups([plan], views, BLOCKS)
    host = torch.zeros(SLOTS * plan.host_page_bytes, dtype=torch.uint8)
    transfer = BlockTransfer(allocation, routes, [host])
    failed = job(1, Direction.LOAD, [0], [3])
    failed.failed = True
    before = block_bytes(views["layer0"], 3)
    transfer.submit([failed])
    assert transfer.poll() == [(1, False)]
    assert block_bytes(views["layer0"], 3) == before


def test_layouts_whose_blocks_are_not_one_page_are_refused():
    views, _ = caches("LHBNC")
    with pytest.raises(ValueError, match="block-contiguous KV cache layout"):
        route_groups([one_group(list(views))], views, BLOCKS)
    views, _ = caches("LBNHC")
    with pytest.raises(ValueError, match="no KV cache registered"):
        route_groups([one_group(["layer0", "missing"])], views, BLOCKS)
    with pytest.raises(ValueError, match="does not hold"):
        route_groups([one_group(["layer0"])], {"layer0": views["layer0"][1:]}, BLOCKS)
    raw = torch.ones(LAYERS * BLOCKS * PAGE + 64, dtype=torch.uint8)
    (shifted,) = paged_layer_views(raw[64:], 1, BLOCKS, HEADS, TOKENS, CONTENT, torch.float32)
    with pytest.raises(ValueError, match="page boundaries"):
        route_groups([one_group(["layer0"])], {"layer0": shifted}, BLOCKS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_save_then_load_on_the_gpu_through_pinned_host_pages(layout):
    from kvtier.storage.pinned import allocate_host_buffer

    views, raw = caches(layout, "cuda")
    plan = one_group(list(views))
    allocation, routes = route_groups([plan], views, BLOCKS)
    with allocate_host_buffer(SLOTS * plan.host_page_bytes, plan.host_page_bytes, "cuda") as host:
        transfer = BlockTransfer(allocation, routes, [host.tensor])
        saved = [block_bytes(v, 4) for v in views.values()]
        transfer.submit([job(1, Direction.SAVE, [7], [4])])
        transfer.synchronize()
        assert transfer.poll() == [(1, True)]
        raw.fill_(0x3C)  # on the caller's stream: the load waits for it
        transfer.submit([job(2, Direction.LOAD, [7], [19])])
        transfer.synchronize()
        assert [block_bytes(v, 19) for v in views.values()] == saved


class CountingCopier(PageCopier):
    """A real CPU copier that also counts the pages of each call it makes."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.calls: list[int] = []

    def copy(self, src, dst, pairs, page_bytes, stream=None):
        self.calls.append(len(pairs))
        return super().copy(src, dst, pairs, page_bytes, stream)


def test_large_calls_go_to_the_bulk_copier_and_stay_exact(monkeypatch):
    import kvtier.vllm.transfer as transfer_module

    monkeypatch.setattr(transfer_module, "BULK_COPIES", 3 * LAYERS)
    views, _ = caches("LBNHC")
    plan = one_group(list(views))
    allocation, routes = route_groups([plan], views, BLOCKS)
    host = torch.zeros(SLOTS * plan.host_page_bytes, dtype=torch.uint8)
    small, bulk = CountingCopier(), CountingCopier()
    transfer = BlockTransfer(allocation, routes, [host], small, bulk)
    transfer.submit([job(1, Direction.SAVE, [0, 1], [3, 4])])  # 2 blocks x 4 layers: below the bound
    transfer.submit([job(2, Direction.SAVE, [2, 3, 4], [5, 6, 7])])  # 3 x 4: at the bound
    assert small.calls == [2 * LAYERS] and bulk.calls == [3 * LAYERS]
    pages = host.view(SLOTS, LAYERS, PAGE).numpy()
    for slot, block in ((0, 3), (1, 4), (2, 5), (3, 6), (4, 7)):
        assert [pages[slot, k].tobytes() for k in range(LAYERS)] == [block_bytes(v, block) for v in views.values()]


def padded(size: int, granule: int) -> int:
    return -(-size // granule) * granule


@pytest.mark.parametrize(
    "heads, granule",
    [(2, PAGE), (3, 1 << 17), (5, 1 << 17)],
    ids=["page-aligned segments", "6 KiB pages, 128 KiB granules", "10 KiB pages, 128 KiB granules"],
)
def test_layers_each_with_a_storage_of_their_own_move_every_byte_and_nothing_between(heads, granule):
    """vLLM 0.34's extensible KV cache reserves one address range and registers each layer as a
    segment of it with a storage of its own (LBNHC), each segment padded to the memory granule (a
    power of two: a page with an odd factor then starts its next segment off a page boundary).
    Before, such caches were refused ("the KV caches live in 4 allocations"; then, for pages with
    an odd factor, "not on page boundaries")."""
    page = heads * TOKENS * CONTENT * 4
    segment_bytes = padded(BLOCKS * page + 1, granule)  # room past the blocks, as vLLM reserves
    reservation = torch.randint(1, 256, (LAYERS * segment_bytes,), dtype=torch.uint8)
    segments = [
        bytes_at(reservation.data_ptr() + k * segment_bytes, BLOCKS * page, reservation.device, reservation)
        for k in range(LAYERS)
    ]
    views = {
        f"layer{k}": paged_layer_views(segment, 1, BLOCKS, heads, TOKENS, CONTENT, torch.float32, "LBNHC")[0]
        for k, segment in enumerate(segments)
    }
    assert len({v.untyped_storage().data_ptr() for v in views.values()}) == LAYERS
    gaps = [slice(k * segment_bytes + BLOCKS * page, (k + 1) * segment_bytes) for k in range(LAYERS)]
    before = [reservation[gap].clone() for gap in gaps]
    plan = GroupPlan(0, tuple(views), (0,), (0,) * LAYERS, page)
    allocation, (route,) = route_groups([plan], views, BLOCKS)
    assert allocation.data_ptr() == reservation.data_ptr()
    assert route.unit_bytes == math.gcd(page, segment_bytes) and (route.unit_bytes < page) == (heads != 2)
    phases = route.phases()  # a call each, of whole pages
    assert sorted(np.concatenate([phase.layers for phase in phases]).tolist()) == list(range(LAYERS))
    assert (len(phases) > 1) == (heads != 2)
    host = torch.zeros(SLOTS * plan.host_page_bytes, dtype=torch.uint8)
    transfer = BlockTransfer(allocation, [route], [host])

    def page_bytes(view, block):
        return view[block].contiguous().view(torch.uint8).numpy().tobytes()  # (LBNHC: the view is the page)

    saved = {b: [page_bytes(v, b) for v in views.values()] for b in (0, 23, 9)}
    transfer.submit([job(1, Direction.SAVE, [0, 3, 1], [0, 23, 9])])
    assert transfer.poll() == [(1, True)]
    pages = host.view(SLOTS, LAYERS, page).numpy()
    assert [pages[3, k].tobytes() for k in range(LAYERS)] == [
        views[f"layer{k}"][23].permute(1, 0, 2).contiguous().view(torch.uint8).numpy().tobytes() for k in range(LAYERS)
    ]
    for segment in segments:
        segment.fill_(0xA5)
    transfer.submit([job(2, Direction.LOAD, [0, 3, 1], [11, 20, 0])])
    assert transfer.poll() == [(2, True)]
    for block, source in ((11, 0), (20, 23), (0, 9)):
        assert [page_bytes(v, block) for v in views.values()] == saved[source]
    assert page_bytes(views["layer2"], 1) == bytes([0xA5]) * page
    for gap, was in zip(gaps, before, strict=True):  # the reservation past each segment's blocks is never written
        assert torch.equal(reservation[gap], was)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads", [2, 3], ids=["4 KiB pages", "6 KiB pages"])
def test_segments_of_one_reserved_device_range_with_unmapped_gaps_between_them(heads):
    """As vLLM 0.34's extensible KV cache maps them: one virtual address range reserved, each layer's
    committed blocks mapped at the start of its segment, the rest of the segment unmapped (a copy
    touching it faults); with 6 KiB pages the segments start off page boundaries. Loads and saves
    move every byte through pinned host pages."""
    from cuda.bindings import driver

    from kvtier.storage.pinned import allocate_host_buffer

    page = heads * TOKENS * CONTENT * 4

    def check(result):
        err, *value = result if isinstance(result, tuple) else (result,)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        return value[0] if len(value) == 1 else value

    device = torch.device("cuda", torch.cuda.current_device())
    torch.zeros(1, device=device)  # the context the driver calls below run in
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device.index
    granule = check(
        driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        )
    )
    committed = -(-BLOCKS * page // granule) * granule
    segment_bytes = 2 * committed  # the second half of every segment stays unmapped
    base = int(check(driver.cuMemAddressReserve(LAYERS * segment_bytes, 0, 0, 0)))
    access = driver.CUmemAccessDesc()
    access.location = prop.location
    access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    handles = []
    try:
        for k in range(LAYERS):
            handle = check(driver.cuMemCreate(committed, prop, 0))
            handles.append(handle)
            check(driver.cuMemMap(base + k * segment_bytes, committed, 0, handle, 0))
            check(driver.cuMemSetAccess(base + k * segment_bytes, committed, [access], 1))
        segments = [bytes_at(base + k * segment_bytes, BLOCKS * page, device) for k in range(LAYERS)]
        for segment in segments:
            segment.copy_(torch.randint(1, 256, segment.shape, dtype=torch.uint8, device=device))
        views = {
            f"layer{k}": paged_layer_views(segment, 1, BLOCKS, heads, TOKENS, CONTENT, torch.float32, "LBNHC")[0]
            for k, segment in enumerate(segments)
        }
        plan = GroupPlan(0, tuple(views), (0,), (0,) * LAYERS, page)
        allocation, routes = route_groups([plan], views, BLOCKS)
        assert (routes[0].unit_bytes < page) == (heads == 3)
        with allocate_host_buffer(SLOTS * plan.host_page_bytes, plan.host_page_bytes, "cuda") as host:
            transfer = BlockTransfer(allocation, routes, [host.tensor])
            saved = {b: [page_of(v, b) for v in views.values()] for b in (0, 23)}
            transfer.submit([job(1, Direction.SAVE, [7, 2], [0, 23])])
            transfer.synchronize()
            assert transfer.poll() == [(1, True)]
            for segment in segments:
                segment.fill_(0x3C)  # on the caller's stream: the load waits for it
            transfer.submit([job(2, Direction.LOAD, [7, 2], [19, 1])])
            transfer.synchronize()
            assert [page_of(v, 19) for v in views.values()] == saved[0]
            assert [page_of(v, 1) for v in views.values()] == saved[23]
            del transfer, allocation, routes, views, segments
        torch.cuda.synchronize()
    finally:
        for k, handle in enumerate(handles):
            check(driver.cuMemUnmap(base + k * segment_bytes, committed))
            check(driver.cuMemRelease(handle))
        check(driver.cuMemAddressFree(base, LAYERS * segment_bytes))


def page_of(view: torch.Tensor, block: int) -> bytes:
    """One layer's block as bytes, whatever its page size."""
    return view[block].contiguous().view(torch.uint8).cpu().numpy().tobytes()
