"""Filling a ``RecordingCache`` with the reused prefix of every row, from kvtier's primary tier.

A transformers attention layer holds the prefix's columns (all of them for full attention; the
last ``window - 1`` for a sliding window, which lie in exactly the blocks kvtier keeps live
there). Each layer's keys and values are a transposed view of a token-major storage
``[batch, columns, heads, dim]`` with a block of spare columns on each side, into which every
row's blocks are copied whole (``page_io.gather_blocks``): one pass over the bytes, one copy per
row for as many layers' roles of one shape as ``GATHER_BYTES`` of storage holds (a launch costs
the host more than a small copy costs the device). Columns a row does not fill (its padding) are
zeros; the spare columns, which may receive the tokens around the row's range from its first and
last block, lie outside the view. The recurrent group's pages (one state snapshot per row, taken
after exactly ``row.reused`` tokens) are gathered in one copy and unpacked into the layers' states.
Every copy is a device operation on the current stream, which ``resume`` ordered after the pages'
promotion.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.hf.batch_rows import Row
from kvtier.hf.hf_cache import RecordingCache, fill_attention, fill_states
from kvtier.hf.model_layers import ModelLayers
from kvtier.hf.page_io import StatePacking, StatePart, gather_blocks, row_blocks, to_device
from kvtier.layout import PageGeometry, PagePart, page_geometries, part_stacks, stack_view
from kvtier.manager import KVCacheManager
from kvtier.spec import GroupKind

GATHER_BYTES = 256 << 20
"""The most storage one gather fills (several layers' roles at once: one launch instead of one each)."""


def state_packing(layers: ModelLayers, mgr: KVCacheManager) -> StatePacking | None:
    """How the recurrent group's page holds each linear-attention state (None without one)."""
    group = next((g for g in mgr.layer_groups if g.kind is GroupKind.RECURRENT), None)
    if group is None:
        return None
    geometry = page_geometries(mgr.spec, mgr.tokens_per_block)[group.group_id]
    parts = []
    for part in geometry.parts:
        layer = layers.by_kvtier_id[part.layer_id]
        for s in layer.states:
            parts.append(StatePart((layer.index, s.role, s.index), part.offset + s.offset, s.nbytes, s.shape, s.dtype))
    return StatePacking(parts, geometry.page_bytes)


@dataclass(frozen=True, slots=True)
class GroupStacks:
    """An attention group's page geometry and its parts in ``part_stacks``: what the load reads,
    fixed for the manager's life (no tensor: a closed manager's memory is not held here)."""

    geometry: PageGeometry
    stacks: list[tuple[PagePart, ...]]


def group_stacks(mgr: KVCacheManager) -> dict[int, GroupStacks]:
    """``GroupStacks`` of every attention group of ``mgr``, by group id (built once per adapter)."""
    return {
        g.group_id: GroupStacks(g, part_stacks(g))
        for g in page_geometries(mgr.spec, mgr.tokens_per_block)
        if g.group.kind is not GroupKind.RECURRENT
    }


def load_prefix(
    cache: RecordingCache,
    layers: ModelLayers,
    mgr: KVCacheManager,
    rows: list[Row],
    width: int,
    packing: StatePacking | None,
    stacks: dict[int, GroupStacks],
) -> None:
    """Make ``cache`` (its attention layers initialized empty) hold the first ``width`` columns of the
    batch, read from each row's read cache; ``stacks``: ``group_stacks(mgr)``."""
    if width == 0:
        return
    batch = len(rows)
    device = mgr.device
    regions = mgr.layout().groups
    for group in mgr.layer_groups:
        if group.kind is GroupKind.RECURRENT:
            assert packing is not None
            _load_states(cache, layers, mgr, rows, group.group_id, packing, width)
            continue
        kept = width if group.window is None else min(width, group.window - 1)
        first_column = width - kept  # the layer holds columns [first_column, width)
        spare = mgr.tokens_per_block
        blocks = []
        for row in rows:
            if row.reused:
                assert row.read is not None
                start = max(0, row.reused - kept)
                slots = row.read.page_indices(group.group_id)
                column = spare + row.pad - first_column
                blocks.append(row_blocks(row.index, slots, start, row.reused, column, mgr.tokens_per_block, device))
        covered = all(row.pad == 0 and row.reused == width for row in rows)  # no column left unwritten
        allocate = torch.empty if covered else torch.zeros
        geometry = stacks[group.group_id].geometry
        buffer = regions[group.group_id].regions[0].as_tensor().view(-1)  # the group's flat primary buffer
        loaded: dict[int, dict[str, torch.Tensor]] = {}  # a layer split in two fills once both are read
        columns = spare + kept + spare
        for parts in _gathers(stacks[group.group_id].stacks, batch * columns):
            storage = allocate((len(parts), batch, columns, *parts[0].shape[1:]), dtype=parts[0].dtype, device=device)
            gather_blocks(stack_view(geometry, buffer, parts), blocks, storage)
            views = storage[:, :, spare : spare + kept].transpose(2, 3).unbind(0)  # each part's, in one call
            for part, view in zip(parts, views, strict=True):
                layer = layers.by_kvtier_id[part.layer_id]
                tensors = loaded.setdefault(layer.index, {})
                tensors[part.role] = view
                if len(tensors) == 2:
                    fill_attention(cache.layers[layer.index], layer.kind, tensors["k"], tensors["v"], width)


def _gathers(stacks: list[tuple[PagePart, ...]], columns: int) -> Iterator[tuple[PagePart, ...]]:
    """The stacks' parts in slices of at most ``GATHER_BYTES`` of storage (``columns`` token columns
    a part), one gather each: a slice's storage lives until the forward has replaced the keys and
    values of its last layer, so a slice bounds what the load adds to the forward's memory."""
    for stack in stacks:
        tokens_per_block = stack[0].shape[0]
        per_gather = max(1, GATHER_BYTES // (stack[0].nbytes // tokens_per_block * columns))
        for start in range(0, len(stack), per_gather):
            yield stack[start : start + per_gather]


def _load_states(
    cache: RecordingCache,
    layers: ModelLayers,
    mgr: KVCacheManager,
    rows: list[Row],
    group_id: int,
    packing: StatePacking,
    width: int,
) -> None:
    """Each reusing row's state page into the linear-attention layers, the states after the prefix's
    ``width`` columns; zeros for the other rows."""
    device = mgr.device
    reusing = [row for row in rows if row.reused]
    slots = to_device(np.array([row.read.page_indices(group_id)[0] for row in reusing]), device)
    region = mgr.layout().groups[group_id].regions[0].as_tensor()
    states = packing.unpack(region[slots])
    at = to_device(np.array([row.index for row in reusing]), device)
    for layer in layers.linear:
        full = {}
        for s in layer.states:
            tensor = torch.zeros((len(rows), *s.shape), dtype=s.dtype, device=device)
            tensor[at] = states[(layer.index, s.role, s.index)]
            full[(s.role, s.index)] = tensor
        fill_states(cache.layers[layer.index], full, width)
