"""Inputs other than tokens: kvtier reuses and saves a row only up to where they reach its keys and
values (``kvtier.hf.token_bound``): a multimodal model's first image placeholder, the caller's own
positions; every call gives plain ``generate``'s tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    GPT2Config,
    GPT2LMHeadModel,
    PaliGemmaConfig,
    PaliGemmaForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

import kvtier
from kvtier.errors import CacheStateError
from kvtier.hf import PrefixCache, token_bound
from kvtier.hf.model_layers import cache_argument
from kvtier.hf.token_bound import dynamic_rope_limit, placeholder_ids, row_bounds
from tests.hf.tiny import PAD, TINY_TEXT, tiers_config, tiny_model, tokens

IMAGE, BEGIN, END = 299, 297, 298
PICTURE = [BEGIN, IMAGE, IMAGE, IMAGE, IMAGE, END]  # 4 features per image
SYSTEM = list(range(10, 30))


def tiny_vlm() -> Gemma3ForConditionalGeneration:
    text = {**TINY_TEXT, "vocab_size": 300, "head_dim": 8, "num_hidden_layers": 2, "sliding_window": 24}
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=IMAGE,
        boi_token_index=BEGIN,
        eoi_token_index=END,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).to(torch.float64).eval()
    with torch.no_grad():  # initialized to zeros: every image would give the same features
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def image(seed: int) -> torch.Tensor:
    return 3 * torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def both(
    model, pc: PrefixCache, prompt: list[int], picture: torch.Tensor | None, types: bool | None = None
) -> tuple[list[int], torch.Tensor]:
    """One call through both paths (the same tokens, the same scores); the sequence and the scores.
    ``types``: give the image spans' ``token_type_ids`` (default: with a picture)."""
    ids = torch.tensor([prompt])
    extra = {} if picture is None else {"pixel_values": picture}
    if picture is not None if types is None else types:
        extra["token_type_ids"] = (ids == IMAGE).long()
    extra.update(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), **extra)
    got = pc.generate(ids, attention_mask=torch.ones_like(ids), **extra)
    assert torch.equal(got.sequences, expected.sequences), f"reused {pc.last_reused_tokens}"
    scores = torch.stack(got.scores)
    torch.testing.assert_close(scores, torch.stack(expected.scores), rtol=0, atol=1e-9)
    return got.sequences[0].tolist(), scores


def test_a_prefix_language_model_is_refused():
    """PaliGemma attends to its whole prompt both ways: a page of one prompt's tokens holds what
    the tokens after them made of it, which another prompt with that prefix does not compute."""
    text = {**TINY_TEXT, "vocab_size": 300, "head_dim": 8, "num_hidden_layers": 2, "model_type": "gemma"}
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE, projection_dim=32)
    model = PaliGemmaForConditionalGeneration(config).to(torch.float64).eval()
    with pytest.raises(NotImplementedError, match="PaliGemmaForConditionalGeneration attends to later tokens"):
        PrefixCache(model, kvtier.CacheConfig(8, [kvtier.PrimaryTier(1 << 20)]))


@pytest.mark.parametrize("whole", [True, False], ids=["transformers 5.23 on", "before 5.23"])
def test_calls_with_images_share_the_text_before_the_first_image_only(whole, monkeypatch):
    """Before transformers 5.23 ``generate`` handed Gemma 3 only the types of the positions it
    computes, and its image attention reads them by absolute position: after a cached prefix the
    image span moved (scores 4e-3 apart with an image, other greedy tokens with types alone, plain
    ``generate`` handed the same cache included). There a call with nonzero types reuses nothing;
    one with an image and no types still shares the text. Both rules are checked on the installed
    transformers, which computes exactly under the first only from 5.23 (the rule it gets)."""
    if whole and not token_bound.WHOLE_TYPES_AFTER_A_CACHE:
        pytest.skip("this transformers' generate cuts the types to the positions it computes")
    monkeypatch.setattr(token_bound, "WHOLE_TYPES_AFTER_A_CACHE", whole)
    shared = len(SYSTEM) if whole else 0
    model = tiny_vlm()
    question = [*SYSTEM, *PICTURE, 40, 41, 42]
    with PrefixCache(model, tiers_config(model, blocks=60)) as pc:
        both(model, pc, [*SYSTEM, 5, 6], None)
        first, first_scores = both(model, pc, question, image(1))
        assert pc.last_reused_tokens == [shared]
        both(model, pc, [*first, 43, 44], image(1))  # the next turn about the same image
        assert pc.last_reused_tokens == [shared]
        _, other_scores = both(model, pc, question, image(2))  # another image, the same tokens
        assert (other_scores - first_scores).abs().max() > 1e-3  # the image counts: its pages were not served
        assert pc.last_reused_tokens == [shared]
        both(model, pc, question, None, types=True)  # the image's span typed, no image given
        assert pc.last_reused_tokens == [shared]
        both(model, pc, question, image(1), types=False)  # an image, no types: the text is shared on any release
        assert pc.last_reused_tokens == [len(SYSTEM)]
        both(model, pc, [*SYSTEM, 5, 7, 8, 9], None)
        assert pc.last_reused_tokens == [len(SYSTEM) + 1]  # "5" was saved by the first call


