"""``kvtier probe``: the device, its host link, the copy path chosen per page size, the knob values;
with ``--disk PATH``, the read ceiling of that disk and the page checksum's speed (``kvtier.cli.disk_probe``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

from kvtier.cli.arguments import between, device
from kvtier.cli.disk_probe import MAX_MIB, MIN_MIB

if TYPE_CHECKING:
    import torch

    from kvtier.copy import CopyPolicy, LinkInfo

DISK_PROBE_MIB = 512  # the disk probe's file, unless --disk-mib says otherwise
PROBE_PAGE_SIZES = (16, 4096, 65_536, 262_144, 884_736, 4_194_304, 15_261_696, 217_055_232)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", type=device, default=None, help="'cpu', 'cuda' or 'cuda:N' (default: cuda if available)"
    )
    parser.add_argument(
        "--disk", default=None, metavar="PATH", help="also measure the read ceiling of the disk under this directory"
    )
    parser.add_argument(
        "--disk-mib",
        type=between(MIN_MIB, MAX_MIB),
        default=None,
        help=f"size of the temporary file of --disk in MiB (default {DISK_PROBE_MIB})",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from kvtier.copy import CopyPolicy, LinkInfo, detect_link
    from kvtier.copy.policy import COHERENT_COPY_KERNEL_ENV, COPY_ENGINE_MIN_BYTES_ENV, SEPARATE_COPY_RUNS
    from kvtier.copy.torch_runs import TORCH_COPY_MIN_RUN_BYTES
    from kvtier.storage.pinned import HOST_REGISTER_CHUNK_BYTES_ENV, chunk_bytes_from_env

    if args.disk is None and args.disk_mib is not None:
        raise ValueError("--disk-mib sizes the file of the disk probe: give --disk PATH too")
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"device {name}: CUDA is not available here")
        return 1
    policy = CopyPolicy.from_env()
    rows: list[tuple[str, str]] = []
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        props = torch.cuda.get_device_properties(index)
        rows.append(("device", f"cuda:{index} {props.name}, {props.multi_processor_count} SMs"))
        link = detect_link(index)
    else:
        rows.append(("device", "cpu (no GPU: every copy is a plain CPU copy)"))
        link = LinkInfo.cpu()
    rows.append(
        ("link", f"{link.kind} ({link.detail}; from {link.source}), coherent={'yes' if link.coherent else 'no'}")
    )
    kernel_unavailable = None
    bindings = True  # cuda-bindings installed (False only where the batched copier cannot be imported)
    if device.type == "cuda":
        engines_row, bindings = _batch_abi(device.index or 0)
        rows.append(("copy engines", engines_row))
        kernel_row, kernel_unavailable = _copy_kernel(device, policy, link)
        rows.append(("copy kernel", kernel_row))
    threshold = policy.copy_engine_min_bytes
    rows.append(
        (
            COPY_ENGINE_MIN_BYTES_ENV,
            f"{_raw(COPY_ENGINE_MIN_BYTES_ENV)} -> {'never' if threshold is None else threshold}",
        )
    )
    rows.append((COHERENT_COPY_KERNEL_ENV, f"{_raw(COHERENT_COPY_KERNEL_ENV)} -> {int(policy.coherent_copy_kernel)}"))
    chunk = chunk_bytes_from_env()
    rows.append(
        (HOST_REGISTER_CHUNK_BYTES_ENV, f"{_raw(HOST_REGISTER_CHUNK_BYTES_ENV)} -> {chunk or 'one registration'}")
    )
    for page in PROBE_PAGE_SIZES:
        path = "cpu" if device.type == "cpu" else policy.choose(page, coherent_link=link.coherent)
        if path == "kernel" and kernel_unavailable is not None:
            path = "copy_engine (the kernel cannot be built)"
        elif path == "copy_engine" and not bindings:
            path = "copy_engine (torch copies: no cuda-bindings)"
            if kernel_unavailable is None and page < TORCH_COPY_MIN_RUN_BYTES:
                shorter = f"below {TORCH_COPY_MIN_RUN_BYTES >> 20} MiB on average"
                path += f"; kernel for calls of more than {SEPARATE_COPY_RUNS} runs {shorter}"
        rows.append((f"path {page:,} B", path))
    if args.disk is not None:
        from kvtier.cli.disk_probe import probe_disk

        try:
            rows += probe_disk(args.disk, args.disk_mib or DISK_PROBE_MIB)
        except (ValueError, OSError) as exc:
            print(f"disk probe: {exc}", file=sys.stderr)
            return 2
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _raw(name: str) -> str:
    value = os.environ.get(name)
    return "<unset>" if value is None else repr(value)


def _copy_kernel(device: torch.device, policy: CopyPolicy, link: LinkInfo) -> tuple[str, str | None]:
    """The copy kernel's row (built, and how long its build or cache load took; or why not), and
    the cause when it cannot be built (``PageCopier.warm_up``)."""
    from kvtier.copy import PageCopier

    copier = PageCopier(device, policy=policy, link=link)
    began = time.perf_counter()
    built = copier.warm_up(PROBE_PAGE_SIZES)
    took_ms = (time.perf_counter() - began) * 1e3
    cause = copier.kernel_unavailable
    if cause is not None:
        return f"unavailable ({cause}): its page sizes go to the copy engines", cause
    if not built:
        return "not used: the policy gives every page size to the copy engines", None
    import triton

    return f"Triton {triton.__version__}, built (or loaded from Triton's cache) in {took_ms:,.0f} ms", None


def _batch_abi(index: int) -> tuple[str, bool]:
    """The copy engines' row, and False only where cuda-bindings is missing (the copier then sends
    the copy engines' calls of many short runs to the kernel)."""
    from kvtier.copy.copy_engine import BatchCopier

    try:
        abi = BatchCopier(index).abi
    except ImportError as exc:
        return (
            f"no batched call ({exc}): a call of many short runs goes to the copy kernel, "
            "any other as one torch copy per run; install kvtier[gpu]",
            False,
        )
    except RuntimeError as exc:
        return f"unavailable: {exc}", True
    if abi is None:
        return "none (a driver older than CUDA 12.8): one cuMemcpyAsync per run", True
    major, minor = divmod(abi.cuda_version, 1000)
    return f"cuMemcpyBatchAsync, CUDA {major}.{minor // 10} ABI (driver {abi.driver_version})", True
