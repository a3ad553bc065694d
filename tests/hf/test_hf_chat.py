"""``PrefixCache.generate`` is token-identical to ``model.generate`` over chat turns, for every kind of
cache layer, while pages travel through host and disk, after a restart on the same disk directory,
and never serves one checkpoint's pages to another."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from kvtier.errors import CacheStateError
from kvtier.hf import PrefixCache, model_layers
from tests.hf.tiny import ARCHS, FIRST_TOKEN, HAS_GEMMA4, WINDOW, tiers_config, tiny_model, tokens
from tests.hf.tiny import config as tiny_config

NEW_TOKENS = 6
ROOT = Path(__file__).resolve().parents[2]


def _turn(model, pc: PrefixCache, prompt: list[int]) -> list[int]:
    """One turn through both paths; they must agree token for token. Returns the whole sequence.

    The mask is given: answers may contain the pad token, from which ``generate`` would infer one.
    """
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    got = pc.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(got, expected), f"reused {pc.last_reused_tokens}"
    return got[0].tolist()


GEMMA4 = pytest.param("gemma4", marks=pytest.mark.skipif(not HAS_GEMMA4, reason="this transformers has no Gemma 4"))


@pytest.mark.parametrize("arch", [*ARCHS, GEMMA4])
def test_chat_through_host_and_disk_then_restart_then_other_weights(arch, tmp_path):
    model = tiny_model(arch)
    config = tiers_config(model, blocks=12, host_blocks=4, disk_blocks=400, disk_path=tmp_path / "disk")
    g = torch.Generator().manual_seed([*ARCHS, "gemma4"].index(arch) + 10)
    system = tokens(g, 41)  # longer than the sliding window
    history = [system + tokens(g, n) for n in (20, 24, 17)]
    with PrefixCache(model, config) as pc:
        for turn in range(2):
            for c in range(3):
                sequence = _turn(model, pc, history[c])
                reused = pc.last_reused_tokens[0]
                if turn or c:  # later conversations share the system prompt from their first turn
                    assert reused >= (len(history[c]) - 24 if turn else 32), (turn, c, reused)
                history[c] = sequence + tokens(g, 7)
        stats = pc.manager.stats()
        assert stats.demotions > 0
        assert stats.hit_tokens["host"] + stats.hit_tokens["disk"] > 0, stats.hit_tokens

    with PrefixCache(model, config) as pc:  # a new process on the same disk directory
        _turn(model, pc, history[0])
        assert pc.last_reused_tokens[0] > WINDOW
        assert pc.manager.stats().hit_tokens["disk"] > 0

    other = tiny_model(arch, seed=1)  # another checkpoint of the same architecture
    with PrefixCache(other, config) as pc:
        _turn(other, pc, history[0])
        assert pc.last_reused_tokens == [0]


def test_after_an_upgrade_of_transformers_the_disk_serves_nothing_saved_before(tmp_path, monkeypatch):
    """A release of transformers may compute a model's keys otherwise (a fix of its rotary
    embedding): pages saved under another version are never served."""
    model = tiny_model("llama")
    config = tiers_config(model, blocks=12, disk_blocks=100, disk_path=tmp_path / "disk")
    prompt = tokens(torch.Generator().manual_seed(13), 40)
    with PrefixCache(model, config) as pc:
        prompt = _turn(model, pc, prompt)
    with PrefixCache(model, config) as pc:  # a restart: the same version reads them
        _turn(model, pc, prompt + [FIRST_TOKEN])
        assert pc.last_reused_tokens == [40]
    monkeypatch.setattr(model_layers, "transformers_version", lambda: transformers.__version__ + ".post1")
    with PrefixCache(model, config) as pc:
        _turn(model, pc, prompt + [FIRST_TOKEN])
        assert pc.last_reused_tokens == [0]


def test_processes_of_one_model_on_one_disk_path_take_a_directory_each(tmp_path, caplog):
    """The ranks of a job build their caches alike, one disk path for all: the second keeps its pages
    in ``path/replica-1`` (before, it failed with ``DiskTierBusyError``); after both restart, each
    serves its own prompt from disk."""
    model = tiny_model("llama")
    config = tiers_config(model, blocks=12, disk_blocks=64, disk_path=tmp_path / "disk")
    g = torch.Generator().manual_seed(5)
    prompts = [tokens(g, 40), tokens(g, 40)]
    caches = [PrefixCache(model, config), PrefixCache(model, config)]
    assert "replica-1" in caplog.text
    assert "another KVCacheManager of this process, still open" in caplog.text  # names who holds it
    for pc, prompt in zip(caches, prompts, strict=True):
        _turn(model, pc, prompt)
        pc.close()
    assert list((tmp_path / "disk" / "replica-1").glob("kvtier-*"))
    caches = [PrefixCache(model, config), PrefixCache(model, config)]  # they take the directories in turn
    for pc, prompt in zip(caches, prompts, strict=True):
        _turn(model, pc, prompt + [FIRST_TOKEN])
        assert pc.last_reused_tokens[0] == 40  # its prompt, 5 blocks
        assert pc.manager.stats().hit_tokens["disk"] == 40
        pc.close()


def test_calls_from_several_threads_run_one_at_a_time_and_each_reads_its_own_reuse():
    """A threaded server shares one PrefixCache: calls wait for each other (before, one that entered
    the manager while another was inside raised ``CacheStateError``), and ``last_reused_tokens`` is
    the calling thread's last call's."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(6)
    chats = [tokens(g, 60 + 3 * i) for i in range(8)]
    errors: list[BaseException] = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can
    with PrefixCache(model, tiers_config(model, blocks=400)) as pc:

        def chat(i: int) -> None:
            try:
                prompt = chats[i]
                for turn in range(4):
                    sequence = _turn(model, pc, prompt)
                    # the last call saved the blocks its prompt and answer filled: all but the last token
                    assert pc.last_reused_tokens == [(len(prompt) - 2) // 8 * 8 if turn else 0]
                    prompt = sequence + [FIRST_TOKEN]
            except BaseException as error:  # reported by the main thread
                errors.append(error)

        threads = [threading.Thread(target=chat, args=(i,)) for i in range(len(chats))]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            sys.setswitchinterval(switch)
    assert not errors, errors[0]


def test_a_compiled_model_is_served_as_the_model_it_wraps(recwarn):
    """``torch.compile(model)`` hides the forward's signature: kvtier passed the cache as the deprecated
    ``past_key_values`` (a FutureWarning each call) and keyed pages by other parameter names."""
    model = tiny_model("llama")
    compiled = torch.compile(model, backend="eager")
    g = torch.Generator().manual_seed(7)
    prompt = tokens(g, 50)
    with (
        PrefixCache(compiled, tiers_config(model, blocks=64)) as pc,
        PrefixCache(model, tiers_config(model, 64)) as plain,
    ):
        assert pc.spec.model_id == plain.spec.model_id
        for _ in range(2):
            prompt = _turn(model, pc, prompt) + [FIRST_TOKEN]
        assert pc.last_reused_tokens[0] > 0
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("arch", ["mistral", "qwen3_next"])
def test_a_prompt_that_leaves_an_earlier_one_midway_reuses_what_the_window_or_state_needs_there(arch):
    """The window's blocks at the point where the prompts part (long gone from the transformers
    cache of the first call) and the recurrent state there were saved as they were written."""
    model = tiny_model(arch)
    config = tiers_config(model, blocks=64)
    g = torch.Generator().manual_seed(3)
    first = tokens(g, 90)
    with PrefixCache(model, config) as pc:
        _turn(model, pc, first)
        _turn(model, pc, first[:53] + tokens(g, 20))
        assert pc.last_reused_tokens[0] >= 48


def _same_nested(a, b) -> bool:
    """Tuples of tensors (per step, per layer), equal entry for entry; None where a layer has none."""
    if isinstance(a, tuple | list):
        return isinstance(b, tuple | list) and len(a) == len(b) and all(map(_same_nested, a, b))
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_a_call_asking_for_the_prompts_hidden_states_or_attentions_computes_the_whole_prompt(arch):
    """generate returns them for every prompt position: such a call reuses nothing (before, they
    covered only the positions after the reused prefix). Without linear-attention layers, the blocks
    it computed are saved as any call's."""
    model = tiny_model(arch)
    model.set_attn_implementation("eager")  # attentions are returned by the eager implementation only
    g = torch.Generator().manual_seed(12)
    prompt = tokens(g, 40)
    with PrefixCache(model, tiers_config(model, blocks=60)) as pc:
        prompt = _turn(model, pc, prompt)
        for flag, field in (("output_hidden_states", "hidden_states"), ("output_attentions", "attentions")):
            prompt += tokens(g, 9)
            ids = torch.tensor([prompt])
            ask = {"max_new_tokens": 3, "do_sample": False, "return_dict_in_generate": True, flag: True}
            expected, got = model.generate(ids, **ask), pc.generate(ids, **ask)
            assert pc.last_reused_tokens == [0]
            assert torch.equal(got.sequences, expected.sequences)
            assert _same_nested(getattr(got, field), getattr(expected, field))
            prompt = got.sequences[0].tolist()
        _turn(model, pc, prompt + tokens(g, 5))
        if arch == "llama":  # the 64 whole blocks of the last call's 67-token prompt were saved
            assert pc.last_reused_tokens == [64]
        else:  # linear-attention states are kept only where a call ran to: the first turn's 40 tokens
            assert pc.last_reused_tokens == [40]


def _letters_tokenizer():
    """A tokenizer over the tiny vocabulary that starts each text with a BOS token, as Llama's does
    (ids 3-28 are the letters a-z, every other id is written ``[id]``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    names = {0: "<pad>", 1: "<s>", 2: "</s>"} | {i: chr(94 + i) if i < 29 else f"[{i}]" for i in range(3, 97)}
    words = Tokenizer(models.WordLevel({name: i for i, name in names.items()}, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.Split(Regex(r"\[\d+\]|."), "isolated")
    words.decoder = decoders.Fuse()
    words.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>", bos_token="<s>")


def test_a_call_with_token_healing_runs_as_plain_generate():
    """``generate`` heals the prompt (re-tokenizes it, makes its BOS padding) after kvtier matched
    it: such a call reuses nothing. Before, it decoded from the cached keys of the prompt as given
    and gave other tokens (scores 0.39 off)."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(8)
    system = [1, *tokens(g, 8)]
    with PrefixCache(model, tiers_config(model, blocks=300), recompute_when_faster=False) as pc:
        pc.generate(torch.tensor([system]), max_new_tokens=1, do_sample=False)
        ids = torch.tensor([system + tokens(g, 30)])
        ask = {"max_new_tokens": 3, "do_sample": False, "token_healing": True, "tokenizer": _letters_tokenizer()}
        ask |= {"return_dict_in_generate": True, "output_scores": True}
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), **ask)
        got = pc.generate(ids, attention_mask=torch.ones_like(ids), **ask)
        assert pc.last_reused_tokens == [0]
        assert torch.equal(got.sequences, expected.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores, strict=True))
        pc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        assert pc.last_reused_tokens == [8]  # the plain call after it reuses as before


