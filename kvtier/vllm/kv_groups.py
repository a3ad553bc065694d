"""vLLM's KV cache groups as a kvtier ``ModelSpec`` and one ``GroupPlan`` per kvtier layer group.

Every vLLM layer becomes one kvtier ``AttentionLayer`` whose page part is exactly that layer's
vLLM block: ``num_kv_heads`` heads of ``state_content_size_bytes`` (vLLM keeps K and V side by
side per head and token), one role ``"kv"``. kvtier stores the bytes as they are; only their size
matters to it. Full-attention groups (MLA included) become full-attention layers, sliding-window
groups sliding-window layers with vLLM's window, so kvtier's reuse rule keeps and asks for the
blocks vLLM keeps and asks for. kvtier groups layers by life cycle, so one kvtier group may gather
several vLLM groups (HMA splits same-type layers into equal groups); each keeps its block table
as a column of the plan.

Groups kvtier cannot represent are refused at construction with ``NotImplementedError`` naming
the group: recurrent (Mamba-style) state, chunked-local and other special attention, padded
pages, pages that are not a multiple of kvtier's 64-byte part alignment, mixed dtypes or block
sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvtier.layout import PART_ALIGN
from kvtier.spec import AttentionLayer, ModelSpec
from kvtier.vllm.transfer import GroupPlan

_FULL = (FullAttentionSpec, MLAAttentionSpec)


@dataclass(frozen=True, slots=True)
class ModelPlan:
    """What the connector keeps: the kvtier model, its groups as vLLM lays them out, the block size."""

    spec: ModelSpec
    groups: tuple[GroupPlan, ...]
    block_size: int
    num_vllm_groups: int

    @property
    def has_sliding_window(self) -> bool:
        return any(g.window is not None for g in self.spec.groups)


def plan_model(kv_cache_config: KVCacheConfig, model_id: str) -> ModelPlan:
    """The plan of ``kv_cache_config``'s transferable groups; ``NotImplementedError`` for what kvtier cannot keep."""
    layers: list[AttentionLayer] = []
    owners: list[tuple[str, int, int]] = []  # per kvtier layer: (vLLM layer name, vLLM group, page bytes)
    dtypes: set[torch.dtype] = set()
    block_sizes: set[int] = set()
    for vllm_group, group in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        spec = group.kv_cache_spec
        window = _window_of(vllm_group, group.layer_names, spec)
        page = _page_bytes(vllm_group, spec)
        itemsize = torch.empty((), dtype=spec.dtype).element_size()
        content = spec.state_content_size_bytes
        if content % itemsize:
            raise NotImplementedError(
                f"kvtier.vllm: KV cache group {vllm_group} stores {content} bytes per head and token, "
                f"not a whole number of {spec.dtype} elements"
            )
        dtypes.add(spec.dtype)
        block_sizes.add(spec.block_size)
        for name in group.layer_names:
            layers.append(AttentionLayer(spec.num_heads, content // itemsize, window=window, roles=("kv",)))
            owners.append((name, vllm_group, page))
    if not layers:
        raise NotImplementedError("kvtier.vllm: the model has no KV cache group to keep")
    if len(dtypes) > 1 or len(block_sizes) > 1:
        raise NotImplementedError(
            f"kvtier.vllm: the KV cache groups mix dtypes {sorted(map(str, dtypes))} "
            f"or block sizes {sorted(block_sizes)}"
        )
    spec = ModelSpec(layers, dtypes.pop(), model_id)
    plans = []
    for group in spec.groups:
        names = tuple(owners[i][0] for i in group.layer_ids)
        vllm_groups = [owners[i][1] for i in group.layer_ids]
        pages = {owners[i][2] for i in group.layer_ids}
        if len(pages) > 1:
            raise NotImplementedError(f"kvtier.vllm: layers {names[:4]} share a life cycle but not a page size {pages}")
        columns = tuple(sorted(set(vllm_groups)))
        layer_columns = tuple(columns.index(v) for v in vllm_groups)
        plans.append(GroupPlan(group.group_id, names, columns, layer_columns, pages.pop()))
    num_groups = len(kv_cache_config.kv_cache_groups)
    return ModelPlan(spec, tuple(plans), block_sizes.pop(), num_groups)


def _window_of(vllm_group: int, names: list[str], spec: object) -> int | None:
    kind = type(spec)
    if getattr(spec, "non_causal", False):
        raise NotImplementedError(
            f"kvtier.vllm: KV cache group {vllm_group} ({kind.__name__}, layers {names[:3]}) attends "
            "non-causally (a Prefix-LM prompt): a position's keys and values depend on the whole prompt, "
            "so no prefix of it can be reused (vLLM turns its own prefix caching off for such models)"
        )
    if kind in _FULL:
        return None  # with the hybrid allocator off vLLM keeps every block of a windowed layer too
    if kind is SlidingWindowSpec:
        return spec.sliding_window  # type: ignore[attr-defined]
    raise NotImplementedError(
        f"kvtier.vllm: KV cache group {vllm_group} ({kind.__name__}, layers {names[:3]}) cannot be kept by "
        "kvtier: it keeps groups of one FullAttentionSpec, MLAAttentionSpec or SlidingWindowSpec only "
        "(recurrent state, chunked-local and other special attention, and layers of several shapes in one "
        "group, are not supported)"
    )


def _page_bytes(vllm_group: int, spec: object) -> int:
    page = spec.page_size_bytes  # type: ignore[attr-defined]
    if page != spec.unpadded_page_size_bytes or spec.tokens_per_state != 1:  # type: ignore[attr-defined]
        raise NotImplementedError(
            f"kvtier.vllm: KV cache group {vllm_group} has padded or pooled pages ({page} bytes per block); "
            "kvtier keeps unpadded pages of one state per token"
        )
    if page % PART_ALIGN:
        raise NotImplementedError(
            f"kvtier.vllm: KV cache group {vllm_group}'s page of {page} bytes is not a multiple of {PART_ALIGN}"
        )
    return page
