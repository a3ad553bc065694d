"""What the TTFT benches (e2e, hf) measure or reset on the machine: the link ceiling, the page cache."""

from __future__ import annotations

import statistics
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def link_ceiling_line(ceiling: float) -> str:
    """The tables' first line: the link ceiling measured, or why there is none (then the link columns are nan)."""
    if not ceiling:
        return "link ceiling: none on a CPU device (no host-to-device link: the link columns are nan)"
    return f"link ceiling (pinned H2D, this run): {ceiling:.1f} GB/s"


def link_ceiling_gbps(device: torch.device) -> float:
    """Host-to-device GB/s of one 1 GiB pinned copy, median of 4 after a warm-up (0 on a CPU device)."""
    if device.type != "cuda":
        return 0.0
    import torch

    from kvtier.storage.pinned import allocate_host_buffer

    n = 1 << 30
    host = allocate_host_buffer(n, n, device)
    host.tensor.fill_(7)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(host.tensor, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    host.release()
    del dst
    return n / statistics.median(times[1:]) / 1e9


def drop_page_cache() -> bool:
    """Ask the OS to drop its page cache (root only), so a disk read is cold; True if it worked."""
    try:
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