def test_a_chunked_prefill_is_no_sample_of_the_prefill_rate(monkeypatch):
    """``generate(prefill_chunk_size=...)``'s first forward computes one chunk of the prompt: timing it
    as the whole prompt made the rate about prompt / chunk times too high (recomputing what loads
    faster). Such calls are not timed; a call without chunks is."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    with PrefixCache(model, tiers_config(model, blocks=400)) as pc:
        told: list[float] = []
        monkeypatch.setattr(pc.manager, "set_prefill_rate", told.append)
        for _ in range(2):
            pc.generate(torch.tensor([tokens(g, 1000)]), max_new_tokens=1, do_sample=False, prefill_chunk_size=16)
        assert told == []
        pc.generate(torch.tensor([tokens(g, 1000)]), max_new_tokens=1, do_sample=False)
        assert len(told) == 1


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
@pytest.mark.parametrize("built_inside", [True, False])
def test_calls_inside_and_outside_inference_mode(arch, built_inside):
    """A script that builds the PrefixCache under ``torch.inference_mode()`` and calls it outside (or
    the other way): the tiers' buffers are ordinary tensors, written in place by either kind of call
    (before, a model with linear-attention layers failed to save its states outside)."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(14)
    prompt = tokens(g, 40)
    with torch.inference_mode(built_inside):
        pc = PrefixCache(model, tiers_config(model, blocks=60, host_blocks=20))
    with pc:
        for turn in range(3):
            with torch.inference_mode(turn == 1 or not built_inside):  # calls of both kinds
                prompt = _turn(model, pc, prompt) + tokens(g, 5)
        assert pc.last_reused_tokens[0] >= 40


