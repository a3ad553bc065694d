"""Copies are ordered against every stream the caller works on, not only the current one.

Each test holds one stream busy (``torch.cuda._sleep``) so that a missing wait shows as bytes
read or written too early: pages are filled with one byte value per (prompt, block), the slots
with ``JUNK`` before they are handed out.
"""

from __future__ import annotations

import time

import pytest
import torch

import kvtier
from kvtier.layout import page_geometries

TPB = 16
JUNK = 0xEE
HOLD_CYCLES = 400_000_000  # about a quarter of a second of one stream's time


@pytest.fixture(autouse=True, scope="module")
def _kernels_loaded() -> None:
    """CUDA loads a kernel at its first launch, synchronizing the device: a first ``fill_`` after a
    held stream would wait for it, and no race could show. Each kernel the tests use runs once first."""
    if torch.cuda.is_available():
        page = torch.empty(64, dtype=torch.uint8, device="cuda")
        page.fill_(1)
        page.clone().copy_(page)
        assert bool((page == 1).all())
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()


def _manager(primary: int, host: int = 0, write_through: bool = False) -> kvtier.KVCacheManager:
    spec = kvtier.ModelSpec.uniform(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.float16, model_id="order")
    page = page_geometries(spec, TPB)[0].page_bytes  # 256 KiB: the copy engines' path
    tiers = [kvtier.PrimaryTier(primary * page + 1)]
    if host:
        tiers.append(kvtier.HostTier(host * page + 1, write_through=write_through))
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block=TPB, tiers=tiers, device="cuda"))


def _prompt(pid: int, blocks: int) -> list[int]:
    return [1000 * (pid + 1) + i for i in range(blocks * TPB)]


def _value(pid: int, block: int) -> int:
    return (pid * 37 + block * 11) % 200 + 1


def _pages(mgr: kvtier.KVCacheManager) -> torch.Tensor:
    return mgr.layout().groups[0].regions[0].as_tensor()


def _hold(stream: torch.cuda.Stream | None = None) -> None:
    with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream()):
        torch.cuda._sleep(HOLD_CYCLES)


def _write(mgr, cache, pid: int, blocks: int, stream=None) -> None:
    """The caller's kernels writing the cache's first ``blocks`` pages, on ``stream``."""
    view, slots = _pages(mgr), cache.page_indices(0)
    with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream()):
        for b in range(blocks):
            view[int(slots[b])].fill_(_value(pid, b))


def _read(mgr, cache, blocks: int) -> list[torch.Tensor]:
    """The caller's kernels reading the cache's pages on the current stream, now."""
    view, slots = _pages(mgr), cache.page_indices(0)
    return [view[int(slots[b])].clone() for b in range(blocks)]


def _wrong(pid: int, clones: list[torch.Tensor]) -> list[int]:
    """Blocks whose clone is not the oracle's bytes (after a synchronize)."""
    torch.cuda.synchronize()
    return [b for b, page in enumerate(clones) if not bool((page == _value(pid, b)).all())]


def _publish(mgr, pid: int, blocks: int) -> None:
    tokens = _prompt(pid, blocks)
    cache = mgr.create_cache(tokens)
    assert cache.resume() and cache.resize(len(tokens))
    _write(mgr, cache, pid, blocks)
    cache.commit(tokens)
    cache.close()
    torch.cuda.synchronize()


def _junk_primary(mgr, pid: int, slots: int) -> None:
    """Take every primary slot (pushing what is there down) and fill it with ``JUNK``."""
    cache = mgr.create_cache(_prompt(pid, slots))
    assert cache.resume() and cache.resize(slots * TPB)
    view = _pages(mgr)
    for slot in cache.page_indices(0):
        view[int(slot)].fill_(JUNK)
    cache.close()
    torch.cuda.synchronize()


def test_a_resume_with_nothing_to_copy_waits_for_a_prefetch_on_another_stream():
    mgr = _manager(primary=8, host=16)
    _publish(mgr, 1, 4)
    _junk_primary(mgr, 90, 8)
    side = torch.cuda.Stream()
    _hold(side)
    assert mgr.prefetch(_prompt(1, 4) + [7], stream=side) == 4
    cache = mgr.create_cache(_prompt(1, 4) + [7])
    assert cache.resume()  # its pages are in the primary tier already: nothing to copy
    assert _wrong(1, _read(mgr, cache, 4)) == []
    cache.close()
    mgr.close()


def test_a_resume_with_nothing_to_copy_waits_for_another_caches_resume_stream():
    mgr = _manager(primary=8, host=16)
    _publish(mgr, 1, 4)
    _junk_primary(mgr, 90, 8)
    side = torch.cuda.Stream()
    _hold(side)
    first = mgr.create_cache(_prompt(1, 4) + [8])
    assert first.resume(side)
    second = mgr.create_cache(_prompt(1, 4) + [9])
    assert second.resume()
    assert _wrong(1, _read(mgr, second, 4)) == []
    first.close()
    second.close()
    mgr.close()


def test_a_resume_with_nothing_to_copy_waits_for_the_stream_that_wrote_the_blocks_it_adopts():
    """Cache A, resumed on a held stream, writes and publishes its blocks there; cache B adopts them
    on the current stream, with nothing to copy: B's kernels read A's bytes, whether A is still
    active or closed."""
    for close_first in (True, False):
        mgr = _manager(primary=8, host=16)
        side = torch.cuda.Stream()
        tokens = _prompt(6, 4)
        first = mgr.create_cache(tokens)
        assert first.resume(side) and first.resize(len(tokens))
        _hold(side)
        _write(mgr, first, 6, 4, side)
        first.commit(tokens)
        if close_first:
            first.close()
        second = mgr.create_cache(tokens + [3])
        assert second.num_reused_tokens == 64
        assert second.resume()
        assert _wrong(6, _read(mgr, second, 4)) == []
        second.close()
        first.close()
        mgr.close()


