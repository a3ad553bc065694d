"""A transformers model's cache, as kvtier sees it: one entry per decoder layer, and a ``ModelSpec``.

The layer kinds come from the cache classes transformers builds for the model
(``DynamicCache(config=model.config)``, what ``generate`` builds), matched by exact class:

    DynamicLayer               full attention           -> kvtier.AttentionLayer
    DynamicSlidingWindowLayer  sliding window W          -> kvtier.AttentionLayer(window=W)
    LinearAttentionLayer       conv + recurrent states   -> kvtier.RecurrentLayer (states packed)
    LinearAttentionAndFull...  both in one decoder layer -> an AttentionLayer and a RecurrentLayer
      (Falcon-H1, Zamba2, Zaya: attention beside a state space model; the states' entry first)
    keys and values of two shapes (multi-head latent attention: DeepSeek-V2/V3, Kimi K2)
                               -> two AttentionLayers of the same window, roles ("k",) and ("v",)
    DummyLayer                 holds nothing             -> no kvtier layer (transformers >= 5.23)

Any other class (an indexed, quantized, static or custom layer) raises ``NotImplementedError``
naming it, as do encoder-decoder models, models without an attention layer, and models that
cannot extend a cache by several tokens at once, keep other positions than their tokens', or
attend to later tokens (``_run_probe``; all run in eval mode). A model that computes left-padded
rows otherwise than kvtier serves them is read with the reason (``padding``, ``kvtier.hf.padding``).
Shapes and dtypes (KV heads, head dim, each state's shape) are read from a probe forward through a
fresh cache, so they are exactly what the model writes. Both use ``W`` the same way: a query
attends to itself and the ``W - 1`` tokens before it.
"""

from __future__ import annotations

import enum
import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import transformers
from transformers import cache_utils
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from kvtier.hf.padding import padding_difference
from kvtier.hf.rotary_tables import stale_tables
from kvtier.spec import AttentionLayer, ModelSpec, RecurrentLayer
from kvtier.weights import default_model_id

STATE_ALIGN = 64  # bytes; every packed state starts on this boundary (any dtype can view it)


