"""Copies between kvtier pages and a batch's dense per-layer tensors, batched over every block.

Loading (pages -> dense): a row's blocks are copied whole, in one ``index_select`` per row for a
stack of layers' roles, straight into token-major ``[batch, columns, heads, dim]`` storages whose
rows have room for whole blocks (``RowBlocks``): one pass over the bytes, no per-block work.

Saving (dense -> pages): a ``TokenMap`` lists tokens twice, where they live in kvtier (page slot,
offset in the block) and in a dense ``[batch, heads, columns, dim]`` tensor (row, column), as
four index tensors on the device; ``scatter`` moves one layer's role for every listed token of
every row in one indexed copy, writing only those tokens (a block may already hold others).

Recurrent states move as whole pages through ``StatePacking``. Nothing here imports transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier.pages import BAD_PAGE_INDEX


def to_device(indices: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host indices as an int64 tensor on ``device``, copied without waiting for the device.

    On CUDA the copy goes through pinned memory: from pageable memory the driver may first wait
    for the stream, which holds the page promotions queued just before.
    """
    tensor = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64))
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


@dataclass(slots=True)
class TokenMap:
    """Token i sits at ``(slots[i], offsets[i])`` in kvtier and at ``(rows[i], columns[i])`` densely."""

    slots: torch.Tensor
    offsets: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor

    def __len__(self) -> int:
        return len(self.slots)

    def from_column(self, first_column: int) -> TokenMap:
        """The same tokens, for a dense tensor that starts at column ``first_column`` (a sliding
        window layer's): each column less ``first_column``, computed once for all its layers."""
        return TokenMap(self.slots, self.offsets, self.rows, self.columns - first_column)


class TokenMapBuilder:
    """Collects token ranges row by row on the host, then ships the indices to the device once."""

    def __init__(self, tokens_per_block: int) -> None:
        self._tpb = tokens_per_block
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, row: int, page_slots: np.ndarray, start: int, end: int, first_column: int) -> None:
        """Tokens ``[start, end)`` of a row whose block b is in slot ``page_slots[b]``; token t at column
        ``first_column + t``. ``ValueError`` if one of those blocks has no page (a broken caller)."""
        if end <= start:
            return
        positions = np.arange(start, end, dtype=np.int64)
        slots = page_slots[positions // self._tpb].astype(np.int64)
        if (slots == BAD_PAGE_INDEX).any():
            raise ValueError(f"row {row}: tokens {start}..{end} include a block without a page")
        rows = np.full(len(positions), row, dtype=np.int64)
        self._parts.append((slots, positions % self._tpb, rows, positions + first_column))

    def build(self, device: torch.device) -> TokenMap:
        """The map on ``device``: its four index arrays go as the rows of one copy."""
        if self._parts:
            table = np.stack([np.concatenate(a) for a in zip(*self._parts, strict=True)])
        else:
            table = np.zeros((4, 0), dtype=np.int64)
        return TokenMap(*to_device(table, device).unbind(0))


@dataclass(slots=True)
class RowBlocks:
    """Whole blocks of one row to load: their page ``slots`` (on the device), the first landing at
    ``column`` of the row's storage, the next ones right after it."""

    row: int
    slots: torch.Tensor
    column: int


def row_blocks(
    row: int, page_slots: np.ndarray, start: int, end: int, first_column: int, tokens_per_block: int, device
) -> RowBlocks:
    """The blocks holding tokens ``[start, end)`` of a row whose token t belongs at storage column
    ``first_column + t``. The storage needs ``tokens_per_block - 1`` spare columns on each side:
    the first and last blocks bring the tokens around the range too. ``ValueError`` if one of
    those blocks has no page (a broken caller)."""
    first, last = start // tokens_per_block, -(-end // tokens_per_block)
    slots = page_slots[first:last].astype(np.int64)
    if len(slots) != last - first or (slots == BAD_PAGE_INDEX).any():
        raise ValueError(f"row {row}: tokens {start}..{end} include a block without a page")
    return RowBlocks(row, to_device(slots, device), first_column + first * tokens_per_block)


def gather_blocks(view: torch.Tensor, rows: list[RowBlocks], storage: torch.Tensor) -> None:
    """Copy each row's blocks of a stack of parts (layers' roles) into ``storage``.

    ``view``: the parts' pages, ``[parts, num_slots, tokens_per_block, heads, dim]``
    (``kvtier.layout.stack_view``); ``storage``: ``[parts, batch, columns, heads, dim]``. One
    ``index_select`` per row for every part at once, writing in place (each part's row is
    contiguous, block after block), as 8-byte words where both layouts allow.
    """
    parts, _, tokens_per_block = view.shape[:3]
    words = _as_words(view)
    for blocks in rows:
        n = len(blocks.slots)
        out = storage[:, blocks.row, blocks.column : blocks.column + n * tokens_per_block]
        out = out.view(parts, n, tokens_per_block, *view.shape[3:])
        src, dst = words, _as_words(out)
        if src.dtype != dst.dtype:  # one side's layout is not whole words
            src, dst = view, out
        torch.index_select(src, 1, blocks.slots, out=dst)


def _as_words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as 8-byte words where its layout allows (its last dimension contiguous, every
    stride and its offset whole words), else itself: a gather moves bytes several times faster in
    fewer, wider elements."""
    size = tensor.element_size()
    strides = tensor.stride()
    if size == 8 or strides[-1] != 1 or (tensor.shape[-1] * size) % 8:
        return tensor
    if (tensor.storage_offset() * size) % 8 or any((stride * size) % 8 for stride in strides[:-1]):
        return tensor
    return tensor.view(torch.int64)


def scatter(dense: torch.Tensor, view: torch.Tensor, tokens: TokenMap) -> None:
    """``view[slot, offset] = dense[row, :, column]`` for every token: dense -> pages."""
    if len(tokens):
        view[tokens.slots, tokens.offsets] = dense[tokens.rows, :, tokens.columns]


@dataclass(frozen=True, slots=True)
class StatePart:
    """One state tensor inside a recurrent page: ``nbytes`` at byte ``offset``, one row's ``shape``."""

    key: tuple[int, str, int]  # (transformers layer index, role, state index)
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class StatePacking:
    """A recurrent page as bytes: every linear-attention state of every layer at a fixed offset."""

    def __init__(self, parts: list[StatePart], page_bytes: int) -> None:
        self.parts = parts
        self.page_bytes = page_bytes

    def pack(self, states: dict[tuple[int, str, int], torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """Pages ``[len(rows), page_bytes]`` (uint8) holding ``states[key][rows]`` for every part."""
        first = states[self.parts[0].key]
        out = torch.zeros(len(rows), self.page_bytes, dtype=torch.uint8, device=first.device)
        for part in self.parts:
            tensor = states[part.key].index_select(0, rows)
            out[:, part.offset : part.offset + part.nbytes] = tensor.contiguous().view(torch.uint8).view(len(rows), -1)
        return out

    def unpack(self, pages: torch.Tensor) -> dict[tuple[int, str, int], torch.Tensor]:
        """Each part of ``pages`` (``[n, page_bytes]`` uint8) as an ``[n, *shape]`` tensor of its dtype."""
        n = pages.shape[0]
        out = {}
        for part in self.parts:
            raw = pages[:, part.offset : part.offset + part.nbytes].contiguous()
            out[part.key] = raw.view(part.dtype).view(n, *part.shape)
        return out
