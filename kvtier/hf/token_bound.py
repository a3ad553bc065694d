"""How far each row's keys and values are decided by its token ids alone: what kvtier may reuse and save.

kvtier keys a prefix by its tokens. A ``generate`` call can give a model more than tokens, and
from the first position those inputs reach, the keys and values are no longer a function of the
tokens: a row is then neither reused nor saved past that position (its *bound*):

- multimodal inputs (``pixel_values``, ``image_grid_thw``, ``input_features``, ... : any tensor
  argument of the model that is not a generation setting, a mask or positions): the first
  placeholder token where the model puts their features, named by the model's configuration
  (``image_token_id``, ``video_token_index``, ...). Without such a name the whole row is bound
  (nothing reused or saved). The text before the first image (a system prompt) is still
  shared; ``generate`` also needs every placeholder in the input it computes, which a reuse up
  to the bound keeps there;
- ``token_type_ids``: the first position where it is not 0 (segments, image spans). Before
  transformers 5.23 ``generate`` handed a model only the types of the positions it computes, while
  Gemma 3's image attention reads them by absolute position: after a cached prefix the image's
  span moved (other tokens than without a cache, ``generate``'s own included). There a row with a
  nonzero type reuses and saves nothing (``WHOLE_TYPES_AFTER_A_CACHE``). Type 0 is not
  "no type" for every model (GPT-2, GPT-J, CodeGen and GPTBigCode add an embedding of any types
  given), so for a model whose logits move when zero types are given (``zero_types_matter``,
  probed once) a call that passes them at all keys its pages in a scope of its own
  (``typed_scope``): zero-typed prefixes are shared only between such calls. Types of another
  shape than the ids are not compared: nothing of the call is reused or saved;
- ``position_ids``: the first position that differs from the ones the attention mask gives
  (the ones kvtier's pages were computed with);
- a rotary embedding whose frequencies follow the length of the forward (``rope_type``
  "dynamic": NTK scaling once a forward reaches its original length): a call that long computes
  every key with frequencies of its own length, so none of its rows reuses or saves anything.
  Shorter calls compute with the original frequencies, as every page kvtier holds was.

A row with none of these is unbounded (None).
"""

from __future__ import annotations

import re

import torch

from kvtier.config import ReuseScope
from kvtier.hf.model_layers import transformers_release
from kvtier.hf.numerics import salted

TYPED_TAG = "token-types"  # the salt tag of a call given ``token_type_ids`` (``typed_scope``)
PROBE_PROMPT = (5, 6, 7, 8)  # ``zero_types_matter``'s tokens (any ids a vocabulary has)
_PLACEHOLDER = re.compile(r"^(image|video|audio|vision)_token_(id|index)$")
_NOT_CONTENT = frozenset({"attention_mask", "position_ids", "token_type_ids", "cache_position", "logits_to_keep"})
# whether this transformers' generate hands a model a call's token types whole after a cached prefix
WHOLE_TYPES_AFTER_A_CACHE = transformers_release() >= (5, 23)


def placeholder_ids(config) -> frozenset[int]:
    """Token ids a multimodal model replaces with features, from its configuration and sub-configurations."""
    found: set[int] = set()
    seen: set[int] = set()

    def visit(cfg) -> None:
        if cfg is None or id(cfg) in seen:
            return
        seen.add(id(cfg))
        for name, value in vars(cfg).items():
            if _PLACEHOLDER.match(name) and isinstance(value, int) and not isinstance(value, bool):
                found.add(value)
            elif hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-configuration
                visit(value)

    visit(config)
    return frozenset(found)


def dynamic_rope_limit(model: torch.nn.Module) -> int | None:
    """The forward length from which the model's rotary embedding changes its frequencies (the
    smallest, if several), or None when none of them depends on the length: dynamic NTK rescales
    from its original length on; LongRoPE (Phi-3, Phi-4-mini) switches from its short to its long
    factors past ``original_max_position_embeddings``, for every position of that forward
    (``generate`` then drops a cache that does not reach past it and recomputes the prompt)."""
    limits = []
    for module in model.modules():
        rope_type = str(getattr(module, "rope_type", ""))
        if "dynamic" in rope_type and hasattr(module, "original_max_seq_len"):
            limits.append(int(module.original_max_seq_len))
        if "longrope" in rope_type:
            limits += [original + 1 for original in _longrope_originals(getattr(module, "config", None))]
    return min(limits) if limits else None


