"""Whether a model's forward runs hooks of the user's: functions kvtier cannot see into.

A forward hook may return another output (an activation-steering vector added to a layer's
hidden states, an ablation), and a pre-hook other inputs: keys and values then depend on Python
code that no fingerprint covers, nor any scope (a hook's behaviour may change between calls
while the function stays the same). ``PrefixCache.generate`` neither reuses nor saves in a call
while such a hook is registered: saved pages would be served to calls without it, in this process
or, through a disk tier, in another.

Hooks known to leave outputs as they are do not count: transformers' own output-capturing hooks
(installed on the first forward from transformers 5; they only read outputs, and only while a
call asks for hidden states or attentions), its ``enable_input_require_grads`` hook, and kvtier's
own (an enclosing call's state recorder and prefill timer, while a callback calls again).

Walks the modules as they are now (a module swapped in after construction included), reading two
dictionaries each, plus torch's global hooks: about 0.1 ms a call for a 32-layer model's 423
modules on the development CPU.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as torch_module

# (module, function name) of hooks that never change a forward's inputs or outputs (NEFTune's
# adds noise only in training mode, where ``kvtier.hf.training_noise`` finds its noise rate)
_INERT = frozenset(
    {
        ("transformers.utils.output_capturing", "output_capturing_hook"),
        ("transformers.modeling_utils", "make_inputs_require_grads"),
        ("transformers.integrations.neftune", "neftune_post_forward_hook"),
    }
)


def user_hook(model: torch.nn.Module) -> str | None:
    """A forward hook or pre-hook that may change ``model``'s computation (where it is registered and
    what it is called), or None when every hook found is inert."""
    for kind, hooks in (
        ("global forward pre-hook", torch_module._global_forward_pre_hooks),
        ("global forward hook", torch_module._global_forward_hooks),
    ):
        found = _first_active(hooks)
        if found is not None:
            return f"a {kind} ({found})"
    stack: list[torch.nn.Module | None] = [model]
    pop, extend = stack.pop, stack.extend
    while stack:
        module = pop()
        if module is None:
            continue
        if module._forward_pre_hooks or module._forward_hooks:  # (rare: most modules have neither)
            for kind, hooks in (
                ("forward pre-hook", module._forward_pre_hooks),
                ("forward hook", module._forward_hooks),
            ):
                found = _first_active(hooks)
                if found is not None:
                    name = next((n for n, m in model.named_modules() if m is module), "")
                    return f"a {kind} on {name or type(module).__name__} ({found})"
        extend(module._modules.values())
    return None


def _first_active(hooks: dict) -> str | None:
    """The name of the first hook of a hook dictionary that is not known to be inert, or None."""
    for hook in hooks.values():
        function = getattr(hook, "func", hook)  # (a functools.partial: its function)
        module = getattr(function, "__module__", None) or ""
        if not module.startswith("kvtier.") and (module, getattr(function, "__name__", None)) not in _INERT:
            return getattr(function, "__qualname__", None) or repr(hook)
    return None
