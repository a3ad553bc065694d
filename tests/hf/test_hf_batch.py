"""Batches: rows of different lengths, left-padded, give exactly what ``model.generate`` gives; each row
reuses the same number of leading batch columns (``width - pad``), as ``batch_rows`` documents."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

from kvtier.hf import PrefixCache
from kvtier.hf.hf_cache import RecordingCache
from tests.hf.tiny import left_padded, tiers_config, tiny_model, tokens

NEW_TOKENS = 5


def _batch_turn(model, pc: PrefixCache, rows: list[list[int]]) -> list[list[int]]:
    ids, mask = left_padded(rows)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    got = pc.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(got, expected), pc.last_reused_tokens
    pads = [ids.shape[1] - len(r) for r in rows]
    widths = {pad + n for pad, n in zip(pads, pc.last_reused_tokens, strict=True) if n}
    assert len(widths) <= 1, (pads, pc.last_reused_tokens)  # one rectangle of reused columns
    return [got[i, pads[i] :].tolist() for i in range(len(rows))]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3_next"])
def test_left_padded_rows_of_different_lengths_over_turns(arch):
    """(Gemma2 is left out here: its eager attention in float64 turns padded rows into NaN in plain
    ``generate`` itself, masked scores overflowing to -inf; see the test below.)"""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(21)
    system = tokens(g, 30)
    rows = [system + tokens(g, 12), tokens(g, 33), system + tokens(g, 3), system + tokens(g, 12)]
    rows[3] = list(rows[0])  # two identical rows: both save, the tree keeps one copy of each block
    with PrefixCache(model, tiers_config(model, blocks=96)) as pc:
        for turn in range(3):
            sequences = _batch_turn(model, pc, rows)
            if turn and arch != "qwen3_next":
                assert all(n > 0 for n in pc.last_reused_tokens), pc.last_reused_tokens
            rows = [s + tokens(g, 4 + 3 * i) for i, s in enumerate(sequences)]


def test_gemma2_rows_of_one_length_with_different_histories():
    model = tiny_model("gemma2")
    g = torch.Generator().manual_seed(26)
    system = tokens(g, 30)
    rows = [system + tokens(g, 10), tokens(g, 40), system + tokens(g, 10)]
    with PrefixCache(model, tiers_config(model, blocks=96)) as pc:
        for turn in range(3):
            sequences = _batch_turn(model, pc, rows)
            if turn:
                assert all(n > 0 for n in pc.last_reused_tokens), pc.last_reused_tokens
            rows = [s + tokens(g, 6) for s in sequences]


def test_a_hybrid_batch_reuses_where_every_row_has_a_state_at_the_shared_width():
    """Rows of one length whose histories end on snapshot points reuse their whole history."""
    model = tiny_model("qwen3_next")
    g = torch.Generator().manual_seed(22)
    system = tokens(g, 32)
    rows = [system + tokens(g, 16) for _ in range(3)]  # 48 tokens: a snapshot point (16-token interval)
    with PrefixCache(model, tiers_config(model, blocks=64)) as pc:
        sequences = _batch_turn(model, pc, rows)
        assert pc.last_reused_tokens == [0, 0, 0]  # every row is matched before any is saved
        _batch_turn(model, pc, [s[:48] + tokens(g, 10) for s in sequences])
        assert pc.last_reused_tokens == [48, 48, 48]


def test_a_mask_that_is_not_left_padding_runs_plain_generate():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(23)
    ids = torch.tensor([tokens(g, 20), tokens(g, 20)])
    mask = torch.ones_like(ids)
    mask[0, 5] = 0  # a hole
    with PrefixCache(model, tiers_config(model, blocks=32)) as pc:
        for _ in range(2):
            expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
            got = pc.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(got, expected)
            assert pc.last_reused_tokens == [0, 0]
        assert pc.manager.stats().lookup_tokens == 0


def test_a_mask_is_inferred_from_pad_tokens_as_generate_does():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(24)
    rows = [tokens(g, 30), tokens(g, 18)]
    ids, _ = left_padded(rows)
    with PrefixCache(model, tiers_config(model, blocks=32)) as pc:
        for _ in range(2):
            expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            got = pc.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(got, expected)
        assert pc.last_reused_tokens == [28, 16]  # row 1 matched 16 tokens (2 blocks): 12 + 16 columns


def test_a_row_the_primary_tier_cannot_hold_is_served_but_not_saved(caplog):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(25)
    long_row, short_row = tokens(g, 70), tokens(g, 20)
    with PrefixCache(model, tiers_config(model, blocks=6)) as pc:  # 48 tokens of primary
        with caplog.at_level(logging.WARNING, logger="kvtier.hf.prefix_cache"):
            _batch_turn(model, pc, [long_row, short_row])
        assert "row 0" in caplog.text and "not saved" in caplog.text
        _batch_turn(model, pc, [short_row + tokens(g, 3)])
        assert pc.last_reused_tokens == [20]  # the short row was saved: its 20 prompt tokens come back
        for _ in range(3):  # the same row again: counted, not logged again
            _batch_turn(model, pc, [long_row])
        assert caplog.text.count("not saved") == 1
    assert "not saved: 3 more" in caplog.text  # summarised at close


def test_several_sampled_sequences_per_row_are_generate_s_and_reuse_the_row_prefix():
    """``num_return_sequences=3`` with sampling: ``generate`` repeats each row before the prompt's
    forward, so kvtier repeats them too; the same seed draws the same tokens. Before, refused."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(26)
    ids, mask = left_padded([tokens(g, 30), tokens(g, 21)])
    sample = {"do_sample": True, "num_return_sequences": 3, "max_new_tokens": NEW_TOKENS}
    with PrefixCache(model, tiers_config(model, blocks=64)) as pc:
        for seed in range(2):
            torch.manual_seed(seed)
            expected = model.generate(ids, attention_mask=mask, **sample)
            torch.manual_seed(seed)
            got = pc.generate(ids, attention_mask=mask, **sample)
            assert got.shape[0] == 6 and torch.equal(got, expected)
        reused = pc.last_reused_tokens
        assert len(reused) == 6 and reused[:3] == [reused[0]] * 3 and reused[3:] == [reused[3]] * 3
        assert min(reused) > 0  # the second call's copies reuse their row's prompt
        # Positions given explicitly are repeated with the rows, as generate repeats them. Before, refused.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        torch.manual_seed(2)
        expected = model.generate(ids, attention_mask=mask, position_ids=positions, **sample)
        torch.manual_seed(2)
        got = pc.generate(ids, attention_mask=mask, position_ids=positions, **sample)
        assert torch.equal(got, expected) and min(pc.last_reused_tokens) > 0
        with pytest.raises(NotImplementedError, match="per-row arguments"):  # images: each model's own rules
            pc.generate(ids, attention_mask=mask, pixel_values=torch.zeros(2, 3, 8, 8), **sample)
        assert pc.last_reused_tokens == []  # a refused call reused nothing. Before, the last call's figures


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "qwen3_next", "falcon_h1"])
def test_beam_search_gives_generate_s_beams_and_every_beam_reuses_its_row_s_prompt(arch):
    """The cache is filled for the rows, then repeated per beam as ``generate`` repeats the rows
    (linear-attention states too): beams, their scores and the sampled beams' draws are
    ``generate``'s. Only the prompts are saved. Before, beam search was refused. (Gemma 2's rows are
    of one length: see the test above. The hybrids keep states every 16 tokens and at a prompt's end.)"""
    hybrid = arch in ("qwen3_next", "falcon_h1")
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(27)
    system = tokens(g, 30)
    rows = (
        [system + tokens(g, 9), system + tokens(g, 20)] if arch != "gemma2" else [system + tokens(g, 9), tokens(g, 39)]
    )
    if hybrid:
        rows = [system[:16] + tokens(g, 16), tokens(g, 32)]
    calls = [{"num_beams": 3, "num_return_sequences": 2}, {"num_beams": 2, "do_sample": True, "top_k": 20}]
    if arch == "falcon_h1":  # its state space layers run a slow reference implementation on a CPU
        calls = calls[:1]
    with PrefixCache(model, tiers_config(model, blocks=96)) as pc:
        for turn in range(2 if arch == "falcon_h1" else 3):
            ids, mask = left_padded(rows)
            for call in calls:
                arguments = {"max_new_tokens": NEW_TOKENS, "return_dict_in_generate": True, "output_scores": True}
                torch.manual_seed(turn)
                expected = model.generate(ids, attention_mask=mask, **arguments, **call)
                torch.manual_seed(turn)
                got = pc.generate(ids, attention_mask=mask, **arguments, **call)
                assert torch.equal(got.sequences, expected.sequences), pc.last_reused_tokens
                # (a hybrid's linear-attention kernels compute in float32 inside, and kvtier's prompt
                # forwards stop at its snapshot points: its scores may differ in the last float32 bits)
                tolerance = 1e-6 if hybrid else 0.0
                torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, rtol=0, atol=tolerance)
                per_row = call.get("num_return_sequences", 1)
                assert len(pc.last_reused_tokens) == len(rows) * per_row
                if turn or call is not calls[0]:  # the first call saved both prompts
                    assert min(pc.last_reused_tokens) >= (16 if hybrid else 32), pc.last_reused_tokens
            rows = [row + tokens(g, 16 if hybrid else 5) for row in rows]


