"""A gated linear recurrence: linear attention with a learned forget gate and a fixed-size state.

Per head, with ``q_t`` scaled by ``head_dim ** -0.5``, ``k_t`` of unit length and the gate
``g_t = sigmoid(g_proj(x_t))`` in (0, 1)::

    S_t = g_t * S_{t-1} + k_t v_t^T        # S: [head_dim, head_dim]
    o_t = q_t S_t

The state ``S`` of all heads, ``[heads, head_dim, head_dim]`` in the model dtype, is everything a
request carries from one token to the next. Both the dense and the paged forward run
:func:`gated_scan`, the same sequential update, so they agree bit for bit on the state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.models.architecture import ModelConfig
from kvtier.models.batch import PagedBatch
from kvtier.models.rope import Rotation


def gated_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence over ``n`` tokens from ``state``.

    ``q, k, v [n, heads, d]``, ``gate [n, heads]``, ``state [heads, d, d]``. Returns the outputs
    ``[n, heads, d]`` and the state after the last token.
    """
    outer = k.unsqueeze(-1) * v.unsqueeze(-2)
    decay = gate[:, :, None, None]
    states = []
    for t in range(q.shape[0]):
        state = torch.addcmul(outer[t], state, decay[t])
        states.append(state)
    out = torch.einsum("nhk,nhkv->nhv", q, torch.stack(states))
    return out, state


class GatedRecurrence(nn.Module):
    """The recurrent token mixer: ``q/k/v_proj`` to ``heads x head_dim``, ``g_proj`` (with bias)
    to one gate per head, ``o_proj`` back to ``hidden_size``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, heads, dim = config.hidden_size, config.num_heads, config.head_dim
        self.q_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.k_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.v_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.g_proj = nn.Linear(hidden, heads, bias=True)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.state_shape = config.recurrent_state_shape

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        heads, dim, _ = self.state_shape
        q = self.q_proj(x).view(n, heads, dim) * dim**-0.5
        k = F.normalize(self.k_proj(x).view(n, heads, dim), dim=-1)
        v = self.v_proj(x).view(n, heads, dim)
        return q, k, v, torch.sigmoid(self.g_proj(x))

    def zero_state(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.state_shape, dtype=like.dtype, device=like.device)

    def forward_dense(self, x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        """The recurrence over the whole sequence ``x [n, hidden]`` from a zero state (a recurrence
        needs no positions: ``rotation`` is unused)."""
        q, k, v, gate = self._inputs(x)
        out, _ = gated_scan(q, k, v, gate, self.zero_state(x))
        return self.o_proj(out.flatten(1))

    def forward_paged(
        self, x: torch.Tensor, rotation: Rotation, batch: PagedBatch, views: dict[str, torch.Tensor], group_id: int
    ) -> torch.Tensor:
        """Per sequence: read the state page (zero state for a fresh sequence), run the new tokens,
        write the state back to the same page."""
        pages = views["state"]
        q, k, v, gate = self._inputs(x)
        outs = []
        for i, entry in enumerate(batch.recurrent[group_id]):
            if entry.fresh:
                state = self.zero_state(x)
            else:
                state = pages.index_select(0, entry.slot).view(x.dtype).view(self.state_shape)
            rows = batch.rows(i)
            out, state = gated_scan(q[rows], k[rows], v[rows], gate[rows], state)
            pages.index_copy_(0, entry.slot, state.reshape(1, -1).view(torch.uint8))
            outs.append(out)
        return self.o_proj(torch.cat(outs).flatten(1))
