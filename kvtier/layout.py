"""Page geometry per layer group, and the ``KvCacheLayout`` handed to connectors.

One page of a layer group is one contiguous slot holding every layer and role of the group (a
cross-layer page), so a page moves between tiers as one copy. Inside a page the parts follow
layer order, then role order; each part starts on a ``PART_ALIGN`` boundary and the page size is
a multiple of ``PART_ALIGN``, so every slot of a buffer is 16-byte aligned (the copy kernel's
requirement) and can be viewed as the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.spec import AttentionLayer, GroupId, GroupKind, LayerGroup, LayerId, ModelSpec

PART_ALIGN = 64


@dataclass(frozen=True, slots=True)
class PagePart:
    """One layer's role inside a page: ``nbytes`` at byte ``offset``, viewed as ``shape`` of ``dtype``."""

    layer_id: LayerId
    role: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """The byte layout of one page of a layer group."""

    group: LayerGroup
    page_bytes: int
    parts: tuple[PagePart, ...]

    @property
    def group_id(self) -> GroupId:
        return self.group.group_id


def page_geometries(spec: ModelSpec, tokens_per_block: int) -> tuple[PageGeometry, ...]:
    """The geometry of every layer group's page, indexed by group id."""
    out = []
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    for group in spec.groups:
        parts = []
        offset = 0
        for lid in group.layer_ids:
            layer = spec.layers[lid]
            if isinstance(layer, AttentionLayer):
                shape = (tokens_per_block, layer.num_kv_heads, layer.head_dim)
                nbytes = tokens_per_block * layer.num_kv_heads * layer.head_dim * itemsize
                chunks = [(role, nbytes, shape, spec.dtype) for role in layer.roles]
            else:
                chunks = [("state", layer.state_bytes, (layer.state_bytes,), torch.uint8)]
            for role, nbytes, shape, dtype in chunks:
                parts.append(PagePart(lid, role, offset, nbytes, shape, dtype))
                offset += _align(nbytes)
        out.append(PageGeometry(group, offset, tuple(parts)))
    return tuple(out)


def part_views(geometry: PageGeometry, buffer: torch.Tensor, layer_id: int) -> dict[str, torch.Tensor]:
    """Strided views of ``layer_id``'s roles into a group buffer of whole pages.

    ``buffer`` is a flat uint8 tensor of ``num_slots * page_bytes`` bytes. Attention roles are
    ``[num_slots, tokens_per_block, heads, dim]`` of the model dtype; a recurrent layer's is
    ``{"state": uint8 [num_slots, state_bytes]}``.
    """
    return {part.role: stack_view(geometry, buffer, (part,))[0] for part in geometry.parts if part.layer_id == layer_id}


def part_stacks(geometry: PageGeometry) -> list[tuple[PagePart, ...]]:
    """The page's parts, in order, cut into runs of consecutive parts of one shape and dtype.

    Parts of one shape lie ``_align(nbytes)`` bytes apart, so ``stack_view`` sees any slice of a
    run as one strided tensor: an attention group of equal layers is a single run.
    """
    stacks: list[list[PagePart]] = []
    for part in geometry.parts:
        last = stacks[-1][-1] if stacks else None
        if last is not None and (part.shape, part.dtype) == (last.shape, last.dtype):
            stacks[-1].append(part)
        else:
            stacks.append([part])
    return [tuple(stack) for stack in stacks]


def stack_view(geometry: PageGeometry, buffer: torch.Tensor, parts: tuple[PagePart, ...]) -> torch.Tensor:
    """A strided ``[len(parts), num_slots, *shape]`` view of consecutive parts of one shape and
    dtype (a slice of a ``part_stacks`` run) into a group buffer of whole pages (flat uint8)."""
    first = parts[0]
    itemsize = torch.empty((), dtype=first.dtype).element_size()
    step = _align(first.nbytes)
    if any(
        p.shape != first.shape or p.dtype != first.dtype or p.offset != first.offset + i * step
        for i, p in enumerate(parts)
    ):
        raise ValueError("stack_view needs consecutive parts of one shape and dtype")
    inner = []
    size = 1
    for dim in reversed(first.shape):
        inner.append(size)
        size *= dim
    num_slots = buffer.numel() // geometry.page_bytes
    shape = (len(parts), num_slots, *first.shape)
    strides = (step // itemsize, geometry.page_bytes // itemsize, *reversed(inner))
    return torch.as_strided(buffer.view(first.dtype), shape, strides, first.offset // itemsize)


@dataclass(frozen=True, slots=True)
class Region:
    """Slot i of the region is ``size`` bytes at address ``base + stride * i``."""

    base: int
    size: int
    stride: int
    num_slots: int
    buffer: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def as_tensor(self) -> torch.Tensor:
        """A uint8 ``[num_slots, size]`` view of the region (needs the owning process)."""
        if self.buffer is None:
            raise ValueError("this Region was built without its buffer; only its addresses are known")
        offset = self.base - self.buffer.untyped_storage().data_ptr()  # as_strided counts from the storage
        return torch.as_strided(self.buffer, (self.num_slots, self.size), (self.stride, 1), offset)


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Where a layer group's pages live in the primary tier."""

    group_id: GroupId
    layer_ids: tuple[LayerId, ...]
    window: int | None
    regions: list[Region]
    kind: GroupKind = GroupKind.ATTENTION
    sink_tokens: int = 0


@dataclass(frozen=True, slots=True)
class KvCacheLayout:
    """The primary tier's memory, per layer group. Addresses are valid only while pages stay there.

    ``model_fingerprint`` names what the pages hold (the model spec's fingerprint, which covers
    the weights through ``ModelSpec.model_id``), so connectors can key their stores.
    """

    tokens_per_block: int
    groups: list[GroupLayout]
    model_fingerprint: str = ""


def _align(n: int) -> int:
    return -(-n // PART_ALIGN) * PART_ALIGN
