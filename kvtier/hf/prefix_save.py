"""Saving what a ``generate`` call computed: every row's new tokens into its write cache's pages.

Row i computed its tokens from ``row.reused`` up to ``N_i`` (its prompt and every generated token
but the last, which no forward has seen). Its write cache already holds (committed) the prefix it
matched, so only tokens ``[committed, N_i)`` are written: resumed, resized to ``N_i``, one
``TokenMap`` per attention group and one indexed copy per layer and role for all rows, then
committed, which publishes every full block. A model with linear-attention layers commits in
segments that end exactly at the snapshot points recorded during generation (multiples of
``snapshot_interval_blocks`` blocks and the end of the prompt), after writing that point's state
into the live state page, so kvtier keeps a snapshot there.

Rows are saved together while the primary tier holds them all; the rest in later rounds. A row
that does not fit the primary tier on its own is not saved (a warning says so).

Only tokens whose keys and values depend on token ids alone are saved (a row's ``bound``, see
``token_bound``: multimodal inputs, token types, positions of the caller's). Only what the model
computed as finite numbers is saved: a row's tokens end before the first
column where a key or value of any attention layer (or, with linear-attention layers, a recorded
state) is NaN or infinite, cut back to a recorded snapshot point in a model with linear-attention
layers. Some transformers models produce NaNs in a left-padded batch (Gemma 2's eager attention
over pad columns, spreading into the row's real columns): ``generate`` answers garbage for that
row, and saving its pages would hand the garbage to every later prompt sharing its prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvtier.errors import InvariantError
from kvtier.hf.batch_rows import Row
from kvtier.hf.hf_cache import RecordingCache, RecordingSlidingWindowLayer, held_columns
from kvtier.hf.model_layers import LayerKind, ModelLayers
from kvtier.hf.page_io import StatePacking, TokenMapBuilder, scatter
from kvtier.manager import KVCacheManager
from kvtier.spec import GroupKind

log = logging.getLogger(__name__)


def save_rows(
    mgr: KVCacheManager,
    layers: ModelLayers,
    rows: list[Row],
    cache: RecordingCache,
    sequences: torch.Tensor,
    width: int,
    records: list[dict[int, torch.Tensor]] | None,
    packing: StatePacking | None,
    unsaved: Callable[[str], None],
    stream=None,
    beams: int = 1,
) -> None:
    """Write and commit every row's computed tokens, then close its write cache. ``records`` are the
    rows' recorded state pages (packed by ``packing``) with linear-attention layers, else None.
    ``unsaved`` is told of each row whose new blocks the primary tier cannot take (it repeats on
    every call while the tier is too small: a rate-limited warning). ``beams``: the cache holds each
    row's beams in turn (beam search); the row's tokens are read from its first beam, whose columns
    of ``sequences`` (then the prompts) every beam of the row computed alike."""
    columns = min(held_columns(cache, layers), sequences.shape[1])
    tokens = [sequences[row.index, row.pad : columns].tolist() for row in rows]
    sources = _sources(cache, layers, width)
    if beams > 1:
        sources = {i: (keys[::beams], values[::beams], first) for i, (keys, values, first) in sources.items()}
    ends, nonfinite = _finite_ends(sources, rows, tokens, width, records, packing)
    for row, end in zip(rows, ends, strict=True):
        if row.index in nonfinite:
            log.warning(
                "kvtier.hf: row %d computed NaN or infinite keys, values or states; its tokens from %d on "
                "are not saved",
                row.index,
                end,
            )
        tokens[row.index] = tokens[row.index][:end]
    pending = list(rows)
    while pending:
        batch = _take_round(pending, tokens, stream)
        if not batch:
            row = pending.pop(0)
            unsaved(
                f"row {row.index}: the primary tier cannot hold its {len(tokens[row.index])} tokens, or a page "
                "it reused was damaged meanwhile"
            )
            row.write.close()
            continue
        _write_pages(mgr, layers, batch, tokens, sources)
        for row in batch:
            _commit(mgr, row, tokens[row.index], records[row.index] if records is not None else None)
            row.write.close()
        pending = pending[len(batch) :]


def _take_round(pending: list[Row], tokens: list[list[int]], stream) -> list[Row]:
    """The leading rows of ``pending`` that fit the primary tier together, resumed and resized.

    A row whose committed prefix fell below ``row.reused`` (a damaged page made it start over)
    cannot be saved: the tokens before ``row.reused`` were never computed here.
    """
    batch = []
    for row in pending:
        cache = row.write
        if (
            not cache.resume(stream)
            or cache.num_committed_tokens < row.reused
            or not cache.resize(len(tokens[row.index]))
        ):
            cache.suspend()
            break
        batch.append(row)
    return batch


def _finite_ends(
    sources: dict[int, tuple],
    rows: list[Row],
    tokens: list[list[int]],
    width: int,
    records: list[dict[int, torch.Tensor]] | None,
    packing: StatePacking | None,
) -> tuple[list[int], set[int]]:
    """Per row, how many of its tokens to save: up to its first column (from ``width`` on, past its
    pads) where a key or value is not finite, and at most its ``bound``; with recurrent states, cut
    back to the last recorded point whose state and every earlier one are finite. Never below what
    it has committed. Also the rows cut for a value that is not finite."""
    bad = None  # [batch, columns from width]: a key or value there is not finite in some layer
    suspects = [] if _all_finite(sources) else sources.values()  # all finite: no column needs a look
    for keys, values, first_column in suspects:
        k, v = keys[:, :, width - first_column :], values[:, :, width - first_column :]
        layer_bad = ~(torch.isfinite(k).all(dim=3).all(dim=1) & torch.isfinite(v).all(dim=3).all(dim=1))
        n = layer_bad.shape[1] if bad is None else min(bad.shape[1], layer_bad.shape[1])
        bad = layer_bad[:, :n] if bad is None else bad[:, :n] | layer_bad[:, :n]
    bad_rows = bad.nonzero().tolist() if bad is not None else []
    first_bad: dict[int, int] = {}
    pads = {row.index: row.pad for row in rows}
    for i, column in bad_rows:
        column += width
        if column >= pads[i] and column - pads[i] < first_bad.get(i, len(tokens[i])):
            first_bad[i] = column - pads[i]
    ends = []
    nonfinite = set(first_bad)
    for row in rows:
        committed = row.write.num_committed_tokens
        end = first_bad.get(row.index, len(tokens[row.index]))
        if row.bound is not None:  # past it, the KV depends on more than the tokens (``token_bound``)
            end = min(end, row.bound)
        if records is not None and packing is not None:
            length = len(tokens[row.index])
            finite_end = _finite_state_end(records[row.index], packing, end, length, committed)
            if finite_end < _finite_state_end(records[row.index], packing, end, length, committed, check_finite=False):
                nonfinite.add(row.index)
            end = finite_end
        ends.append(max(end, committed))
    return ends, nonfinite


def _all_finite(sources: dict[int, tuple]) -> bool:
    """Whether every key and value of every layer is finite, told in a few launches: the 2-norms of
    all the tensors at once (``torch._foreach_norm``, in float32 for half types). A norm is finite
    only if every element is; one that overflows reads as not finite, and the caller then looks
    column by column, as for a NaN. The norms read every column, the reused ones too (whole
    tensors keep the one-launch path): one pass over the call's keys and values on the device, a
    few ms for a long history, against about ten launches per layer."""
    tensors = [t for keys, values, _ in sources.values() for t in (keys, values)]
    if not tensors:
        return True
    half = tensors[0].dtype in (torch.float16, torch.bfloat16)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32 if half else None)
    return bool(torch.isfinite(torch.stack(norms)).all())


def _finite_state_end(
    pages: dict[int, torch.Tensor],
    packing: StatePacking,
    end: int,
    length: int,
    committed: int,
    check_finite: bool = True,
) -> int:
    """``end`` for a row with recurrent states (``pages``: recorded state pages by point): unchanged
    when nothing is cut (``end == length`` and every state finite), else the last recorded point
    ``<= end`` with every state up to it finite (or ``committed``): the recurrent page is only ever
    committed holding a recorded state. ``check_finite=False``: the states are not looked at."""
    good = committed
    for point in sorted(p for p in pages if p > committed):
        if point > end or (check_finite and not _finite_states(packing, pages[point])):
            return good
        good = point
    return end if end == length else good


def _finite_states(packing: StatePacking, page: torch.Tensor) -> bool:
    """Whether every floating-point state packed in ``page`` is finite."""
    states = packing.unpack(page[None]).values()
    return all(bool(torch.isfinite(state).all()) for state in states if state.is_floating_point())


def _sources(cache: RecordingCache, layers: ModelLayers, width: int) -> dict[int, tuple]:
    """Per transformers layer: (keys, values, first column) holding every column the call computed."""
    out = {}
    for layer in layers.attention:
        hf = cache.layers[layer.index]
        if layer.kind is LayerKind.SLIDING:
            assert isinstance(hf, RecordingSlidingWindowLayer)
            keys, values = hf.written()
            out[layer.index] = (keys, values, width)
        else:
            out[layer.index] = (hf.keys, hf.values, 0)
    return out


def _write_pages(
    mgr: KVCacheManager, layers: ModelLayers, batch: list[Row], tokens: list[list[int]], sources: dict
) -> None:
    """Keys and values of tokens ``[committed, N_i)`` of every row into its pages, per layer and role."""
    for group in mgr.layer_groups:
        if group.kind is GroupKind.RECURRENT:
            continue
        builder = TokenMapBuilder(mgr.tokens_per_block)
        for row in batch:
            start = row.write.num_committed_tokens
            builder.add(row.index, row.write.page_indices(group.group_id), start, len(tokens[row.index]), row.pad)
        token_map = builder.build(mgr.device)
        maps = {0: token_map}  # by the first column a layer's tensors hold
        for layer_id in group.layer_ids:
            layer = layers.by_kvtier_id[layer_id]
            keys, values, first_column = sources[layer.index]
            if first_column not in maps:
                maps[first_column] = token_map.from_column(first_column)
            views = mgr.kv_views(layer_id)
            for role in layer.roles:
                scatter(keys if role == "k" else values, views[role], maps[first_column])


def _commit(mgr: KVCacheManager, row: Row, tokens: list[int], records: dict[int, torch.Tensor] | None) -> None:
    """Commit ``tokens[committed:]``; with a recurrent group, in segments ending at recorded snapshots."""
    start = row.write.num_committed_tokens
    end = len(tokens)
    if end <= start:  # cut back to what it holds already (a bound, a value not finite)
        return
    if records is None:
        row.write.commit(tokens[start:end])
        return
    group = next(g.group_id for g in mgr.layer_groups if g.kind is GroupKind.RECURRENT)
    interval = mgr.config.snapshot_interval_blocks * mgr.tokens_per_block
    region = mgr.layout().groups[group].regions[0].as_tensor()
    slot = int(row.write.page_indices(group)[0])
    for point in sorted({p for p in records if start < p <= end} | {end}):
        if point in records:
            region[slot].copy_(records[point])
        elif point % interval == 0 or point == len(row.prompt):
            raise InvariantError(f"row {row.index}: no state was recorded at snapshot point {point}")
        row.write.commit(tokens[start:point])
        start = point
