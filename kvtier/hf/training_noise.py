"""Whether a model's forward is random right now: modules in training mode with dropout or noise.

A module in training mode applies its dropout (``torch.nn.Dropout`` and its kin, a PEFT
adapter's ``lora_dropout``, an attention's ``attention_dropout`` rate), layer drop or a router's
jitter noise; the keys and values of such a forward are random draws, not a function of the
prefix. ``PrefixCache.generate`` neither reuses nor saves in such a call: pages saved from it
would be served to later calls (in eval mode, say) as if they were the prefix's.

Only modules in training mode are read, so a model in eval mode costs one flag per module. A
training-mode module counts when it is a dropout module with ``p > 0`` or holds a positive number
under a name that says so (``attention_dropout``, ``layerdrop``, ``jitter_noise``, ``attn_pdrop``,
...); a model trained with every such rate at 0 (most causal LMs) still reuses.
"""

from __future__ import annotations

import re

import torch

_RANDOM_RATE = re.compile(r"drop|jitter|noise")


def random_module(model: torch.nn.Module) -> str | None:
    """A module of ``model`` whose forward is random now (its name, and why), or None when none is.

    Walks the modules as they are now (adapters injected after a ``PrefixCache`` was built
    included: a new module starts in training mode), reading only the training-mode ones.
    """
    stack: list[torch.nn.Module | None] = [model]
    while stack:
        module = stack.pop()
        if module is None:
            continue
        if module.training:
            why = _random_rate(module)
            if why is not None:
                name = next((n for n, m in model.named_modules() if m is module), "")
                return f"{name or type(module).__name__} ({why})"
        stack.extend(module._modules.values())
    return None


def _random_rate(module: torch.nn.Module) -> str | None:
    """What makes a training-mode module's forward random (``"dropout p=0.1"``,
    ``"attention_dropout=0.1"``), or None."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return f"dropout p={module.p}" if module.p > 0 else None
    for attribute in _rate_names(module):
        value = getattr(module, attribute, 0)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return f"{attribute}={value}"
    return None


def _rate_names(module: torch.nn.Module) -> tuple[str, ...]:
    """The attributes of ``module`` named as random rates, found once per module class and number of
    attributes (instances of a class that set another set of attributes have another count)."""
    attributes = vars(module)
    kind = (type(module), len(attributes))
    names = _RATE_NAMES.get(kind)
    if names is None:
        names = tuple(a for a in attributes if not a.startswith("_") and _RANDOM_RATE.search(a))
        _RATE_NAMES[kind] = names
    return names


_RATE_NAMES: dict[tuple[type, int], tuple[str, ...]] = {}