class _Settings:
    """A stand-in generation config: its attributes are generation settings."""

    max_new_tokens = 5
    eos_token_id = None


@pytest.mark.parametrize("whole", [True, False], ids=["transformers 5.23 on", "before 5.23"])
def test_bounds_where_more_than_tokens_reach_the_keys_and_values(whole, monkeypatch):
    monkeypatch.setattr(token_bound, "WHOLE_TYPES_AFTER_A_CACHE", whole)
    ids = torch.tensor([[PAD, PAD, 5, 6, IMAGE, 7], [8, 9, 10, 11, 12, 13]])
    mask = (ids != PAD).long()
    pads = [2, 0]
    settings = _Settings()
    images = frozenset({IMAGE})
    assert row_bounds(ids, mask, pads, {}, settings, images) == [None, None]
    assert row_bounds(ids, mask, pads, {"max_new_tokens": 3, "eos_token_id": torch.tensor([2])}, settings, images) == [
        None,
        None,
    ]
    assert row_bounds(ids, mask, pads, {"pixel_values": torch.ones(1)}, settings, images) == [2, None]
    assert row_bounds(ids, mask, pads, {"pixel_values": [torch.ones(1)]}, settings, frozenset()) == [0, 0]
    types = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    typed = [1, None] if whole else [0, None]  # (before 5.23 a typed row keys nothing by its tokens)
    assert row_bounds(ids, mask, pads, {"token_type_ids": types}, settings, images) == typed
    standard = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    assert row_bounds(ids, mask, pads, {"position_ids": standard}, settings, images) == [None, None]
    shifted = standard.clone()
    shifted[1, 3:] += 100
    assert row_bounds(ids, mask, pads, {"position_ids": shifted}, settings, images) == [None, 3]
    assert row_bounds(ids, mask, pads, {"position_ids": torch.zeros(3, 2, 6)}, settings, images) == [0, 0]


def test_placeholder_names_are_read_from_the_configuration_and_its_parts():
    assert placeholder_ids(tiny_vlm().config) == {IMAGE}
    assert placeholder_ids(tiny_model("llama").config) == frozenset()


@pytest.mark.parametrize(
    ("arch", "reuses"),
    [("llama", (0, 16, 20, 29)), ("qwen3_next", (0, 16, 16, 16))],  # linear attention: from snapshots only
)
def test_a_call_with_positions_of_its_own_reuses_only_where_they_are_the_usual_ones(arch, reuses):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(4)
    prompt = tokens(g, 30)
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    shifted = torch.arange(30)[None].clone()
    shifted[0, 20:] += 7  # a gap in the positions from token 20 on
    with PrefixCache(model, tiers_config(model, blocks=60)) as pc:
        for positions, reused in zip((shifted, None, shifted, None), reuses, strict=True):  # 16: 20's full blocks
            extra = {} if positions is None else {"position_ids": positions}
            expected = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, **extra)
            got = pc.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, **extra)
            assert torch.equal(got, expected)
            assert pc.last_reused_tokens == [reused]


