"""The paged forward's input (``PagedSequence``) and its checked, planned form (``PagedBatch``).

``PagedBatch.prepare`` runs once per ``forward_paged`` call: it concatenates the sequences' new
tokens, plans every attention group's gathers and masks, and checks every slot that will be read
or written, with a single device synchronisation for the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.models.paged_attention import AttentionPlan, plan_attention
from kvtier.spec import AttentionLayer, ModelSpec, RecurrentLayer

KvViews = Callable[[int], dict[str, torch.Tensor]]


@dataclass(slots=True)
class PagedSequence:
    """One sequence's share of a paged forward.

    ``token_ids``: int64 ``[n]`` (n >= 1), the new tokens at positions ``start .. start + n - 1``;
    the K/V (or state) of the ``start`` tokens before them is cached. ``page_indices[g]``: int64
    slots for layer group ``g`` (other integer arrays and lists are converted). When every tensor
    of the batch is on the host, the batch is planned and checked there and shipped to the device
    asynchronously; on the device, the check costs one synchronisation. Attention group:
    one entry per block, at least ``ceil((start + n) / tokens_per_block)``, ``BAD_PAGE_INDEX``
    where a block has no page (only blocks wholly outside the window may be absent). Recurrent
    group: exactly one entry, the live state page (its content is ignored when ``start == 0``).
    """

    token_ids: torch.Tensor
    start: int
    page_indices: tuple[torch.Tensor, ...]


@dataclass(slots=True)
class AttentionGroupPlan:
    """One attention group across the batch: where each new token's K/V row goes, and each
    sequence's gather plan. ``write_slots`` / ``write_rows``: int64 ``[total new tokens]``."""

    write_slots: torch.Tensor
    write_rows: torch.Tensor
    sequences: list[AttentionPlan]


@dataclass(slots=True)
class RecurrentSlot:
    """One sequence's live state page for a recurrent group; ``fresh``: start from a zero state."""

    slot: torch.Tensor
    fresh: bool


@dataclass(slots=True)
class PagedBatch:
    """A checked batch. ``token_ids`` / ``positions``: int64 ``[T]`` over all sequences in order;
    sequence ``i`` owns rows ``bounds[i]:bounds[i + 1]``."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    bounds: list[int]
    attention: dict[int, AttentionGroupPlan]
    recurrent: dict[int, list[RecurrentSlot]]

    def rows(self, i: int) -> slice:
        return slice(self.bounds[i], self.bounds[i + 1])

    @classmethod
    def prepare(
        cls,
        seqs: Sequence[PagedSequence],
        spec: ModelSpec,
        kv_views: KvViews,
        vocab_size: int,
        query_group: int,
        device: torch.device,
    ) -> PagedBatch:
        """Validate ``seqs`` against ``spec`` and the page views, and plan the batch.

        Raises ``ValueError`` for malformed sequences, views that do not match the model, or a
        slot that is out of range or ``BAD_PAGE_INDEX`` where a page must be read or written.
        """
        if not seqs:
            raise ValueError("forward_paged needs at least one sequence")
        target = device
        if device.type != "cpu" and all(_on_cpu(seq) for seq in seqs):
            # Plan and check on the host, where the indices are: no device synchronisation, so
            # the forward's kernels queue behind copies still landing (e.g. pages being promoted).
            device = torch.device("cpu")
        starts = [_check_start(i, seq.start) for i, seq in enumerate(seqs)]
        token_ids = [_token_ids(i, seq, device) for i, seq in enumerate(seqs)]
        bounds = [0]
        for ids in token_ids:
            bounds.append(bounds[-1] + ids.numel())
        all_ids = torch.cat(token_ids)
        positions = torch.cat(
            [torch.arange(s, s + ids.numel(), device=device) for s, ids in zip(starts, token_ids, strict=True)]
        )
        problems = [((all_ids < 0) | (all_ids >= vocab_size)).any()]
        attention: dict[int, AttentionGroupPlan] = {}
        recurrent: dict[int, list[RecurrentSlot]] = {}
        for group in spec.groups:
            gid = group.group_id
            layer = spec.layers[group.layer_ids[0]]
            views = kv_views(group.layer_ids[0])
            pages = [_page_indices(i, seq, gid, len(spec.groups), device) for i, seq in enumerate(seqs)]
            if isinstance(layer, RecurrentLayer):
                num_slots = _check_state_view(views, gid, layer)
                for i, p in enumerate(pages):
                    if p.numel() != 1:
                        raise ValueError(f"sequence {i}: recurrent group {gid} needs one page index, got {p.numel()}")
                recurrent[gid] = [RecurrentSlot(p, s == 0) for p, s in zip(pages, starts, strict=True)]
                slots = torch.cat(pages)
            else:
                num_slots, tpb = _check_kv_view(views, gid, layer, spec.dtype, target)
                plan = _plan_group(starts, token_ids, pages, tpb, group.window, group.sink_tokens, query_group)
                attention[gid] = plan
                slots = torch.cat([s.read_slots for s in plan.sequences])
            problems.append(((slots < 0) | (slots >= num_slots)).any())
        if bool(torch.stack(problems).any()):  # on the device: its one synchronisation
            raise ValueError(_diagnose(all_ids, vocab_size, attention, recurrent))
        batch = cls(all_ids, positions, bounds, attention, recurrent)
        return batch if device == target else batch.to(target)

    def to(self, device: torch.device) -> PagedBatch:
        """The same plan on ``device``, copied without waiting for the device's queue."""
        attention = {
            gid: AttentionGroupPlan(
                _move(plan.write_slots, device),
                _move(plan.write_rows, device),
                [
                    AttentionPlan(
                        _move(a.read_slots, device),
                        a.num_keys,
                        None if a.mask is None else _move(a.mask, device),
                        a.causal,
                    )
                    for a in plan.sequences
                ],
            )
            for gid, plan in self.attention.items()
        }
        recurrent = {
            gid: [RecurrentSlot(_move(r.slot, device), r.fresh) for r in slots] for gid, slots in self.recurrent.items()
        }
        return PagedBatch(
            _move(self.token_ids, device), _move(self.positions, device), self.bounds, attention, recurrent
        )


