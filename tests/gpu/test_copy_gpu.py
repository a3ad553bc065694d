"""PageCopier on a CUDA device: byte-exact round trips host -> GPU -> host on every path.

Shapes are the reference PRs' (attention, conv-state and SSM-state pages of a hybrid model) plus
small and many-page calls. Source pages hold a different non-zero word at every 8 bytes, so a
page read from the wrong slot, a short copy or an overrun shows. Destination slots that no pair
names keep their poison and are checked too.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvtier.copy import CopyPolicy, PageCopier
from kvtier.copy.policy import SEPARATE_COPY_RUNS
from kvtier.storage.pinned import allocate_host_buffer
from tests.test_tiers import run_python

if not torch.cuda.is_available():  # the module-scoped fixtures below need the device
    pytest.skip("needs a CUDA device", allow_module_level=True)

MiB = 1 << 20
ROUND_TRIP_SHAPES = [
    (1, 884_736),
    (140, 884_736),
    (300, 884_736),
    (300, 16),
    (1, 15_261_696),
    (12, 15_261_696),
    (1, 217_055_232),
    (8, 4 * MiB),
    (64, 4 * MiB),
    (512, 64 * 1024),
]
SPARE_SLOTS = 2
POOL_BYTES = 3 * 217_055_232
POISON = 0xA5
PATHS = ("copy_engine", "kernel", "auto")


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def copiers(device: torch.device) -> dict[str, PageCopier]:
    return {
        "copy_engine": PageCopier(device, policy=CopyPolicy(copy_engine_min_bytes=0)),
        "kernel": PageCopier(device, policy=CopyPolicy(copy_engine_min_bytes=None, coherent_copy_kernel=True)),
        "auto": PageCopier(device),
    }


@pytest.fixture(scope="module")
def pools(device: torch.device):
    """Two pinned host pools and one device pool, each large enough for every shape's slots."""
    host_src = allocate_host_buffer(POOL_BYTES, 4096, device)
    host_dst = allocate_host_buffer(POOL_BYTES, 4096, device)
    dev = torch.empty(POOL_BYTES, dtype=torch.uint8, device=device)
    yield host_src.tensor, dev, host_dst.tensor
    host_src.release()
    host_dst.release()


def fill_words(buffer: torch.Tensor, seed: int) -> None:
    """A distinct non-zero 64-bit word at every 8 bytes (an odd multiply and an xor-shift are
    bijections, so distinct inputs stay distinct and none maps to 0); tail bytes get 0x3C."""
    words = buffer.numel() // 8
    x = torch.arange(seed + 1, seed + 1 + words, dtype=torch.int64, device="cuda")
    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit value
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9
    if buffer.device.type == "cpu":
        x = x.cpu()  # then a CPU memcpy: one cudaMemcpy may not span two registered chunks
    buffer[: words * 8].copy_(x.view(torch.uint8))
    buffer[words * 8 :].fill_(0x3C)


def views(pools, n: int, page: int, offset: int = 0):
    slots = n + SPARE_SLOTS
    return tuple(pool[offset : offset + slots * page] for pool in pools), slots