def test_sampling_draws_the_same_tokens_with_the_same_seed():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    prompt = tokens(g, 40)
    with PrefixCache(model, tiers_config(model, blocks=32)) as pc:
        for _ in range(2):
            ids = torch.tensor([prompt])
            mask = torch.ones_like(ids)
            torch.manual_seed(7)
            expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0)
            torch.manual_seed(7)
            got = pc.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0)
            assert torch.equal(got, expected)
            prompt = got[0].tolist() + tokens(g, 5)
        assert pc.last_reused_tokens[0] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_chat_with_write_through_copies(arch):
    """Each generate leaves its published pages copied to host memory (``maintain``); later turns
    evict them without a copy and still equal ``model.generate``."""
    model = tiny_model(arch)
    config = tiers_config(model, blocks=12, host_blocks=64)
    config = dataclasses.replace(
        config, tiers=[config.tiers[0], dataclasses.replace(config.tiers[1], write_through=True)]
    )
    g = torch.Generator().manual_seed(5)
    history = [tokens(g, 40 + 3 * c) for c in range(3)]
    with PrefixCache(model, config) as pc:
        history[0] = _turn(model, pc, history[0]) + tokens(g, 5)
        first = pc.manager.stats()
        assert first.demotions == 0 and first.bytes_copied.get("primary->host:cpu", 0) > 0  # copies, not moves
        for _ in range(2):
            for c in range(3):
                history[c] = _turn(model, pc, history[c]) + tokens(g, 5)
        stats = pc.manager.stats()
        assert stats.demotions > 0 and stats.hit_tokens["host"] > 0
        pc.manager.check_invariants()