def test_write_through_waits_for_pages_written_on_the_resume_stream():
    mgr = _manager(primary=8, host=16, write_through=True)
    _junk_primary(mgr, 80, 8)
    side = torch.cuda.Stream()
    tokens = _prompt(5, 4)
    cache = mgr.create_cache(tokens)
    assert cache.resume(side) and cache.resize(len(tokens))
    _hold(side)  # the caller's stream is busy with earlier work
    _write(mgr, cache, 5, 4, side)
    cache.commit(tokens)
    cache.close()
    assert mgr.maintain() >= 4  # copies of the published pages to host memory
    torch.cuda.synchronize()
    _junk_primary(mgr, 81, 8)  # the originals give way to their host copies, moving no byte
    again = mgr.create_cache(tokens + [5])
    assert again.reused_by_tier["host"] == 64
    assert again.resume()
    assert _wrong(5, _read(mgr, again, 4)) == []
    again.close()
    mgr.close()


def test_a_resize_demotes_on_the_caches_stream_before_it_writes_the_slots():
    mgr = _manager(primary=8, host=16)
    _publish(mgr, 7, 8)  # the whole primary tier, evictable
    side = torch.cuda.Stream()
    tokens = _prompt(8, 4)
    cache = mgr.create_cache(tokens)
    assert cache.resume(side)
    _hold()  # the current stream is busy: nothing the cache does runs there
    assert cache.resize(len(tokens))  # four of pid 7's pages go down to host memory
    _write(mgr, cache, 8, 4, side)  # into the slots they vacated
    cache.commit(tokens)
    cache.close()
    torch.cuda.synchronize()
    again = mgr.create_cache(_prompt(7, 8) + [1])
    assert again.reused_by_tier["host"] == 64
    assert again.resume()
    assert _wrong(7, _read(mgr, again, 8)) == []
    again.close()
    mgr.close()


def test_a_prefetch_on_another_stream_waits_for_work_queued_on_the_current_one():
    mgr = _manager(primary=8, host=16)
    for pid in (1, 2, 3):
        _publish(mgr, pid, 4)  # pid 1 went down to host memory
    reader = mgr.create_cache(_prompt(2, 4) + [1])
    assert reader.resume()
    _hold()
    early = _read(mgr, reader, 4)  # the caller's kernels still to read pid 2's pages, queued
    reader.close()
    toucher = mgr.create_cache(_prompt(3, 4) + [1])
    assert toucher.resume()  # pid 3's pages are the most recently used: pid 2's are the victims
    toucher.close()
    side = torch.cuda.Stream()
    assert mgr.prefetch(_prompt(1, 4) + [7], stream=side) == 4  # into the slots pid 2's pages vacate
    assert _wrong(2, early) == []
    mgr.close()


@pytest.mark.parametrize("handle", [False, True])
def test_a_store_load_on_another_stream_keeps_its_staging_bytes_until_read(tmp_path, handle):
    from kvtier.connector import FileSystemConnector

    mgr = _manager(primary=8)
    connector = FileSystemConnector(str(tmp_path))
    connector.register_kv_cache_layout(mgr.layout())
    cache = mgr.create_cache(_prompt(3, 2))
    assert cache.resume() and cache.resize(2 * TPB)
    view = _pages(mgr)
    slots = [int(s) for s in cache.page_indices(0)]
    side = torch.cuda.Stream()
    _hold(side)
    for slot, value in zip(slots, (0x11, 0x22), strict=True):  # two steps' loads through one staging buffer
        connector._copy_in([(0, slot, bytes([value]) * view.shape[1])], side.cuda_stream if handle else side)
    torch.cuda.synchronize()
    assert [bool((view[slot] == value).all()) for slot, value in zip(slots, (0x11, 0x22), strict=True)] == [True, True]
    cache.close()
    connector.close()
    mgr.close()


def test_a_store_save_waits_for_the_forward_that_wrote_its_pages(tmp_path):
    """The engine computes on a stream of its own: a finished request's save, copied out on the
    connector's thread, waits for the work queued there when the request finished."""
    from kvtier.connector import FileSystemConnector
    from kvtier.connector.base import ConnectorRequest

    mgr = _manager(primary=8)
    connector = FileSystemConnector(str(tmp_path))
    connector.register_kv_cache_layout(mgr.layout())
    saved: list = []
    connector.store.put_many = lambda items: saved.extend(items) or [True] * len(items)
    tokens = _prompt(4, 2)
    cache = mgr.create_cache(tokens)
    side = torch.cuda.Stream()
    assert cache.resume(side) and cache.resize(len(tokens))
    slots = cache.page_indices(0).tolist()
    with torch.cuda.stream(side):  # the engine's forward, still queued when the request finishes
        _hold(side)
        _write(mgr, cache, 4, 2, side)
        request = ConnectorRequest(0, tokens, tokens, kvtier.ReuseScope(), len(tokens), [slots])
        assert connector.request_finished(request, [slots])
    while not connector.get_finished([0], [])[0]:
        time.sleep(0.001)
    assert [bool((torch.from_numpy(page) == _value(4, b)).all()) for b, (_, page) in enumerate(saved)] == [True, True]
    cache.close()
    connector.close()
    mgr.close()
