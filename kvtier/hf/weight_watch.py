"""Noticing that a model's weights changed under a ``PrefixCache`` (an optimizer step, ``load_state_dict``).

Pages computed with one set of weights must never be served to another. A ``PrefixCache`` names
its weights once, at construction (a fingerprint of every byte, or the caller's ``model_id``);
a training loop that generates between optimizer steps changes them in place afterwards. Every
in-place write to a parameter or buffer through autograd's view of it (``optimizer.step()``,
``load_state_dict``, ``tensor.copy_`` under ``no_grad``) bumps the tensor's version counter,
replacing a parameter changes its identity, and converting one (``model.half()``, ``.to()``)
gives it new memory: ``WeightWatch`` keeps all three for every parameter
and persistent buffer (what the fingerprint covers: not a rotary cache a forward may rebuild) of
the model's modules, listed once at construction, and compares them at each call: a pass over
the tensors' handles, not their bytes (about 0.15 ms for a Llama-3-8B-shaped model on the
development CPU, against 0.6 ms for walking the module tree each time). Not noticed: writes
in place through ``tensor.data`` (torch does not count them) and modules added or swapped in after
construction: build the ``PrefixCache`` after those (a PEFT adapter injected later is not a
change of weights: its calls get a scope of their own, ``adapters``).
"""

from __future__ import annotations

import torch

from kvtier.weights import weights_fingerprint


class WeightWatch:
    """Whether ``model``'s weights are still those a ``PrefixCache`` was built for.

    ``fingerprint``: the weights' fingerprint at construction (the first part of the pages' default
    ``model_id``), or None when the caller named the weights: then any counted write is taken as a
    change.
    """

    def __init__(self, model: torch.nn.Module, fingerprint: str | None) -> None:
        self._model = model
        self._modules = list(model.modules())
        self._fingerprint = fingerprint
        self._seen = self._handles()

    def unchanged(self) -> bool:
        """False when the weights were written to (and, where a fingerprint is known, now differ
        from it); a write that left every byte as it was is accepted and remembered."""
        seen = self._handles()
        if seen == self._seen:
            return True
        if self._fingerprint is None or weights_fingerprint(self._model) != self._fingerprint:
            return False
        self._seen = seen
        return True

    def _handles(self) -> tuple[tuple[int, int, int], ...]:
        """(identity, version, address) of every parameter and persistent buffer of the modules."""
        return tuple(
            (id(t), t._version, t.data_ptr())
            for module in self._modules
            for name, t in (*module._parameters.items(), *module._buffers.items())
            if t is not None and name not in module._non_persistent_buffers_set
        )