def test_beam_search_saves_the_prompt_and_not_the_beams():
    """A beam call's next turn (its prompt and an answer) reuses the prompt's full blocks only: the
    cache's rows are reordered and cut at every step, so they do not hold the returned beams."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(28)
    prompt = tokens(g, 30)  # 3 full blocks of 8
    with PrefixCache(model, tiers_config(model, blocks=64)) as pc:
        out = pc.generate(torch.tensor([prompt]), max_new_tokens=12, num_beams=3)
        answer = out[0, 30:].tolist()
        pc.generate(torch.tensor([prompt + answer + tokens(g, 4)]), max_new_tokens=2, do_sample=False)
        assert pc.last_reused_tokens == [24]


def test_repeating_rows_for_beams_repeats_what_sliding_window_layers_recorded():
    """A hybrid model's prompt runs to its snapshot points before its rows are repeated per beam:
    the keys and values its sliding-window layers recorded meanwhile are repeated with the rest.
    (Before, saving a beam call of a model with linear-attention and sliding-window layers, as
    LaRA-mini's, failed on batches of two sizes.)"""
    model = tiny_model("mistral")
    g = torch.Generator().manual_seed(30)
    ids = torch.tensor([tokens(g, 6), tokens(g, 6)])
    cache = RecordingCache(model.config)
    argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        model(ids[:, :4], **{argument: cache}, use_cache=True)
        cache.repeat_rows(3)
        model(ids.repeat_interleave(3, dim=0)[:, 4:], **{argument: cache}, use_cache=True)
    keys, values = cache.layers[0].written()
    assert keys.shape[0] == values.shape[0] == 6 and keys.shape[-2] == 6
    assert torch.equal(keys[0], keys[2]) and torch.equal(values[3], values[5]) and not torch.equal(keys[0], keys[3])


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_the_managers_hits_are_what_the_rows_reused(arch):
    """A row cut to the batch's common width recomputes the rest of its match: the manager counts
    as hits the tokens the rows took (``last_reused_tokens``), the rest as recomputed, and each
    prompt token looked up once (mistral's sliding window reads a row's shorter prefix through a
    second cache of the same row)."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(5)
    base = tokens(g, 40)
    with PrefixCache(model, tiers_config(model, blocks=64)) as pc:
        pc.generate(torch.tensor([base]), max_new_tokens=2, do_sample=False)
        batches = [
            ([base[:39] + [5], tokens(g, 20) + base[:20]], 39),
            ([base[:39] + [6], base[:20] + tokens(g, 20)], 59),
        ]
        for rows, matched in batches:
            before = pc.manager.stats()
            ids, mask = left_padded(rows)
            pc.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
            after = pc.manager.stats()
            hits = sum(after.hit_tokens.values()) - sum(before.hit_tokens.values())
            recomputed = after.recomputed_tokens - before.recomputed_tokens
            assert hits == sum(pc.last_reused_tokens)
            assert after.lookup_tokens - before.lookup_tokens == sum(len(row) for row in rows)
            assert hits + recomputed == matched  # the rows' matches, whatever the width took of them
