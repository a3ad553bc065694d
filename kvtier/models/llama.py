"""The Llama-style decoder: embeddings, a stack of pre-norm layers, final norm, lm head.

Parameter names follow Hugging Face Llama checkpoints (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ``model.layers.{i}.mlp.gate_proj.weight``,
``model.norm.weight``, ``lm_head.weight``), so ``state_dict()`` is a loadable checkpoint. A
recurrent layer's mixer is ``model.layers.{i}.linear_attn``. With tied embeddings there is no
``lm_head``: the logits use ``embed_tokens.weight``.

Three ways to run it, all greedy-equivalent in float64: ``forward_dense`` (whole sequence, no
cache), ``forward_paged`` (new tokens over K/V and states held in kvtier pages) and
``reference_generate`` (the cache-free greedy oracle).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.models.architecture import LayerKind, ModelConfig
from kvtier.models.attention import Attention
from kvtier.models.batch import KvViews, PagedBatch, PagedSequence
from kvtier.models.recurrent import GatedRecurrence
from kvtier.models.rope import Rope, Rotation
from kvtier.spec import ModelSpec


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension, computed in at least float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = x.to(torch.promote_types(x.dtype, torch.float32))
        return F.rms_norm(work, work.shape[-1:], eps=self.eps).to(x.dtype) * self.weight


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, no bias."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """``h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``."""

    def __init__(self, config: ModelConfig, kind: LayerKind) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if kind is LayerKind.RECURRENT:
            self.linear_attn = GatedRecurrence(config)
        else:
            self.self_attn = Attention(config, kind)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.kind = kind

    @property
    def mixer(self) -> Attention | GatedRecurrence:
        return self.linear_attn if self.kind is LayerKind.RECURRENT else self.self_attn

    def forward_dense(self, x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        h = x + self.mixer.forward_dense(self.input_layernorm(x), rotation)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_paged(
        self, x: torch.Tensor, rotation: Rotation, batch: PagedBatch, views: dict[str, torch.Tensor], group_id: int
    ) -> torch.Tensor:
        h = x + self.mixer.forward_paged(self.input_layernorm(x), rotation, batch, views, group_id)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderBackbone(nn.Module):
    """Embeddings, layers and the final norm (Hugging Face's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, kind) for kind in config.layer_kinds)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderModel(nn.Module):
    """A decoder-only language model that runs its KV cache through kvtier pages.

    ``spec`` is the ``ModelSpec`` a ``KVCacheManager`` for this model needs (its dtype is the
    model's); layer ``i`` of the model is layer ``i`` of the spec.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBackbone(config)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rope = Rope(config.head_dim, config.rope_theta, config.rope_scaling)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def spec(self) -> ModelSpec:
        return self.config.spec(self.dtype)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.model.norm(hidden), weight)

    @torch.inference_mode()
    def forward_dense(self, token_ids: torch.Tensor, logits_for: str = "all") -> torch.Tensor:
        """The causal forward over ``token_ids`` (int64 ``[n]``, positions ``0..n-1``), no cache.

        Returns logits ``[n, vocab]`` (``logits_for="all"``) or ``[1, vocab]`` for the last token
        (``"last"``, e.g. a recompute prefill that only needs the next token).
        """
        _check_logits_for(logits_for)
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
        rotation = self.rope.rotation(torch.arange(ids.numel(), device=self.device), self.dtype)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer.forward_dense(x, rotation)
        return self._logits(x if logits_for == "all" else x[-1:])

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Same as :meth:`forward_dense`: logits ``[n, vocab]``."""
        return self.forward_dense(token_ids)

    @torch.inference_mode()
    def forward_paged(self, seqs: Sequence[PagedSequence], kv_views: KvViews, logits_for: str = "last") -> torch.Tensor:
        """Run the new tokens of ``seqs`` over their cached K/V and recurrent states.

        Writes every new token's K/V into its page, and each recurrent layer's state after the
        last new token into the sequence's state page. ``kv_views(layer_id)`` gives the page views
        of a layer (``KVCacheManager.kv_views``). Returns logits ``[len(seqs), vocab]`` for the
        last token of each sequence (``"last"``) or ``[sum of n, vocab]`` for every new token in
        sequence order (``"all"``).
        """
        _check_logits_for(logits_for)
        spec = self.spec
        query_group = self.config.num_heads // self.config.num_kv_heads
        batch = PagedBatch.prepare(seqs, spec, kv_views, self.vocab_size, query_group, self.device)
        rotation = self.rope.rotation(batch.positions, self.dtype)
        x = self.model.embed_tokens(batch.token_ids)
        for layer_id, layer in enumerate(self.model.layers):
            x = layer.forward_paged(x, rotation, batch, kv_views(layer_id), spec.group_of(layer_id).group_id)
        if logits_for == "last":
            x = x[torch.tensor(batch.bounds[1:], device=self.device) - 1]
        return self._logits(x)

    def reference_generate(self, prompt_tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Greedy generation with no cache at all: every step recomputes the whole sequence."""
        tokens = [int(t) for t in prompt_tokens]
        if not tokens:
            raise ValueError("reference_generate needs at least one prompt token")
        if not all(0 <= t < self.vocab_size for t in tokens):
            raise ValueError(f"prompt tokens must lie in [0, {self.vocab_size})")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        out: list[int] = []
        for _ in range(max_tokens):
            logits = self.forward_dense(torch.tensor(tokens + out), logits_for="last")
            out.append(int(logits[0].argmax()))
        return out


def _check_logits_for(logits_for: str) -> None:
    if logits_for not in ("all", "last"):
        raise ValueError(f"logits_for must be 'all' or 'last', got {logits_for!r}")
