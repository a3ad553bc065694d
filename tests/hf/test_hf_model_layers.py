"""What ``PrefixCache`` reads from a model, what it refuses (at construction, naming it), and the
arguments ``generate`` refuses before touching anything."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import GenerationConfig

import kvtier
from kvtier.hf import PrefixCache
from kvtier.hf.model_layers import LayerKind, read_model
from tests.hf.test_hf_recompute import turn
from tests.hf.tiny import HAS_GEMMA4, TINY_TEXT, VOCAB, WINDOW, tiers_config, tiny_model, tokens


def test_layers_and_groups_of_each_architecture():
    gemma = read_model(tiny_model("gemma2"))
    assert [x.kind for x in gemma.layers] == [LayerKind.SLIDING, LayerKind.FULL] * 2
    assert [(g.kind.value, g.window, g.layer_ids) for g in gemma.spec.groups] == [
        ("sliding_window", WINDOW, (0, 2)),
        ("attention", None, (1, 3)),
    ]
    qwen = read_model(tiny_model("qwen3_next"))
    assert [x.kind for x in qwen.layers] == [LayerKind.LINEAR] * 3 + [LayerKind.FULL]
    layer = qwen.layers[0]
    assert [(s.role, s.shape, s.dtype) for s in layer.states] == [
        ("conv", (64, 4), torch.float64),  # (2 * key dim + value dim) channels, kernel 4
        ("recurrent", (4, 8, 8), torch.float32),  # value heads, key dim, value dim
    ]
    assert qwen.spec.layers[0].state_bytes == 64 * 4 * 8 + 4 * 8 * 8 * 4
    assert qwen.spec.layers[3] == kvtier.AttentionLayer(2, 8)
    assert qwen.spec.dtype == torch.float64
    falcon = read_model(tiny_model("falcon_h1"))  # each decoder layer: its states, then its attention
    assert [(x.index, x.kind) for x in falcon.layers] == [
        (i, kind) for i in range(2) for kind in (LayerKind.LINEAR, LayerKind.FULL)
    ]
    assert [(g.kind.value, g.layer_ids) for g in falcon.spec.groups] == [("recurrent", (0, 2)), ("attention", (1, 3))]
    latent = read_model(tiny_model("deepseek_v3"))  # two latents of different sizes: a kvtier layer each
    assert [(x.index, x.roles, x.num_kv_heads, x.head_dim) for x in latent.layers] == [
        (i, roles, 1, dim) for i in range(2) for roles, dim in ((("k",), 16), (("v",), 8))
    ]
    assert [(g.kind.value, g.layer_ids) for g in latent.spec.groups] == [("attention", (0, 1, 2, 3))]


@pytest.mark.skipif(not HAS_GEMMA4, reason="this transformers has no Gemma 4")
def test_layers_of_a_model_that_shares_keys_and_values_across_layers():
    """Gemma 4: its last two layers read earlier layers' keys and values (their cache layers hold
    nothing, no kvtier layer), and its full attention layers have larger heads than its sliding ones."""
    gemma4 = read_model(tiny_model("gemma4"))
    shared = [(LayerKind.EMPTY, 0)] * 2 if hasattr(transformers.cache_utils, "DummyLayer") else []  # (from 5.23)
    assert [(x.kind, x.head_dim) for x in gemma4.layers] == [
        (LayerKind.SLIDING, 8),
        (LayerKind.SLIDING, 8),
        (LayerKind.FULL, 16),
        (LayerKind.SLIDING, 8),
        *shared,
    ]
    assert [(g.kind.value, g.window, g.layer_ids) for g in gemma4.spec.groups] == [
        ("sliding_window", WINDOW, (0, 1, 3)),
        ("attention", None, (2,)),
    ]


def test_model_id_is_a_fingerprint_of_the_weights_and_the_configuration_unless_given():
    model = tiny_model("llama")
    model_id = read_model(model).spec.model_id
    assert model_id.startswith(f"weights:{kvtier.weights_fingerprint(model)}+config-")
    assert model_id.endswith(f"+transformers-{transformers.__version__}+attention-sdpa")  # code, kernels
    assert read_model(tiny_model("llama", seed=1)).spec.model_id != model_id
    model.config.output_hidden_states = True  # a runtime switch: the same keys and values
    assert read_model(model).spec.model_id == model_id
    with PrefixCache(model, tiers_config(model, blocks=8), model_id="llama-tiny@1") as pc:
        assert pc.manager.spec.model_id == "llama-tiny@1"


def test_a_configuration_edited_after_the_model_was_built_names_the_tables_it_computes_with():
    """The rotary tables are computed when the model is built: a base edited into the configuration
    afterwards changes nothing the model computes. Before, the ``model_id`` named the edited setting,
    so a model built with that base for real shared its pages (other tokens)."""
    edited = tiny_model("llama")
    edited.config.rope_parameters["rope_theta"] = 100.0
    for_real = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(edited.config), dtype=torch.float64)
    for_real.load_state_dict(edited.state_dict())
    assert "+rotary-" not in read_model(for_real).spec.model_id  # tables as the configuration names them
    assert "+rotary-" in read_model(edited).spec.model_id
    assert read_model(edited).spec.model_id != read_model(for_real).spec.model_id


def test_the_tables_are_compared_on_the_cpu_whatever_the_default_device():
    """A script that sets a default device (CUDA on a GPU; the meta device stands in here) before
    building the cache: transformers' rotary functions make their tables there, and comparing them
    with the CPU copy of the built ones raised before."""
    model, edited = tiny_model("llama"), tiny_model("llama")
    edited.config.rope_parameters["rope_theta"] = 100.0
    expected = read_model(model).spec.model_id, read_model(edited).spec.model_id
    torch.set_default_device("meta")
    try:
        assert (read_model(model).spec.model_id, read_model(edited).spec.model_id) == expected
    finally:
        torch.set_default_device(None)
    assert "+rotary-" in expected[1]


def test_an_encoder_decoder_model_is_refused():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    model = transformers.T5ForConditionalGeneration(config)
    with pytest.raises(NotImplementedError, match="encoder-decoder"):
        PrefixCache(model, kvtier.CacheConfig(8, [kvtier.PrimaryTier(1 << 20)]))


def test_a_model_with_offloaded_weights_is_refused_by_what_it_is():
    """accelerate's ``cpu_offload`` leaves the weights on the meta device. Before, the refusal said
    "cache_config.device is cpu, the model is on meta: use the same", which no device can follow."""
    model = tiny_model("llama")
    config = tiers_config(model, blocks=8)
    with pytest.raises(NotImplementedError, match="weights offloaded"):
        PrefixCache(model.to("meta"), config)


def test_a_model_without_attention_layers_is_refused():
    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, state_size=4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(NotImplementedError, match="no attention layer"):
        PrefixCache(model, kvtier.CacheConfig(8, [kvtier.PrimaryTier(1 << 20)]))


def test_a_model_that_cannot_extend_a_cache_by_several_tokens_is_refused():
    """XLM's forward takes one new token over a cache at a time: generate() given a cached prefix
    fails for it, so a PrefixCache of it would fail at the first call that reuses one."""
    config = transformers.XLMConfig(vocab_size=VOCAB, emb_dim=16, n_layers=1, n_heads=2, is_decoder=True)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(NotImplementedError, match="XLMWithLMHeadModel cannot extend a cache by several tokens"):
        PrefixCache(model, kvtier.CacheConfig(8, [kvtier.PrimaryTier(1 << 20)]))


def test_a_model_that_keeps_a_cache_of_its_own_is_refused_by_name():
    """MiniMax's forward refuses a DynamicCache (a ValueError of its own): refused as a model kvtier
    cannot serve, not with the model's error."""
    config = transformers.MiniMaxConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        num_local_experts=2,
        num_experts_per_tok=1,
        pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(NotImplementedError, match="MiniMaxForCausalLM cannot run with the cache kvtier gives it"):
        PrefixCache(model, kvtier.CacheConfig(8, [kvtier.PrimaryTier(1 << 20)]))


