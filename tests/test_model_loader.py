"""Loading a model from config.json + safetensors written by the test itself."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvtier.models import LayerKind, ModelConfig, build_model, config_from_hf, config_to_hf, named_config
from kvtier.models.llama import DecoderModel
from kvtier.models.random_init import random_model

DTYPE = torch.float64
PROMPT = list(range(3, 120, 2))


def save_checkpoint(model: DecoderModel, config_json: dict, directory: Path, shards: int = 1) -> Path:
    """Write ``config_json`` and the model's weights (float32, split over ``shards`` files)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_json))
    tensors = {name: t.to(torch.float32).contiguous() for name, t in model.state_dict().items()}
    names = sorted(tensors)
    for i in range(shards):
        part = {name: tensors[name] for name in names[i::shards]}
        save_file(part, str(directory / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    return directory


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-swa", "tiny-hybrid"])
def test_round_trip_generates_the_same_tokens(name: str, tmp_path: Path) -> None:
    original = build_model(name, "cpu", DTYPE, seed=5)
    path = save_checkpoint(original, config_to_hf(original.config), tmp_path / name, shards=2)
    loaded = build_model(path, "cpu", DTYPE)
    assert loaded.config == original.config
    assert loaded.spec == original.spec
    for (key, a), b in zip(original.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), key  # float32-drawn weights survive the float32 file exactly
    assert loaded.reference_generate(PROMPT, 12) == original.reference_generate(PROMPT, 12)


def test_hugging_face_llama_config_with_tied_embeddings(tmp_path: Path) -> None:
    """A config.json as Hugging Face writes it for Llama: no head_dim, no layer_types, tied
    embeddings and so no lm_head.weight in the file; unknown keys are ignored."""
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
    }
    config = config_from_hf(raw)
    assert (config.head_dim, config.num_kv_heads, config.tie_word_embeddings) == (8, 2, True)
    assert config.layer_kinds == (LayerKind.FULL_ATTENTION,) * 3
    original = random_model(config, torch.device("cpu"), DTYPE, seed=1)
    assert "lm_head.weight" not in original.state_dict()
    loaded = build_model(save_checkpoint(original, raw, tmp_path), "cpu", DTYPE)
    assert loaded.lm_head is None
    assert loaded.reference_generate(PROMPT, 10) == original.reference_generate(PROMPT, 10)


def test_loads_into_another_dtype(tmp_path: Path) -> None:
    original = build_model("tiny-llama", "cpu", torch.float32, seed=2)
    loaded = build_model(save_checkpoint(original, config_to_hf(original.config), tmp_path), "cpu", DTYPE)
    assert loaded.dtype == DTYPE
    torch.testing.assert_close(loaded.model.norm.weight, original.model.norm.weight.to(DTYPE))


def test_sliding_window_and_rope_keys() -> None:
    base = config_to_hf(named_config("tiny-llama"))
    del base["layer_types"], base["sliding_window"]
    mistral = config_from_hf({**base, "model_type": "mistral", "sliding_window": 64})
    assert mistral.layer_kinds == (LayerKind.SLIDING_ATTENTION,) * 4 and mistral.sliding_window == 64
    llama = config_from_hf({**base, "sliding_window": 64})  # transformers' Llama has no window
    assert llama.layer_kinds == (LayerKind.FULL_ATTENTION,) * 4 and llama.sliding_window is None
    qwen = config_from_hf({**base, "sliding_window": 64, "use_sliding_window": False})
    assert qwen.layer_kinds == (LayerKind.FULL_ATTENTION,) * 4 and qwen.sliding_window is None
    mixed = config_from_hf(
        {**base, "sliding_window": 32, "sink_tokens": 2, "layer_types": ["sliding_attention", "full_attention"] * 2}
    )
    assert mixed.spec(DTYPE).layers[0].window == 32 and mixed.spec(DTYPE).layers[0].sink_tokens == 2
    llama31 = config_from_hf(
        {
            **base,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert llama31.rope_scaling is not None and llama31.rope_scaling.factor == 8.0
    assert config_from_hf(config_to_hf(llama31)) == llama31
    del base["rope_theta"]
    v5 = config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}})
    assert v5.rope_theta == 1234.0 and v5.rope_scaling is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": None}, "lacks hidden_size"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
        ({"layer_types": ["full_attention", "moe", "full_attention", "full_attention"]}, "malformed"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"model_type": "granite"}, "model_type 'granite' is not supported"),  # Llama's names, another network
        ({"model_type": "cohere"}, "model_type 'cohere' is not supported"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}}, "partial_rotary_factor=0.25"),
    ],
)
def test_malformed_config_is_rejected(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_hf({**config_to_hf(named_config("tiny-llama")), **change})


def test_bad_checkpoints_are_rejected(tmp_path: Path) -> None:
    model = build_model("tiny-llama", "cpu", DTYPE)
    config_json = config_to_hf(model.config)
    good = save_checkpoint(model, config_json, tmp_path / "good")

    (tmp_path / "nojson").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        build_model(tmp_path / "nojson", "cpu", DTYPE)
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        build_model(tmp_path / "badjson", "cpu", DTYPE)
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text(json.dumps(config_json))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        build_model(noweights, "cpu", DTYPE)

    missing = save_checkpoint(model, config_json, tmp_path / "missing")
    weights = {k: v.float().contiguous() for k, v in model.state_dict().items() if "layers.2.mlp" not in k}
    save_file(weights, str(next(missing.glob("*.safetensors"))))
    with pytest.raises(ValueError, match=r"3 weights missing.*layers\.2\.mlp"):
        build_model(missing, "cpu", DTYPE)

    wider = dataclasses.replace(model.config, intermediate_size=256)
    (tmp_path / "shape").mkdir()
    save_checkpoint(model, config_to_hf(wider), tmp_path / "shape")
    with pytest.raises(ValueError, match="checkpoint shape"):
        build_model(tmp_path / "shape", "cpu", DTYPE)

    extra = {k: v.float().contiguous() for k, v in model.state_dict().items()}
    extra["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(extra, str(next(good.glob("*.safetensors"))))
    with pytest.raises(ValueError, match="q_norm"):
        build_model(good, "cpu", DTYPE)

    with pytest.raises(ValueError, match="unknown model"):
        build_model(tmp_path / "does-not-exist", "cpu", DTYPE)


def test_config_round_trip_of_every_named_config() -> None:
    for name in ("tiny-llama", "tiny-swa", "tiny-hybrid", "small-llama", "llama-8b-shape"):
        config = named_config(name)
        assert isinstance(config, ModelConfig)
        assert config_from_hf(json.loads(json.dumps(config_to_hf(config)))) == config


@pytest.mark.parametrize("from_checkpoint", [False, True])
def test_weights_larger_than_the_machine_are_refused_before_any_is_allocated(tmp_path, monkeypatch, from_checkpoint):
    """A named model and a checkpoint directory alike. Before, the allocator's traceback (or the
    out-of-memory killer) ended the process."""
    model = build_model("tiny-llama", "cpu", DTYPE)
    source = save_checkpoint(model, config_to_hf(model.config), tmp_path / "ckpt") if from_checkpoint else "tiny-llama"
    nbytes = sum(p.numel() for p in model.parameters()) * DTYPE.itemsize
    monkeypatch.setattr("kvtier.config._host_memory_bytes", lambda: nbytes - 1)
    with pytest.raises(ValueError, match=r"the model's weights \(0\.0 GiB in torch\.float64\) cannot be allocated"):
        build_model(source, "cpu", DTYPE)
    build_model(source, "cpu", torch.float32)  # half the bytes: they fit
