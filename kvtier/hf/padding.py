"""Whether a model computes a left-padded row as kvtier serves it: the probe behind padded batches.

kvtier reuses a row of a left-padded batch on two assumptions about the model:

1. a token's keys and values do not depend on the padding before it: a page computed for a row
   with no padding serves a row with any, and the other way round;
2. nothing reads the contents of padding columns: kvtier fills those of a reused prefix with
   zeros, where ``generate`` has the pad token's keys and values.

Most models hold both (positions follow the attention mask, masked columns weigh exactly zero).
Some do not, in ``generate`` itself: TrOCR and MOSS count the padding in the positions of every
decoding step (the cache's length), so a generated token's keys change with the padding before
it; GIT's decoding steps attend to cached padding columns. For those, a padded row would get
other scores than ``generate`` gives: ``padding_difference`` names what differs, and
``PrefixCache`` runs calls with padding as plain ``generate``.

Both checks are exact (bit for bit), on tiny inputs computed the way ``generate`` computes them
(positions from the mask where the forward takes them), in shapes that leave no room for rounding
to differ: the first attention layer's keys of one decoded token, and the logits of one row
computed twice alike but for the numbers in its padding columns.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

PROMPT = (5, 6, 7, 8)  # the probe's tokens (any ids a vocabulary has)
NEXT = 9
PADS = 2


def padding_difference(model: torch.nn.Module, argument: str, first_attention: int | None) -> str | None:
    """What makes ``model`` compute a left-padded row otherwise than kvtier serves it, or None.

    ``argument``: the name its forward takes the cache by; ``first_attention``: the index of its
    first attention layer when no layer with recurrent states comes before it (else None: that
    check is skipped, a state kept over padding being another computation than over none).
    Runs under ``torch.no_grad`` in the caller's mode (eval).
    """
    device = next(model.parameters()).device
    run = _Forward(model, argument, device)
    if first_attention is not None and run.shifts_decoding(first_attention):
        return "its decoding steps place a token after left padding otherwise than after none"
    if run.reads_padding():
        return "its forward reads the keys and values of masked padding columns"
    return None


class _Forward:
    """Forwards as ``generate`` makes them: mask given, positions from it where the forward takes them."""

    def __init__(self, model: torch.nn.Module, argument: str, device: torch.device) -> None:
        self.model = model
        self.argument = argument
        self.device = device
        self.positions = "position_ids" in inspect.signature(model.forward).parameters

    def __call__(self, ids: list[list[int]], mask: list[list[int]], cache: DynamicCache, start: int):
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        mask_t = torch.tensor(mask, dtype=torch.long, device=self.device)
        arguments = {"input_ids": ids_t[:, start:], "attention_mask": mask_t, "use_cache": True, self.argument: cache}
        if self.positions:
            arguments["position_ids"] = ((mask_t.cumsum(-1) - 1).masked_fill(mask_t == 0, 1))[:, start:]
        return self.model(**arguments)

    def shifts_decoding(self, layer: int) -> bool:
        """Whether the keys of a token decoded after a padded prompt differ from those after the
        same prompt unpadded, in the first attention layer (its keys are the token's alone)."""
        padded = [0] * PADS + list(PROMPT)
        keys = []
        for ids, mask in (
            ([padded], [[0] * PADS + [1] * len(PROMPT)]),
            ([list(PROMPT)], [[1] * len(PROMPT)]),
        ):
            cache = DynamicCache(config=self.model.config)
            self(ids, mask, cache, 0)
            self([ids[0] + [NEXT]], [mask[0] + [1]], cache, len(ids[0]))
            keys.append(cache.layers[layer].keys[..., -1:, :])
        return not torch.equal(keys[0], keys[1])

    def reads_padding(self) -> bool:
        """Whether a padded row whose cached padding columns hold zeros gets other logits, for its
        prompt and a decoded token, than the same row whose padding columns hold ones (one row at a
        time: a batch of two would leave room for kernels to round its rows apart, as MoE layers do)."""
        row = [0] * PADS + list(PROMPT)
        mask = [0] * PADS + [1] * len(PROMPT)
        logits = []
        for fill in (0, 1):
            cache = DynamicCache(config=self.model.config)
            self([row[:PADS]], [mask[:PADS]], cache, 0)
            for layer in cache.layers:
                if isinstance(layer, DynamicLayer) and layer.keys is not None and layer.keys.numel():
                    layer.keys.fill_(fill)
                    layer.values.fill_(fill)
            prompt = self([row], [mask], cache, PADS).logits
            step = self([row + [NEXT]], [mask + [1]], cache, len(row)).logits
            logits.append((prompt, step))
        return not all(torch.equal(a, b) for a, b in zip(*logits, strict=True))
