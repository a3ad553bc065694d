"""vLLM's per-layer KV cache views (0.33 and 0.34 lay them out alike), reproduced without vLLM (for
the data path's tests and bench).

vLLM allocates one flat buffer and views it as ``[num_blocks, heads, tokens, content]`` per layer
(content: K then V of one head and token, in the cache dtype). The physical order is a layout:
``LBNHC`` (vLLM's default: layer-major, a block is ``[tokens, heads, content]``), ``LBHNC``
(layer-major, ``[heads, tokens, content]``), ``BLNHC`` (block-major: a block of every layer side
by side) or ``LHBNC`` (heads outside blocks: a layer's block is not contiguous, which the data
path refuses). Layer l's block b starts at ``l * layer_stride + b * block_stride``.
"""

from __future__ import annotations

import torch

LAYOUTS = ("LBNHC", "LBHNC", "BLNHC", "LHBNC")


def paged_layer_views(
    raw: torch.Tensor,
    num_layers: int,
    num_blocks: int,
    heads: int,
    tokens: int,
    content: int,
    dtype: torch.dtype,
    layout: str = "LBNHC",
) -> list[torch.Tensor]:
    """One ``[num_blocks, heads, tokens, content]`` view of ``dtype`` per layer into ``raw`` (flat uint8)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    page = heads * tokens * content  # elements of one layer's block
    if raw.numel() < num_layers * num_blocks * page * itemsize:
        raise ValueError(f"raw holds {raw.numel()} bytes, fewer than {num_layers} layers of {num_blocks} blocks")
    typed = raw[: num_layers * num_blocks * page * itemsize].view(dtype)
    if layout == "BLNHC":
        layer_stride, block_stride = page, num_layers * page
    else:
        layer_stride, block_stride = num_blocks * page, page
    if layout == "LBHNC":
        inner = (tokens * content, content, 1)  # heads, tokens, content
    elif layout == "LHBNC":
        inner = (num_blocks * tokens * content, content, 1)
        block_stride = tokens * content
    else:
        inner = (content, heads * content, 1)
    shape = (num_blocks, heads, tokens, content)
    base = typed.storage_offset()
    strides = (block_stride, *inner)
    return [torch.as_strided(typed, shape, strides, base + layer * layer_stride) for layer in range(num_layers)]
