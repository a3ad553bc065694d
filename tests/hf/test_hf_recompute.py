"""``PrefixCache`` times its prompt forwards and recomputes cached blocks that would load slower
than that (``recompute_when_faster``): a slow disk's blocks are recomputed, with the same answer."""

from __future__ import annotations

import pytest
import torch

from kvtier.hf import PrefixCache
from tests.disk_speed import slow_disk_reads
from tests.hf.tiny import tiers_config, tiny_model, tokens

PROMPT = 300  # tokens: a prompt forward long enough to be timed (kvtier.engine.prefill_meter.MIN_TOKENS)


def turn(model, pc: PrefixCache, prompt: list[int]) -> int:
    """One call through both paths (they must agree token for token); the tokens it reused."""
    ids = torch.tensor([prompt])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    got = pc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert torch.equal(got, expected)
    return pc.last_reused_tokens[0]


@pytest.mark.parametrize("weigh", [True, False])
def test_a_slow_disk_is_recomputed_once_both_rates_are_measured_and_after_a_restart(weigh, tmp_path, monkeypatch):
    slow_disk_reads(monkeypatch, 2e6)
    model = tiny_model("llama")
    config = tiers_config(model, blocks=50, disk_blocks=2000, disk_path=tmp_path / "disk")
    g = torch.Generator().manual_seed(7)
    kept = tokens(g, PROMPT)
    with PrefixCache(model, config, recompute_when_faster=weigh) as pc:
        turn(model, pc, kept)  # computed whole: the first prefill rate when weighed
        for _ in range(2):
            turn(model, pc, tokens(g, PROMPT))  # push it down to disk
        assert turn(model, pc, [*kept, *tokens(g, 5)]) >= PROMPT - 8  # the disk's speed is not known yet: loaded
        assert pc.manager.stats().hit_tokens["disk"] > 0
        for _ in range(2):
            turn(model, pc, tokens(g, PROMPT))
        reused = turn(model, pc, [*kept, *tokens(g, 5)])
        recomputed = pc.manager.stats().recomputed_tokens
    if weigh:
        assert reused == 0 and recomputed >= PROMPT - 8  # reading it back is slower than computing it
    else:
        assert reused >= PROMPT - 8 and recomputed == 0
    with PrefixCache(model, config, recompute_when_faster=weigh) as pc:  # a restart: both rates remembered
        reused = turn(model, pc, [*kept, *tokens(g, 5)])
        recomputed = pc.manager.stats().recomputed_tokens
    if weigh:
        assert reused == 0 and recomputed >= PROMPT - 8  # the first call is weighed too
    else:
        assert reused >= PROMPT - 8 and recomputed == 0


def test_a_prefix_on_a_fast_tier_is_loaded_once_the_prefill_rate_is_known(tmp_path):
    model = tiny_model("llama")
    config = tiers_config(model, blocks=50, host_blocks=2000)
    g = torch.Generator().manual_seed(8)
    kept = tokens(g, PROMPT)
    with PrefixCache(model, config) as pc:
        turn(model, pc, kept)
        for _ in range(2):
            turn(model, pc, tokens(g, PROMPT))
        for _ in range(2):  # the second time with the host tier's speed measured
            assert turn(model, pc, [*kept, *tokens(g, 5)]) >= PROMPT - 8
            for _ in range(2):
                turn(model, pc, tokens(g, PROMPT))
        assert pc.manager.stats().recomputed_tokens == 0
        assert pc.manager.stats().hit_tokens["host"] >= 2 * (PROMPT - 8)


def test_recompute_when_faster_must_be_a_bool():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="recompute_when_faster must be a bool"):
        PrefixCache(model, tiers_config(model, blocks=4), recompute_when_faster=1)
