"""``RowOracle``: fresh random non-zero bytes written into every row a cache computes, through the
public ``kv_views`` at ``page_indices``, and checked byte for byte wherever they are reused."""

from __future__ import annotations

import numpy as np
import torch

import kvtier


class RowOracle:
    """Rows kept per (prompt prefix, layer, role); ``check`` compares what a cache reused with them,
    in this manager or in one started later on the same disk (``mgr`` set to it)."""

    def __init__(self, mgr: kvtier.KVCacheManager, seed: int = 0) -> None:
        self.mgr = mgr
        self.rng = np.random.default_rng(seed)
        self.written: dict[tuple[tuple[int, ...], int, str], np.ndarray] = {}

    def _rows(self, cache: kvtier.KVCache, start: int, end: int):
        tpb = self.mgr.tokens_per_block
        for layer in range(len(self.mgr.spec.layers)):
            slots = cache.page_indices(self.mgr.spec.group_of(layer).group_id)
            for role, view in self.mgr.kv_views(layer).items():
                for pos in range(start, end):
                    slot = int(slots[pos // tpb])
                    if slot >= 0:
                        yield layer, role, pos, view[slot, pos % tpb].view(torch.uint8).reshape(-1)

    def write(self, cache: kvtier.KVCache, tokens: list[int], start: int, end: int) -> None:
        for layer, role, pos, row in self._rows(cache, start, end):
            data = self.rng.integers(1, 256, row.numel(), dtype=np.uint8)
            row.copy_(torch.from_numpy(data))
            self.written[(tuple(tokens[: pos + 1]), layer, role)] = data

    def check(self, cache: kvtier.KVCache, tokens: list[int]) -> int:
        """Compare every reused row with the bytes written for its prefix; returns the rows checked."""
        checked = 0
        for layer, role, pos, row in self._rows(cache, 0, cache.num_reused_tokens):
            want = self.written[(tuple(tokens[: pos + 1]), layer, role)]
            assert np.array_equal(row.numpy(), want), (pos, layer, role)
            checked += 1
        return checked


def prefill(
    mgr: kvtier.KVCacheManager, rows: RowOracle, tokens: list[int], keep: bool = False
) -> kvtier.KVCache | None:
    """Serve ``tokens`` as a request, its reused rows checked and its new rows written; the cache
    is closed, or suspended and returned (``keep``)."""
    cache = mgr.create_cache(tokens)
    assert cache.resume()
    rows.check(cache, tokens)
    start = cache.num_committed_tokens
    assert cache.resize(len(tokens))
    rows.write(cache, tokens, start, len(tokens))
    cache.commit(tokens[start:])
    if keep:
        cache.suspend()
        return cache
    cache.close()
    return None


def reuse(mgr: kvtier.KVCacheManager, rows: RowOracle, tokens: list[int]) -> int:
    """Tokens reused by a new cache for ``tokens``, its reused rows checked byte for byte."""
    cache = mgr.create_cache(tokens)
    assert cache.resume()
    reused = cache.num_reused_tokens
    if reused:
        assert rows.check(cache, tokens) > 0
    cache.close()
    return reused
