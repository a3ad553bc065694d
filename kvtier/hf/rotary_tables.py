"""Rotary tables a model was built with, against those its configuration names now.

A transformers rotary embedding computes its inverse frequencies once, at construction, from the
configuration (``rope_parameters``: the base, the scaling). A configuration edited afterwards
(``model.config.rope_parameters["rope_theta"] = ...``, or ``rope_scaling`` set on a loaded model
to stretch its context) changes nothing the model computes, but the default ``model_id`` digests
the configuration: pages computed with the built tables would carry the edited settings' name, and
a process built with those settings for real would be served them. ``stale_tables`` finds such
modules; their tables' fingerprint then joins the ``model_id`` (``kvtier.hf.model_layers``).

Only modules that name their rotary type (``rope_type``) and keep their configuration
(``config``) are recomputed, with transformers' own functions; a module whose tables cannot be
recomputed (a type of its own, tables per layer type) counts as matching, as before.
"""

from __future__ import annotations

import torch

from kvtier.weights import tensors_fingerprint


def stale_tables(model: torch.nn.Module) -> str | None:
    """A fingerprint of the rotary tables of ``model``'s modules whose tables (or scaling) differ from
    those their configuration names now, or None when every one that can be recomputed matches."""
    stale = []
    for name, module in model.named_modules():
        table = module._buffers.get("original_inv_freq", module._buffers.get("inv_freq"))
        rope_type = getattr(module, "rope_type", None)
        if table is None or not isinstance(rope_type, str) or getattr(module, "config", None) is None:
            continue
        implied = _implied(module, rope_type)
        if implied is None:
            continue
        frequencies, scaling = implied
        built = table.detach().to("cpu")
        # (tables built on a GPU may differ from the CPU's in the last bit: an edit changes far more)
        same = frequencies.shape == built.shape and torch.allclose(
            frequencies.to(built.dtype), built, rtol=1e-5, atol=0
        )
        if not same or float(scaling) != float(getattr(module, "attention_scaling", scaling)):
            stale.append((name, built))
    return tensors_fingerprint(stale) if stale else None


def _implied(module: torch.nn.Module, rope_type: str) -> tuple[torch.Tensor, float] | None:
    """The inverse frequencies and scaling ``module``'s configuration names now (on the CPU, whatever
    ``torch.set_default_device`` says), or None where transformers' functions cannot tell."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # as transformers initialises them: the module's own function for its type (``default``, and
    # ``axial`` or ``ntk_alpha`` where a model defines them), else the shared one
    function = getattr(module, f"compute_{rope_type}_rope_parameters", None) or ROPE_INIT_FUNCTIONS.get(rope_type)
    if function is None:
        return None
    try:
        with torch.device("cpu"):  # the functions make their tensors on the default device
            frequencies, scaling = function(module.config)
    except Exception:  # (a configuration these functions do not read: the module's own business)
        return None
    return (frequencies, scaling) if isinstance(frequencies, torch.Tensor) else None