def check_round_trip(
    copier: PageCopier, pools, n: int, page: int, stream, *, seed: int = 0, offset: int = 0
) -> list[str]:
    """host_src -> dev -> host_dst through permuted slots; the bytes and the untouched slots are checked."""
    (host_src, dev, host_dst), slots = views(pools, n, page, offset)
    fill_words(host_src, seed)
    dev.fill_(POISON)
    host_dst.fill_(POISON)
    torch.cuda.synchronize()
    rng = np.random.default_rng(n * 1_000_003 + page)
    src_slots, dev_slots, dst_slots = (rng.permutation(slots)[:n] for _ in range(3))
    paths = [
        copier.copy(host_src, dev, np.stack([src_slots, dev_slots], axis=1).astype(np.int32), page, stream),
        copier.copy(dev, host_dst, np.stack([dev_slots, dst_slots], axis=1), page, stream),
    ]
    torch.cuda.synchronize()
    src_pages = host_src[: slots * page].view(slots, page)
    dst_pages = host_dst[: slots * page].view(slots, page)
    assert torch.equal(dst_pages[torch.from_numpy(dst_slots)], src_pages[torch.from_numpy(src_slots)])
    untouched = np.setdiff1d(np.arange(slots), dst_slots)
    assert bool((dst_pages[torch.from_numpy(untouched)] == POISON).all()), "a slot that no pair names was written"
    dev_untouched = np.setdiff1d(np.arange(slots), dev_slots)
    assert bool((dev[: slots * page].view(slots, page)[torch.from_numpy(dev_untouched)] == POISON).all())
    return paths


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("n", "page"), ROUND_TRIP_SHAPES, ids=[f"{n}x{p}" for n, p in ROUND_TRIP_SHAPES])
def test_round_trip(copiers, pools, device, path: str, n: int, page: int) -> None:
    copier = copiers[path]
    stream = torch.cuda.Stream(device)
    expected = copier.policy.choose(page, coherent_link=copier.link.coherent)
    assert check_round_trip(copier, pools, n, page, stream) == [expected, expected]
    if path != "auto":
        assert expected == path


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("n", "page", "offset"), [(3, 24, 0), (3, 4 * MiB + 8, 0), (3, 64, 8)])
def test_unaligned_sizes_and_addresses(copiers, pools, device, path: str, n: int, page: int, offset: int) -> None:
    """The copy engines take any size and address; the kernel refuses before any GPU work."""
    copier = copiers[path]
    stream = torch.cuda.Stream(device)
    if copier.policy.choose(page, coherent_link=copier.link.coherent, runs=n) == "copy_engine":
        assert check_round_trip(copier, pools, n, page, stream, offset=offset) == ["copy_engine"] * 2
        return
    (host_src, dev, _), _ = views(pools, n, page, offset)
    fill_words(host_src, 1)
    dev.fill_(POISON)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="16"):
        copier.copy(host_src, dev, [(i, i) for i in range(n)], page, stream)
    torch.cuda.synchronize()
    assert bool((dev == POISON).all()), "a refused call changed the destination"


@pytest.mark.parametrize("handle", [0, 1], ids=["null", "legacy"])
@pytest.mark.parametrize("path", ("copy_engine", "kernel"))
@pytest.mark.parametrize("n", [1, 3])
def test_legacy_null_stream_keeps_order(copiers, pools, handle: int, path: str, n: int) -> None:
    """On the legacy stream, a copy runs after earlier work there and before later work there."""
    copier = copiers[path]
    page = 4 * MiB
    (host_src, dev, host_dst), slots = views(pools, n, page)
    expected = torch.empty(slots * page, dtype=torch.uint8, device="cuda")
    fill_words(expected, 2)
    host_dst.fill_(POISON)
    dev.fill_(POISON)
    torch.cuda.synchronize()
    pairs = [(i, slots - 1 - i) for i in range(n)]
    legacy = torch.cuda.default_stream()
    with torch.cuda.stream(legacy):
        torch.cuda._sleep(100_000_000)  # holds the legacy stream while everything below is queued
        dev.copy_(expected)  # earlier work: the copy must see these bytes
    assert copier.copy(dev, host_dst, pairs, page, handle) == path
    with torch.cuda.stream(legacy):
        fill_words(dev, 3)  # later work: must not overtake the copy
    torch.cuda.synchronize()
    want = expected.cpu().view(slots, page)
    got = host_dst.view(slots, page)
    for s, d in pairs:
        assert torch.equal(got[d], want[s])
    # and host -> device on the legacy stream, read back by later work on it
    fill_words(host_src, 4)
    torch.cuda.synchronize()
    with torch.cuda.stream(legacy):
        torch.cuda._sleep(100_000_000)
    copier.copy(host_src, dev, pairs, page, handle)
    with torch.cuda.stream(legacy):
        snapshot = dev.clone()
    torch.cuda.synchronize()
    src_pages = host_src.view(slots, page)
    for s, d in pairs:
        assert torch.equal(snapshot.view(slots, page)[d].cpu(), src_pages[s])