def tiny_qwen2_vl() -> Qwen2VLForConditionalGeneration:
    text = dict(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e4},
        pad_token_id=PAD,
        initializer_range=0.3,
    )
    vision = dict(
        depth=1, embed_dim=32, hidden_size=32, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=296,
        vision_start_token_id=BEGIN,
        vision_end_token_id=END,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float64).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def test_a_qwen2_vl_call_positions_its_tokens_as_plain_generate_whatever_call_came_before():
    """Qwen2-VL keeps its last call's rotary position deltas and trusts them whenever the cache it
    is handed is not empty: a call reusing a prefix must not run with the last call's (an image
    call's: wrong tokens; a call of more rows: a crash)."""
    model = tiny_qwen2_vl()
    system = list(range(10, 42))  # four blocks of 8
    text = torch.tensor([system + [70, 71, 72]])

    def text_call(generate):
        return generate(
            text,
            attention_mask=torch.ones_like(text),
            max_new_tokens=6,
            return_dict_in_generate=True,
            output_scores=True,
        )

    def image_call(generate):
        ids = torch.tensor([system + [BEGIN] + [IMAGE] * 16 + [END, 60, 61, 62]])  # a 1x8x8 grid, merged 2x2
        pixels = torch.randn(64, 3 * 2 * 14 * 14, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        grid = torch.tensor([[1, 8, 8]])
        types = (ids == IMAGE).long()
        generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            pixel_values=pixels,
            image_grid_thw=grid,
            mm_token_type_ids=types,
        )

    def three_rows_call(generate):
        ids = torch.tensor([system[::-1] + [1, 2, 3]] * 3)
        generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2)

    expected = text_call(model.generate)
    with PrefixCache(model, kvtier.CacheConfig(8, [kvtier.PrimaryTier(16 << 20)])) as pc:
        text_call(pc.generate)
        for before in (image_call, three_rows_call):
            before(pc.generate)
            got = text_call(pc.generate)
            assert pc.last_reused_tokens == [34]
            assert torch.equal(got.sequences, expected.sequences)
            torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores), rtol=0, atol=1e-9)