def _longrope_originals(config) -> list[int]:
    """``original_max_position_embeddings`` of each LongRoPE parameter set of ``config`` (one, or
    one per layer type)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    sets = [parameters] if "rope_type" in parameters else list(parameters.values())
    return [
        int(p["original_max_position_embeddings"])
        for p in sets
        if isinstance(p, dict) and p.get("rope_type") == "longrope" and "original_max_position_embeddings" in p
    ]


def takes_content(kwargs: dict, generation_config) -> bool:
    """Whether ``generate`` arguments carry model inputs other than tokens (multimodal): a tensor, or
    a container of tensors, under a name that is not a generation setting, a mask or positions."""
    return any(
        name not in _NOT_CONTENT and not hasattr(generation_config, name) and _has_tensor(value)
        for name, value in kwargs.items()
    )


def row_bounds(
    host_ids: torch.Tensor,
    mask: torch.Tensor,
    pads: list[int],
    kwargs: dict,
    generation_config,
    placeholders: frozenset[int],
) -> list[int | None]:
    """Per row, the number of its prompt tokens (after its pads) whose keys and values depend on
    token ids only, or None when all of them do."""
    bounds: list[int | None] = [None] * len(pads)

    def cut(i: int, at: int) -> None:
        bounds[i] = at if bounds[i] is None else min(bounds[i], at)

    if takes_content(kwargs, generation_config):
        marks = torch.tensor(sorted(placeholders), dtype=host_ids.dtype, device=host_ids.device)
        for i, pad in enumerate(pads):
            hits = torch.isin(host_ids[i, pad:], marks).nonzero()
            if not placeholders:
                cut(i, 0)  # where the features go is unknown: nothing of the row is keyed by tokens alone
            elif len(hits):
                cut(i, int(hits[0, 0]))
    types = kwargs.get("token_type_ids")
    if isinstance(types, torch.Tensor) and types.shape == host_ids.shape:
        host_types = types.detach().to("cpu")
        if WHOLE_TYPES_AFTER_A_CACHE:
            _first_differing(host_types, torch.zeros_like(host_types), pads, cut)
        else:  # a cached prefix would shift where the model reads the row's types
            for i, pad in enumerate(pads):
                if host_types[i, pad:].any():
                    cut(i, 0)
    elif types is not None:  # another layout: not compared, not trusted
        for i in range(len(pads)):
            cut(i, 0)
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape == host_ids.shape:
        host_mask = mask.detach().to("cpu", torch.long)
        standard = (host_mask.cumsum(-1) - 1).masked_fill(host_mask == 0, 1)
        _first_differing(positions.detach().to("cpu", torch.long), standard, pads, cut)
    elif positions is not None:  # another layout (3-D rotary positions): not compared, not trusted
        for i in range(len(pads)):
            cut(i, 0)
    return bounds


def zero_types_matter(model: torch.nn.Module) -> bool:
    """Whether ``model`` computes other logits for a prompt given all-zero ``token_type_ids`` than
    given none (compared bit for bit, so a difference in rounding alone counts too; a forward that
    refuses them counts). Runs under ``torch.no_grad`` in the caller's mode (eval)."""
    ids = torch.tensor([PROBE_PROMPT], dtype=torch.long, device=next(model.parameters()).device)
    plain = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    try:
        typed = model(**plain, token_type_ids=torch.zeros_like(ids)).logits
    except Exception:  # (a forward without the argument: a call giving it fails in generate as well)
        return True
    return not torch.equal(model(**plain).logits, typed)


def typed_scope(scope: ReuseScope, kwargs: dict, zeros_matter: bool) -> ReuseScope:
    """The scope a call's pages are keyed in: ``scope``, salted apart when the call gives
    ``token_type_ids`` to a model for which zero types are not the same as none."""
    return salted(scope, TYPED_TAG) if zeros_matter and kwargs.get("token_type_ids") is not None else scope


def _first_differing(given: torch.Tensor, expected: torch.Tensor, pads: list[int], cut) -> None:
    for i, pad in enumerate(pads):
        differs = (given[i, pad:] != expected[i, pad:]).nonzero()
        if len(differs):
            cut(i, int(differs[0, 0]))


def _has_tensor(value: object) -> bool:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return isinstance(value, torch.Tensor)