@pytest.mark.parametrize("path", ("copy_engine", "kernel"))
def test_event_orders_consumer_after_copy(copiers, pools, device, path: str) -> None:
    """Producer stream -> recorded event -> consumer stream sees the pages.

    The producer is held by a stream wait on a flag in pinned memory until everything is queued
    (deterministic, not won by timing); a stream that does not wait on the event reads the
    destination meanwhile and must still see the poison.
    """
    from cuda.bindings import driver

    copier = copiers[path]
    n, page = 8, 4 * MiB
    (host_src, dev, _), slots = views(pools, n, page)
    fill_words(host_src, 5)
    dev.fill_(POISON)
    flag_buffer = allocate_host_buffer(4096, 4096, device)
    flag = flag_buffer.tensor.view(torch.int32)
    flag.zero_()
    torch.cuda.synchronize()
    producer, consumer, bystander = (torch.cuda.Stream(device) for _ in range(3))
    err, flag_address = driver.cuMemHostGetDevicePointer(flag.data_ptr(), 0)
    assert int(err) == 0
    release = threading.Timer(30.0, lambda: flag.fill_(1))  # never leave the stream held
    release.start()
    try:
        (err,) = driver.cuStreamWaitValue32(
            driver.CUstream(producer.cuda_stream),
            flag_address,
            1,
            driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
        )
        if int(err):
            pytest.skip(f"cuStreamWaitValue32 is not available here (CUresult {int(err)})")
        pairs = np.array([(i, slots - 1 - i) for i in range(n)], dtype=np.int64)
        assert copier.copy(host_src, dev, pairs, page, producer) == path
        done = torch.cuda.Event()
        done.record(producer)
        consumer.wait_event(done)
        with torch.cuda.stream(consumer):
            seen = dev.clone()
        with torch.cuda.stream(bystander):
            early = dev.clone()
        bystander.synchronize()
        assert not producer.query(), "the gate did not hold the producer"
    finally:
        flag.fill_(1)
        release.cancel()
    torch.cuda.synchronize()
    assert bool((early == POISON).all()), "the copy ran before the gate opened"
    src_pages = host_src.view(slots, page)
    for s, d in pairs.tolist():
        assert torch.equal(seen.view(slots, page)[d].cpu(), src_pages[s])
    flag_buffer.release()


@pytest.mark.parametrize("path", PATHS)
def test_empty_call_is_a_no_op(copiers, pools, path: str) -> None:
    host_src, dev, _ = pools
    stream = torch.cuda.Stream()
    assert copiers[path].copy(host_src, dev, np.empty((0, 2), dtype=np.int64), 4096, stream) == "none"
    assert copiers[path].copy(host_src, dev, [], 4096) == "none"


@pytest.mark.parametrize("path", ("copy_engine", "kernel"))
def test_chunked_registration_round_trip(copiers, device, path: str) -> None:
    """A host buffer registered in several chunks works on both paths (pages never straddle chunks)."""
    n, page = 24, 884_736
    slots = n + SPARE_SLOTS
    chunk = 5 * page + 12345
    src = allocate_host_buffer(slots * page, page, device, chunk_bytes=chunk)
    dst = allocate_host_buffer(slots * page, page, device, chunk_bytes=chunk)
    assert len(src.chunks) > 1 and all(offset % page == 0 for offset, _ in src.chunks)
    assert src.tensor.is_pinned()
    dev = torch.empty(slots * page, dtype=torch.uint8, device=device)
    pools = (src.tensor, dev, dst.tensor)
    assert check_round_trip(copiers[path], pools, n, page, torch.cuda.Stream(device), seed=6) == [path, path]
    src.release()
    dst.release()


@pytest.mark.parametrize("path", ("copy_engine", "kernel"))
def test_device_to_device(copiers, device, path: str) -> None:
    n, page = 96, 65_536
    a = torch.empty((n + 4) * page, dtype=torch.uint8, device=device)
    b = torch.full_like(a, POISON)
    fill_words(a, 7)
    pairs = np.stack([np.arange(n), np.arange(n)[::-1] + 4], axis=1)
    assert copiers[path].copy(a, b, pairs, page, torch.cuda.current_stream()) == path
    torch.cuda.synchronize()
    for s, d in pairs.tolist():
        assert torch.equal(b[d * page : (d + 1) * page], a[s * page : (s + 1) * page])
    assert bool((b[: 4 * page] == POISON).all())


