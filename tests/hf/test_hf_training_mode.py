"""A model whose forward is random (dropout or noise in training mode) is neither reused nor saved
by ``PrefixCache.generate`` (``kvtier.hf.training_noise``): such pages are random draws, and an
eval-mode call would be served them as its prefix's."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from kvtier.hf import PrefixCache
from kvtier.hf.training_noise import random_module
from tests.hf.tiny import TINY_TEXT, VOCAB, tiers_config, tiny_model, tokens


def scored(fn, prompt: list[int]):
    ids = torch.tensor([prompt])
    return fn(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )


def same_output(a, b) -> bool:
    scores = zip(a.scores, b.scores, strict=True)
    return torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in scores)


def test_calls_with_attention_dropout_in_training_mode_reuse_and_save_nothing(caplog):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(num_hidden_layers=2, attention_dropout=0.3, **TINY_TEXT), dtype=torch.float64
    )
    prompt = tokens(torch.Generator().manual_seed(11), 40)
    model.train()
    with PrefixCache(model, tiers_config(model, blocks=40)) as pc, caplog.at_level(logging.WARNING, "kvtier"):
        scored(pc.generate, prompt)
        scored(pc.generate, prompt)
        assert pc.last_reused_tokens == [0]
        assert sum("attention_dropout=0.3" in r.getMessage() for r in caplog.records) == 1  # told once
        model.eval()
        got = scored(pc.generate, prompt)
        assert pc.last_reused_tokens == [0]  # nothing of the training-mode calls was kept
        assert same_output(got, scored(model.generate, prompt))
        again = scored(pc.generate, prompt)
        assert pc.last_reused_tokens == [39]  # eval-mode calls reuse as usual
        assert same_output(again, scored(model.generate, prompt))


def test_training_mode_without_dropout_still_reuses():
    model = tiny_model("llama").train()  # every dropout rate 0: the forward is a function of its input
    prompt = tokens(torch.Generator().manual_seed(12), 40)
    assert random_module(model) is None
    with PrefixCache(model, tiers_config(model, blocks=40)) as pc:
        scored(pc.generate, prompt)
        got = scored(pc.generate, prompt)
        assert pc.last_reused_tokens == [39]
        assert same_output(got, scored(model.generate, prompt))


def test_a_dropout_added_later_starts_in_training_mode_and_is_seen():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).eval()
    assert random_module(model) is None
    model.add_module("extra", torch.nn.Dropout(0.1))  # a new module is in training mode
    assert random_module(model) == "extra (dropout p=0.1)"
    model.eval()
    assert random_module(model) is None
    del model.extra
    model.train()
    assert random_module(model) == "1 (dropout p=0.5)"


def test_an_adapter_injected_into_an_eval_model_with_lora_dropout_is_not_cached():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(13), 40)
    with PrefixCache(model, tiers_config(model, blocks=40)) as pc:
        torch.manual_seed(14)
        config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.2, target_modules=["q_proj"], init_lora_weights=False
        )
        peft.inject_adapter_in_model(config, model, adapter_name="late")  # its dropout is active: random forwards
        scored(pc.generate, prompt)
        scored(pc.generate, prompt)
        assert pc.last_reused_tokens == [0]
        model.eval()
        scored(pc.generate, prompt)
        got = scored(pc.generate, prompt)
        assert pc.last_reused_tokens == [39]
        assert same_output(got, scored(model.generate, prompt))


def test_a_model_built_in_training_mode_is_probed_in_eval_mode_and_left_as_it_was():
    """The construction's probes compare what the model computes, so dropout is off meanwhile (GPT-2
    drops out embeddings and residuals: before, it was refused as attending to later tokens); each
    module's own training flag is put back (here one block already in eval mode)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config).train()
    model.transformer.h[0].eval()
    modes = [module.training for module in model.modules()]
    PrefixCache(model, tiers_config(model, blocks=8)).close()
    assert [module.training for module in model.modules()] == modes


def test_a_first_call_in_inference_mode_leaves_later_calls_outside_it_working():
    """Before: after a first ``generate`` under ``torch.inference_mode()`` (a server's warm-up), every
    call outside it raised ``RuntimeError`` (an in-place write to an inference tensor) once its
    forward had run, and its output was lost."""
    model = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(13), 40)
    with PrefixCache(model, tiers_config(model, blocks=40)) as pc:
        with torch.inference_mode():
            scored(pc.generate, prompt)
        got = scored(pc.generate, [*prompt, 5])
        assert pc.last_reused_tokens == [40]
        assert same_output(got, scored(model.generate, [*prompt, 5]))
        with torch.no_grad():
            got = scored(pc.generate, [*prompt, 6])
        assert same_output(got, scored(model.generate, [*prompt, 6]))