def test_a_model_whose_cache_keeps_positions_of_its_own_is_refused():
    """CPM-Ant's cache holds its prompt's positions before the tokens': pages of the tokens alone
    resumed into it gave other tokens than generate (silently)."""
    config = transformers.CpmAntConfig(
        vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, dim_head=8, dim_ff=32, num_hidden_layers=1
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(NotImplementedError, match=r"CpmAntForCausalLM's cache holds \[33\] positions per layer"):
        PrefixCache(model, kvtier.CacheConfig(8, [kvtier.PrimaryTier(1 << 20)]))


def test_a_model_that_attends_to_later_tokens_is_refused_and_served_once_causal():
    """A BERT-style decoder loaded without ``is_decoder=True`` attends both ways: its first token's
    keys depend on the tokens after it, so a page saved from one prompt does not hold what another
    prompt with that prefix computes. Refused; the same weights built causally are served."""
    sizes = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    tiers = kvtier.CacheConfig(8, [kvtier.PrimaryTier(1 << 20)])
    torch.manual_seed(0)
    both_ways = transformers.BertLMHeadModel(transformers.BertConfig(**sizes)).eval()
    with pytest.raises(NotImplementedError, match="BertLMHeadModel attends to later tokens: layer 1"):
        PrefixCache(both_ways, tiers)
    causal = transformers.BertLMHeadModel(transformers.BertConfig(is_decoder=True, **sizes)).eval()
    causal.load_state_dict(both_ways.state_dict())
    g = torch.Generator().manual_seed(4)
    prompt = tokens(g, 30)
    with PrefixCache(causal, tiers) as pc:
        for _ in range(2):
            ids = torch.tensor([prompt])
            expected = causal.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            assert torch.equal(pc.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), expected)
            prompt = expected[0].tolist() + tokens(g, 5)
        assert pc.last_reused_tokens == [32]