class LayerKind(str, enum.Enum):
    FULL = "full_attention"
    SLIDING = "sliding_attention"
    LINEAR = "linear_attention"
    BOTH = "attention_and_linear"  # a decoder layer with both: read as a FULL and a LINEAR entry
    EMPTY = "empty"  # a DummyLayer: nothing cached


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One state tensor of a linear-attention layer, packed at ``offset`` in the layer's state bytes.

    ``role`` is "conv" or "recurrent", ``index`` the layer's state index; ``shape`` is one row's.
    """

    role: str
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ModelLayer:
    """One decoder layer's cache (or its attention or its states, for a layer with both): its kind,
    attention geometry or packed states, its kvtier layer id."""

    index: int
    kind: LayerKind
    kvtier_id: int | None = None
    window: int | None = None
    num_kv_heads: int = 0
    head_dim: int = 0
    states: tuple[StateTensor, ...] = ()
    roles: tuple[str, ...] = ("k", "v")  # an attention entry's tensors: both, or one of a layer split in two


@dataclass(frozen=True, slots=True)
class ModelLayers:
    """Every decoder layer in transformers order (one with attention and states as two entries of
    one ``index``, the states first), and the ``ModelSpec`` of those that cache something."""

    layers: tuple[ModelLayer, ...]
    spec: ModelSpec
    cache_argument: str  # the name the model's forward takes its cache by
    weights: str | None = None  # the weights' fingerprint in the spec's default model_id (None: the caller's)
    padding: str | None = None  # why a left-padded row is not computed as kvtier serves it (``kvtier.hf.padding``)
    attention: tuple[ModelLayer, ...] = field(init=False)
    linear: tuple[ModelLayer, ...] = field(init=False)
    by_kvtier_id: dict[int, ModelLayer] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", tuple(x for x in self.layers if x.kind in _ATTENTION))
        object.__setattr__(self, "linear", tuple(x for x in self.layers if x.kind is LayerKind.LINEAR))
        object.__setattr__(self, "by_kvtier_id", {x.kvtier_id: x for x in self.layers if x.kvtier_id is not None})


_ATTENTION = (LayerKind.FULL, LayerKind.SLIDING)
_KINDS = {
    DynamicLayer: LayerKind.FULL,
    DynamicSlidingWindowLayer: LayerKind.SLIDING,
    LinearAttentionLayer: LayerKind.LINEAR,
}
if hasattr(cache_utils, "DummyLayer"):  # added in transformers 5.23 for layers that cache nothing
    _KINDS[cache_utils.DummyLayer] = LayerKind.EMPTY
if hasattr(cache_utils, "LinearAttentionAndFullAttentionLayer"):
    _KINDS[cache_utils.LinearAttentionAndFullAttentionLayer] = LayerKind.BOTH


def read_model(model: torch.nn.Module, model_id: str | None = None) -> ModelLayers:
    """The cache layers of ``model`` and their ``ModelSpec``; ``model_id`` defaults to the weights'
    fingerprint with the configuration's (rotary settings decide keys too, and are not weights) and
    transformers' version (a release may compute a model's keys otherwise: an upgrade starts cold).

    Raises ``NotImplementedError`` naming what kvtier cannot represent.
    """
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "generate", None)):
        raise TypeError(f"expected a transformers model with a config and generate(), got {type(model).__name__}")
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"{type(model).__name__} is an encoder-decoder model; kvtier.hf serves decoder-only")
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        offloaded = (
            " (some of its weights offloaded: on the meta device)" if any(d.type == "meta" for d in devices) else ""
        )
        raise NotImplementedError(
            f"{type(model).__name__} is split across devices {sorted(map(str, devices))}{offloaded}"
        )
    probe = DynamicCache(config=config)
    kinds = []
    for i, layer in enumerate(probe.layers):
        kind = _KINDS.get(type(layer))
        if kind is None:
            raise NotImplementedError(f"layer {i} has a {type(layer).__name__} cache, which kvtier cannot represent")
        kinds.append(kind)
    if not any(k in _ATTENTION or k is LayerKind.BOTH for k in kinds):
        raise NotImplementedError(
            f"{type(model).__name__} has no attention layer (only {sorted({k.value for k in kinds})}); "
            "generate() cannot resume such a cache from a prefix"
        )
    _refuse_prompt_learning(model)
    argument = cache_argument(model)
    _run_probe(model, probe, argument, kinds)
    with torch.no_grad(), evaluating(model):
        padding = padding_difference(model, argument, _first_attention(kinds))
    layers: list[ModelLayer] = []
    spec_layers: list[AttentionLayer | RecurrentLayer] = []
    kv_dtypes = set()
    for i, (kind, layer) in enumerate(zip(kinds, probe.layers, strict=True)):
        if kind is LayerKind.EMPTY:
            layers.append(ModelLayer(i, kind))
            continue
        if kind in (LayerKind.LINEAR, LayerKind.BOTH):
            states = _state_tensors(i, layer)
            layers.append(ModelLayer(i, LayerKind.LINEAR, len(spec_layers), states=states))
            spec_layers.append(RecurrentLayer(sum(_align(s.nbytes) for s in states)))
            if kind is LayerKind.LINEAR:
                continue
            kind = LayerKind.FULL  # and its attention, as a layer of its own
        keys, values = layer.keys, layer.values  # (written by the probe: ``_check_written``)
        if keys.dtype != values.dtype:
            raise NotImplementedError(
                f"layer {i} keeps keys of {keys.dtype} and values of {values.dtype}; kvtier pages need one dtype"
            )
        kv_dtypes.add(keys.dtype)
        window = layer.sliding_window if kind is LayerKind.SLIDING else None
        split = keys.shape[1:] != values.shape[1:]  # multi-head latent attention keeps two shapes
        for roles, tensor in ((("k",), keys), (("v",), values)) if split else ((("k", "v"), keys),):
            heads, dim = tensor.shape[1], tensor.shape[3]
            layers.append(ModelLayer(i, kind, len(spec_layers), window, heads, dim, roles=roles))
            spec_layers.append(AttentionLayer(heads, dim, window=window, roles=roles))
    if len(kv_dtypes) != 1:
        raise NotImplementedError(f"attention layers keep different dtypes {sorted(map(str, kv_dtypes))}")
    weights = None
    if model_id is None:  # transformers' version and the attention kernels too: they compute the keys and values
        weights, model_id = default_model_id(model, config)
        model_id += f"+transformers-{transformers_version()}+attention-{attention_implementation(model)}"
        tables = stale_tables(model)  # a configuration edited after the model was built: name the tables
        if tables is not None:
            model_id += f"+rotary-{tables[:16]}"
    spec = ModelSpec(spec_layers, dtype=kv_dtypes.pop(), model_id=model_id)
    return ModelLayers(tuple(layers), spec, argument, weights, padding)


def _first_attention(kinds: list[LayerKind]) -> int | None:
    """The first attention layer's index, unless a layer with recurrent states comes before it."""
    for index, kind in enumerate(kinds):
        if kind in _ATTENTION:
            return index
        if kind in (LayerKind.LINEAR, LayerKind.BOTH):
            return None
    return None