def _on_cpu(seq: PagedSequence) -> bool:
    tensors = [seq.token_ids, *seq.page_indices]
    return all(not isinstance(t, torch.Tensor) or t.device.type == "cpu" for t in tensors)


def _move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device, non_blocking=True)


def _check_start(i: int, start: object) -> int:
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"sequence {i}: start must be an int >= 0, got {start!r}")
    return start


def _token_ids(i: int, seq: PagedSequence, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(seq.token_ids, dtype=torch.int64, device=device)
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError(f"sequence {i}: token_ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
    return ids


def _page_indices(i: int, seq: PagedSequence, gid: int, num_groups: int, device: torch.device) -> torch.Tensor:
    if len(seq.page_indices) != num_groups:
        raise ValueError(f"sequence {i}: {len(seq.page_indices)} page index lists for {num_groups} layer groups")
    return torch.as_tensor(seq.page_indices[gid], dtype=torch.int64, device=device).reshape(-1)


def _plan_group(
    starts: list[int],
    token_ids: list[torch.Tensor],
    pages: list[torch.Tensor],
    tpb: int,
    window: int | None,
    sink_tokens: int,
    query_group: int,
) -> AttentionGroupPlan:
    plans, write_slots, write_rows = [], [], []
    for i, (start, ids, p) in enumerate(zip(starts, token_ids, pages, strict=True)):
        n = ids.numel()
        needed = -(-(start + n) // tpb)
        if p.numel() < needed:
            raise ValueError(
                f"sequence {i}: {p.numel()} page indices cover fewer than the {needed} blocks of positions "
                f"0..{start + n - 1} (tokens_per_block={tpb}); resize the cache before the forward"
            )
        new_positions = torch.arange(start, start + n, device=p.device)
        write_slots.append(p.index_select(0, new_positions // tpb))
        write_rows.append(new_positions % tpb)
        plans.append(plan_attention(start, n, p, tpb, window, sink_tokens, query_group))
    return AttentionGroupPlan(torch.cat(write_slots), torch.cat(write_rows), plans)


def _check_kv_view(
    views: dict[str, torch.Tensor], gid: int, layer: AttentionLayer, dtype: torch.dtype, device: torch.device
) -> tuple[int, int]:
    """``(num_slots, tokens_per_block)`` of an attention group's views, after checking them."""
    k, v = views.get("k"), views.get("v")
    if k is None or v is None or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"layer group {gid}: kv_views must give 'k' and 'v' as [slots, tokens_per_block, heads, dim]")
    if tuple(k.shape[2:]) != (layer.num_kv_heads, layer.head_dim):
        raise ValueError(
            f"layer group {gid}: pages hold {tuple(k.shape[2:])} (heads, dim) per token, the model "
            f"{(layer.num_kv_heads, layer.head_dim)}: build the cache from model.spec"
        )
    if k.dtype != dtype or k.device != device:
        raise ValueError(f"layer group {gid}: pages are {k.dtype} on {k.device}, the model runs {dtype} on {device}")
    return k.shape[0], k.shape[1]


def _check_state_view(views: dict[str, torch.Tensor], gid: int, layer: RecurrentLayer) -> int:
    """``num_slots`` of a recurrent group's state view, after checking it."""
    state = views.get("state")
    if state is None or state.dtype != torch.uint8 or tuple(state.shape[1:]) != (layer.state_bytes,):
        raise ValueError(
            f"layer group {gid}: kv_views of a recurrent layer must give 'state' as uint8 "
            f"[slots, {layer.state_bytes}]: build the cache from model.spec"
        )
    return state.shape[0]


def _diagnose(
    token_ids: torch.Tensor,
    vocab_size: int,
    attention: dict[int, AttentionGroupPlan],
    recurrent: dict[int, list[RecurrentSlot]],
) -> str:
    """The message for a batch that failed the combined check (slow path: runs only on error)."""
    if bool(((token_ids < 0) | (token_ids >= vocab_size)).any()):
        return f"token ids must lie in [0, {vocab_size}); got {token_ids.min().item()}..{token_ids.max().item()}"
    for gid, plan in attention.items():
        for i, seq in enumerate(plan.sequences):
            if bool((seq.read_slots < 0).any()):
                return (
                    f"sequence {i}: layer group {gid} has BAD_PAGE_INDEX for a block inside the attention window; "
                    "only blocks wholly outside it may be released"
                )
    for gid, slots in recurrent.items():
        for i, entry in enumerate(slots):
            if bool((entry.slot < 0).any()):
                return f"sequence {i}: recurrent group {gid} has no live state page (BAD_PAGE_INDEX)"
    return "a page index is past the end of its layer group's pages (num_slots)"
