"""Test data for pages: every KV row and state is derived from the tokens before it, never zero.

Like real KV, row ``i`` of a sequence depends on tokens ``0..i``; a recurrent state after ``n``
tokens depends on tokens ``0..n-1``. So a page reused from another request with the same prefix
must hold exactly the bytes this request would have written, and any page that lands in the
wrong slot, is stale, or was corrupted on the way through a tier shows up as a mismatch.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

import kvtier
from kvtier.layout import page_geometries


def prefix_digests(tokens: list[int]) -> list[int]:
    """``d[i]``: a 64-bit digest of ``tokens[: i + 1]``."""
    out = []
    h = hashlib.blake2b(b"kvdata", digest_size=8).digest()
    for t in tokens:
        h = hashlib.blake2b(h + int(t).to_bytes(8, "little"), digest_size=8).digest()
        out.append(int.from_bytes(h, "little"))
    return out


def _bytes_for(seed: int, salt: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([seed, salt])
    return rng.integers(1, 256, n, dtype=np.uint8)


class PageOracle:
    """Writes and checks page contents of caches of one manager, through its primary buffers (CPU or GPU).

    ``weights``: which model's bytes (the same tokens give other bytes under other weights)."""

    def __init__(self, mgr: kvtier.KVCacheManager, weights: int = 0) -> None:
        self.mgr = mgr
        self.weights = weights
        self.tpb = mgr.tokens_per_block
        self.geometries = page_geometries(mgr.spec, self.tpb)

    def _put(self, group: int, at: int, data: np.ndarray) -> None:
        buffer = self.mgr._pool.tiers[0].storage.buffers[group]
        buffer[at : at + data.size].copy_(torch.from_numpy(data))

    def _get(self, group: int, at: int, n: int) -> np.ndarray:
        return self.mgr._pool.tiers[0].storage.buffers[group][at : at + n].cpu().numpy()

    def _places(self, cache: kvtier.KVCache, tokens: list[int], start: int, end: int):
        """(group, byte offset, expected bytes, what) of every row ``start..end-1`` with a page, and of
        each recurrent state after ``end`` tokens."""
        digests = [d ^ self.weights for d in prefix_digests(tokens[:end])]
        for geo in self.geometries:
            g = geo.group_id
            slots = cache.page_indices(g)
            if geo.group.kind is kvtier.GroupKind.RECURRENT:
                if end:
                    want = _bytes_for(digests[end - 1], 1000 + g, geo.page_bytes)
                    yield g, int(slots[0]) * geo.page_bytes, want, f"state page of group {g}"
                continue
            for pos in range(start, end):
                slot = int(slots[pos // self.tpb])
                if slot == kvtier.BAD_PAGE_INDEX:
                    continue
                for i, part in enumerate(geo.parts):
                    row = part.nbytes // self.tpb
                    at = slot * geo.page_bytes + part.offset + (pos % self.tpb) * row
                    what = f"group {g} position {pos} part {part.layer_id}/{part.role} (slot {slot})"
                    yield g, at, _bytes_for(digests[pos], i, row), what

    def write(self, cache: kvtier.KVCache, tokens: list[int], start: int, end: int) -> None:
        """Write KV rows for positions ``start..end-1`` (and the state after ``end`` tokens)."""
        for group, at, data, _ in self._places(cache, tokens, start, end):
            self._put(group, at, data)

    def check(self, cache: kvtier.KVCache, tokens: list[int]) -> None:
        """Every row below ``num_committed_tokens`` that has a page holds its expected bytes."""
        for group, at, want, what in self._places(cache, tokens, 0, cache.num_committed_tokens):
            assert np.array_equal(self._get(group, at, want.size), want), f"{what} differs"


def small_spec(kind: str = "llama", dtype: torch.dtype = torch.float16) -> kvtier.ModelSpec:
    """Small model specs for manager tests: one, two (sliding window) or two (recurrent) groups."""
    if kind == "llama":
        return kvtier.ModelSpec.uniform(2, 2, 8, dtype)
    if kind == "swa":
        return kvtier.ModelSpec(
            [
                kvtier.AttentionLayer(2, 8),
                kvtier.AttentionLayer(2, 8, window=10, sink_tokens=3),
                kvtier.AttentionLayer(2, 8),
                kvtier.AttentionLayer(2, 8, window=10, sink_tokens=3),
            ],
            dtype,
        )
    if kind == "hybrid":
        return kvtier.ModelSpec(
            [
                kvtier.AttentionLayer(2, 8),
                kvtier.RecurrentLayer(96),
                kvtier.AttentionLayer(2, 8),
                kvtier.RecurrentLayer(40),
            ],
            dtype,
        )
    raise ValueError(kind)