def test_use_cache_false_saved_with_a_checkpoint_is_set_aside(caplog):
    """Checkpoints saved after training with gradient checkpointing carry ``use_cache: false``, which
    their generation config inherits: the calls run as ``generate(use_cache=True)`` does, and reuse
    (before, every call was refused). ``use_cache=False`` passed to the call is still refused."""
    config = tiny_config("llama")
    config.use_cache = False  # as such a checkpoint's config.json has it
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    model.generation_config.eos_token_id = None
    assert model.generation_config.use_cache is False  # inherited, as from_pretrained inherits it
    g = torch.Generator().manual_seed(11)
    prompt = tokens(g, 40)
    with PrefixCache(model, tiers_config(model, blocks=32)) as pc, caplog.at_level("INFO", "kvtier.hf"):
        for _ in range(2):
            ids = torch.tensor([prompt])
            mask = torch.ones_like(ids)
            greedy = {"attention_mask": mask, "max_new_tokens": NEW_TOKENS, "do_sample": False}
            expected = model.generate(ids, use_cache=True, **greedy)
            got = pc.generate(ids, **greedy)
            assert torch.equal(got, expected)
            prompt = got[0].tolist() + tokens(g, 5)
        assert pc.last_reused_tokens[0] > 0
        with pytest.raises(ValueError, match="use_cache=True"):
            pc.generate(ids, attention_mask=mask, max_new_tokens=2, use_cache=False)
    assert sum("use_cache=False" in r.getMessage() for r in caplog.records) == 1


def test_a_quantized_cache_preset_by_the_generation_config_is_refused():
    """Its keys and values are rounded, so plain ``generate`` gives other tokens than kvtier's exact
    pages would: refused as the same argument given to the call is, rather than set aside."""
    model = tiny_model("llama")
    model.generation_config.cache_implementation = "quantized"
    ids = torch.tensor([tokens(torch.Generator().manual_seed(10), 20)])
    with PrefixCache(model, tiers_config(model, blocks=8)) as pc, pytest.raises(NotImplementedError, match="quantized"):
        pc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2)


