"""Scattered pages on a CUDA machine without cuda-bindings: the copy kernel against torch copies.

``pip install kvtier`` without the ``gpu`` extra has Triton (torch brings it) but no cuda-bindings:
no batched copy-engine call. Three copiers move the same calls of scattered pages, both ways:

- ``auto``: cuda-bindings installed, the default policy (the reference);
- ``torch``: no cuda-bindings, the kernel kept out: one torch copy per page;
- ``no-bindings``: no cuda-bindings, as the copier is: calls of more than ``SEPARATE_COPY_RUNS``
  runs shorter than ``TORCH_COPY_MIN_RUN_BYTES`` on average go to the kernel (Triton's own launch
  every call), the others as torch copies.

For each: the host time of one call (median, the stream held busy so nothing waits), the GPU time
of a call (CUDA events, each call gated so its submission is hidden) idle and under
``kvtier bench copy``'s matmul load, and the rate a caller gets, the bytes over the longer of the
two. Needs a CUDA device; run from the source tree:
``PYTHONPATH=. python scripts/copy_without_bindings.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

import kvtier.copy.copy_engine as copy_engine
import kvtier.copy.driver_api as driver_api
from kvtier.cli import bench_copy
from kvtier.copy import PageCopier

KiB, MiB = 1 << 10, 1 << 20
SHAPES = ((4 * KiB, 512), (64 * KiB, 512), (256 * KiB, 128), (2 * MiB, 64))  # (page bytes, pages a call)
ITERS = 15
GATE_CYCLES_PER_PAGE = 20_000  # about 10 us a page: hides a torch copy's submission too


@contextmanager
def _no_bindings():
    """Driver calls fail to import while the block runs, as without cuda-bindings."""

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'cuda'")

    saved = copy_engine.DriverApi, driver_api.DriverApi
    copy_engine.DriverApi = driver_api.DriverApi = missing
    try:
        yield
    finally:
        copy_engine.DriverApi, driver_api.DriverApi = saved


def main() -> None:
    bench = bench_copy._CopyBench(ITERS, warmup=3)
    device = bench.device
    torch_only = PageCopier(device)
    torch_only._kernel_unavailable = "kept out for this comparison"
    copiers = {"auto": bench.copiers["auto"], "torch": torch_only, "no-bindings": PageCopier(device)}
    with _no_bindings():  # both no-bindings copiers build what they use inside
        for name in ("torch", "no-bindings"):
            for page, pages in SHAPES:
                _calls(bench, copiers[name], "h2d", page, pages)[0]()
        torch.cuda.synchronize()
    print("dir  page KiB  pages  copier       path         submit us  idle GB/s  load GB/s  idle got  load got")
    for direction in ("h2d", "d2h"):
        for page, pages in SHAPES:
            for name, copier in copiers.items():
                print(_row(bench, name, copier, direction, page, pages))


def _row(bench: bench_copy._CopyBench, name: str, copier: PageCopier, direction: str, page: int, pages: int) -> str:
    """One printed row: the call's path, host submit time, and rates idle and under load."""
    call, path = _calls(bench, copier, direction, page, pages)
    submit_ms = _submit_ms(bench, call, pages)
    gate = bench_copy.GATE_CYCLES + GATE_CYCLES_PER_PAGE * pages
    idle = statistics.median(bench.time_gated(lambda _: call(), gate))
    loaded, _ = bench.under_load(lambda: bench.time_gated(lambda _: call(), gate), expected_ms=400.0)
    load = statistics.median(loaded)
    size = pages * page / 1e6  # MB: GB/s = MB / ms
    return (
        f"{direction}  {page // KiB:8d}  {pages:5d}  {name:<11}  {path:<11}  {submit_ms * 1e3:9.0f}  "
        f"{size / idle:9.1f}  {size / load:9.1f}  {size / max(idle, submit_ms):8.1f}  "
        f"{size / max(load, submit_ms):8.1f}"
    )


def _calls(bench: bench_copy._CopyBench, copier: PageCopier, direction: str, page: int, pages: int):
    """One call of ``pages`` scattered pages as a thunk, and the path its first run took."""
    src, dst, src_slots, dst_slots = bench._buffers(direction, page)
    (pairs,) = bench._pair_sets(pages, src_slots, dst_slots, 1)
    path = copier.copy(src, dst, pairs, page, bench.stream)
    return (lambda: copier.copy(src, dst, pairs, page, bench.stream)), path


def _submit_ms(bench: bench_copy._CopyBench, call: Callable[[], object], pages: int) -> float:
    """Median host milliseconds of one call, each queued behind a sleep so that nothing waits."""
    times = []
    with torch.cuda.stream(bench.stream):
        for _ in range(ITERS):
            torch.cuda._sleep(bench_copy.GATE_CYCLES + GATE_CYCLES_PER_PAGE * pages)
            began = time.perf_counter()
            call()
            times.append((time.perf_counter() - began) * 1e3)
    bench.stream.synchronize()
    return statistics.median(times)


if __name__ == "__main__":
    main()
