"""kvtier/spec.py: layers, layer groups by life cycle, group_of, fingerprint, argument checks."""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier import AttentionLayer, GroupKind, ModelSpec, RecurrentLayer


def mixed_spec() -> ModelSpec:
    return ModelSpec(
        [
            AttentionLayer(2, 8),  # 0: full attention
            AttentionLayer(2, 8, window=16),  # 1: sliding window 16
            RecurrentLayer(100),  # 2: recurrent
            AttentionLayer(4, 16),  # 3: full attention again, other shape: same life cycle
            AttentionLayer(2, 8, window=16, sink_tokens=4),  # 4: same window, sinks: a new group
            AttentionLayer(2, 8, window=32),  # 5: another window: a new group
            RecurrentLayer(48),  # 6: recurrent, other size: still the one recurrent group
            AttentionLayer(2, 8, window=16),  # 7: back to group 1
        ],
        torch.float16,
    )


def test_groups_follow_life_cycles_in_order_of_first_appearance():
    spec = mixed_spec()
    got = [(g.group_id, g.layer_ids, g.kind, g.window, g.sink_tokens) for g in spec.groups]
    assert got == [
        (0, (0, 3), GroupKind.ATTENTION, None, 0),
        (1, (1, 7), GroupKind.SLIDING_WINDOW, 16, 0),
        (2, (2, 6), GroupKind.RECURRENT, None, 0),
        (3, (4,), GroupKind.SLIDING_WINDOW, 16, 4),
        (4, (5,), GroupKind.SLIDING_WINDOW, 32, 0),
    ]
    assert all(isinstance(g, kvtier.LayerGroup) for g in spec.groups)


def test_group_ids_depend_on_order_not_on_kind():
    spec = ModelSpec([RecurrentLayer(8), AttentionLayer(1, 4, window=5), AttentionLayer(1, 4), RecurrentLayer(16)])
    assert [(g.kind, g.layer_ids) for g in spec.groups] == [
        (GroupKind.RECURRENT, (0, 3)),
        (GroupKind.SLIDING_WINDOW, (1,)),
        (GroupKind.ATTENTION, (2,)),
    ]


def test_all_recurrent_layers_form_one_group():
    spec = ModelSpec([RecurrentLayer(n) for n in (8, 24, 1000)])
    assert len(spec.groups) == 1
    assert spec.groups[0].kind is GroupKind.RECURRENT
    assert spec.groups[0].layer_ids == (0, 1, 2)
    assert spec.groups[0].window is None


def test_uniform():
    spec = ModelSpec.uniform(num_layers=3, num_kv_heads=4, head_dim=32, dtype=torch.float32)
    assert spec.layers == [AttentionLayer(4, 32)] * 3
    assert spec.dtype == torch.float32
    assert [(g.group_id, g.layer_ids, g.kind) for g in spec.groups] == [(0, (0, 1, 2), GroupKind.ATTENTION)]
    windowed = ModelSpec.uniform(2, 1, 8, window=64)
    assert windowed.dtype == torch.bfloat16
    assert [(g.kind, g.window, g.layer_ids) for g in windowed.groups] == [(GroupKind.SLIDING_WINDOW, 64, (0, 1))]


@pytest.mark.parametrize(
    ("num_layers", "error"), [(0, ValueError), (-2, ValueError), (True, TypeError), (2.0, TypeError)]
)
def test_uniform_rejects_bad_layer_counts(num_layers, error):
    with pytest.raises(error, match="num_layers"):
        ModelSpec.uniform(num_layers, 2, 8)


def test_group_of():
    spec = mixed_spec()
    assert [spec.group_of(i).group_id for i in range(8)] == [0, 1, 2, 0, 3, 4, 2, 1]
    assert spec.group_of(6) is spec.groups[2]


@pytest.mark.parametrize("layer_id", [-1, 8, 100, True, "0", 1.0, None])
def test_group_of_unknown_layer(layer_id):
    with pytest.raises(ValueError, match=r"unknown layer id .*layers 0\.\.7"):
        mixed_spec().group_of(layer_id)


def test_layers_and_roles_are_normalised():
    spec = ModelSpec((AttentionLayer(1, 4, roles=["k", "v", "scale"]),))
    assert isinstance(spec.layers, list)
    assert spec.layers[0].roles == ("k", "v", "scale")


# -- fingerprint ---------------------------------------------------------------------------------


def test_fingerprint_is_stable():
    a, b = mixed_spec(), mixed_spec()
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 32 and int(a.fingerprint(), 16) >= 0
    # A fixed value: it names pages on disk and in connector stores, across processes and machines
    # (no dependence on hash seeds). Changing the description orphans every stored page.
    spec = ModelSpec([AttentionLayer(2, 8), RecurrentLayer(40)], torch.float16)
    assert spec.fingerprint() == "2d68f9d603e7a1b8658f65bf236bac70"


