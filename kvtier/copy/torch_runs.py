"""The copy engines without cuda-bindings: one torch copy per run of consecutive slots.

Where cuda-bindings is not installed (``pip install kvtier`` without the ``gpu`` extra on a CUDA
machine), the batched driver call cannot be made. The copier then gives each run of a call
(``kvtier.copy.runs``) to torch as one asynchronous copy on the caller's stream: the same copy
engines move the bytes, byte for byte and in stream order, at a host cost of one torch call per
run instead of one driver call per call.

One torch copy costs 14-17 us of host time (an H100 host, docs/benchmarks.md section 64), in
which the link (about 55 GB/s) moves about 0.8 MB: runs of ``TORCH_COPY_MIN_RUN_BYTES`` or more
keep the link busy (scattered 2 MiB pages moved at 49.7 GB/s against 52.9 on the batched call),
shorter ones leave it waiting for the host (scattered 64 KiB pages: 4.8 GB/s against 26.4). A call
of more than ``SEPARATE_COPY_RUNS`` runs averaging less goes to the copy kernel instead, where it
takes the call; longer runs stay on the copy engines, which leave the SMs to the model.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import torch

from kvtier.copy.copy_request import CopyRequest

TORCH_COPY_MIN_RUN_BYTES: Final = 1 << 20  # runs at least this long on average go as torch copies


def copy_runs_with_torch(request: CopyRequest, runs: np.ndarray, stream: torch.cuda.Stream) -> None:
    """Enqueue on ``stream`` one copy per run ``(src_slot, dst_slot, pages)`` of ``request``
    (``build_runs``): asynchronous where the host side is pinned or registered, as torch copies are."""
    page = request.page_bytes
    src, dst = request.src, request.dst
    with torch.cuda.stream(stream):
        for s, d, n in runs.tolist():
            dst[d * page : (d + n) * page].copy_(src[s * page : (s + n) * page], non_blocking=True)


def torch_copies_keep_up(request: CopyRequest, runs: np.ndarray) -> bool:
    """Whether the call's runs average at least ``TORCH_COPY_MIN_RUN_BYTES``: one torch copy per run
    then submits faster than the link moves the bytes."""
    return request.pairs.shape[0] * request.page_bytes >= TORCH_COPY_MIN_RUN_BYTES * runs.shape[0]
