"""Filling a ``RecordingCache`` with the reused prefix of every row, from kvtier's primary tier.

A transformers attention layer holds the prefix's columns (all of them for full attention; the
last ``window - 1`` for a sliding window, which lie in exactly the blocks kvtier keeps live
there). Each layer's keys and values are a transposed view of a token-major storage
``[batch, columns, heads, dim]`` with a block of spare columns on each side, into which every
row's blocks are copied whole (``page_io.gather_blocks``): one pass over the bytes. Columns a row
does not fill (its padding) are zeros; the spare columns, which may receive the tokens around the
row's range from its first and last block, lie outside the view. The recurrent group's pages (one
state snapshot per row, taken after exactly ``row.reused`` tokens) are gathered in one copy and
unpacked into the layers' states. Every copy is a device operation on the current stream, which
``resume`` ordered after the pages' promotion.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.hf.batch_rows import Row
from kvtier.hf.hf_cache import RecordingCache, fill_attention, fill_states
from kvtier.hf.model_layers import ModelLayers
from kvtier.hf.page_io import StatePacking, StatePart, gather_blocks, row_blocks, to_device
from kvtier.layout import page_geometries
from kvtier.manager import KVCacheManager
from kvtier.spec import GroupKind


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


def load_prefix(
    cache: RecordingCache,
    layers: ModelLayers,
    mgr: KVCacheManager,
    rows: list[Row],
    width: int,
    packing: StatePacking | None,
) -> None:
    """Make ``cache`` (its attention layers initialized empty) hold the first ``width`` columns of the
    batch, read from each row's read cache."""
    if width == 0:
        return
    batch = len(rows)
    device = mgr.device
    for group in mgr.layer_groups:
        if group.kind is GroupKind.RECURRENT:
            assert packing is not None
            _load_states(cache, layers, mgr, rows, group.group_id, packing)
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
        loaded: dict[int, dict[str, torch.Tensor]] = {}  # a layer split in two fills once both are read
        for layer_id in group.layer_ids:
            layer = layers.by_kvtier_id[layer_id]
            views = mgr.kv_views(layer_id)
            shape = (batch, spare + kept + spare, layer.num_kv_heads, layer.head_dim)
            tensors = loaded.setdefault(layer.index, {})
            for role in layer.roles:
                storage = allocate(shape, dtype=mgr.spec.dtype, device=device)
                gather_blocks(views[role], blocks, storage)
                tensors[role] = storage[:, spare : spare + kept].transpose(1, 2)
            if len(tensors) == 2:
                fill_attention(cache.layers[layer.index], layer.kind, tensors["k"], tensors["v"], width)


def _load_states(
    cache: RecordingCache,
    layers: ModelLayers,
    mgr: KVCacheManager,
    rows: list[Row],
    group_id: int,
    packing: StatePacking,
) -> None:
    """Each reusing row's state page into the linear-attention layers; zeros for the other rows."""
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
        fill_states(cache.layers[layer.index], full)
