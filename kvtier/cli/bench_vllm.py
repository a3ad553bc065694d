"""``kvtier bench vllm``: the vLLM connector's data path on a GPU, in vLLM's own KV cache layout.

Runs ``kvtier.vllm.transfer.BlockTransfer`` exactly as the connector's worker does (no vLLM
needed): per-layer views of one device allocation laid out as vLLM lays them out
(``kvtier.vllm.paged_views``, default LBNHC), a pinned host buffer of kvtier pages (one block of
every layer per page), and save (vLLM blocks -> host pages) and load (host pages -> vLLM blocks)
jobs of scattered blocks. Default shape: Llama-3-8B (32 layers, 8 KV heads, head dim 128, bf16,
block size 16: 64 KiB per layer and block, 2 MiB per host page).

Per (path, direction, blocks): GPU time from events on the transfer stream (a sleep queued ahead
of each job, longer than its host submission, keeps the submission out of it), GB/s and its share
of the link (``--link-gbps``, default 55: PCIe 5 x16 as measured in docs/benchmarks.md), the
host cost of one submit (building the copy pairs and the copier call: what a step pays on the
CPU), and a byte-exact check of every page the last job moved. Figures are medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from kvtier.cli.arguments import at_least, positive

GiB = 1 << 30
PATHS = ("auto", "copy_engine", "kernel")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=at_least(1), default=32)
    parser.add_argument("--kv-heads", type=at_least(1), default=8)
    parser.add_argument("--head-dim", type=at_least(1), default=128)
    parser.add_argument("--block-size", type=at_least(1), default=16)
    parser.add_argument("--blocks", default="1,64,2048", help="blocks per job, comma-separated")
    parser.add_argument("--layout", default="LBNHC", choices=("LBNHC", "LBHNC", "BLNHC"))
    parser.add_argument("--paths", default="auto,kernel", help=f"copier paths, comma-separated, of {PATHS}")
    parser.add_argument("--iters", type=at_least(1), default=15, help="timed jobs per measurement (median of these)")
    parser.add_argument("--link-gbps", type=positive, default=55.0, help="the host link's bandwidth, for the share")
    parser.add_argument(
        "--segment-granule",
        type=at_least(0),
        default=0,
        help="start each layer's blocks on a multiple of this many bytes, as vLLM 0.34's extensible KV cache "
        "maps each layer (0, the default: one allocation, layers back to back; layer-major layouts only)",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise ValueError("it measures host<->GPU block copies and needs a CUDA device; none is available here")
    sizes = [int(x) for x in args.blocks.split(",")]
    paths = args.paths.split(",")
    if any(p not in PATHS for p in paths) or min(sizes) < 1 or args.iters < 5:
        raise ValueError(f"--paths must name {PATHS}, --blocks be >= 1 and --iters >= 5")
    if args.segment_granule and args.layout == "BLNHC":
        raise ValueError("--segment-granule needs a layer-major layout (a layer's blocks in one range): LBNHC or LBHNC")
    bench = _Bench(args, max(sizes))
    rows = []
    for path in paths:
        for direction in ("save", "load"):
            for n in sizes:
                rows.append(bench.measure(path, direction, n))
                r = rows[-1]
                print(
                    f"  {path} {direction} {n}: {r['gpu_ms']:.3f} ms, {r['gbps']:.1f} GB/s, exact {r['exact']}",
                    flush=True,
                )
    report = {"shape": bench.shape, "rows": rows, "device": torch.cuda.get_device_name()}
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    _print(report, args.link_gbps)
    return 0 if all(row["exact"] for row in rows) else 1


class _Bench:
    def __init__(self, args: argparse.Namespace, max_blocks: int) -> None:
        import numpy as np
        import torch

        from kvtier.copy import CopyPolicy, PageCopier
        from kvtier.storage.pinned import allocate_host_buffer
        from kvtier.vllm.paged_views import paged_layer_views
        from kvtier.vllm.transfer import KERNEL_ONLY, BlockTransfer, GroupPlan, bytes_at, route_groups

        self.torch, self.np = torch, np
        self.iters = args.iters
        self.link_gbps = args.link_gbps
        device = torch.device("cuda", torch.cuda.current_device())
        layers, heads, dim, tokens = args.layers, args.kv_heads, args.head_dim, args.block_size
        self.page = tokens * heads * 2 * dim * 2  # bf16, K and V of every head and token of a block
        self.layers = layers
        self.num_blocks = 2 * max_blocks  # jobs pick scattered blocks out of twice as many
        self.slots = max_blocks
        layer_bytes = self.num_blocks * self.page
        granule = args.segment_granule
        segment = -(-layer_bytes // granule) * granule if granule else layer_bytes
        raw = torch.empty(layers * segment, dtype=torch.uint8, device=device)
        for chunk in raw.split(GiB):
            chunk.random_(1, 256)
        if granule:  # a layer a storage of its own, padded to the granule: it may start off page boundaries
            base = raw.data_ptr()
            segments = [bytes_at(base + i * segment, layer_bytes, device, raw) for i in range(layers)]
            views = [
                paged_layer_views(seg, 1, self.num_blocks, heads, tokens, 2 * dim, torch.bfloat16, args.layout)[0]
                for seg in segments
            ]
        else:
            views = paged_layer_views(raw, layers, self.num_blocks, heads, tokens, 2 * dim, torch.bfloat16, args.layout)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        plan = GroupPlan(0, tuple(names), (0,), (0,) * layers, self.page)
        allocation, (self.route,) = route_groups([plan], dict(zip(names, views, strict=True)), self.num_blocks)
        self.allocation = allocation
        self.host = allocate_host_buffer(self.slots * plan.host_page_bytes, plan.host_page_bytes, device)
        for chunk in self.host.tensor.split(GiB):
            chunk.copy_(torch.randint(1, 256, (chunk.numel(),), dtype=torch.uint8, device=device))
        policies = {
            "auto": CopyPolicy.from_env(),
            "copy_engine": CopyPolicy(copy_engine_min_bytes=0),
            "kernel": CopyPolicy(copy_engine_min_bytes=None, coherent_copy_kernel=True),
        }
        self.transfers = {
            name: BlockTransfer(allocation, [self.route], [self.host.tensor], PageCopier(device, policy=policy))
            for name, policy in policies.items()
        }
        # "auto" is what the connector's worker runs: large calls go to the kernel (transfer.BULK_COPIES)
        self.transfers["auto"].bulk_copier = PageCopier(device, policy=KERNEL_ONLY)
        self.rng = np.random.default_rng(0)
        self.shape = {
            "layers": layers,
            "kv_heads": heads,
            "head_dim": dim,
            "block_size": tokens,
            "dtype": "bfloat16",
            "layout": args.layout,
            "page_bytes": self.page,
            "host_page_bytes": plan.host_page_bytes,
            "segment_granule": granule,
            "phases": len(self.route.phases()),
        }
        torch.cuda.synchronize()

    def measure(self, path: str, direction: str, n: int) -> dict[str, Any]:
        from kvtier.vllm.transfer import BULK_COPIES, Direction, GroupBlocks, TransferJob

        torch, np = self.torch, self.np
        transfer = self.transfers[path]
        gpu_ms, submit_us = [], []
        job = None
        for i in range(self.iters + 2):  # two warm-up jobs: the first call of a path initialises it
            blocks = self.rng.choice(self.num_blocks, n, replace=False).astype(np.int64)
            slots = self.rng.choice(self.slots, n, replace=False).astype(np.int64)
            job = TransferJob(i, "bench", Direction(direction), [GroupBlocks(0, slots, blocks[:, None])])
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if i >= 2:  # the copies start only after the host has submitted them: ~2x the last submit
                cycles = min(int(submit_us[-1] * 4e3) if submit_us else 2_000_000, 400_000_000)
                with torch.cuda.stream(transfer.stream):
                    torch.cuda._sleep(max(cycles, 2_000_000))
            start.record(transfer.stream)
            t0 = time.perf_counter()
            transfer.submit([job])
            t1 = time.perf_counter()
            end.record(transfer.stream)
            end.synchronize()
            assert transfer.poll() == [(i, True)], "a benchmark job failed"
            if i >= 1:
                submit_us.append((t1 - t0) * 1e6)
            if i >= 2:
                gpu_ms.append(start.elapsed_time(end))
        submit_us = submit_us[1:]
        assert job is not None
        exact = self._exact(job)
        ms = statistics.median(gpu_ms)
        moved = n * self.layers * self.page
        gbps = moved / (ms / 1e3) / 1e9
        copier = transfer.copier
        widest = max(len(phase.layers) for phase in self.route.phases())  # the call of the most pages
        if transfer.bulk_copier is not None and n * widest >= BULK_COPIES:
            copier = transfer.bulk_copier
        chosen = copier.policy.choose(self.page, coherent_link=copier.link.coherent)
        return {
            "path": path,
            "chosen": chosen,
            "direction": direction,
            "blocks": n,
            "bytes": moved,
            "gpu_ms": ms,
            "gbps": gbps,
            "link_share": gbps / self.link_gbps,
            "submit_us": statistics.median(submit_us),
            "exact": exact,
            "gpu_ms_all": gpu_ms,
            "submit_us_all": submit_us,
        }

    def _exact(self, job: Any) -> bool:
        """Every page of ``job`` is the same on both sides (the job moved exactly those bytes)."""
        torch = self.torch
        (rows,) = job.groups
        route = self.route
        device_pages = self.allocation.view(-1, route.unit_bytes)
        first = torch.tensor([layer.first_unit for layer in route.layers], device=self.allocation.device)
        stride = torch.tensor([layer.unit_stride for layer in route.layers], device=self.allocation.device)
        blocks = torch.from_numpy(rows.device_blocks[:, 0]).to(self.allocation.device)
        units = first[None, :, None] + blocks[:, None, None] * stride[None, :, None]
        units = units + torch.arange(route.units_per_page, device=self.allocation.device)
        on_device = device_pages[units].flatten(2)  # (n, layers, page)
        host = self.host.tensor.view(-1, self.layers, self.page)[torch.from_numpy(rows.host_slots)]
        return bool(torch.equal(on_device, host.to(self.allocation.device)))


def _print(report: dict[str, Any], link_gbps: float) -> None:
    shape = report["shape"]
    print(
        f"kvtier bench vllm on {report['device']}: {shape['layers']} layers x {shape['kv_heads']} KV heads x "
        f"head dim {shape['head_dim']}, {shape['dtype']}, block {shape['block_size']}, layout {shape['layout']} "
        f"({shape['page_bytes'] // 1024} KiB per layer and block)"
    )
    if shape["segment_granule"]:
        print(
            f"each layer in a segment of its own, padded to {shape['segment_granule']} bytes: "
            f"the layers' blocks start at {shape['phases']} offsets past page boundaries (a copy call each)"
        )
    print(
        f"{'path':<18}{'dir':<6}{'blocks':>7}{'MiB':>8}{'GPU ms':>9}{'GB/s':>8}{'of link':>9}{'submit us':>11}  exact"
    )
    for r in report["rows"]:
        path = r["path"] if r["path"] != "auto" else f"auto:{r['chosen']}"
        print(
            f"{path:<18}{r['direction']:<6}{r['blocks']:>7}{r['bytes'] / (1 << 20):>8.0f}{r['gpu_ms']:>9.3f}"
            f"{r['gbps']:>8.1f}{r['link_share']:>8.0%}{r['submit_us']:>11.0f}  {r['exact']}"
        )
    print(f"(share of a {link_gbps:.0f} GB/s link; GPU time from events, medians)")
