"""What a model's layers are, as far as the KV cache is concerned, and how they group.

A layer group is the set of layers that share a life cycle: attention layers with the same
(window, sink_tokens), or all recurrent layers. Pages are allocated, reused, released and moved
per layer group; group ids are 0..G-1 in order of first appearance in ``ModelSpec.layers``.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import NewType

import torch

LayerId = NewType("LayerId", int)
GroupId = NewType("GroupId", int)

MAX_UNIFORM_LAYERS = 1 << 16
"""The most layers ``ModelSpec.uniform`` builds: far more than any model has (hundreds at most); it
builds each one, so a larger count (a typo) would only run out of memory."""


class GroupKind(str, enum.Enum):
    """The life cycle of a layer group's pages."""

    ATTENTION = "attention"  # one page per block of tokens, kept for the whole history
    SLIDING_WINDOW = "sliding_window"  # blocks older than the window are released
    RECURRENT = "recurrent"  # one live state page per request, snapshots for reuse


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """An attention layer: per token, ``num_kv_heads x head_dim`` elements for each role.

    ``window``: sliding-window size in tokens (None = full attention). ``sink_tokens``: leading
    tokens a sliding-window layer always keeps. ``roles``: the tensors kept per token.
    """

    num_kv_heads: int
    head_dim: int
    window: int | None = None
    sink_tokens: int = 0
    roles: tuple[str, ...] = ("k", "v")

    def __post_init__(self) -> None:
        _check_positive_int("num_kv_heads", self.num_kv_heads)
        _check_positive_int("head_dim", self.head_dim)
        if self.window is not None:
            _check_positive_int("window", self.window)
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int):
            raise TypeError(f"sink_tokens must be an int, got {self.sink_tokens!r}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.sink_tokens and self.window is None:
            raise ValueError("sink_tokens only applies to sliding-window layers (set window)")
        if isinstance(self.roles, str | bytes):
            raise TypeError(f"roles must be a tuple of names, e.g. ('k', 'v'), not the string {self.roles!r}")
        roles = tuple(self.roles)
        if not roles or len(set(roles)) != len(roles) or not all(isinstance(r, str) and r for r in roles):
            raise ValueError(f"roles must be distinct non-empty names, got {self.roles!r}")
        object.__setattr__(self, "roles", roles)


@dataclass(frozen=True, slots=True)
class RecurrentLayer:
    """A layer with a fixed-size per-request state (SSM, convolution, linear attention)."""

    state_bytes: int

    def __post_init__(self) -> None:
        _check_positive_int("state_bytes", self.state_bytes)


Layer = AttentionLayer | RecurrentLayer


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers that share a page life cycle. ``window`` is None unless sliding-window."""

    group_id: GroupId
    layer_ids: tuple[LayerId, ...]
    window: int | None
    kind: GroupKind
    sink_tokens: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """The layers of a model, the element type of its attention KV, and the weights' name.

    ``model_id`` names the weights (a checkpoint name and revision, or a fingerprint of the
    weights, see ``kvtier.weights``). It is part of ``fingerprint()``, which names every key
    derived from a page (tree roots, the disk directory, connector keys), so pages computed
    under one ``model_id`` are never served under another. None means "any weights of this
    shape": fine in memory, unsafe for a disk directory or a store shared across checkpoints.
    """

    layers: list[Layer]
    dtype: torch.dtype = torch.bfloat16
    model_id: str | None = None
    groups: tuple[LayerGroup, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        layers = list(self.layers)
        if not layers:
            raise ValueError("a ModelSpec needs at least one layer")
        for i, layer in enumerate(layers):
            if not isinstance(layer, AttentionLayer | RecurrentLayer):
                raise TypeError(f"layer {i} is {type(layer).__name__}, not AttentionLayer or RecurrentLayer")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise TypeError(f"model_id must be a non-empty str or None, got {self.model_id!r}")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "groups", _group_layers(layers))

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        window: int | None = None,
        model_id: str | None = None,
    ) -> ModelSpec:
        """``num_layers`` (1 to ``MAX_UNIFORM_LAYERS``) identical attention layers."""
        _check_positive_int("num_layers", num_layers)
        if num_layers > MAX_UNIFORM_LAYERS:
            raise ValueError(f"num_layers must be <= {MAX_UNIFORM_LAYERS}, got {num_layers}")
        layers = [AttentionLayer(num_kv_heads, head_dim, window=window) for _ in range(num_layers)]
        return cls(layers, dtype, model_id)

    def group_of(self, layer_id: int) -> LayerGroup:
        """The layer group holding ``layer_id``; ``ValueError`` for an unknown layer."""
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < len(self.layers):
            raise ValueError(f"unknown layer id {layer_id!r}: the model has layers 0..{len(self.layers) - 1}")
        for group in self.groups:
            if layer_id in group.layer_ids:
                return group
        raise AssertionError("every layer belongs to a group")  # pragma: no cover

    def fingerprint(self) -> str:
        """A stable hex digest of everything that decides the bytes of a page: shapes, dtype, weights."""
        desc = {
            "dtype": str(self.dtype),
            "model_id": self.model_id,
            "layers": [
                {
                    "kind": "attention",
                    "heads": x.num_kv_heads,
                    "dim": x.head_dim,
                    "window": x.window,
                    "sink": x.sink_tokens,
                    "roles": list(x.roles),
                }
                if isinstance(x, AttentionLayer)
                else {"kind": "recurrent", "state_bytes": x.state_bytes}
                for x in self.layers
            ],
        }
        return hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=16).hexdigest()


def _group_layers(layers: list[Layer]) -> tuple[LayerGroup, ...]:
    """Group layers by life cycle, ids in order of first appearance."""
    members: dict[tuple, list[LayerId]] = {}
    for i, layer in enumerate(layers):
        if isinstance(layer, RecurrentLayer):
            life = ("recurrent",)
        else:
            life = ("attention", layer.window, layer.sink_tokens)
        members.setdefault(life, []).append(LayerId(i))
    groups = []
    for gid, (life, ids) in enumerate(members.items()):
        if life[0] == "recurrent":
            kind, window, sink = GroupKind.RECURRENT, None, 0
        else:
            window, sink = life[1], life[2]
            kind = GroupKind.ATTENTION if window is None else GroupKind.SLIDING_WINDOW
        groups.append(LayerGroup(GroupId(gid), tuple(ids), window, kind, sink))
    return tuple(groups)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