def test_host_to_host_on_a_gpu_copier_is_a_cpu_copy(copiers) -> None:
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    assert copiers["auto"].copy(src, dst, [(0, 3), (3, 0)], 4096) == "cpu"
    assert torch.equal(dst[3 * 4096 :], src[:4096]) and torch.equal(dst[:4096], src[3 * 4096 :])


def test_pageable_host_memory(copiers, device) -> None:
    """The copy engines take pageable host memory; the kernel refuses it with a clear error."""
    page, n = 65_536, 4
    src = torch.empty((n + 1) * page, dtype=torch.uint8)
    src.copy_(torch.randint(1, 256, src.shape, dtype=torch.uint8))
    dev = torch.zeros_like(src, device=device)
    pairs = [(i, n - i) for i in range(n)]
    assert copiers["copy_engine"].copy(src, dev, pairs, page) == "copy_engine"
    torch.cuda.synchronize()
    for s, d in pairs:
        assert torch.equal(dev[d * page : (d + 1) * page].cpu(), src[s * page : (s + 1) * page])
    with pytest.raises(ValueError, match="pageable"):
        copiers["kernel"].copy(src, dev, pairs, page)


def test_warm_up_builds_the_kernel_path_once_and_copies_stay_exact(pools, device) -> None:
    """``warm_up`` launches once over its own scratch (a second call does nothing), and a copy of
    small scattered pages after it takes the kernel and lands byte for byte."""
    copier = PageCopier(device)
    assert copier.warm_up([4096]) is True
    assert copier.warm_up([4096]) is False
    assert check_round_trip(copier, pools, 140, 4096, torch.cuda.Stream(device), seed=3) == ["kernel", "kernel"]


def _no_c_compiler(*args, **kwargs):
    raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")


def _no_triton(*args, **kwargs):
    raise ModuleNotFoundError("No module named 'triton'")


@pytest.mark.parametrize("broken", ["launcher", "import"])
def test_a_kernel_that_cannot_be_built_sends_every_copy_to_the_copy_engines(
    pools, device, monkeypatch, caplog, broken
) -> None:
    """Where Triton's launcher cannot be compiled (no C compiler) or Triton is not installed,
    ``warm_up`` logs one WARNING naming the cause; then small scattered pages, the kernel's by
    policy, go to the copy engines and land byte for byte."""
    import kvtier.copy.copier as copier_module
    import kvtier.copy.kernel as kernel

    if broken == "launcher":
        monkeypatch.setattr(kernel, "launch_copy_kernel", _no_c_compiler)
    else:
        monkeypatch.setattr(copier_module, "_KernelPath", _no_triton)
    copier = PageCopier(device)
    with caplog.at_level("WARNING", logger="kvtier.copy.copier"):
        assert copier.warm_up([4096]) is False
        assert copier.warm_up([4096]) is False
    assert len(caplog.records) == 1
    cause = "C compiler" if broken == "launcher" else "No module named 'triton'"
    assert "copy engines" in caplog.text and cause in caplog.text
    stream = torch.cuda.Stream(device)
    assert check_round_trip(copier, pools, 140, 4096, stream, seed=4) == ["copy_engine", "copy_engine"]


def test_a_first_kernel_call_where_the_kernel_cannot_be_built_goes_to_the_copy_engines(
    pools, device, monkeypatch, caplog
) -> None:
    """Without a warm-up, the first call the policy gives the kernel builds it; where it cannot be
    built, that call and the later ones go to the copy engines, exact, with one WARNING."""
    import kvtier.copy.copier as copier_module

    monkeypatch.setattr(copier_module, "_KernelPath", _no_triton)
    copier = PageCopier(device)
    stream = torch.cuda.Stream(device)
    with caplog.at_level("WARNING", logger="kvtier.copy.copier"):
        assert check_round_trip(copier, pools, 140, 4096, stream, seed=5) == ["copy_engine", "copy_engine"]
        assert check_round_trip(copier, pools, 3, 4096, stream, seed=6) == ["copy_engine", "copy_engine"]
    assert len(caplog.records) == 1 and "No module named 'triton'" in caplog.text


