"""Whether a model's attention applies the sliding window its cache layers keep.

transformers gives every layer a sliding-window cache (``DynamicSlidingWindowLayer``, keeping the
last ``window - 1`` tokens) when a model's configuration sets ``sliding_window`` without
``layer_types``, whether or not the model's attention masks by it: a Llama configuration carrying
a stray ``sliding_window`` key attends to the whole prompt in a prefill, and to what the cache
kept in decoding steps (Moshi's default configuration too). ``generate``'s tokens are those.
kvtier, reading the layers as windows, serves a reused prefix of a prompt longer than the window
with its last ``window - 1`` tokens only, where ``generate`` attends to all of it: calls that long
must run as plain ``generate``. Calls no longer than the window compute alike either way.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from kvtier.hf.model_layers import LayerKind, ModelLayers, evaluating


def uniform_window(layers: ModelLayers) -> int | None:
    """The window of a model whose attention layers are all sliding-window layers of one window
    (the layers transformers makes of a bare ``sliding_window`` setting), else None."""
    windows = {layer.window if layer.kind is LayerKind.SLIDING else None for layer in layers.attention}
    return windows.pop() if len(windows) == 1 else None


def applies_window(model: torch.nn.Module, layers: ModelLayers, window: int) -> bool:
    """Whether the model's prompt forward applies ``window`` in its first attention layer: two
    prompts of ``window + 2`` tokens differing in their first token only give the next attention
    layer the same keys at the last position, bit for bit (two rows of one batch, run by the same
    kernels), when that position attends no further back than the window. (The model's output
    would differ either way: each layer reaches ``window - 1`` tokens further back.) A model of
    one attention layer is judged by its last logits, which only that layer feeds."""
    device = next(model.parameters()).device
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = (torch.arange(window + 2, device=device) % vocab).repeat(2, 1)
    ids[1, 0] = (ids[0, 0] + 1) % vocab
    cache = DynamicCache(config=model.config)
    arguments = {layers.cache_argument: cache, "use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        arguments["logits_to_keep"] = 1  # (a long prompt's logits at every position are large)
    with torch.no_grad(), evaluating(model):
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **arguments).logits[:, -1]
    first = layers.attention[0].index
    later = [layer.index for layer in layers.attention if layer.index != first]  # (a split layer is two entries)
    if not later:
        return torch.equal(logits[0], logits[1])
    keys = cache.layers[later[0]].keys[:, :, -1]
    return torch.equal(keys[0], keys[1])
