"""The data path of ``kvtier.hf`` without transformers: token maps, page gather/scatter, state
packing, left padding and the choice of reused columns, on a real ``KVCacheManager``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import kvtier
from kvtier.hf import page_io
from kvtier.hf.batch_rows import Row, choose_width, close_rows, left_pads, release_reads
from kvtier.hf.page_io import StatePacking, StatePart, TokenMapBuilder, gather_blocks, row_blocks, scatter
from kvtier.layout import page_geometries, part_stacks, stack_view

TPB = 4


def _manager(window: int | None = None, partial: bool = True) -> kvtier.KVCacheManager:
    spec = kvtier.ModelSpec([kvtier.AttentionLayer(2, 4, window=window) for _ in range(2)], torch.float64)
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)], enable_partial_reuse=partial)
    return kvtier.KVCacheManager(spec, config)


def _committed(mgr: kvtier.KVCacheManager, tokens: list[int]) -> None:
    """Publish ``tokens``' full blocks (the page contents do not matter to the bookkeeping)."""
    cache = mgr.create_cache(tokens)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens[cache.num_committed_tokens :])
    cache.close()


def test_importing_kvtier_or_the_data_path_does_not_import_transformers():
    code = "import sys, kvtier, kvtier.hf.page_io, kvtier.hf.batch_rows; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_scatter_writes_exactly_the_listed_tokens_and_blocks_come_back_whole():
    mgr = _manager()
    caches = [mgr.create_cache(list(range(1, 12))), mgr.create_cache(list(range(50, 57)))]
    for cache, n in zip(caches, (11, 7), strict=True):
        assert cache.resume() and cache.resize(n)
    k = mgr.kv_views(1)["k"]
    k.fill_(-7.0)
    dense = torch.randn(2, 2, 13, 4, dtype=torch.float64) + 3.0
    builder = TokenMapBuilder(TPB)
    builder.add(0, caches[0].page_indices(0), 0, 11, 2)  # row 0: tokens 0..10 at columns 2..12
    builder.add(1, caches[1].page_indices(0), 3, 7, 6)  # row 1: tokens 3..6 at columns 9..12
    tokens = builder.build(mgr.device)
    assert len(tokens) == 15
    scatter(dense, k, tokens)
    slots = [c.page_indices(0) for c in caches]
    for t in range(11):
        assert torch.equal(k[slots[0][t // TPB], t % TPB], dense[0, :, 2 + t])
    for t in range(7):
        expected = dense[1, :, 6 + t] if t >= 3 else torch.full((2, 4), -7.0, dtype=torch.float64)
        assert torch.equal(k[slots[1][t // TPB], t % TPB], expected)  # tokens 0..2 untouched

    # back, whole blocks into a token-major storage with a block of spare columns on each side
    storage = torch.zeros(2, TPB + 13 + TPB, 2, 4, dtype=torch.float64)
    blocks = [
        row_blocks(0, slots[0], 0, 11, TPB + 2, TPB, mgr.device),
        row_blocks(1, slots[1], 3, 7, TPB + 6, TPB, mgr.device),
    ]
    assert [len(b.slots) for b in blocks] == [3, 2] and [b.column for b in blocks] == [TPB + 2, TPB + 6]
    gather_blocks(k[None], blocks, storage[None])
    view = storage[:, TPB : TPB + 13].transpose(1, 2)  # [batch, heads, columns, dim]
    assert torch.equal(view[0, :, 2:], dense[0, :, 2:])
    assert torch.equal(view[1, :, 9:], dense[1, :, 9:])
    assert not view[0, :, :2].any()  # row 0's padding is left alone
    mgr.close()


@pytest.mark.parametrize("dim", [4, 3])  # rows of 8-byte words, and of 6 bytes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_stack_of_layers_gathers_as_one_part_at_a_time_would(dtype, dim):
    spec = kvtier.ModelSpec([kvtier.AttentionLayer(2, dim) for _ in range(3)], dtype)
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    geometry = page_geometries(spec, TPB)[0]
    (stack,) = part_stacks(geometry)
    buffer = mgr.layout().groups[0].regions[0].as_tensor().view(-1)
    buffer.copy_(torch.randint(1, 255, buffer.shape, dtype=torch.uint8))  # every byte pattern, NaNs too
    view = stack_view(geometry, buffer, stack)
    assert (page_io._as_words(view).dtype == torch.int64) == (dim == 4)  # the path taken: words, or elements
    slots = [np.array([5, 2, 9]), np.array([7, 1])]
    blocks = [
        row_blocks(0, slots[0], 1, 11, TPB + 1, TPB, mgr.device),
        row_blocks(1, slots[1], 0, 6, TPB + 6, TPB, mgr.device),
    ]
    storage = torch.zeros(len(stack), 2, TPB + 13 + TPB, 2, dim, dtype=dtype)
    gather_blocks(view, blocks, storage)
    expected = torch.zeros_like(storage)
    for p, part in enumerate(stack):
        role = mgr.kv_views(part.layer_id)[part.role]
        for row, b in zip(blocks, (0, 1), strict=True):
            for j, slot in enumerate(row.slots.tolist()):
                expected[p, b, row.column + j * TPB : row.column + (j + 1) * TPB] = role[slot]
    assert torch.equal(storage.view(torch.int16), expected.view(torch.int16))
    mgr.close()


def test_a_token_map_refuses_a_block_without_a_page():
    mgr = _manager(window=5)
    cache = mgr.create_cache(list(range(1, 30)))
    assert cache.resume() and cache.resize(24)
    cache.commit(list(range(1, 25)))  # blocks older than the window are released
    slots = cache.page_indices(0)
    assert slots[0] == kvtier.BAD_PAGE_INDEX
    builder = TokenMapBuilder(TPB)
    with pytest.raises(ValueError, match="without a page"):
        builder.add(0, slots, 0, 24, 0)
    builder.add(0, slots, 20, 24, 0)  # the live ones are fine
    assert len(builder.build(mgr.device)) == 4
    with pytest.raises(ValueError, match="without a page"):
        row_blocks(0, slots, 0, 24, 0, TPB, mgr.device)
    assert len(row_blocks(0, slots, 20, 24, 0, TPB, mgr.device).slots) == 1
    mgr.close()


def test_state_packing_round_trips_states_of_several_dtypes():
    parts = [
        StatePart((0, "conv", 0), 0, 3 * 5 * 8, (3, 5), torch.float64),
        StatePart((0, "recurrent", 0), 128, 2 * 2 * 2 * 4, (2, 2, 2), torch.float32),
        StatePart((2, "conv", 0), 192, 3 * 5 * 8, (3, 5), torch.float64),
    ]
    packing = StatePacking(parts, 320)
    states = {
        (0, "conv", 0): torch.randn(4, 3, 5, dtype=torch.float64) + 1,
        (0, "recurrent", 0): torch.randn(4, 2, 2, 2) - 1,
        (2, "conv", 0): torch.randn(4, 3, 5, dtype=torch.float64) * 5,
    }
    rows = torch.tensor([3, 1])
    pages = packing.pack(states, rows)
    assert pages.shape == (2, 320) and pages.dtype == torch.uint8
    back = packing.unpack(pages)
    for key, tensor in states.items():
        assert back[key].dtype == tensor.dtype
        assert torch.equal(back[key], tensor[rows])


def test_left_pads():
    assert left_pads(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])) == [2, 0]
    assert left_pads(torch.tensor([[True, True], [False, True]])) == [0, 1]
    assert left_pads(torch.tensor([[1, 0, 1, 1]])) is None  # a hole
    assert left_pads(torch.tensor([[1, 1, 0, 0]])) is None  # right padding
    assert left_pads(torch.tensor([[0, 0, 0], [1, 1, 1]])) is None  # an empty row


def _rows(mgr, prompts: list[list[int]], width: int) -> list[Row]:
    return [Row(i, width - len(p), p, mgr.create_cache(p), kvtier.DEFAULT_SCOPE) for i, p in enumerate(prompts)]


def test_the_width_is_set_by_the_longest_uncached_part_and_each_row_gets_exactly_its_share():
    mgr = _manager(window=6)  # a sliding window: a shorter share needs its own match
    a, b = list(range(100, 140)), list(range(200, 230))
    _committed(mgr, a[:32])
    _committed(mgr, b[:28])
    rows = _rows(mgr, [a, b[:29] + [7, 8, 9, 10]], 40)  # b: 33 tokens, 7 padding columns
    assert [r.write.num_reused_tokens for r in rows] == [32, 28]
    width = choose_width(mgr, rows, 40)
    assert width == 32 and [r.reused for r in rows] == [32, 25]
    assert rows[0].read is rows[0].write and rows[1].read is not rows[1].write
    assert rows[1].read.num_committed_tokens == 25 and rows[1].read.state is kvtier.CacheState.ACTIVE
    release_reads(rows)
    assert rows[0].write.state is kvtier.CacheState.SUSPENDED and rows[1].read is None
    close_rows(rows)
    mgr.close()


def test_the_width_shrinks_until_every_row_gets_exactly_its_share():
    mgr = _manager(window=6, partial=False)  # only block boundaries: 25 tokens cannot be had
    a, b = list(range(100, 140)), list(range(200, 230))
    _committed(mgr, a[:32])
    _committed(mgr, b[:28])
    rows = _rows(mgr, [a, b[:29] + [7, 8, 9, 10]], 40)
    # b cannot give 25 (only block boundaries): width 7 + 24 = 31; a cannot give 31: 28; b cannot
    # give 21: 27; ... the padding (7) is not a multiple of the block (4), so it ends at 4 and 0.
    assert choose_width(mgr, rows, 40) == 4
    assert [r.reused for r in rows] == [4, 0] and rows[1].read is None
    close_rows(rows)
    mgr.close()


def test_only_full_attention_takes_a_shorter_share_from_the_same_pages():
    mgr = _manager()
    a, b = list(range(100, 140)), list(range(200, 230))
    _committed(mgr, a[:32])
    _committed(mgr, b[:28])
    rows = _rows(mgr, [a, b[:29] + [7, 8, 9, 10]], 40)
    assert choose_width(mgr, rows, 40) == 32
    assert rows[1].read is rows[1].write and rows[1].reused == 25
    assert np.all(rows[1].read.page_indices(0)[:7] != kvtier.BAD_PAGE_INDEX)
    close_rows(rows)
    mgr.close()