def dynamic_ntk_llama():
    """A tiny Llama whose rotary frequencies rescale once a forward reaches 32 positions."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        num_hidden_layers=2,
        **{**TINY_TEXT, "max_position_embeddings": 32},
        rope_scaling={"rope_type": "dynamic", "factor": 4.0},
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def fresh_rotary(model) -> None:
    """The rotary embedding as built: transformers keeps the frequencies of the longest forward since
    the last short one, so two equal calls agree only from the same state."""
    for module in model.modules():
        if getattr(module, "rope_type", None) == "dynamic":
            module.register_buffer("inv_freq", module.original_inv_freq, persistent=False)
            module.max_seq_len_cached = module.original_max_seq_len


def test_a_call_as_long_as_a_dynamic_rotary_embedding_rescales_reuses_and_saves_nothing():
    model = dynamic_ntk_llama()
    assert dynamic_rope_limit(model) == 32 and dynamic_rope_limit(tiny_model("llama")) is None
    g = torch.Generator().manual_seed(3)
    history = tokens(g, 20)
    with PrefixCache(model, tiers_config(model, blocks=60)) as pc:
        for length, reused in ((27, 0), (30, 24), (38, 0), (45, 0)):  # from 32 on, every key is rescaled
            history = [*history, *tokens(g, length - len(history))][:length]
            ids = torch.tensor([history])
            extra = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_scores=True)
            fresh_rotary(model)
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), **extra)
            fresh_rotary(model)
            got = pc.generate(ids, attention_mask=torch.ones_like(ids), **extra)
            assert torch.equal(got.sequences, expected.sequences)
            torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores), rtol=0, atol=1e-12)
            assert pc.last_reused_tokens == [reused]
            history = got.sequences[0].tolist()


def longrope_phi3():
    """A tiny Phi-3 whose LongRoPE switches to its long factors for forwards past 32 positions."""
    from transformers import AutoModelForCausalLM, Phi3Config

    half = TINY_TEXT["hidden_size"] // TINY_TEXT["num_attention_heads"] // 2
    config = Phi3Config(
        num_hidden_layers=2,
        **{**TINY_TEXT, "max_position_embeddings": 256},
        original_max_position_embeddings=32,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [3.0] * half},
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def test_a_longrope_model_runs_calls_past_its_original_length_as_plain_generate():
    """Phi-3's LongRoPE rotates every key of a forward past ``original_max_position_embeddings`` with
    its long factors (and ``generate`` drops a cache that does not reach past it). Such calls run as
    plain ``generate``: before, a first call that long failed (the dropped cache was read for the
    save), and a later one loaded pages that ``generate`` then threw away, counted as reused."""
    model = longrope_phi3()
    assert dynamic_rope_limit(model) == 33
    g = torch.Generator().manual_seed(4)
    history = tokens(g, 40)
    with PrefixCache(model, tiers_config(model, blocks=60)) as pc:
        for length, reused in ((40, 0), (20, 0), (30, 16), (45, 0)):  # 16: 20's full blocks
            ids = torch.tensor([history[:length]])
            extra = dict(max_new_tokens=2, do_sample=False, return_dict_in_generate=True, output_scores=True)
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), **extra)
            got = pc.generate(ids, attention_mask=torch.ones_like(ids), **extra)
            assert torch.equal(got.sequences, expected.sequences)
            torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores), rtol=0, atol=1e-12)
            assert pc.last_reused_tokens == [reused]


def test_a_call_whose_generate_sets_the_cache_aside_reuses_and_saves_nothing(caplog):
    """Some models' ``prepare_inputs_for_generation`` drop the cache they are given for some calls
    (Phi-3's did so past its original length): the call's tokens are ``generate``'s, nothing of it is
    saved or counted as reused, and a WARNING says so once."""
    model = tiny_model("llama")
    prepare = model.prepare_inputs_for_generation

    name = cache_argument(model)

    def dropping(input_ids, *args, **kwargs):
        inputs = prepare(input_ids, *args, **kwargs)
        given = inputs.get(name)
        if kwargs.get("is_first_iteration") and input_ids.shape[1] > 30 and given and given.get_seq_length():
            # as Phi-3's did: the cache is dropped and the whole prompt computed again
            inputs.update({name: None, "input_ids": input_ids, "position_ids": torch.arange(input_ids.shape[1])[None]})
        return inputs

    model.prepare_inputs_for_generation = dropping
    g = torch.Generator().manual_seed(5)
    prompt = tokens(g, 36)
    with PrefixCache(model, tiers_config(model, blocks=60)) as pc:
        for length in (24, 36):
            ids = torch.tensor([prompt[:length]])
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
            got = pc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
            assert torch.equal(got, expected)
            assert pc.last_reused_tokens == [0]
        assert pc.manager.stats().tiers["primary"].pages_used == 3  # 24's blocks only: 36 saved nothing
    assert "set aside the cache" in caplog.text


def test_zero_token_types_are_not_taken_for_no_types():
    """GPT-2 adds an embedding of any ``token_type_ids`` given, zeros too: calls with and without
    them are keyed apart, and each reuses only its own kind's prefixes, with ``generate``'s scores.
    Before, a call with zero types reused a plain call's prefix (and the other way round), off by
    0.04 in the scores."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=256, pad_token_id=PAD)
    model = GPT2LMHeadModel(config).to(torch.float64).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([tokens(g, 40)])
    zeros = {"token_type_ids": torch.zeros_like(ids)}
    settings = {"max_new_tokens": 4, "return_dict_in_generate": True, "output_scores": True}
    with PrefixCache(model, kvtier.CacheConfig(8, [kvtier.PrimaryTier(8 << 20)])) as pc:
        for extra, reused in (({}, 0), (zeros, 0), (zeros, 39), ({}, 39)):
            expected = model.generate(ids, **settings, **extra)
            got = pc.generate(ids, **settings, **extra)
            assert torch.equal(got.sequences, expected.sequences)
            assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores, strict=True))
            assert pc.last_reused_tokens == [reused]


def test_switching_only_the_text_models_attention_kernels_is_noticed():
    """``set_attn_implementation({"text_config": ...})`` leaves the top level's setting as it was.
    Before, only that was read: pages of the other kernels were served (scores 7e-8 off)."""
    model = tiny_vlm()
    prompt = [*range(3, 43)]
    ids = torch.tensor([prompt])
    with PrefixCache(model, tiers_config(model, blocks=20)) as pc:
        pc.generate(ids, max_new_tokens=2)
        kernel = model.config.text_config._attn_implementation
        model.set_attn_implementation({"text_config": "eager" if kernel != "eager" else "sdpa"})
        with pytest.raises(CacheStateError, match=r"attention \(or experts\) implementation changed"):
            pc.generate(ids, max_new_tokens=2)
        model.set_attn_implementation({"text_config": kernel})
        assert torch.equal(pc.generate(ids, max_new_tokens=2), model.generate(ids, max_new_tokens=2))
