"""What the copy kernel takes, checked without importing Triton: so a call the kernel would refuse
is refused (``ValueError``) before the kernel is built or any GPU work is queued, and a copier
without the batched copy-engine call can tell which calls the kernel may take instead."""

from __future__ import annotations

from typing import Final

import torch

ALIGN: Final = 16  # the kernel moves 16-byte vectors: page sizes and buffer addresses are multiples of it
MAX_PAGE_BYTES: Final = ALIGN << 31  # the kernel's scalar arguments stay 32-bit integers below it


def kernel_refusal(src: torch.Tensor, dst: torch.Tensor, page_bytes: int) -> str | None:
    """Why the kernel cannot move pages of ``page_bytes`` between these buffers, or None when it can."""
    if page_bytes % ALIGN:
        return (
            f"the copy kernel needs a page size that is a multiple of {ALIGN} bytes, got {page_bytes}; "
            "pad the page or use the copy engines (KVTIER_COPY_ENGINE_MIN_BYTES=0)"
        )
    if page_bytes >= MAX_PAGE_BYTES:
        return (
            f"the copy kernel takes pages below {MAX_PAGE_BYTES} bytes, got {page_bytes}; "
            "use the copy engines (KVTIER_COPY_ENGINE_MIN_BYTES=0)"
        )
    for name, buffer in (("src", src), ("dst", dst)):
        if buffer.data_ptr() % ALIGN:
            return f"the copy kernel needs {name} to start on a {ALIGN}-byte boundary"
    return None