BASE = [AttentionLayer(2, 8, window=16, sink_tokens=4), AttentionLayer(2, 8), RecurrentLayer(40)]
VARIANTS = {
    "heads": [AttentionLayer(3, 8, window=16, sink_tokens=4), *BASE[1:]],
    "head_dim": [AttentionLayer(2, 16, window=16, sink_tokens=4), *BASE[1:]],
    "window": [AttentionLayer(2, 8, window=17, sink_tokens=4), *BASE[1:]],
    "sink": [AttentionLayer(2, 8, window=16, sink_tokens=3), *BASE[1:]],
    "roles": [AttentionLayer(2, 8, window=16, sink_tokens=4, roles=("k",)), *BASE[1:]],
    "role_order": [AttentionLayer(2, 8, window=16, sink_tokens=4, roles=("v", "k")), *BASE[1:]],
    "role_name": [AttentionLayer(2, 8, window=16, sink_tokens=4, roles=("k", "w")), *BASE[1:]],
    "state_bytes": [*BASE[:2], RecurrentLayer(41)],
    "layer_order": [BASE[1], BASE[0], BASE[2]],
    "extra_layer": [*BASE, AttentionLayer(2, 8)],
    "fewer_layers": BASE[:2],
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fingerprint_changes_with_any_layer_detail(name):
    base = ModelSpec(BASE, torch.float16).fingerprint()
    assert ModelSpec(VARIANTS[name], torch.float16).fingerprint() != base


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int8])
def test_fingerprint_changes_with_dtype(dtype):
    assert ModelSpec(BASE, dtype).fingerprint() != ModelSpec(BASE, torch.float16).fingerprint()


def test_fingerprints_of_many_specs_are_distinct():
    prints = {ModelSpec(v, torch.float16).fingerprint() for v in VARIANTS.values()}
    assert len(prints) == len(VARIANTS)


# -- argument checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_kv_heads": 0, "head_dim": 8}, ValueError, "num_kv_heads must be > 0, got 0"),
        ({"num_kv_heads": -1, "head_dim": 8}, ValueError, "num_kv_heads must be > 0"),
        ({"num_kv_heads": 2.0, "head_dim": 8}, TypeError, "num_kv_heads must be an int"),
        ({"num_kv_heads": True, "head_dim": 8}, TypeError, "num_kv_heads must be an int"),
        ({"num_kv_heads": 2, "head_dim": 0}, ValueError, "head_dim must be > 0"),
        ({"num_kv_heads": 2, "head_dim": "8"}, TypeError, "head_dim must be an int"),
        ({"num_kv_heads": 2, "head_dim": 8, "window": 0}, ValueError, "window must be > 0"),
        ({"num_kv_heads": 2, "head_dim": 8, "window": 1.5}, TypeError, "window must be an int"),
        ({"num_kv_heads": 2, "head_dim": 8, "window": 8, "sink_tokens": -1}, ValueError, "sink_tokens must be >= 0"),
        ({"num_kv_heads": 2, "head_dim": 8, "window": 8, "sink_tokens": 1.0}, TypeError, "sink_tokens must be an int"),
        ({"num_kv_heads": 2, "head_dim": 8, "window": 8, "sink_tokens": True}, TypeError, "sink_tokens must be an int"),
        ({"num_kv_heads": 2, "head_dim": 8, "sink_tokens": 4}, ValueError, "only applies to sliding-window"),
        ({"num_kv_heads": 2, "head_dim": 8, "roles": ()}, ValueError, "roles must be distinct non-empty names"),
        ({"num_kv_heads": 2, "head_dim": 8, "roles": ("k", "k")}, ValueError, "roles must be distinct"),
        ({"num_kv_heads": 2, "head_dim": 8, "roles": ("k", "")}, ValueError, "roles must be distinct non-empty"),
        ({"num_kv_heads": 2, "head_dim": 8, "roles": ("k", 1)}, ValueError, "roles must be distinct non-empty"),
    ],
)
def test_attention_layer_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        AttentionLayer(**kwargs)


def test_sink_tokens_zero_without_window_is_fine():
    assert AttentionLayer(2, 8, sink_tokens=0).window is None


@pytest.mark.parametrize(
    ("state_bytes", "error"), [(0, ValueError), (-8, ValueError), ("8", TypeError), (8.0, TypeError)]
)
def test_recurrent_layer_rejects_bad_sizes(state_bytes, error):
    with pytest.raises(error, match="state_bytes"):
        RecurrentLayer(state_bytes)


def test_model_spec_rejects_bad_layers_and_dtype():
    with pytest.raises(ValueError, match="at least one layer"):
        ModelSpec([])
    with pytest.raises(TypeError, match="layer 1 is str, not AttentionLayer or RecurrentLayer"):
        ModelSpec([AttentionLayer(2, 8), "attention"])
    with pytest.raises(TypeError, match="layer 0 is dict"):
        ModelSpec([{"num_kv_heads": 2, "head_dim": 8}])
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        ModelSpec([AttentionLayer(2, 8)], dtype="float16")


def test_layers_are_immutable():
    layer = AttentionLayer(2, 8)
    with pytest.raises(AttributeError):
        layer.window = 4  # type: ignore[misc]