def transformers_version() -> str:
    """The version of the transformers whose model code computes the keys and values."""
    return transformers.__version__


def transformers_release() -> tuple[int, int]:
    """(major, minor) of the installed transformers: its behaviours kvtier adapts to are by release."""
    found = re.match(r"(\d+)\.(\d+)", transformers.__version__)
    if found is None:  # a build naming no release: taken as the newest (its model code is current)
        return (1 << 16, 0)
    return int(found.group(1)), int(found.group(2))


def attention_implementation(model: torch.nn.Module) -> str | None:
    """The attention kernels the model runs (``eager``, ``sdpa``, ...): their keys and values
    differ in the last bits, so pages of one are not served to calls of another. A multimodal
    model's sub-configurations (``text_config``, ...) may each name their own
    (``set_attn_implementation({"text_config": ...})``): those that differ from the top level's are
    added as ``name=kernel``. A mixture-of-experts model's experts kernels
    (``set_experts_implementation``: ``grouped_mm``, ``batched_mm``, ...) round otherwise too: added
    as ``experts=kernel``. (The hub's kernels are a call's numerics: ``kvtier.hf.numerics``.)"""
    config = model.config
    top = getattr(config, "_attn_implementation", None)
    others = [
        f"{name}={kernel}"
        for name in getattr(config, "sub_configs", None) or ()
        if (kernel := getattr(getattr(config, name, None), "_attn_implementation", None)) not in (None, top)
    ]
    can_set_experts = getattr(model, "_can_set_experts_implementation", None)
    if callable(can_set_experts) and can_set_experts():
        configs = [config, *(getattr(config, name, None) for name in getattr(config, "sub_configs", None) or ())]
        experts = sorted({str(k) for c in configs if (k := getattr(c, "_experts_implementation", None)) is not None})
        others.append(f"experts={'/'.join(experts)}")
    return top if not others else "+".join([str(top), *others])


def wrapped_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model whose forward ``model``'s ``generate`` runs: a PEFT model's wrapped
    model (``get_base_model()``: PEFT's ``generate`` hands over to it, and its forward takes
    ``**kwargs`` and passes them on), else ``model`` itself."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def cache_argument(model: torch.nn.Module) -> str:
    """The name ``model``'s forward and ``generate`` take a cache by: ``cache`` where the forward of
    ``wrapped_model(model)`` names it (transformers' name since ``past_key_values`` was deprecated),
    else ``past_key_values``. (Passing the old name warns, and fails once transformers drops it.)"""
    return "cache" if "cache" in inspect.signature(wrapped_model(model).forward).parameters else "past_key_values"


