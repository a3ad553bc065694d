"""kvtier/layout.py: page geometry per layer group, strided part views, regions and the manager's layout."""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier import AttentionLayer, GroupKind, ModelSpec, RecurrentLayer
from kvtier.layout import PART_ALIGN, Region, page_geometries, part_stacks, part_views, stack_view

TPB = 3


def hybrid_spec(dtype: torch.dtype = torch.float16) -> ModelSpec:
    # Sizes chosen so that no part is a multiple of PART_ALIGN on its own.
    return ModelSpec(
        [
            AttentionLayer(1, 5),  # group 0: 3 * 1 * 5 * 2 = 30 bytes per role
            RecurrentLayer(70),  # group 1
            AttentionLayer(3, 4, window=7, roles=("k", "v", "scale")),  # group 2: 3 * 3 * 4 * 2 = 72 bytes per role
            AttentionLayer(2, 3),  # group 0: 3 * 2 * 3 * 2 = 36 bytes per role
            RecurrentLayer(5),  # group 1
        ],
        dtype,
    )


def _align(n: int) -> int:
    return -(-n // PART_ALIGN) * PART_ALIGN


def test_geometry_parts_follow_layer_then_role_order_and_are_aligned():
    geos = page_geometries(hybrid_spec(), TPB)
    assert [g.group_id for g in geos] == [0, 1, 2]
    full, rec, swa = geos

    assert [(p.layer_id, p.role, p.offset, p.nbytes, p.shape) for p in full.parts] == [
        (0, "k", 0, 30, (TPB, 1, 5)),
        (0, "v", 64, 30, (TPB, 1, 5)),
        (3, "k", 128, 36, (TPB, 2, 3)),
        (3, "v", 192, 36, (TPB, 2, 3)),
    ]
    assert full.page_bytes == 256
    assert all(p.dtype == torch.float16 for p in full.parts)

    assert [(p.layer_id, p.role, p.offset, p.nbytes, p.shape, p.dtype) for p in rec.parts] == [
        (1, "state", 0, 70, (70,), torch.uint8),
        (4, "state", 128, 5, (5,), torch.uint8),
    ]
    assert rec.page_bytes == 192

    assert [(p.role, p.offset, p.nbytes) for p in swa.parts] == [("k", 0, 72), ("v", 128, 72), ("scale", 256, 72)]
    assert swa.page_bytes == 384
    assert swa.group.kind is GroupKind.SLIDING_WINDOW and swa.group.window == 7


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8])
@pytest.mark.parametrize("tpb", [1, 3, 16])
def test_geometry_invariants(dtype, tpb):
    spec = hybrid_spec(dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for geo in page_geometries(spec, tpb):
        assert geo.page_bytes % PART_ALIGN == 0
        end = 0
        for part in geo.parts:
            assert part.offset % PART_ALIGN == 0
            assert part.offset == _align(end)  # packed: the next aligned byte after the previous part
            layer = spec.layers[part.layer_id]
            if isinstance(layer, RecurrentLayer):
                assert part.nbytes == layer.state_bytes
            else:
                assert part.nbytes == tpb * layer.num_kv_heads * layer.head_dim * itemsize
            end = part.offset + part.nbytes
        assert geo.page_bytes == _align(end)


def fill(geo, num_slots: int, seed: int) -> torch.Tensor:
    """A group buffer of random non-zero bytes."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (num_slots * geo.page_bytes,), dtype=torch.uint8, generator=gen)


def test_attention_views_alias_the_buffer_at_the_computed_offsets():
    spec = hybrid_spec()
    geo = page_geometries(spec, TPB)[0]
    num_slots = 5
    buffer = fill(geo, num_slots, seed=1)
    views = part_views(geo, buffer, 3)
    assert set(views) == {"k", "v"}
    for role, part in zip(["k", "v"], geo.parts[2:], strict=True):
        view = views[role]
        assert view.shape == (num_slots, TPB, 2, 3)
        assert view.dtype == torch.float16
        assert view.stride() == (geo.page_bytes // 2, 6, 3, 1)
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        # Reading: each slot's bytes at slot * page + offset are the view's elements.
        for slot in range(num_slots):
            at = slot * geo.page_bytes + part.offset
            assert torch.equal(view[slot].contiguous().view(torch.uint8).reshape(-1), buffer[at : at + part.nbytes])

    # Writing through a view lands exactly there and nowhere else.
    before = buffer.clone()
    value = torch.tensor(-3.25, dtype=torch.float16)
    views["v"][4, 2, 1, 0] = value
    at = 4 * geo.page_bytes + geo.parts[3].offset + ((2 * 2 + 1) * 3 + 0) * 2
    assert torch.equal(buffer[at : at + 2], value.reshape(1).view(torch.uint8))
    changed = (buffer != before).nonzero().reshape(-1).tolist()
    assert changed and all(at <= i < at + 2 for i in changed)


def test_views_of_a_group_tile_its_pages_without_overlap():
    spec = hybrid_spec(torch.float32)
    for geo in page_geometries(spec, TPB):
        num_slots = 3
        buffer = torch.zeros(num_slots * geo.page_bytes, dtype=torch.uint8)
        covered = torch.zeros_like(buffer, dtype=torch.int32)
        for layer_id in geo.group.layer_ids:
            for view in part_views(geo, buffer, layer_id).values():
                buffer.zero_()
                view.view(torch.uint8).fill_(1)
                covered += buffer != 0
        # Every byte is in at most one view; exactly the parts' bytes (not the padding) are covered.
        assert int(covered.max()) == 1
        expected = torch.zeros_like(covered)
        for slot in range(num_slots):
            for part in geo.parts:
                expected[slot * geo.page_bytes + part.offset : slot * geo.page_bytes + part.offset + part.nbytes] = 1
        assert torch.equal(covered, expected)


def test_recurrent_state_views():
    spec = hybrid_spec()
    geo = page_geometries(spec, TPB)[1]
    num_slots = 4
    buffer = fill(geo, num_slots, seed=2)
    for layer_id, part in zip([1, 4], geo.parts, strict=True):
        views = part_views(geo, buffer, layer_id)
        assert list(views) == ["state"]
        state = views["state"]
        assert state.shape == (num_slots, part.nbytes) and state.dtype == torch.uint8
        assert state.stride() == (geo.page_bytes, 1)
        for slot in range(num_slots):
            at = slot * geo.page_bytes + part.offset
            assert torch.equal(state[slot], buffer[at : at + part.nbytes])
    views = part_views(geo, buffer, 4)
    views["state"][2] = torch.arange(7, 12, dtype=torch.uint8)
    at = 2 * geo.page_bytes + geo.parts[1].offset
    assert buffer[at : at + 5].tolist() == [7, 8, 9, 10, 11]


def test_part_views_of_a_layer_outside_the_group_are_empty():
    geo = page_geometries(hybrid_spec(), TPB)[0]
    assert part_views(geo, fill(geo, 2, seed=3), 1) == {}


def test_stacks_cut_where_the_shape_changes_and_view_each_part_as_part_views_does():
    spec = ModelSpec(
        [AttentionLayer(2, 3), AttentionLayer(2, 3), AttentionLayer(1, 5), AttentionLayer(2, 3)], torch.float16
    )
    geo = page_geometries(spec, TPB)[0]
    stacks = part_stacks(geo)
    assert [[(p.layer_id, p.role) for p in stack] for stack in stacks] == [
        [(0, "k"), (0, "v"), (1, "k"), (1, "v")],
        [(2, "k"), (2, "v")],
        [(3, "k"), (3, "v")],
    ]
    num_slots = 4
    buffer = fill(geo, num_slots, seed=5)
    for stack in stacks:
        for start in range(len(stack)):
            parts = stack[start:]  # any slice of a run is one view
            view = stack_view(geo, buffer, parts)
            assert view.shape == (len(parts), num_slots, *parts[0].shape)
            for part, one in zip(parts, view, strict=True):
                expected = part_views(geo, buffer, part.layer_id)[part.role]
                assert one.stride() == expected.stride() and one.data_ptr() == expected.data_ptr()
                assert torch.equal(one.view(torch.int16), expected.view(torch.int16))  # random bytes: NaNs too
    with pytest.raises(ValueError, match="consecutive parts"):
        stack_view(geo, buffer, (stacks[0][0], stacks[0][2]))


def test_region_as_tensor():
    buffer = torch.randint(1, 256, (10 * 48,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    region = Region(buffer.data_ptr() + 16, 20, 48, 9, buffer)  # slot i: 20 bytes at 16 + 48 * i
    t = region.as_tensor()
    assert t.shape == (9, 20) and t.dtype == torch.uint8 and t.stride() == (48, 1)
    for i in range(9):
        assert t[i].data_ptr() == region.base + region.stride * i
        assert torch.equal(t[i], buffer[16 + 48 * i : 16 + 48 * i + 20])
    t[3, 0] = 0
    assert int(buffer[16 + 48 * 3]) == 0


def test_region_without_buffer():
    region = Region(0x1000, 64, 64, 2)
    assert region.buffer is None
    with pytest.raises(ValueError, match="without its buffer"):
        region.as_tensor()


def test_region_over_a_view_with_a_storage_offset():
    storage = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    buffer = storage[64:]
    region = Region(buffer.data_ptr(), 16, 32, 4, buffer)
    t = region.as_tensor()
    assert t[0].data_ptr() == region.base
    assert torch.equal(t[1], buffer[32:48])


def test_manager_layout_regions_cover_the_primary_buffers():
    spec = hybrid_spec()
    config = kvtier.CacheConfig(tokens_per_block=TPB, tiers=[kvtier.PrimaryTier(1 << 16)], snapshot_interval_blocks=2)
    mgr = kvtier.KVCacheManager(spec, config)
    try:
        layout = mgr.layout()
        assert isinstance(layout, kvtier.KvCacheLayout)
        assert layout.tokens_per_block == TPB
        assert layout.model_fingerprint == spec.fingerprint()
        geos = page_geometries(spec, TPB)
        assert [(g.group_id, g.layer_ids, g.window, g.kind, g.sink_tokens, len(g.regions)) for g in layout.groups] == [
            (s.group_id, s.layer_ids, s.window, s.kind, s.sink_tokens, 1) for s in spec.groups
        ]
        stats = mgr.stats().tiers["primary"]
        assert sum(g.regions[0].num_slots for g in layout.groups) == stats.pages_total
        assert sum(g.regions[0].num_slots * g.regions[0].size for g in layout.groups) == stats.bytes_total
        for group, geo in zip(layout.groups, geos, strict=True):
            region = group.regions[0]
            assert region.size == region.stride == geo.page_bytes == mgr.page_bytes(group.group_id)
            assert region.num_slots >= 1
            assert region.buffer is not None
            assert region.base == region.buffer.data_ptr()
            assert region.buffer.numel() == region.num_slots * region.size  # the whole buffer, nothing else
            pages = region.as_tensor()
            assert pages.shape == (region.num_slots, region.size)
            # kv_views and the region are the same memory: write through one, read the other.
            slot = region.num_slots - 1
            for layer_id in group.layer_ids:
                for role, view in mgr.kv_views(layer_id).items():
                    part = next(p for p in geo.parts if p.layer_id == layer_id and p.role == role)
                    data = torch.randint(1, 256, (part.nbytes,), dtype=torch.uint8)
                    view[slot].view(torch.uint8).view(-1).copy_(data)
                    assert torch.equal(pages[slot, part.offset : part.offset + part.nbytes], data)
    finally:
        mgr.close()