@pytest.mark.parametrize(("arch", "preset"), [("gemma2", "hybrid"), ("llama", "static")])
def test_a_static_cache_preset_by_the_generation_config_is_set_aside(arch, preset, caplog):
    """Gemma checkpoints ship ``cache_implementation="hybrid"`` in their generation config: the calls
    run on kvtier's cache, give plain ``generate``'s tokens (on its static cache) and reuse; an
    explicit ``cache_implementation="dynamic"`` is the same request."""
    model = tiny_model(arch)
    model.generation_config.cache_implementation = preset
    g = torch.Generator().manual_seed(9)
    history = tokens(g, 40)
    with PrefixCache(model, tiers_config(model, blocks=60)) as pc, caplog.at_level("INFO", "kvtier.hf"):
        for turn in range(3):
            history = [*history, *tokens(g, 9)]
            ids = torch.tensor([history])
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
            extra = {"cache_implementation": "dynamic"} if turn == 2 else {}
            got = pc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, **extra)
            assert torch.equal(got, expected)
            assert (pc.last_reused_tokens[0] > 0) == (turn > 0)
            history = got[0].tolist()
    assert sum(f"cache_implementation={preset!r}" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("gather_bytes", [1, None])
def test_the_prefix_loads_in_one_gather_per_slice_of_layers(gather_bytes, monkeypatch):
    """By default the four key and value parts of the tiny Llama load in one gather; with slices of
    one part, in four; both serve what plain ``generate`` computes."""
    from kvtier.hf import prefix_load

    if gather_bytes is not None:
        monkeypatch.setattr(prefix_load, "GATHER_BYTES", gather_bytes)
    gathers = []
    real = prefix_load.gather_blocks
    monkeypatch.setattr(prefix_load, "gather_blocks", lambda view, *a: gathers.append(view.shape[0]) or real(view, *a))
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(31)
    history = tokens(g, 30)
    with PrefixCache(model, tiers_config(model, blocks=40)) as pc:
        sequence = _turn(model, pc, history)
        assert gathers == []  # nothing to reuse yet
        _turn(model, pc, sequence + tokens(g, 5))
        assert pc.last_reused_tokens[0] > 0
    assert gathers == ([1, 1, 1, 1] if gather_bytes == 1 else [4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_prefix_loads_exactly_the_bytes_of_its_pages(dtype):
    """Half types gather as 8-byte words: every loaded key and value equals its page's, byte for byte."""
    import numpy as np

    from kvtier.hf.batch_rows import Row, choose_width, close_rows
    from kvtier.hf.hf_cache import RecordingCache
    from kvtier.hf.prefix_load import load_prefix

    model = tiny_model("llama").to(dtype)
    g = torch.Generator().manual_seed(41)
    prompt = tokens(g, 37)
    with PrefixCache(model, tiers_config(model, blocks=40)) as pc:
        ids = torch.tensor([prompt])
        pc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        mgr = pc.manager
        longer = np.array(prompt + tokens(g, 3))
        rows = [Row(0, 0, longer, mgr.create_cache(longer, pc.scope), pc.scope)]
        cache = RecordingCache(model.config)
        cache.initialize_attention(mgr.spec.dtype, mgr.device)
        width = choose_width(mgr, rows, len(longer), None)
        assert width == 32  # four blocks of 8
        load_prefix(cache, pc._layers, mgr, rows, width, pc._packing, pc._stacks)
        tpb = mgr.tokens_per_block
        for layer_id, layer in pc._layers.by_kvtier_id.items():
            slots = rows[0].read.page_indices(mgr.spec.group_of(layer_id).group_id)[: width // tpb]
            for role, loaded in (("k", cache.layers[layer.index].keys), ("v", cache.layers[layer.index].values)):
                pages = mgr.kv_views(layer_id)[role][
                    torch.from_numpy(slots.astype(np.int64))
                ]  # [blocks, tpb, heads, dim]
                expected = pages.reshape(width, *pages.shape[2:]).transpose(0, 1)[None]  # [1, heads, columns, dim]
                assert loaded.dtype == dtype and torch.equal(loaded.view(torch.int16), expected.view(torch.int16))
        close_rows(rows)


def test_a_generation_config_passed_second_or_by_name_carries_kvtier_s_cache_settings(monkeypatch):
    """``model.generate(input_ids, generation_config)`` takes the config second: so does
    ``pc.generate``. kvtier's settings for its cache (no ``cache_implementation``, ``use_cache``) go
    in a copy of a passed config, never beside it, where transformers deprecates them and warns of
    them as the caller's. Before, a config given second was taken for the attention mask
    (``ValueError``), and every call with a config passed drew that deprecation warning."""
    model = tiny_model("llama")
    ids = torch.tensor([tokens(torch.Generator().manual_seed(18), 40)])
    passed = transformers.GenerationConfig(max_new_tokens=4, use_cache=True)
    expected = model.generate(ids, passed)
    seen = []
    generate = model.generate

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    with PrefixCache(model, tiers_config(model, blocks=40)) as pc:
        for _ in range(2):
            assert torch.equal(pc.generate(ids, passed), expected)
        assert min(pc.last_reused_tokens) > 0
        assert torch.equal(pc.generate(ids, generation_config=passed), expected)
        mask = torch.ones_like(ids)
        assert torch.equal(pc.generate(ids, passed, attention_mask=mask), expected)  # the usual padded call's form
        assert torch.equal(pc.generate(ids, mask, generation_config=passed), expected)  # the mask second, as before
        with pytest.raises(TypeError, match="multiple values for argument 'generation_config'"):
            pc.generate(ids, passed, generation_config=passed)
        with pytest.raises(TypeError, match="multiple values for argument 'attention_mask'"):
            pc.generate(ids, mask, attention_mask=mask)
        with pytest.raises(TypeError, match="at most one more positional argument"):
            pc.generate(ids, mask, passed)
        assert pc.last_reused_tokens == []  # a refused call reused nothing
        pc.generate(ids, passed)
        assert min(pc.last_reused_tokens) > 0
    with pytest.raises(CacheStateError, match="closed"):
        pc.generate(ids, passed)
    assert pc.last_reused_tokens == []  # nor does one refused for the closed cache
    for kwargs in seen:
        assert "cache_implementation" not in kwargs and "use_cache" not in kwargs
        given = kwargs["generation_config"]
        assert given is not passed and given.cache_implementation is None and given.use_cache is True
    assert passed.use_cache is True and passed.cache_implementation is None  # the caller's config as it was


@pytest.mark.parametrize("preset", ["beams", "sampling", "hidden_states", "pad"])
def test_a_generation_config_passed_to_a_call_is_completed_from_the_models(preset):
    """``generate`` takes the settings a passed ``generation_config`` leaves unset from the model's.
    Before, PrefixCache read the passed one alone: beams on the model's config crashed the call,
    sampling there refused ``num_return_sequences``, hidden states there came back for the suffix
    only, and a pad id there was not seen when inferring a padded batch's mask."""
    model = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(17), 40)
    passed = transformers.GenerationConfig(max_new_tokens=4)
    ids = torch.tensor([[*prompt, 5, 6]])
    mask = torch.ones_like(ids)
    if preset == "beams":
        model.generation_config.num_beams = 3
    elif preset == "sampling":  # as chat checkpoints ship it
        model.generation_config.do_sample = True
        passed.num_return_sequences = 2
    elif preset == "hidden_states":
        model.generation_config.return_dict_in_generate = True
        model.generation_config.output_hidden_states = True
    else:
        model.generation_config.pad_token_id = 0
        ids = torch.tensor([[0, 0, *prompt], [*prompt, 5, 6]])
        mask = None
        passed.return_dict_in_generate = passed.output_scores = True  # the scores tell stale pages
    masks = [mask, mask] if preset != "pad" else [None, None, torch.ones_like(ids)]  # then the pads attended
    with PrefixCache(model, tiers_config(model, blocks=80)) as pc:
        for call, mask in enumerate(masks):  # the second call reuses what the first saved
            torch.manual_seed(0)
            expected = model.generate(ids, attention_mask=mask, generation_config=passed)
            torch.manual_seed(0)
            got = pc.generate(ids, attention_mask=mask, generation_config=passed)
            if preset in ("hidden_states", "pad"):
                assert _same_nested(expected.hidden_states, got.hidden_states)
                assert _same_nested(expected.scores, got.scores)
                expected, got = expected.sequences, got.sequences
            assert torch.equal(expected, got)
            if call == 1 and preset != "hidden_states":  # (which compute their whole prompt: nothing reused)
                assert min(pc.last_reused_tokens) > 0


def test_a_prefix_cache_copied_or_pickled_is_a_type_error_naming_it():
    model = tiny_model("llama")
    with PrefixCache(model, tiers_config(model, blocks=8)) as pc:
        for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match=r"PrefixCache cannot be copied or pickled.*in each process"):
                duplicate(pc)
        prompt = tokens(torch.Generator().manual_seed(3), 20)
        _turn(model, pc, prompt)
        _turn(model, pc, prompt)
        assert pc.last_reused_tokens == [19]  # all but the last prompt token


FORK_WHILE_INSIDE = """
import os, signal, sys, threading
import torch
from kvtier.errors import CacheStateError
from kvtier.hf import PrefixCache
from tests.hf.tiny import tiers_config, tiny_model

torch.set_num_threads(1)
model = tiny_model("llama")
pc = PrefixCache(model, tiers_config(model, blocks=8))
inside, leave = threading.Event(), threading.Event()

class Stalls:  # a streamer that holds the call open until the parent lets it go
    def put(self, value):
        inside.set()
        leave.wait()
    def end(self):
        pass

ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
worker = threading.Thread(target=lambda: pc.generate(ids, max_new_tokens=2, do_sample=False, streamer=Stalls()))
worker.start()
inside.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # a hang ends the child with SIGALRM
    try:
        pc.generate(ids, max_new_tokens=2, do_sample=False)
        print("child served", flush=True)
    except CacheStateError as refusal:
        print("child refused:", "forked child" in str(refusal), flush=True)
    pc.close()  # the parent's: nothing is done
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
leave.set()
worker.join()
pc.close()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_is_refused_a_prefix_cache_another_thread_was_inside():
    """A fork while a thread of the parent is inside ``generate`` (a server forking workers): the
    child's copy of the call lock is held by a thread the child does not have. Before, the child's
    first call waited for ever; now it raises ``CacheStateError`` naming the fork, and ``close``
    does nothing there."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_WHILE_INSIDE], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["child refused: True", "child exit 0"], done.stderr[-3000:]


def test_a_call_made_from_inside_another_leaves_each_its_own_reuse():
    """A callback of a ``generate`` (here ``prefix_allowed_tokens_fn``) may call the PrefixCache
    again on the same thread. Before, the outer call's ``last_reused_tokens`` then read the inner's."""
    model = tiny_model("llama")
    outer, inner = (tokens(torch.Generator().manual_seed(seed), 40) for seed in (18, 19))
    with PrefixCache(model, tiers_config(model, blocks=80)) as pc:
        for prompt in (outer, inner):  # cached, for the calls below to reuse
            pc.generate(torch.tensor([prompt]), max_new_tokens=1)
        seen = {}

        def allowed(batch_id, ids):
            if not seen:
                pc.generate(torch.tensor([inner[:36] + [5]]), max_new_tokens=1)
                seen["inner"] = pc.last_reused_tokens
            return list(range(model.config.vocab_size))

        ids = torch.tensor([[*outer, 5, 6]])
        got = pc.generate(ids, max_new_tokens=3, prefix_allowed_tokens_fn=allowed)
        assert torch.equal(got, model.generate(ids, max_new_tokens=3, prefix_allowed_tokens_fn=allowed))
        assert seen["inner"] == [36] and pc.last_reused_tokens == [40]


def test_a_call_that_raises_inside_generate_reports_no_reuse():
    """A stopping criterion that raises: ``generate`` fails after kvtier loaded the prefix. Before,
    ``last_reused_tokens`` still told of the reuse the failed call had planned."""
    model = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(13), 40)

    class Broken(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            raise RuntimeError("a stopping criterion that breaks")

    with PrefixCache(model, tiers_config(model, 60)) as pc:
        pc.generate(torch.tensor([prompt]), max_new_tokens=2, do_sample=False)
        before = pc.manager.stats()
        with pytest.raises(RuntimeError, match="breaks"):
            pc.generate(
                torch.tensor([[*prompt, 5]]),
                max_new_tokens=2,
                do_sample=False,
                stopping_criteria=transformers.StoppingCriteriaList([Broken()]),
            )
        assert pc.last_reused_tokens == [0]
        after = pc.manager.stats()  # the manager agrees: the match counts as recomputed, not as hits
        assert after.hit_tokens == before.hit_tokens
        assert after.recomputed_tokens - before.recomputed_tokens == 40
        pc.generate(torch.tensor([[*prompt, 5]]), max_new_tokens=2, do_sample=False)
        assert pc.last_reused_tokens == [40]
