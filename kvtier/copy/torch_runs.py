"""The copy engines without cuda-bindings: one torch copy per run of consecutive slots.

Where cuda-bindings is not installed (``pip install kvtier`` without the ``gpu`` extra on a CUDA
machine), neither the batched driver call nor the kernel's driver calls can be made. The
copier then gives each run of a call (``kvtier.copy.runs``) to torch as one asynchronous copy
on the caller's stream: the same copy engines move the bytes, byte for byte and in stream
order, at a host cost of one torch call per run instead of one driver call per call.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.copy.copy_request import CopyRequest


def copy_runs_with_torch(request: CopyRequest, runs: np.ndarray, stream: torch.cuda.Stream) -> None:
    """Enqueue on ``stream`` one copy per run ``(src_slot, dst_slot, pages)`` of ``request``
    (``build_runs``): asynchronous where the host side is pinned or registered, as torch copies are."""
    page = request.page_bytes
    src, dst = request.src, request.dst
    with torch.cuda.stream(stream):
        for s, d, n in runs.tolist():
            dst[d * page : (d + n) * page].copy_(src[s * page : (s + n) * page], non_blocking=True)
