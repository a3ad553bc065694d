"""Models that compute a left-padded row otherwise than kvtier serves it (``kvtier.hf.padding``):
TrOCR counts the padding in its decoding steps' positions, GIT's decoding steps attend to cached
padding. Their padded calls run as plain ``generate``; calls without padding still reuse."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GitConfig, GitForCausalLM, TrOCRConfig, TrOCRForCausalLM

from kvtier.hf import PrefixCache
from kvtier.hf.model_layers import read_model, transformers_release
from tests.hf.tiny import ARCHS, left_padded, tiers_config, tiny_model, tokens

VOCAB = 100


def tiny_trocr() -> TrOCRForCausalLM:
    torch.manual_seed(0)
    config = TrOCRConfig(
        vocab_size=VOCAB,
        d_model=32,
        decoder_layers=2,
        decoder_attention_heads=2,
        decoder_ffn_dim=64,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return _greedy(TrOCRForCausalLM(config))


def tiny_git() -> GitForCausalLM:
    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    config = GitConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
        vision_config={**vision, "patch_size": 14},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return _greedy(GitForCausalLM(config))


def _greedy(model):
    model = model.to(torch.float64).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize(
    ("build", "reason"),
    [(tiny_trocr, "decoding steps place a token after left padding"), (tiny_git, "reads the keys and values")],
    ids=["trocr", "git"],
)
def test_a_model_that_computes_padded_rows_its_own_way_runs_padded_calls_as_generate(build, reason, caplog):
    model = build()
    if build is tiny_git and transformers_release() < (5, 21):
        pytest.skip("before transformers 5.21 GIT's forward needs positions for a one-token step: kvtier refuses it")
    assert reason in read_model(model).padding
    g = torch.Generator().manual_seed(40)
    system = tokens(g, 24)
    rows = [system + tokens(g, 20), system + tokens(g, 9)]
    arguments = {"max_new_tokens": 4, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    with PrefixCache(model, tiers_config(model, blocks=64)) as pc:
        pc.generate(torch.tensor([rows[0]]), max_new_tokens=2)  # unpadded: saved, reused below
        pc.generate(torch.tensor([rows[0]]), max_new_tokens=2)
        assert pc.last_reused_tokens == [40]
        with caplog.at_level(logging.INFO, logger="kvtier.hf.prefix_cache"):
            for _ in range(2):
                ids, mask = left_padded(rows)
                expected = model.generate(ids, attention_mask=mask, **arguments)
                got = pc.generate(ids, attention_mask=mask, **arguments)
                assert torch.equal(got.sequences, expected.sequences)
                assert torch.equal(torch.stack(got.scores), torch.stack(expected.scores))  # before: other scores
                assert pc.last_reused_tokens == [0, 0]
        assert caplog.text.count("computes left-padded rows its own way") == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_models_that_compute_padded_rows_as_kvtier_serves_them_pass_the_probe(arch):
    assert read_model(tiny_model(arch)).padding is None