def test_a_cache_layer_kvtier_cannot_represent_is_refused_by_name():
    from transformers import cache_utils

    indexed = [
        name
        for name, layer in cache_utils.DYNAMIC_LAYER_TYPE_MAPPING.items()
        if layer.__name__ == "DynamicIndexedLayer"
    ]
    model = tiny_model("llama")
    model.config.layer_types = ["full_attention", indexed[0]]  # a sparse-attention indexer's cache (its name varies)
    with pytest.raises(NotImplementedError, match="layer 1 has a DynamicIndexedLayer cache"):
        PrefixCache(model, kvtier.CacheConfig(8, [kvtier.PrimaryTier(1 << 20)]))


def test_a_model_spread_over_devices_is_refused():
    model = tiny_model("llama")
    model.model.layers[1].to("meta")  # as accelerate leaves a layer offloaded to disk
    with pytest.raises(NotImplementedError, match=r"split across devices \['cpu', 'meta'\]"):
        PrefixCache(model, kvtier.CacheConfig(8, [kvtier.PrimaryTier(1 << 20)]))


def test_the_cache_must_live_on_the_models_device():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="same"):
        PrefixCache(model, kvtier.CacheConfig(8, [kvtier.PrimaryTier(1 << 20)], device="cuda"))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5}, NotImplementedError, "group_beam_search"),
        ({"num_return_sequences": 2}, NotImplementedError, "num_return_sequences"),  # greedy: several need sampling
        # assisted decoding writes drafts into the cache and cuts them back: refused however it is asked for
        ({"prompt_lookup_num_tokens": 3}, NotImplementedError, "assisted decoding"),
        ({"generation_config": GenerationConfig(prompt_lookup_num_tokens=3)}, NotImplementedError, "assisted decoding"),
        ({"assistant_early_exit": 1}, NotImplementedError, "assisted decoding"),
        ({"use_mtp": True}, NotImplementedError, "assisted decoding"),
        ({"penalty_alpha": 0.6, "top_k": 4}, NotImplementedError, "contrastive_search"),
        ({"use_cache": False}, ValueError, "use_cache"),
        ({"cache_implementation": "static"}, NotImplementedError, "cache_implementation"),
        ({"past_key_values": None}, ValueError, "supplies the cache"),
        ({"inputs_embeds": torch.zeros(1, 3, 32)}, ValueError, "input_ids"),
        # (before: refused for a per-row argument num_return_sequences cannot repeat)
        (
            {"inputs_embeds": torch.zeros(1, 3, 32), "do_sample": True, "num_return_sequences": 2},
            ValueError,
            "input_ids",
        ),
    ],
)
def test_generate_refuses_what_it_cannot_serve_and_changes_nothing(kwargs, error, match):
    model = tiny_model("llama")
    with PrefixCache(model, tiers_config(model, blocks=8)) as pc:
        ids = torch.tensor([tokens(torch.Generator().manual_seed(5), 12)])
        with pytest.raises(error, match=match):
            pc.generate(ids, max_new_tokens=2, **kwargs)
        assert pc.manager.stats().lookup_tokens == 0


