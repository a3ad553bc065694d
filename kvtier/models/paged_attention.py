"""Attention over K/V held in pages, and the SDPA call shared with the dense path.

A layer's K (and V) lives in ``view [num_slots, tokens_per_block, kv_heads, head_dim]``; the token
at position ``p`` of a sequence is row ``p % tokens_per_block`` of the page whose slot is entry
``p // tokens_per_block`` of the sequence's page indices. New tokens are scattered into their
rows with one ``index_put_`` per role; the keys a chunk needs are gathered with one
``index_select`` per role over whole blocks, then the tail of the last block (rows past the last
new token, never written) is dropped, so garbage rows are never read, not even masked ones.

Visibility: key ``j`` is visible to query ``i`` iff ``j <= i`` and, in a sliding-window layer,
``i - j < window or j < sink_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


@dataclass(slots=True)
class AttentionPlan:
    """Where one sequence's keys come from, for every layer of one attention layer group.

    ``read_slots``: int64 slots of the gathered blocks, in position order. ``num_keys``: keys
    kept from the gather. Full attention: the keys are positions ``0 .. start + n - 1`` and the
    queries the last ``n`` of them, so ``causal`` (bottom-right aligned) says it all and ``mask`` is
    None. Sliding window: ``mask`` is bool ``[query_group * n, num_keys]`` (True = visible), with
    the queries folded as in :func:`attend`.
    """

    read_slots: torch.Tensor
    num_keys: int
    mask: torch.Tensor | None
    causal: bool


def plan_attention(
    start: int,
    n: int,
    pages: torch.Tensor,
    tokens_per_block: int,
    window: int | None,
    sink_tokens: int,
    query_group: int,
) -> AttentionPlan:
    """Plan the gather and the mask for ``n`` new tokens after ``start`` cached ones.

    ``pages``: int64 page indices of the sequence (one per block, on the model device), long
    enough to cover position ``start + n - 1``. Blocks wholly older than the window of the first
    new token (and not holding sink tokens) are not read: they may be released.
    """
    end = start + n
    last_block = (end - 1) // tokens_per_block
    first_block = 0 if window is None else max(0, (start - window + 1) // tokens_per_block)
    sink_blocks = -(-sink_tokens // tokens_per_block)
    if first_block <= sink_blocks:
        read_slots = pages[: last_block + 1]
        key_positions = torch.arange(end, device=pages.device)
    else:
        read_slots = torch.cat((pages[:sink_blocks], pages[first_block : last_block + 1]))
        key_positions = torch.cat(
            (
                torch.arange(sink_blocks * tokens_per_block, device=pages.device),
                torch.arange(first_block * tokens_per_block, end, device=pages.device),
            )
        )
    num_keys = key_positions.numel()
    if window is None:
        return AttentionPlan(read_slots, num_keys, None, causal=n > 1)
    query_positions = torch.arange(start, end, device=pages.device)[:, None]
    distance = query_positions - key_positions[None, :]
    visible = (distance >= 0) & ((distance < window) | (key_positions[None, :] < sink_tokens))
    mask = visible.expand(query_group, n, num_keys).reshape(query_group * n, num_keys)
    return AttentionPlan(read_slots, num_keys, mask, False)


def write_kv(view: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """Store ``values [T, kv_heads, head_dim]`` at ``view[slots[t], rows[t]]`` for every token t."""
    view.index_put_((slots, rows), values)


def gather_keys(view: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """The planned keys (or values) as ``[num_keys, kv_heads, head_dim]``: one ``index_select``."""
    blocks = view.index_select(0, plan.read_slots)
    return blocks.flatten(0, 1)[: plan.num_keys]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    ``q [n, heads, d]``, ``k`` and ``v [m, kv_heads, d]`` with ``m >= n``; query head ``h`` reads
    kv head ``h // (heads // kv_heads)``. Either ``mask``, bool ``[g * n, m]`` for the folded
    queries (below), or ``causal``: query ``i`` sees keys ``0 .. m - n + i`` (bottom-right aligned;
    the square causal mask when ``m == n``), or neither (every key visible). Returns ``[n, heads, d]``.

    Without a mask, SDPA's own grouped-query support is used, and a bottom-right causal bias that
    is never materialised (the flash kernel on CUDA). With a mask, the ``g`` query heads that share
    a kv head are folded into the query length, so that the memory-efficient kernel (which takes
    masks but not grouped heads) runs without repeating K/V.
    """
    n, heads, dim = q.shape
    m, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    keys = k.transpose(0, 1).unsqueeze(0)
    values = v.transpose(0, 1).unsqueeze(0)
    if mask is None:
        queries = q.transpose(0, 1).unsqueeze(0)
        bias = causal_lower_right(n, m) if causal and n != m else None
        square = causal and n == m
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=bias, is_causal=square, enable_gqa=group > 1
        )
        return out.squeeze(0).transpose(0, 1)
    folded = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, dim)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)
    return out.view(kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, heads, dim)


def dense_mask(n: int, window: int, sink_tokens: int, query_group: int, device: torch.device) -> torch.Tensor:
    """The folded sliding-window mask of a dense forward over positions ``0..n-1``."""
    positions = torch.arange(n, device=device)
    distance = positions[:, None] - positions[None, :]
    visible = (distance >= 0) & ((distance < window) | (positions[None, :] < sink_tokens))
    return visible.expand(query_group, n, n).reshape(query_group * n, n)
