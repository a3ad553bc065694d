"""The reference engine's models computed from checkpoints that transformers writes: the same
tokens as transformers' own model of the checkpoint, or a refusal at load time."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GraniteConfig, LlamaConfig, MistralConfig

from kvtier.models import build_model

SHAPE = dict(
    vocab_size=300,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
)
PROMPT = list(range(3, 90, 2))  # 44 tokens: past the windows and the rotary scalings' original lengths


def saved(config, tmp_path) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model, str(tmp_path)


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**SHAPE),
        LlamaConfig(tie_word_embeddings=True, **SHAPE),
        LlamaConfig(head_dim=16, **SHAPE),
        LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}, **SHAPE),
        LlamaConfig(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            **SHAPE,
        ),
        MistralConfig(sliding_window=20, **SHAPE),
    ],
    ids=["llama", "tied", "head-dim", "linear-rope", "llama3-rope", "mistral-window"],
)
def test_a_llama_or_mistral_checkpoint_generates_what_transformers_generates(config, tmp_path):
    reference, path = saved(config, tmp_path)
    ours = build_model(path, "cpu", torch.float64)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    assert ours.reference_generate(PROMPT, 30) == expected[0, len(PROMPT) :].tolist()


def test_a_sliding_window_key_in_a_llama_file_is_ignored_as_transformers_llama_ignores_it(tmp_path):
    """Some Llama files carry ``sliding_window``; transformers' Llama attends to every token whatever
    it says (its forward; its ``generate`` would trim a dynamic cache to the window, so the
    reference here is the forward)."""
    config = LlamaConfig(**SHAPE)
    config.sliding_window = 20
    reference, path = saved(config, tmp_path)
    ours = build_model(path, "cpu", torch.float64)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        # transformers builds its rotary tables in float32: 7e-8 apart; a window would be 0.1 off
        torch.testing.assert_close(ours.forward_dense(ids[0]), reference(ids).logits[0], rtol=0, atol=1e-6)


def test_an_architecture_that_keeps_llamas_tensor_names_is_refused(tmp_path):
    """Granite's checkpoints load tensor for tensor into Llama's network, which ignores its
    multipliers: other tokens than transformers' Granite. The loader refuses it by name."""
    granite = GraniteConfig(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0, **SHAPE)
    _, path = saved(granite, tmp_path)
    with pytest.raises(ValueError, match="model_type 'granite' is not supported"):
        build_model(path, "cpu", torch.float64)
