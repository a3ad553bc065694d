"""``kvtier bench copy``: host<->GPU page copies on each path, idle and under load (target 1 of docs/benchmarks.md).

Measures, in one process:

- every reference shape (docs/copy.md), host->device and device->host, on the copy engines, the kernel and the
  automatic choice, idle and with bf16 matmuls running on another stream;
- a page-size sweep at a fixed call size (the crossover that sets KVTIER_COPY_ENGINE_MIN_BYTES);
- both directions at once (64 x 4 MiB each way on two streams);
- the host cost of submitting a call, per path and page count, with scattered slots and with
  consecutive ones (one run: one copy on either path).

GPU times come from CUDA events around each call, after warm-up; a sleep kernel ahead of each
call, longer than its host submit time, keeps that time out of them (it is measured apart).
Each iteration copies between other slots of 1 GiB buffers (larger than the 60 MB L2). Figures
are medians; the JSON has every sample.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

from kvtier.cli.arguments import at_least

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10
PERF_SHAPES = ((1, 217_055_232), (12, 15_261_696), (140, 884_736), (64, 4 * MiB), (512, 64 * KiB))
SWEEP_PAGES = (16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB)
SWEEP_CALL_BYTES = 64 * MiB
# (pages, page bytes) of the host submit-cost measurement; 4 KiB pages are the kernel's to carry
SUBMIT_SHAPES = ((1, 64 * KiB), (140, 64 * KiB), (140, 884_736), (512, 64 * KiB), (4096, 64 * KiB), (4096, 4 * KiB))
SUBMIT_SLOTS = ("scattered", "consecutive")  # random slots; one run of consecutive slots on both sides
BUFFER_BYTES = 1 * GiB
GATE_CYCLES = 400_000  # about 0.2 ms at 2 GHz: covers a launch or a batch submit of a few pages
GATE_CYCLES_PER_PAGE = 2_000  # about 1 us per page: covers the driver's ~0.5 us per page
PATHS = ("copy_engine", "kernel", "auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=at_least(1), default=20, help="timed calls per measurement (median of these)")
    parser.add_argument("--warmup", type=at_least(0), default=3, help="untimed calls before each measurement")
    parser.add_argument("--no-load", action="store_true", help="skip the measurements under a compute load")


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise ValueError("it measures host<->GPU copies and needs a CUDA device; none is available here")
    if args.iters < 10:
        raise ValueError("--iters must be at least 10 (figures are medians of at least 10 calls)")
    bench = _CopyBench(args.iters, args.warmup)
    report = bench.run_all(with_load=not args.no_load)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    _print_tables(report)
    return 0


class _CopyBench:
    def __init__(self, iters: int, warmup: int) -> None:
        import numpy as np
        import torch

        from kvtier.copy import CopyPolicy, PageCopier
        from kvtier.storage.pinned import allocate_host_buffer

        self.torch, self.np = torch, np
        self.iters, self.warmup = iters, warmup
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.copiers = {
            "copy_engine": PageCopier(self.device, policy=CopyPolicy(copy_engine_min_bytes=0)),
            "kernel": PageCopier(self.device, policy=CopyPolicy(copy_engine_min_bytes=None, coherent_copy_kernel=True)),
            "auto": PageCopier(self.device),
        }
        self.host = allocate_host_buffer(BUFFER_BYTES, 4 * KiB, self.device)
        self.dev = torch.randint(0, 256, (BUFFER_BYTES,), dtype=torch.uint8, device=self.device)
        self.host.tensor.copy_(torch.randint(0, 256, (BUFFER_BYTES,), dtype=torch.uint8, device=self.device))
        self.stream = torch.cuda.Stream(self.device)
        self.other = torch.cuda.Stream(self.device)
        self.load_stream = torch.cuda.Stream(self.device)
        self.rng = np.random.default_rng(0)
        self.mm = [torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16) for _ in range(3)]
        self.mm_ms = self._matmul_ms()
        torch.cuda.synchronize()

    # --- one measurement -------------------------------------------------------------------
    def _pair_sets(self, n: int, src_slots: int, dst_slots: int, count: int) -> list[Any]:
        """``count`` sets of ``n`` pairs of distinct random slots, as C-contiguous int64 arrays (what
        the tiers pass)."""
        np = self.np
        return [
            np.stack([self.rng.permutation(src_slots)[:n], self.rng.permutation(dst_slots)[:n]], axis=1).astype(
                np.int64
            )
            for _ in range(count)
        ]

    def _buffers(self, direction: str, page: int) -> tuple[Any, Any, int, int]:
        host, dev = self.host.tensor, self.dev
        if direction == "h2d":
            return host, dev, host.numel() // page, dev.numel() // page
        return dev, host, dev.numel() // page, host.numel() // page

    def time_calls(self, path: str, direction: str, n: int, page: int, gate_cycles: int | None = None) -> list[float]:
        """Milliseconds of each timed call (CUDA events), after the warm-up calls. Each is gated by
        an idle kernel of ``gate_cycles`` (default: ``GATE_CYCLES`` + ``GATE_CYCLES_PER_PAGE`` a page)."""
        gate = GATE_CYCLES + GATE_CYCLES_PER_PAGE * n if gate_cycles is None else gate_cycles
        src, dst, src_slots, dst_slots = self._buffers(direction, page)
        sets = self._pair_sets(n, src_slots, dst_slots, 4)
        copier, stream = self.copiers[path], self.stream
        for i in range(self.warmup):
            copier.copy(src, dst, sets[i % len(sets)], page, stream)
        stream.synchronize()
        return self.time_gated(lambda i: copier.copy(src, dst, sets[i % len(sets)], page, stream), gate)

    def time_gated(self, submit: Callable[[int], None], gate: int) -> list[float]:
        """Milliseconds (CUDA events) of each of ``self.iters`` calls ``submit(i)`` that queue work on
        ``self.stream``, each call between its own pair of events, after an idle kernel of ``gate``
        cycles so that the call's submission is hidden from its timing."""
        torch, stream = self.torch, self.stream
        events = []
        with torch.cuda.stream(stream):
            for i in range(self.iters):
                torch.cuda._sleep(gate)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                submit(i)
                end.record(stream)
                events.append((start, end))
        stream.synchronize()
        return [start.elapsed_time(end) for start, end in events]

    def under_load(self, measure: Any, expected_ms: float) -> tuple[Any, bool]:
        """Run ``measure()`` while matmuls run on another stream; also whether they outlasted it."""
        torch = self.torch
        count = math.ceil(1.5 * expected_ms / self.mm_ms) + 3
        a, b, c = self.mm
        with torch.cuda.stream(self.load_stream):
            for _ in range(count):
                torch.mm(a, b, out=c)
        result = measure()
        covered = not self.load_stream.query()
        self.load_stream.synchronize()
        return result, covered

    def _matmul_ms(self) -> float:
        torch = self.torch
        a, b, c = self.mm
        with torch.cuda.stream(self.load_stream):
            torch.mm(a, b, out=c)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                torch.mm(a, b, out=c)
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 5

    # --- sections --------------------------------------------------------------------------
    def bandwidth_rows(self, section: str, shapes: Any, paths: Any, with_load: bool) -> list[dict[str, Any]]:
        rows = []
        for n, page in shapes:
            for direction in ("h2d", "d2h"):
                for path in paths:
                    times = self.time_calls(path, direction, n, page)
                    rows.append(_row(section, n, page, direction, path, "idle", times))
                    if with_load:
                        gate_ms = (GATE_CYCLES + GATE_CYCLES_PER_PAGE * n) / 1e6  # at 1 GHz or faster
                        expected = (self.warmup + self.iters) * (2 * statistics.median(times) + gate_ms)
                        loaded, covered = self.under_load(
                            lambda p=path, d=direction, k=n, b=page: self.time_calls(p, d, k, b), expected
                        )
                        rows.append(_row(section, n, page, direction, path, "load", loaded, load_covered=covered))
        return rows

    def both_directions(self) -> list[dict[str, Any]]:
        """64 x 4 MiB host->device on one stream while 64 x 4 MiB go device->host on another."""
        torch, np = self.torch, self.np
        n, page = 64, 4 * MiB
        host, dev = self.host.tensor, self.dev
        half_host, half_dev = host.numel() // page // 2, dev.numel() // page // 2
        # host->device reads the lower half of the host slots and writes the lower half of the device
        # slots; device->host reads the upper device half and writes the upper host half.
        h2d = self._pair_sets(n, half_host, half_dev, 1)[0]
        d2h = self._pair_sets(n, half_dev, half_host, 1)[0] + np.array([half_dev, half_host], dtype=np.int32)
        rows = []
        for path in PATHS:
            copier = self.copiers[path]
            times = []
            for i in range(self.warmup + self.iters):
                with torch.cuda.stream(self.stream):
                    torch.cuda._sleep(GATE_CYCLES + GATE_CYCLES_PER_PAGE * 2 * n)
                start = torch.cuda.Event(enable_timing=True)
                ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                start.record(self.stream)
                self.other.wait_event(start)
                copier.copy(host, dev, h2d, page, self.stream)
                copier.copy(dev, host, d2h, page, self.other)
                ends[0].record(self.stream)
                ends[1].record(self.other)
                torch.cuda.synchronize()
                if i >= self.warmup:
                    times.append(max(start.elapsed_time(end) for end in ends))
            row = _row("both_directions", 2 * n, page, "both", path, "idle", times)
            rows.append(row)
        return rows

    def submit_costs(self) -> list[dict[str, Any]]:
        torch = self.torch
        rows = []
        for path in ("copy_engine", "kernel"):
            for stream_name, stream in (("stream", self.stream), ("legacy", 0)):
                for (n, page), slots in itertools.product(SUBMIT_SHAPES, SUBMIT_SLOTS):
                    pairs = self._submit_pairs(n, page, slots)
                    copier = self.copiers[path]
                    samples = []
                    for _ in range(40):
                        torch.cuda.synchronize()  # an empty queue: the call's own cost, no backpressure
                        begin = time.perf_counter()
                        copier.copy(self.host.tensor, self.dev, pairs, page, stream)
                        samples.append((time.perf_counter() - begin) * 1e6)
                    torch.cuda.synchronize()
                    us = statistics.median(samples[5:])
                    rows.append(
                        {
                            "section": "submit",
                            "path": path,
                            "stream": stream_name,
                            "slots": slots,
                            "pages": n,
                            "page_bytes": page,
                            "host_us": round(us, 1),
                            "target_us": round(20 + 0.1 * n, 1),
                        }
                    )
        return rows

    def _submit_pairs(self, n: int, page: int, slots: str) -> Any:
        """Pairs host -> device: random distinct slots, or one run of consecutive slots on both sides."""
        if slots == "scattered":
            return self._pair_sets(n, self.host.tensor.numel() // page, self.dev.numel() // page, 1)[0]
        first = self.np.arange(n, dtype=self.np.int64)
        return self.np.stack([first + 3, first + 5], axis=1)

    def run_all(self, with_load: bool) -> dict[str, Any]:
        report: dict[str, Any] = {"env": self.environment()}
        rows = self.bandwidth_rows("perf_shapes", PERF_SHAPES, PATHS, with_load)
        sweep = [(max(1, SWEEP_CALL_BYTES // page), page) for page in SWEEP_PAGES]
        rows += self.bandwidth_rows("sweep", sweep, ("copy_engine", "kernel"), with_load)
        rows += self.both_directions()
        rows += self.submit_costs()
        report["rows"] = rows
        report["summary"] = _summary(rows, report["env"]["copy_engine_min_bytes"])
        return report

    def environment(self) -> dict[str, Any]:
        import triton
        from cuda import bindings

        torch = self.torch
        props = torch.cuda.get_device_properties(self.device)
        auto = self.copiers["auto"]
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
        except OSError:
            commit = ""
        commit = commit or "unknown (not a git checkout)"
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": props.name,
            "sms": props.multi_processor_count,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda_bindings": bindings.__version__,
            "link": {"kind": auto.link.kind, "detail": auto.link.detail, "coherent": auto.link.coherent},
            "copy_engine_min_bytes": auto.policy.copy_engine_min_bytes,
            "matmul_ms": round(self.mm_ms, 3),
            "commit": commit,
            "iters": self.iters,
        }


def _row(
    section: str, n: int, page: int, direction: str, path: str, load: str, times: list[float], **extra: Any
) -> dict[str, Any]:
    median = statistics.median(times)
    return {
        "section": section,
        "pages": n,
        "page_bytes": page,
        "direction": direction,
        "path": path,
        "load": load,
        "ms": round(median, 4),
        "gbps": round(n * page / median / 1e6, 2),
        "samples_ms": [round(t, 4) for t in times],
        **extra,
    }


def _summary(rows: list[dict[str, Any]], threshold: int | None) -> dict[str, Any]:
    """The target-1 checks on this run's rows."""
    shape_rows = [r for r in rows if r["section"] == "perf_shapes"]
    ceiling = {
        d: max(r["gbps"] for r in rows if r.get("direction") == d and r["load"] == "idle") for d in ("h2d", "d2h")
    }
    auto_vs_best = []
    for r in shape_rows:
        if r["path"] != "auto":
            continue
        peers = [
            p for p in shape_rows if (p["pages"], p["direction"], p["load"]) == (r["pages"], r["direction"], r["load"])
        ]
        best = max(peers, key=lambda p: p["gbps"])
        entry = {
            "shape": f"{r['pages']} x {r['page_bytes']}",
            "direction": r["direction"],
            "load": r["load"],
            "auto_gbps": r["gbps"],
            "best_path": best["path"],
            "best_gbps": best["gbps"],
            "ratio": round(r["gbps"] / best["gbps"], 3),
            "of_link": round(r["gbps"] / ceiling[r["direction"]], 3),
        }
        entry["link_target"] = 0.9 if r["page_bytes"] >= 256 * KiB else 0.8
        auto_vs_best.append(entry)
    both = [r for r in rows if r["section"] == "both_directions"]
    submit = [r for r in rows if r["section"] == "submit"]
    return {
        "copy_engine_min_bytes": threshold,
        "link_ceiling_gbps": ceiling,
        "auto_vs_best": auto_vs_best,
        "auto_within_95pct": all(e["ratio"] >= 0.95 for e in auto_vs_best),
        "link_targets_met_idle": all(e["of_link"] >= e["link_target"] for e in auto_vs_best if e["load"] == "idle"),
        "both_directions_gbps": {r["path"]: r["gbps"] for r in both},
        "submit_met": {
            f"{r['path']}/{r['stream']}/{r['slots']}/{r['pages']}x{r['page_bytes']}": r["host_us"] <= r["target_us"]
            for r in submit
        },
    }


def _print_tables(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    rows = report["rows"]
    summary = report["summary"]
    sweep = Table(title="page-size sweep, 64 MiB per call (GB/s): copy engines / kernel")
    for column in ("page", "h2d idle", "h2d load", "d2h idle", "d2h load"):
        sweep.add_column(column, justify="right")
    for page in SWEEP_PAGES:
        cells = []
        for direction in ("h2d", "d2h"):
            for load in ("idle", "load"):
                got = {
                    r["path"]: r["gbps"]
                    for r in rows
                    if r["section"] == "sweep"
                    and (r["page_bytes"], r["direction"], r["load"]) == (page, direction, load)
                }
                cells.append(f"{got.get('copy_engine', '-')} / {got.get('kernel', '-')}" if got else "-")
        sweep.add_row(f"{page:,}", *cells)
    console.print(sweep)
    submit = Table(title="host submit cost (us) on an idle queue, target 20 + 0.1 per page in brackets")
    for column in ("path", "stream", "slots", *(f"{n} x {page:,}" for n, page in SUBMIT_SHAPES)):
        submit.add_column(column, justify="right")
    for path, stream, slots in itertools.product(("copy_engine", "kernel"), ("stream", "legacy"), SUBMIT_SLOTS):
        got = {
            (r["pages"], r["page_bytes"]): r
            for r in rows
            if r["section"] == "submit" and (r["path"], r["stream"], r["slots"]) == (path, stream, slots)
        }
        submit.add_row(
            path, stream, slots, *(f"{got[shape]['host_us']} ({got[shape]['target_us']})" for shape in SUBMIT_SHAPES)
        )
    console.print(submit)
    shapes = Table(title=f"reference shapes (GB/s); auto: copy engines from {summary['copy_engine_min_bytes']} B")
    for column in ("shape", "dir", "load", "copy_engine", "kernel", "auto", "auto/best", "auto/link"):
        shapes.add_column(column, justify="right")
    for entry in summary["auto_vs_best"]:
        n, page = (int(x) for x in entry["shape"].split(" x "))
        got = {
            r["path"]: r["gbps"]
            for r in rows
            if r["section"] == "perf_shapes"
            and (r["pages"], r["page_bytes"], r["direction"], r["load"]) == (n, page, entry["direction"], entry["load"])
        }
        shapes.add_row(
            f"{n} x {page:,}",
            entry["direction"],
            entry["load"],
            str(got["copy_engine"]),
            str(got["kernel"]),
            str(got["auto"]),
            f"{entry['ratio']:.2f}",
            f"{entry['of_link']:.2f}",
        )
    console.print(shapes)
    console.print(f"both directions at once, 64 x 4 MiB each way (GB/s): {summary['both_directions_gbps']}")
    console.print(
        f"auto within 95% of best everywhere: {summary['auto_within_95pct']}; "
        f"link targets (idle): {summary['link_targets_met_idle']}"
    )
