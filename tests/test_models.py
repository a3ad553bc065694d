"""The named models, their specs, the dense forward and the oracle, RoPE and the recurrence."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvtier.models import NAMED_CONFIGS, LayerKind, RopeScaling, build_model, named_config
from kvtier.models.llama import DecoderModel
from kvtier.models.recurrent import gated_scan
from kvtier.models.rope import Rope, inverse_frequencies
from kvtier.spec import AttentionLayer, GroupKind, RecurrentLayer

DTYPE = torch.float64


@pytest.mark.parametrize(
    ("name", "group_kinds"),
    [
        ("tiny-llama", [GroupKind.ATTENTION]),
        ("tiny-swa", [GroupKind.SLIDING_WINDOW, GroupKind.ATTENTION]),
        ("tiny-hybrid", [GroupKind.RECURRENT, GroupKind.ATTENTION]),
    ],
)
def test_spec_matches_the_layers(name: str, group_kinds: list[GroupKind]) -> None:
    model = build_model(name, "cpu", DTYPE)
    config = model.config
    spec = model.spec
    assert spec.dtype == DTYPE == model.dtype
    assert model.device == torch.device("cpu")
    assert model.vocab_size == config.vocab_size
    assert [g.kind for g in spec.groups] == group_kinds
    assert len(spec.layers) == config.num_layers == 4
    for layer, kind in zip(spec.layers, config.layer_kinds, strict=True):
        if kind is LayerKind.RECURRENT:
            assert layer == RecurrentLayer(config.num_heads * config.head_dim**2 * 8)
        elif kind is LayerKind.SLIDING_ATTENTION:
            assert layer == AttentionLayer(config.num_kv_heads, config.head_dim, window=48, sink_tokens=4)
        else:
            assert layer == AttentionLayer(config.num_kv_heads, config.head_dim)
    assert sum(p.numel() for p in model.parameters()) < 250_000  # tiny: float64 CPU tests stay fast


def test_recurrent_state_bytes_follow_the_dtype() -> None:
    config = named_config("tiny-hybrid")
    layer = config.spec(torch.bfloat16).layers[0]
    assert layer == RecurrentLayer(config.num_heads * config.head_dim**2 * 2)


def test_llama_8b_shape_has_llama3_8b_dimensions() -> None:
    config = named_config("llama-8b-shape")
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (32, 4096, 32, 8)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (128, 14336, 128256)
    assert config.rope_theta == 500000.0
    assert config.spec(torch.bfloat16).layers == [AttentionLayer(8, 128)] * 32
    with torch.device("meta"):
        model = DecoderModel(config)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="tiny-llama"):
        build_model("tiny-lama", "cpu", DTYPE)


def test_weights_come_from_the_seed() -> None:
    a = build_model("tiny-hybrid", "cpu", DTYPE, seed=3)
    b = build_model("tiny-hybrid", "cpu", torch.float32, seed=3)
    c = build_model("tiny-hybrid", "cpu", DTYPE, seed=4)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb.to(DTYPE)), name  # drawn in float32, then cast
        assert not torch.equal(pa, pc), name
    assert not any(p.requires_grad for p in a.parameters())
    assert not a.training


def test_small_llama_is_a_cpu_model() -> None:
    model = build_model("small-llama", "cpu", torch.float32)
    logits = model.forward_dense(torch.arange(1024) % model.vocab_size, logits_for="last")
    assert logits.shape == (1, model.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-swa", "tiny-hybrid"])
def test_dense_forward_is_causal(name: str) -> None:
    model = build_model(name, "cpu", DTYPE)
    ids = torch.randint(0, model.vocab_size, (70,), generator=torch.Generator().manual_seed(0))
    full = model.forward_dense(ids)
    assert full.shape == (70, model.vocab_size)
    torch.testing.assert_close(model.forward_dense(ids[:40]), full[:40], rtol=0, atol=1e-12)
    torch.testing.assert_close(model.forward_dense(ids, logits_for="last"), full[-1:], rtol=0, atol=1e-12)
    changed = ids.clone()
    changed[39] = (changed[39] + 1) % model.vocab_size
    assert not torch.allclose(model.forward_dense(changed)[39:], full[39:])


def test_sliding_window_sees_the_window_and_the_sinks() -> None:
    model = build_model("tiny-swa", "cpu", DTYPE)
    attention = model.model.layers[0].self_attn
    assert (attention.window, attention.sink_tokens) == (48, 4)
    x = torch.randn(120, model.config.hidden_size, dtype=DTYPE, generator=torch.Generator().manual_seed(0))
    rotation = model.rope.rotation(torch.arange(120), DTYPE)
    base = attention.forward_dense(x, rotation)

    def changed_rows(j: int) -> set[int]:
        y = x.clone()
        y[j] += 1.0
        diff = (attention.forward_dense(y, rotation) - base).abs().amax(dim=1)
        return set(torch.nonzero(diff > 1e-12).flatten().tolist())

    assert changed_rows(10) == set(range(10, 10 + 48))  # an ordinary key: visible for 48 positions
    assert changed_rows(2) == set(range(2, 120))  # a sink token: visible to every later query


def test_reference_generate_checks_its_arguments() -> None:
    model = build_model("tiny-llama", "cpu", DTYPE)
    assert model.reference_generate([1, 2, 3], 0) == []
    assert len(model.reference_generate([1, 2, 3], 5)) == 5
    with pytest.raises(ValueError, match="at least one"):
        model.reference_generate([], 3)
    with pytest.raises(ValueError, match="lie in"):
        model.reference_generate([model.vocab_size], 3)
    with pytest.raises(ValueError, match="max_tokens"):
        model.reference_generate([1], -1)
    with pytest.raises(ValueError, match="logits_for"):
        model.forward_dense(torch.tensor([1]), logits_for="middle")


def test_bf16_forward_is_finite() -> None:
    for name in ("tiny-llama", "tiny-swa", "tiny-hybrid"):
        model = build_model(name, "cpu", torch.bfloat16)
        assert torch.isfinite(model.forward_dense(torch.arange(200) % model.vocab_size)).all()


def test_rope_rotates_by_relative_position() -> None:
    rope = Rope(16, 10000.0)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 16, dtype=DTYPE, generator=gen), torch.randn(1, 1, 16, dtype=DTYPE, generator=gen)

    def rotate(x: torch.Tensor, position: int) -> torch.Tensor:
        return rope.rotation(torch.tensor([position]), DTYPE).apply(x)

    def score(m: int, n: int) -> float:
        return float((rotate(q, m) * rotate(k, n)).sum())

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-12)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-6)
    assert float(rotate(q, 12345).norm()) == pytest.approx(float(q.norm()), abs=1e-12)
    assert torch.equal(rotate(q, 0), q)


def test_llama3_rope_scaling_keeps_high_and_divides_low_frequencies() -> None:
    plain = inverse_frequencies(128, 500000.0)
    scaled = inverse_frequencies(128, 500000.0, RopeScaling("llama3", factor=8.0))
    wavelength = 2 * math.pi / plain
    high, low = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert high.any() and low.any()
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    middle = ~(high | low)
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        RopeScaling("yarn", factor=4.0)


def test_gated_scan_is_the_recurrence_and_splits_at_any_token() -> None:
    gen = torch.Generator().manual_seed(0)
    n, heads, dim = 9, 2, 4
    q, k, v = (torch.randn(n, heads, dim, dtype=DTYPE, generator=gen) for _ in range(3))
    gate = torch.rand(n, heads, dtype=DTYPE, generator=gen)
    state = torch.randn(heads, dim, dim, dtype=DTYPE, generator=gen)
    out, final = gated_scan(q, k, v, gate, state)
    s = state.clone()
    for t in range(n):
        for h in range(heads):
            s[h] = gate[t, h] * s[h] + torch.outer(k[t, h], v[t, h])
            torch.testing.assert_close(out[t, h], q[t, h] @ s[h], rtol=0, atol=1e-12)
    torch.testing.assert_close(final, s, rtol=0, atol=1e-12)
    head, mid = gated_scan(q[:4], k[:4], v[:4], gate[:4], state)
    tail, end = gated_scan(q[4:], k[4:], v[4:], gate[4:], mid)
    assert torch.equal(torch.cat((head, tail)), out) and torch.equal(end, final)


def test_named_configs_are_valid() -> None:
    assert {"tiny-llama", "tiny-swa", "tiny-hybrid", "small-llama", "llama-8b-shape"} <= set(NAMED_CONFIGS)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        dataclasses.replace(named_config("tiny-llama"), num_kv_heads=3)
    with pytest.raises(ValueError, match="sliding_window"):
        dataclasses.replace(named_config("tiny-swa"), sliding_window=None)
    with pytest.raises(ValueError, match="even"):
        dataclasses.replace(named_config("tiny-llama"), head_dim=15)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_a_cuda_model_without_cuda_is_a_clear_error():
    """Before, torch's bare ``AssertionError: Torch not compiled with CUDA enabled``."""
    with pytest.raises(RuntimeError, match="CUDA is not available here"):
        build_model("tiny-llama", "cuda")