FIRST_CALL_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # as if it were not installed: importing it raises ImportError
import torch
from kvtier.copy import PageCopier
from kvtier.storage.pinned import allocate_host_buffer
host = allocate_host_buffer(64 * 4096, 4096, "cuda")
host.tensor.copy_(torch.randint(1, 256, (64 * 4096,), dtype=torch.uint8))
dev = torch.zeros(64 * 4096, dtype=torch.uint8, device="cuda")
back = allocate_host_buffer(64 * 4096, 4096, "cuda")
copier = PageCopier("cuda")
pairs = [(i, 63 - i) for i in range(40)]
print(copier.copy(host.tensor, dev, pairs, 4096), copier.copy(dev, back.tensor, [(d, s) for s, d in pairs], 4096))
torch.cuda.synchronize()
print("exact" if torch.equal(back.tensor[: 40 * 4096], host.tensor[: 40 * 4096]) else "wrong")
"""


def test_a_first_kernel_call_without_triton_goes_to_the_copy_engines() -> None:
    """No warm-up, no Triton: the first call the policy gives the kernel is not refused; it lands
    through the copy engines, with one WARNING."""
    done = run_python(FIRST_CALL_WITHOUT_TRITON, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["copy_engine", "copy_engine", "exact"], done.stdout
    assert done.stderr.count("the copy kernel cannot be built") == 1, done.stderr[-3000:]


@pytest.fixture
def without_bindings(monkeypatch):
    """This process as if cuda-bindings were not installed: every driver call object fails to import."""
    import kvtier.copy.copy_engine as copy_engine
    import kvtier.copy.driver_api as driver_api

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'cuda'")

    monkeypatch.setattr(copy_engine, "DriverApi", missing)
    monkeypatch.setattr(driver_api, "DriverApi", missing)


@pytest.mark.parametrize(("page", "scattered"), [(4096, "kernel"), (64 * 1024, "kernel"), (2 * MiB, "copy_engine")])
def test_without_cuda_bindings_scattered_small_pages_take_the_kernel_and_runs_go_as_torch_copies(
    pools, device, without_bindings, caplog, page, scattered
):
    """cuda-bindings not installed: a copy-engine call of scattered pages below
    ``TORCH_COPY_MIN_RUN_BYTES`` goes to the kernel (Triton's own launches, the ring's events
    torch's); scattered larger pages, a call at an unaligned offset and a call of one run go as
    torch copies. Both directions land byte for byte, with one WARNING."""
    copier = PageCopier(device, policy=CopyPolicy(copy_engine_min_bytes=0))
    stream = torch.cuda.Stream(device)
    with caplog.at_level("WARNING", logger="kvtier.copy.copier"):
        assert check_round_trip(copier, pools, 24, page, stream, seed=7) == [scattered, scattered]
        assert check_round_trip(copier, pools, 24, page, stream, seed=8, offset=8) == ["copy_engine", "copy_engine"]
        (host_src, dev, host_dst), _ = views(pools, 24, page)
        fill_words(host_src, 9)
        torch.cuda.synchronize()
        assert copier.copy(host_src, dev, [(i, i + 1) for i in range(8)], page, stream) == "copy_engine"
        assert copier.copy(dev, host_dst, [(i + 1, i + 2) for i in range(8)], page, stream) == "copy_engine"
        torch.cuda.synchronize()
        assert torch.equal(host_dst[2 * page : 10 * page], host_src[: 8 * page])
    assert len(caplog.records) == 1 and "needs cuda-bindings" in caplog.text
    assert copier._batch is None
    assert (copier._kernel is not None and copier._kernel._fast is None) == (scattered == "kernel")


def test_without_cuda_bindings_a_triton_that_cannot_reach_host_memory_leaves_the_copies_to_torch(
    pools, device, without_bindings, monkeypatch, caplog
):
    """Without cuda-bindings Triton finds every buffer's device address itself; the kernel is built
    with a launch from pinned host memory, so a Triton that refuses it (its launcher's error) leaves
    the kernel unbuilt, with a WARNING, and scattered small pages land through torch copies."""
    import kvtier.copy.kernel as kernel

    real = kernel.launch_copy_kernel

    def refuse_host_memory(src, dst, *args, **kwargs):
        if src.device.type == "cpu" or dst.device.type == "cpu":
            raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(kernel, "launch_copy_kernel", refuse_host_memory)
    copier = PageCopier(device)
    with caplog.at_level("WARNING", logger="kvtier.copy.copier"):
        assert copier.warm_up([4096]) is False
        assert "cpu tensor" in copier.kernel_unavailable
        stream = torch.cuda.Stream(device)
        assert check_round_trip(copier, pools, 24, 4096, stream, seed=12) == ["copy_engine", "copy_engine"]
    assert "the copy kernel cannot be built" in caplog.text and "needs cuda-bindings" in caplog.text


def test_without_cuda_bindings_queued_kernel_launches_never_read_a_table_written_again(pools, device, without_bindings):
    """Three times as many launches as the ring has tables, queued behind a sleeping stream: each
    table is written again only after the launch that read it ran (torch's events), so every call
    copies its own pairs."""
    from kvtier.copy.table_ring import SLOTS

    copier = PageCopier(device)
    page, calls, per_call = 4096, 3 * SLOTS, 16
    host_src, dev, host_dst = (pool[: calls * per_call * page] for pool in pools)
    fill_words(host_src, 11)
    dev.fill_(POISON)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream(device)
    rng = np.random.default_rng(5)
    order = rng.permutation(calls * per_call)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # holds the stream while every launch below is queued
    for call in range(calls):
        dst_slots = order[call * per_call : (call + 1) * per_call]
        pairs = np.stack([dst_slots[::-1], dst_slots], axis=1)
        assert copier.copy(host_src, dev, pairs, page, stream) == "kernel"
    assert copier.copy(dev, host_dst, np.stack([order, order], axis=1), page, stream) == "kernel"
    torch.cuda.synchronize()
    src_pages = host_src.view(-1, page)
    dst_pages = host_dst.view(-1, page)
    for call in range(calls):
        dst_slots = order[call * per_call : (call + 1) * per_call]
        want = src_pages[torch.from_numpy(dst_slots[::-1].copy())]
        assert torch.equal(dst_pages[torch.from_numpy(dst_slots)], want), f"call {call} copied other pairs"


def test_a_buffer_registered_in_chunks_without_cuda_bindings_is_refused_and_released(device, monkeypatch):
    """Registering in chunks needs the driver to confirm each chunk maps at its host address;
    without cuda-bindings the allocation is refused with what to do, and no chunk stays registered."""
    import sys

    from kvtier.storage import pinned

    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    released = []
    real_release = pinned.HostBuffer.release

    def release(buffer):
        released.append(len(buffer.chunks))
        real_release(buffer)

    monkeypatch.setattr(pinned.HostBuffer, "release", release)
    with pytest.raises(RuntimeError, match="kvtier\\[gpu\\]"):
        allocate_host_buffer(8 * 4096, 4096, device, chunk_bytes=2 * 4096)
    assert released and released[0] == 4


def test_warm_up_builds_nothing_for_pages_that_go_to_the_copy_engines(device) -> None:
    """Pages the policy gives to the copy engines (2 MiB by default; every size with a threshold
    of 0) never take the kernel: no launch, and its path stays unbuilt."""
    for copier, sizes in (
        (PageCopier(device), [2 * MiB, 64 * 1024]),
        (PageCopier(device, policy=CopyPolicy(copy_engine_min_bytes=0)), [16, 4096]),
    ):
        assert copier.warm_up(sizes) is False
        assert copier._kernel is None


def test_many_pages_in_one_call(copiers, pools) -> None:
    """70,000 pages in one call (one driver call, one launch) land byte for byte."""
    n, page = 70_000, 16
    assert check_round_trip(copiers["copy_engine"], pools, n, page, torch.cuda.Stream(), seed=8) == ["copy_engine"] * 2
    assert check_round_trip(copiers["kernel"], pools, n, page, torch.cuda.Stream(), seed=9) == ["kernel"] * 2


def test_bad_arguments_change_nothing(copiers, pools) -> None:
    host_src, dev, _ = pools
    view = dev[: 8 * 4096]
    view.fill_(POISON)
    for path in PATHS:
        with pytest.raises(ValueError):
            copiers[path].copy(host_src, view, [(0, 8)], 4096)
        with pytest.raises(ValueError):
            copiers[path].copy(host_src, view, [(0, 1), (2, 1)], 4096)
        with pytest.raises(ValueError):
            copiers[path].copy(host_src, view, [(0, 1)], -4096)
    torch.cuda.synchronize()
    assert bool((view == POISON).all())


@pytest.mark.parametrize("n", [1, 4, 12])
def test_small_calls_go_as_separate_copies(copiers, pools, device, monkeypatch, n: int) -> None:
    """Up to SEPARATE_COPY_RUNS runs: one cuMemcpyAsync each, no batched call; more: one batched call."""
    from kvtier.copy import copy_engine

    batched = []
    submit = copy_engine.BatchCopier._submit

    def counted(self, *args):
        batched.append(args[1])
        submit(self, *args)

    monkeypatch.setattr(copy_engine.BatchCopier, "_submit", counted)
    stream = torch.cuda.Stream(device)
    assert check_round_trip(copiers["copy_engine"], pools, n, 4 * MiB, stream) == ["copy_engine"] * 2
    if n <= copy_engine.SEPARATE_COPY_RUNS:
        assert batched == []
    else:  # (permuted slots: a few may still merge into runs)
        assert len(batched) == 2 and min(batched) > copy_engine.SEPARATE_COPY_RUNS


@pytest.mark.parametrize("n", [1, 4, 12])
def test_auto_sends_a_call_of_a_few_runs_to_the_copy_engines_whatever_its_page_size(copiers, pools, device, n: int):
    """Pages below the copy-engine threshold go to the kernel, unless the call has a few runs only."""
    from kvtier.copy.policy import SEPARATE_COPY_RUNS

    paths = check_round_trip(copiers["auto"], pools, n, 4096, torch.cuda.Stream(device), seed=11)
    assert paths == ["copy_engine" if n <= SEPARATE_COPY_RUNS else "kernel"] * 2  # (12 of 14 slots, permuted)


def test_a_policy_that_always_takes_the_kernel_builds_no_runs(copiers, pools, device, monkeypatch) -> None:
    """Runs only choose between the kernel and a few separate copies: where even a call of one run
    goes to the kernel, a call of consecutive slots is sent there without counting its runs."""
    from kvtier.copy import copier as copier_module

    built = []
    build_runs = copier_module.build_runs
    monkeypatch.setattr(copier_module, "build_runs", lambda *args: built.append(args) or build_runs(*args))
    (host_src, dev, _), _ = views(pools, 12, 4096)
    fill_words(host_src, 12)
    consecutive = np.stack([np.arange(12), np.arange(12) + 2], axis=1)
    assert copiers["kernel"].copy(host_src, dev, consecutive, 4096, torch.cuda.current_stream(device)) == "kernel"
    torch.cuda.synchronize()
    assert not built
    assert torch.equal(dev[2 * 4096 : 14 * 4096].cpu(), host_src[: 12 * 4096])
    assert copiers["auto"].copy(host_src, dev, consecutive, 4096, torch.cuda.current_stream(device)) == "copy_engine"
    assert built  # where one run would go to the copy engines, the runs are counted


def test_kernel_follows_host_buffers_released_and_allocated_again(copiers, device) -> None:
    """Each new host buffer (a new registration, perhaps at a released one's address) and a view into
    one are reached at their own device address: the launches' cached addresses follow them."""
    n, page = 12, 16_384
    dev = torch.full(((n + 4) * page,), POISON, dtype=torch.uint8, device=device)
    pairs = np.stack([np.arange(n), np.arange(n) + 4], axis=1)
    for seed in range(4):
        host = allocate_host_buffer((n + 8) * page, page, device)
        fill_words(host.tensor, seed + 30)
        source = host.tensor[4 * page :] if seed % 2 else host.tensor  # a view that starts 4 pages in
        assert copiers["kernel"].copy(source, dev, pairs, page, torch.cuda.current_stream()) == "kernel"
        torch.cuda.synchronize()
        assert torch.equal(dev[4 * page :].cpu(), source[: n * page])
        host.release()


@pytest.mark.parametrize("n", [1, 12, 300])
def test_a_driver_older_than_cuda_12_8_copies_every_call_as_separate_copies(pools, device, monkeypatch, n: int):
    """Without ``cuMemcpyBatchAsync`` the copy-engine path still copies, one ``cuMemcpyAsync`` per run."""
    from kvtier.copy import copy_engine

    monkeypatch.setattr(copy_engine, "DriverApi", driver_of_cuda(12040))
    batched = []
    monkeypatch.setattr(copy_engine.BatchCopier, "_submit", lambda self, *args: batched.append(args))
    copier = PageCopier(device, policy=CopyPolicy(copy_engine_min_bytes=0))
    for stream in (torch.cuda.Stream(device), 0):
        assert check_round_trip(copier, pools, n, 64 * 1024, stream, seed=n) == ["copy_engine"] * 2
    assert copier._batch is not None and copier._batch.abi is None
    assert batched == []
    src = torch.randint(1, 256, (5 * 4096,), dtype=torch.uint8)  # pageable host memory
    dev = torch.zeros_like(src, device=device)
    assert copier.copy(src, dev, [(i, 4 - i) for i in range(5)], 4096) == "copy_engine"
    torch.cuda.synchronize()
    for i in range(5):
        assert torch.equal(dev[(4 - i) * 4096 : (5 - i) * 4096].cpu(), src[i * 4096 : (i + 1) * 4096])


@pytest.mark.parametrize("n", [1, 12, 300])
def test_a_driver_of_cuda_12_8_copies_through_its_batched_call(pools, device, monkeypatch, n: int):
    """A CUDA 12.8 or 12.9 driver (driver 570-579) offers ``cuMemcpyBatchAsync`` with a ``failIdx``
    out-parameter before the stream. A newer driver gives that entry point too when asked for CUDA
    12.8 (``cuGetProcAddress``), so this driver's whole copy-engine path runs here, byte for byte."""
    from kvtier.copy import copy_engine

    monkeypatch.setattr(copy_engine, "DriverApi", driver_of_cuda(12080))
    submitted = []
    submit = copy_engine.BatchCopier._submit
    monkeypatch.setattr(
        copy_engine.BatchCopier, "_submit", lambda self, *args: submitted.append(1) or submit(self, *args)
    )
    copier = PageCopier(device, policy=CopyPolicy(copy_engine_min_bytes=0))
    for stream in (torch.cuda.Stream(device), 0):
        assert check_round_trip(copier, pools, n, 64 * 1024, stream, seed=n + 7) == ["copy_engine"] * 2
    abi = copier._batch.abi
    assert abi is not None and abi.cuda_version == 12080 and abi.has_fail_index
    if n > 2 * SEPARATE_COPY_RUNS:  # a call of a few runs goes as separate copies, more through the batch
        assert submitted
    src = torch.randint(1, 256, (5 * 4096,), dtype=torch.uint8)  # pageable host memory: always batched
    dev = torch.zeros_like(src, device=device)
    before = len(submitted)
    assert copier.copy(src, dev, [(i, 4 - i) for i in range(5)], 4096) == "copy_engine"
    torch.cuda.synchronize()
    assert len(submitted) > before
    for i in range(5):
        assert torch.equal(dev[(4 - i) * 4096 : (5 - i) * 4096].cpu(), src[i * 4096 : (i + 1) * 4096])


def driver_of_cuda(version: int) -> type:
    """``DriverApi`` whose driver reports CUDA ``version`` (e.g. 12080): the copier then picks the
    entry points such a driver has, which this newer driver still hands out when asked for them."""
    from kvtier.copy.driver_api import DriverApi

    class Reported(DriverApi):
        def __init__(self, device_index: int) -> None:
            super().__init__(device_index)
            self.driver_version = version

    return Reported
