"""A forward hook of the user's on the model (activation steering, an ablation) changes keys and
values in ways no fingerprint sees: calls run as plain ``generate`` while one is registered,
reusing and saving nothing (``kvtier.hf.forward_hooks``)."""

from __future__ import annotations

import logging

import torch
from torch.nn.modules.module import register_module_forward_hook

from kvtier.hf import PrefixCache
from tests.hf.tiny import tiers_config, tiny_model, tokens


def greedy(fn, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt])
    return fn(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)


def steering(vector: torch.Tensor):
    def hook(module, args, output):  # adds ``vector`` to a decoder layer's hidden states
        return output + vector if isinstance(output, torch.Tensor) else (output[0] + vector, *output[1:])

    return hook


def test_calls_while_a_steering_hook_is_registered_reuse_and_save_nothing(caplog):
    """Before, a hook registered after construction was served the unhooked pages (other tokens),
    and its own pages were saved for calls without it, in this process or through a disk tier."""
    model = tiny_model("llama")
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    prompt = tokens(torch.Generator().manual_seed(3), 40)
    with PrefixCache(model, tiers_config(model, blocks=60)) as pc:
        assert torch.equal(greedy(pc.generate, prompt), greedy(model.generate, prompt))
        handle = model.model.layers[0].register_forward_hook(steering(0.3 * vector))
        with caplog.at_level(logging.WARNING, logger="kvtier.hf.prefix_cache"):
            for suffix in ([5], [5, 6]):
                steered = [*prompt[:32], *suffix]
                assert torch.equal(greedy(pc.generate, steered), greedy(model.generate, steered))
                assert pc.last_reused_tokens == [0]
        assert caplog.text.count("a forward hook on model.layers.0") == 1
        handle.remove()
        assert torch.equal(
            greedy(pc.generate, [*prompt[:32], 5, 6, 7]), greedy(model.generate, [*prompt[:32], 5, 6, 7])
        )
        assert pc.last_reused_tokens == [32]  # the unhooked call's blocks: none of the hooked ones


def test_a_global_forward_hook_counts_too():
    model = tiny_model("llama")
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    layers = set(model.model.layers)
    prompt = tokens(torch.Generator().manual_seed(4), 40)
    with PrefixCache(model, tiers_config(model, blocks=60)) as pc:
        greedy(pc.generate, prompt)
        hook = steering(0.3 * vector)
        handle = register_module_forward_hook(
            lambda module, args, output: hook(module, args, output) if module in layers else None
        )
        try:
            assert torch.equal(greedy(pc.generate, [*prompt, 1]), greedy(model.generate, [*prompt, 1]))
            assert pc.last_reused_tokens == [0]
        finally:
            handle.remove()
