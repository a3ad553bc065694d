"""State a model keeps from one ``generate`` call for the next, which a call reusing a prefix must not inherit.

Plain ``generate`` starts every call from an empty cache, so a model may keep values of its last
prompt for its decode steps and trust them whenever the cache it is handed is not empty. A call
that hands it a cache filled with a reused prefix would then run with the previous call's values.

- ``rope_deltas`` (the Qwen2-VL family's multimodal rotary positions, kept by the inner model):
  with a non-empty cache and no new image or video tokens, the model offsets the call's
  positions by the previous call's deltas; cleared, it computes them from this call's tokens,
  as plain ``generate`` does.
"""

from __future__ import annotations

import torch

_PER_CALL = ("rope_deltas",)


class CallState:
    """The modules of one model that keep per-call values; ``clear()`` before each call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._kept = [(module, name) for module in model.modules() for name in _PER_CALL if name in vars(module)]

    def clear(self) -> None:
        """Forget what the last call left, as a call starting from an empty cache would."""
        for module, name in self._kept:
            setattr(module, name, None)
