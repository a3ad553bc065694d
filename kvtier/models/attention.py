"""Grouped-query self-attention with RoPE: full or sliding-window, dense or over pages."""

from __future__ import annotations

import torch
from torch import nn

from kvtier.models.architecture import LayerKind, ModelConfig
from kvtier.models.batch import PagedBatch
from kvtier.models.paged_attention import attend, dense_mask, gather_keys, write_kv
from kvtier.models.rope import Rotation


class Attention(nn.Module):
    """Llama attention: ``q/k/v/o_proj`` without bias, RoPE on q and k, ``num_heads`` query heads
    over ``num_kv_heads`` kv heads. Inputs and outputs are ``[tokens, hidden_size]``; ``rotation``
    is the RoPE rotation of the tokens' positions."""

    def __init__(self, config: ModelConfig, kind: LayerKind) -> None:
        super().__init__()
        hidden, heads, kv_heads, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, dim
        sliding = kind is LayerKind.SLIDING_ATTENTION
        self.window = config.sliding_window if sliding else None
        self.sink_tokens = config.sink_tokens if sliding else 0

    def _project(self, x: torch.Tensor, rotation: Rotation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        return rotation.apply(q), rotation.apply(k), v

    def forward_dense(self, x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        """Causal attention over the whole sequence ``x`` (positions ``0..n-1``)."""
        q, k, v = self._project(x, rotation)
        if self.window is None:
            out = attend(q, k, v, None, causal=True)
        else:
            mask = dense_mask(x.shape[0], self.window, self.sink_tokens, self.num_heads // self.num_kv_heads, x.device)
            out = attend(q, k, v, mask, causal=False)
        return self.o_proj(out.flatten(1))

    def forward_paged(
        self, x: torch.Tensor, rotation: Rotation, batch: PagedBatch, views: dict[str, torch.Tensor], group_id: int
    ) -> torch.Tensor:
        """Write the batch's new K/V into their pages, then attend each sequence over its pages."""
        q, k, v = self._project(x, rotation)
        plan = batch.attention[group_id]
        write_kv(views["k"], plan.write_slots, plan.write_rows, k)
        write_kv(views["v"], plan.write_slots, plan.write_rows, v)
        outs = []
        for i, seq in enumerate(plan.sequences):
            keys, values = gather_keys(views["k"], seq), gather_keys(views["v"], seq)
            outs.append(attend(q[batch.rows(i)], keys, values, seq.mask, seq.causal))
        return self.o_proj(torch.cat(outs).flatten(1))
