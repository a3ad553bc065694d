"""The transformers cache a ``PrefixCache`` hands to ``generate``, and what it records on the way.

``RecordingCache`` is a ``DynamicCache`` built from the model's config whose sliding-window layers
keep every key and value they are given at ``update()`` (the layer itself drops tokens that leave
the window), so every block of the call can be saved afterwards. Full-attention layers keep all
columns anyway. ``StateRecorder`` is a forward hook that packs the linear-attention states of a
row whenever a forward ends at one of that row's snapshot points.

Layout of a batch (left padding): row i has ``pad_i`` padding columns, then its tokens; token t
of row i is column ``pad_i + t``. A prefix of ``width`` columns holds, for row i, its first
``width - pad_i`` tokens (none when that is <= 0: padding only, zeros, as a padded prefill leaves
it: masked keys, and states that padding never changes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from kvtier.hf.model_layers import LayerKind, ModelLayers


class RecordingSlidingWindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer that also keeps every key and value written to it, in order."""

    def __init__(self, sliding_window: int, **kwargs) -> None:
        super().__init__(sliding_window, **kwargs)
        self.written_keys: list[torch.Tensor] = []
        self.written_values: list[torch.Tensor] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.written_keys.append(key_states)
        self.written_values.append(value_states)
        return super().update(key_states, value_states, *args, **kwargs)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times in turn, the recorded keys and values too (a hybrid model's
        prompt ran to its snapshot points before its rows were repeated for beam search)."""
        super().batch_repeat_interleave(repeats)
        self.written_keys = [k.repeat_interleave(repeats, dim=0) for k in self.written_keys]
        self.written_values = [v.repeat_interleave(repeats, dim=0) for v in self.written_values]

    def written(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every column written since the prefix, ``[batch, heads, columns, dim]``."""
        return torch.cat(self.written_keys, dim=-2), torch.cat(self.written_values, dim=-2)

    def forget_written(self) -> None:
        self.written_keys, self.written_values = [], []


class RecordingCache(DynamicCache):
    """``DynamicCache(config=...)`` whose sliding-window layers record what they are given."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
        for i, layer in enumerate(self.layers):
            if type(layer) is DynamicSlidingWindowLayer:
                self.layers[i] = RecordingSlidingWindowLayer(layer.sliding_window)

    def initialize_attention(self, dtype: torch.dtype, device: torch.device) -> None:
        """Initialize every attention layer empty, as its first ``update`` would.

        Done before any page is promoted: a sliding-window layer's initialization copies a scalar
        to the device, which would wait for every copy already queued there.
        """
        empty = torch.empty(0, dtype=dtype, device=device)
        for layer in self.layers:
            if isinstance(layer, DynamicLayer):
                layer.lazy_initialization(empty, empty)

    def forget_written(self) -> None:
        """Drop the recorded tensors (the cache stays usable, as a plain ``DynamicCache``)."""
        for layer in self.layers:
            if isinstance(layer, RecordingSlidingWindowLayer):
                layer.forget_written()

    def repeat_rows(self, repeats: int) -> None:
        """Each row ``repeats`` times in turn, as ``generate`` repeats a batch's rows for its beams
        (keys, values and linear-attention states: transformers repeats only the former itself)."""
        for layer in self.layers:
            if isinstance(layer, DynamicLayer):
                layer.batch_repeat_interleave(repeats)
            if isinstance(layer, LinearAttentionLayer):
                for states, ready in (
                    (layer.conv_states, layer.is_conv_states_initialized),
                    (layer.recurrent_states, layer.is_recurrent_states_initialized),
                ):
                    for index, tensor in states.items():
                        if ready[index] and tensor is not None:
                            states[index] = tensor.repeat_interleave(repeats, dim=0)


def fill_attention(layer, kind: LayerKind, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
    """Make an initialized, empty layer hold a prefix of ``width`` columns: all of them (full
    attention), or the last ``keys.shape[-2]`` (sliding window, which keeps ``window - 1``)."""
    layer.keys, layer.values = keys, values
    if kind is LayerKind.SLIDING:
        layer.cumulative_length = width


def fill_states(layer, states: dict[tuple[str, int], torch.Tensor], width: int) -> None:
    """Make a fresh linear-attention layer hold ``states`` (role, state index) -> ``[batch, ...]``,
    the states after a prefix of ``width`` columns. From transformers 5.25 on, such a layer counts
    the columns it was given (``get_seq_length``, from which a model whose first layer is one
    takes its positions): it is told the prefix's."""
    for (role, index), tensor in states.items():
        if role == "conv":
            layer.lazy_initialization(conv_states=tensor, state_idx=index, conv_kernel_size=tensor.shape[-1])
            layer.conv_states[index].copy_(tensor)
        else:
            layer.lazy_initialization(recurrent_states=tensor, state_idx=index)
            layer.recurrent_states[index].copy_(tensor)
        layer.has_previous_state[index] = True
    count = getattr(layer, "cumulative_length_linear", None)
    if isinstance(count, torch.Tensor):
        count.fill_(width)


def held_columns(cache: RecordingCache, layers: ModelLayers) -> int:
    """The columns ``cache`` holds, as its first attention layer counts them (a linear-attention
    layer counts only the columns it was given, from transformers 5.25 on, as a 0-d tensor)."""
    return int(cache.layers[layers.attention[0].index].get_seq_length())


def live_states(cache: RecordingCache, layers: ModelLayers) -> dict[tuple[int, str, int], torch.Tensor]:
    """The linear-attention states the cache holds now, keyed (layer index, role, state index)."""
    out = {}
    for layer in layers.linear:
        hf = cache.layers[layer.index]
        for state in layer.states:
            tensors = hf.conv_states if state.role == "conv" else hf.recurrent_states
            out[(layer.index, state.role, state.index)] = tensors[state.index]
    return out


class StateRecorder:
    """A forward hook: after each forward, pack the states of rows that reached a snapshot point.

    ``points(row, position) -> bool`` says whether a row's state after ``position`` tokens is wanted.
    ``records[row][position]`` is then a uint8 page image (see ``page_io.StatePacking``). ``stride``:
    the cache holds each row that many times in turn (beam search), and the first copy is read.
    """

    def __init__(
        self,
        cache: RecordingCache,
        layers: ModelLayers,
        pads: list[int],
        pack: Callable[[dict, torch.Tensor], torch.Tensor],
        points: Callable[[int, int], bool],
    ) -> None:
        self.cache = cache
        self.layers = layers
        self.pads = pads
        self.pack = pack
        self.points = points
        self.records: list[dict[int, torch.Tensor]] = [{} for _ in pads]
        self.stride = 1

    def __call__(self, module, args, output) -> None:
        columns = held_columns(self.cache, self.layers)
        rows = [i for i, pad in enumerate(self.pads) if self.points(i, columns - pad)]
        if not rows:
            return
        states = live_states(self.cache, self.layers)
        device = next(iter(states.values())).device
        pages = self.pack(states, torch.tensor([i * self.stride for i in rows], dtype=torch.long, device=device))
        for k, i in enumerate(rows):
            self.records[i][columns - self.pads[i]] = pages[k]