def test_generate_checks_its_inputs_and_a_closed_cache():
    model = tiny_model("llama")
    pc = PrefixCache(model, tiers_config(model, blocks=8))
    with pytest.raises(TypeError, match="2-D integer"):
        pc.generate(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="shape"):
        pc.generate(torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 2))
    pc.close()
    pc.close()
    with pytest.raises(kvtier.CacheStateError):
        pc.generate(torch.tensor([[5, 6, 7]]))


def _llama_with_a_stray_window() -> torch.nn.Module:
    """A tiny Llama whose configuration carries a ``sliding_window`` its attention does not apply."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, sliding_window=WINDOW, **TINY_TEXT)
    model = transformers.LlamaForCausalLM(config).to(torch.float64).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model


def test_a_window_the_attention_does_not_apply_makes_longer_calls_plain_generate():
    """A Llama configuration carrying a stray ``sliding_window`` gets sliding-window cache layers,
    but Llama attends to the whole prompt: a call longer than the window runs as plain generate;
    shorter calls reuse as before. Before, a reused prefix was served with its last window - 1
    tokens only, and the tokens differed from generate's."""
    model = _llama_with_a_stray_window()
    g = torch.Generator().manual_seed(1)
    with PrefixCache(model, tiers_config(model, blocks=60), recompute_when_faster=False) as pc:
        assert {layer.kind for layer in pc._layers.attention} == {LayerKind.SLIDING}
        short = tokens(g, WINDOW - 4)
        turn(model, pc, short)
        assert turn(model, pc, short[:16] + tokens(g, 4)) == 16  # within the window: reused
        long = tokens(g, 40)
        turn(model, pc, long)
        assert turn(model, pc, long[:32] + tokens(g, 10)) == 0


def test_a_window_probe_that_fails_is_made_again(monkeypatch):
    """The probe of the window raises once (out of memory: it runs two rows of the window's length):
    that call runs as plain generate, and the next long one probes again. Before, the failed probe
    was never made again, and later long calls reused as if the window applied: other tokens."""
    from kvtier.hf import prefix_cache

    model = _llama_with_a_stray_window()
    probe = prefix_cache.applies_window
    failures = iter([MemoryError("the probe's two rows")])

    def failing_once(*args):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return probe(*args)

    monkeypatch.setattr(prefix_cache, "applies_window", failing_once)
    g = torch.Generator().manual_seed(1)
    with PrefixCache(model, tiers_config(model, blocks=60), recompute_when_faster=False) as pc:
        long = tokens(g, 40)
        assert turn(model, pc, long) == 0
        assert turn(model, pc, long[:32] + tokens(g, 10)) == 0


def test_a_window_the_attention_applies_keeps_longer_calls_reused():
    model = tiny_model("mistral")
    g = torch.Generator().manual_seed(2)
    with PrefixCache(model, tiers_config(model, blocks=60), recompute_when_faster=False) as pc:
        long = tokens(g, 40)
        turn(model, pc, long)
        assert turn(model, pc, long[:32] + tokens(g, 10)) == 32


def test_a_decoder_with_fewer_layers_than_its_cache_is_served():
    """Whisper's decoder alone (``WhisperForCausalLM``, as distil-whisper ships for assisted decoding)
    has fewer layers than the cache transformers sizes for it (by the encoder's count): the layers
    it never writes cache nothing. Before, it was refused as if it fed keys of its own."""
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=4,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        pad_token_id=0,
        max_target_positions=128,
    )
    model = transformers.WhisperForCausalLM(config).to(torch.float64).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    g = torch.Generator().manual_seed(3)
    with PrefixCache(model, tiers_config(model, blocks=60), recompute_when_faster=False) as pc:
        assert len(pc.spec.layers) == 2
        first = tokens(g, 40)
        turn(model, pc, first)
        assert turn(model, pc, first[:32] + tokens(g, 10)) == 32