def _refuse_prompt_learning(model: torch.nn.Module) -> None:
    """``NotImplementedError`` for a PEFT model with a prompt-learning adapter (prefix tuning,
    prompt tuning, P-tuning): it feeds virtual tokens or keys of its own into every forward, which
    no page of kvtier holds. PEFT refuses to add an adapter of another type to such a model later."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return
    prompts = {name: c for name, c in configs.items() if getattr(c, "is_prompt_learning", False)}
    if prompts:
        named = ", ".join(f"{name!r} ({getattr(c.peft_type, 'value', c.peft_type)})" for name, c in prompts.items())
        raise NotImplementedError(
            f"{type(model).__name__} has a PEFT prompt-learning adapter: {named}; it feeds virtual tokens of its "
            "own (prefix tuning, prompt tuning, P-tuning) into every forward, which kvtier cannot page (adapters "
            "that change the layers' weights, such as LoRA, are served)"
        )


def _run_probe(model: torch.nn.Module, cache: DynamicCache, argument: str, kinds: list[LayerKind]) -> None:
    """One token through the model into ``cache``, so every layer holds tensors of its true shape,
    then two more on top of it, as resuming a prefix extends a cache by a whole suffix in one
    forward. ``NotImplementedError`` for a model that cannot take such a cache at all (MiniMax keeps
    a cache of its own), or cannot extend it so (XLM, ProphetNet: ``generate``
    given such a cache fails the same way), naming what its forward raised, and for one whose full
    attention layers do not hold one position per token fed (CPM-Ant keeps positions of its own
    prompt beside them): kvtier's pages hold the positions of a block's tokens, nothing else. Then
    ``_check_causal``."""
    device = next(model.parameters()).device
    full = [layer for kind, layer in zip(kinds, cache.layers, strict=True) if kind in (LayerKind.FULL, LayerKind.BOTH)]
    with torch.no_grad(), evaluating(model):
        try:
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True, **{argument: cache})
        except Exception as e:  # the model's own error, whatever its type (MiniMax refuses a DynamicCache)
            raise NotImplementedError(
                f"{type(model).__name__} cannot run with the cache kvtier gives it (a transformers "
                f"DynamicCache): its forward raised {type(e).__name__} on a one-token probe: {e} (where "
                "model.generate fails the same way, the model cannot run in this setting at all: its dtype, "
                "its device, its configuration)"
            ) from e
        _check_written(model, cache, kinds)
        _check_positions(model, full, 1)
        suffix = torch.zeros((1, 2), dtype=torch.long, device=device)
        try:
            model(
                input_ids=suffix,
                attention_mask=torch.ones((1, 3), dtype=torch.long, device=device),
                use_cache=True,
                **{argument: cache},
            )
        except Exception as e:  # the model's own error, whatever its type
            raise NotImplementedError(
                f"{type(model).__name__} cannot extend a cache by several tokens in one forward, which resuming "
                f"a prefix needs (its forward raised {type(e).__name__}: {e})"
            ) from e
        _check_positions(model, full, 3)
        _check_causal(model, argument, kinds, device)


def _check_written(model: torch.nn.Module, cache: DynamicCache, kinds: list[LayerKind]) -> None:
    """``NotImplementedError`` unless the forward wrote keys into the attention layers of the cache
    it was given (PEFT's prefix tuning feeds its own instead: there is nothing kvtier could page).
    Attention layers after the last one written become ``EMPTY`` in ``kinds``: transformers sizes
    a cache by ``num_hidden_layers``, which for Whisper's decoder (``WhisperForCausalLM``) counts the
    encoder's layers, and the decoder never touches the extra ones."""
    attention = [i for i, kind in enumerate(kinds) if kind in _ATTENTION or kind is LayerKind.BOTH]
    written = [i for i in attention if _holds_keys(cache.layers[i])]
    unwritten = [i for i in attention if i not in written]
    if written and all(i > written[-1] and kinds[i] in _ATTENTION for i in unwritten):
        for i in unwritten:
            kinds[i] = LayerKind.EMPTY
        return
    if unwritten:
        i = unwritten[0]
        raise NotImplementedError(
            f"{type(model).__name__} did not write layer {i} ({kinds[i].value}) of the cache its forward was "
            "given; kvtier pages what a forward writes there (a model that feeds keys of its own, as PEFT's "
            "prefix tuning does, cannot resume from them)"
        )


def _holds_keys(layer) -> bool:
    return bool(layer.is_initialized) and layer.keys is not None and layer.keys.numel() > 0


def _check_causal(model: torch.nn.Module, argument: str, kinds: list[LayerKind], device: torch.device) -> None:
    """``NotImplementedError`` unless the first token's keys and values are the same whatever token
    follows it, bit for bit (two rows of one batch, run by the same kernels): a page is reusable
    only when each token sees the tokens before it and none after. A BERT-style model loaded with
    ``config.is_decoder=False`` attends both ways, as a prefix language model (PaliGemma) does over
    its prompt: their pages would serve other prompts wrongly."""
    rows = torch.tensor([[0, 1], [0, 2]], dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    model(input_ids=rows, attention_mask=torch.ones_like(rows), use_cache=True, **{argument: cache})
    for index, (kind, layer) in enumerate(zip(kinds, cache.layers, strict=True)):
        if kind not in _ATTENTION and kind is not LayerKind.BOTH:
            continue
        for tensor in (layer.keys, layer.values):
            if tensor is not None and not torch.equal(tensor[0, :, 0], tensor[1, :, 0]):
                raise NotImplementedError(
                    f"{type(model).__name__} attends to later tokens: layer {index}'s keys and values of a "
                    "prompt's first token change with the token after it (a prompt attended both ways, as "
                    "a prefix language model's, PaliGemma's, or a BERT-style model's without "
                    "config.is_decoder=True), so its pages cannot serve another prompt"
                )


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode meanwhile (dropout off: a probe compares what it computes), each
    module's own training flag restored afterwards."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _check_positions(model: torch.nn.Module, layers: list, tokens: int) -> None:
    """``NotImplementedError`` unless each of these cache layers holds ``tokens`` positions."""
    held = {layer.keys.shape[-2] for layer in layers if layer.keys is not None}
    if held and held != {tokens}:
        raise NotImplementedError(
            f"{type(model).__name__}'s cache holds {sorted(held)} positions per layer where {tokens} tokens went in: "
            "kvtier keeps one position per token (positions of the model's own, as CPM-Ant's prompt, are not kept)"
        )


def _state_tensors(index: int, layer: LinearAttentionLayer) -> tuple[StateTensor, ...]:
    """The states a linear-attention layer holds after the probe, packed one after another."""
    out = []
    offset = 0
    for role, tensors, ready in (
        ("conv", layer.conv_states, layer.is_conv_states_initialized),
        ("recurrent", layer.recurrent_states, layer.is_recurrent_states_initialized),
    ):
        for state_index, tensor in sorted(tensors.items()):
            if not ready[state_index] or tensor is None:
                continue
            nbytes = tensor[0].numel() * tensor.element_size()
            out.append(StateTensor(role, state_index, tuple(tensor.shape[1:]), tensor.dtype, offset, nbytes))
            offset += _align(nbytes)
    if not out:
        raise NotImplementedError(f"layer {index} (linear attention) kept no state after a forward pass")
    return tuple(out)


def _align(n: int) -> int:
    return -(-n // STATE_ALIGN) * STATE_ALIGN
