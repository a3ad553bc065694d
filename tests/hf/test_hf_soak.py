"""Random chat sessions through ``PrefixCache.generate``: every call gives plain ``generate``'s tokens
and scores, whatever the architecture, the tiers and the batch.

Each seed draws an architecture, tiers (a primary tier of 6 to 200 blocks, host memory and a
disk or not), conversations that share a system prompt, and turns that answer a random subset of
them in one left-padded batch (or one row without a mask), each turn continuing from the last.
Pages go down the tiers, come back, are evicted and reused in every order the sessions make.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.hf import PrefixCache
from tests.hf.tiny import ARCHS, left_padded, tiers_config, tiny_model, tokens

SEEDS = range(8)
SCORE_TOLERANCE = 1e-6  # a model with linear attention runs its prompt in stretches: float32 rounding inside


def session(seed: int, tmp_path, device: str = "cpu") -> list[list[int]]:
    """Play one random session on ``device``, checking each call against ``generate``; the tokens
    each call reused."""
    rng = random.Random(seed)
    arch = rng.choice([a for a in ARCHS if a != "gemma2"])  # Gemma 2's padded rows are NaN in plain generate
    model = tiny_model(arch).to(device)
    disk = rng.choice([0, 0, 100])
    config = tiers_config(
        model,
        blocks=rng.choice([6, 12, 40, 200]),
        host_blocks=rng.choice([0, 8, 40]),
        disk_blocks=disk,
        disk_path=tmp_path / "disk" if disk else None,
        device=device,
    )
    g = torch.Generator().manual_seed(seed)
    system = tokens(g, rng.choice([5, 17, 40]))
    conversations = [system + tokens(g, rng.randint(1, 20)) for _ in range(rng.randint(1, 4))]
    reused = []
    with PrefixCache(model, config, recompute_when_faster=False) as pc:
        for turn in range(rng.randint(2, 5)):
            chosen = rng.sample(range(len(conversations)), rng.randint(1, len(conversations)))
            rows = [conversations[i] for i in chosen]
            ids, mask = (t.to(device) for t in left_padded(rows))
            if len(rows) == 1 and rng.random() < 0.5:
                mask = None
            settings = dict(max_new_tokens=rng.randint(1, 9), do_sample=False, output_scores=True)
            expected = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **settings)
            got = pc.generate(ids, attention_mask=mask, return_dict_in_generate=True, **settings)
            reused.append(pc.last_reused_tokens)
            where = f"seed {seed} ({arch}), turn {turn}, reused {pc.last_reused_tokens}"
            assert torch.equal(got.sequences, expected.sequences), where
            for a, b in zip(got.scores, expected.scores, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=SCORE_TOLERANCE, msg=where)
            width = ids.shape[1]
            for j, i in enumerate(chosen):
                conversations[i] = got.sequences[j, width - len(rows[j]) :].tolist() + tokens(g, rng.randint(1, 12))
    return reused


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_session_gives_generates_tokens_and_scores(seed, tmp_path):
    reused = session(seed, tmp_path)
    assert len(reused) >= 2
