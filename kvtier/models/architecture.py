"""The architecture of a decoder model, and the named variants ``build_model`` knows.

A model is a stack of layers, each one a token mixer (full attention, sliding-window attention
or a gated linear recurrence) followed by a SwiGLU MLP, with RMSNorm before each and a residual
around each. Layer kinds use Hugging Face's ``layer_types`` names for the attention kinds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvtier.models.rope import RopeScaling
from kvtier.spec import AttentionLayer, Layer, ModelSpec, RecurrentLayer


class LayerKind(str, enum.Enum):
    """What mixes tokens in a layer."""

    FULL_ATTENTION = "full_attention"
    SLIDING_ATTENTION = "sliding_attention"  # window ``sliding_window``, first ``sink_tokens`` always kept
    RECURRENT = "linear_attention"  # gated linear recurrence with a fixed-size state


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Dimensions and layer kinds of a Llama-style decoder.

    Invariants: ``num_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention);
    ``head_dim`` is even (RoPE); a model with sliding-window layers has a ``sliding_window``.
    A recurrent layer uses ``num_heads`` heads of ``head_dim`` and keeps a
    ``[num_heads, head_dim, head_dim]`` state.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_kinds: tuple[LayerKind, ...]
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        kinds = tuple(LayerKind(kind) for kind in self.layer_kinds)
        if not kinds:
            raise ValueError("a model needs at least one layer")
        object.__setattr__(self, "layer_kinds", kinds)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if LayerKind.SLIDING_ATTENTION in kinds and (self.sliding_window is None or self.sliding_window <= 0):
            raise ValueError("sliding-window layers need a positive sliding_window")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """The state of one recurrent layer: ``[heads, key dim, value dim]``."""
        return (self.num_heads, self.head_dim, self.head_dim)

    def spec(self, dtype: torch.dtype) -> ModelSpec:
        """The cache's view of the model: one ``AttentionLayer`` or ``RecurrentLayer`` per layer."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        heads, key_dim, value_dim = self.recurrent_state_shape
        layers: list[Layer] = []
        for kind in self.layer_kinds:
            if kind is LayerKind.RECURRENT:
                layers.append(RecurrentLayer(heads * key_dim * value_dim * itemsize))
            elif kind is LayerKind.SLIDING_ATTENTION:
                layers.append(AttentionLayer(self.num_kv_heads, self.head_dim, self.sliding_window, self.sink_tokens))
            else:
                layers.append(AttentionLayer(self.num_kv_heads, self.head_dim))
        return ModelSpec(layers, dtype)


_FULL, _SLIDING, _RECURRENT = LayerKind.FULL_ATTENTION, LayerKind.SLIDING_ATTENTION, LayerKind.RECURRENT

_TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)

NAMED_CONFIGS: dict[str, ModelConfig] = {
    # Tiny models for float64 CPU tests: 4 layers, hidden 64.
    "tiny-llama": ModelConfig(**_TINY, layer_kinds=(_FULL,) * 4),
    "tiny-swa": ModelConfig(
        **_TINY,
        layer_kinds=(_SLIDING, _FULL, _SLIDING, _FULL),
        sliding_window=48,
        sink_tokens=4,
    ),
    "tiny-hybrid": ModelConfig(**_TINY, layer_kinds=(_RECURRENT, _FULL, _RECURRENT, _FULL)),
    # The CPU demo's model: a 2K-token prefill takes a fraction of a second on 2 cores in float32.
    "small-llama": ModelConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        layer_kinds=(_FULL,) * 4,
    ),
    # Llama-3-8B dimensions, for GPU timing with random weights.
    "llama-8b-shape": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        layer_kinds=(_FULL,) * 32,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
}


def named_config(name: str) -> ModelConfig:
    """The config of a named variant; ``ValueError`` listing the known names otherwise."""
    try:
        return NAMED_CONFIGS[name]
    except KeyError:
        known = ", ".join(sorted(NAMED_CONFIGS))
        raise ValueError(
            f"unknown model {name!r}: use one of {known}, or a directory holding config.json and *.safetensors"
        ) from None
