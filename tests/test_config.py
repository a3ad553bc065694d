"""kvtier/config.py: CacheConfig and tier checks, ReuseScope checks and its byte encoding."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import DEFAULT_SCOPE, CacheConfig, DiskTier, HostTier, PrimaryTier, ReuseScope

MiB = 1 << 20


# -- CacheConfig ----------------------------------------------------------------------------------


def test_defaults_and_normalisation(tmp_path):
    tiers = (PrimaryTier(3 * MiB), HostTier(5 * MiB), DiskTier(7 * MiB, tmp_path))
    config = CacheConfig(tiers=tiers)
    assert config.tiers == list(tiers)  # any sequence, kept as a list
    assert config.device == torch.device("cpu")
    assert isinstance(config.device, torch.device)
    assert (config.tokens_per_block, config.snapshot_interval_blocks) == (16, 4)
    assert config.enable_reuse and config.enable_partial_reuse
    assert [t.name for t in config.tiers] == ["primary", "host", "disk"]


@pytest.mark.parametrize(
    "kinds", [["primary"], ["primary", "host"], ["primary", "disk"], ["primary", "host", "disk"]], ids=str
)
def test_valid_tier_orders(kinds, tmp_path):
    make = {
        "primary": lambda: PrimaryTier(MiB),
        "host": lambda: HostTier(2 * MiB),
        "disk": lambda: DiskTier(MiB, tmp_path),
    }
    config = CacheConfig(tokens_per_block=8, tiers=[make[k]() for k in kinds])
    assert [t.name for t in config.tiers] == kinds


@pytest.mark.parametrize("tiers", [[], [HostTier(MiB)], [HostTier(MiB), PrimaryTier(MiB)], [DiskTier(MiB, "/tmp/x")]])
def test_tiers_must_start_with_primary(tiers):
    with pytest.raises(ValueError, match="tiers must start with a PrimaryTier"):
        CacheConfig(tiers=tiers)


def test_default_config_has_no_tiers_and_is_rejected():
    with pytest.raises(ValueError, match="PrimaryTier"):
        CacheConfig()


@pytest.mark.parametrize(
    "rest",
    [
        [PrimaryTier(MiB)],
        [HostTier(MiB), HostTier(MiB)],
        [DiskTier(MiB, "/tmp/x"), HostTier(MiB)],
        [DiskTier(MiB, "/tmp/x"), DiskTier(MiB, "/tmp/y")],
        [HostTier(MiB), DiskTier(MiB, "/tmp/x"), HostTier(MiB)],
        [HostTier(MiB), PrimaryTier(MiB)],
    ],
    ids=lambda rest: "primary+" + "+".join(t.name for t in rest),
)
def test_tiers_are_ordered_and_each_at_most_once(rest):
    with pytest.raises(ValueError, match="ordered warm to cold, each kind at most once"):
        CacheConfig(tiers=[PrimaryTier(MiB), *rest])


@pytest.mark.parametrize("other", ["host", 1 << 20, None])
def test_unknown_tier_kind(other):
    with pytest.raises(TypeError, match="unknown tier"):
        CacheConfig(tiers=[PrimaryTier(MiB), other])


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu"), "cuda", "cuda:1", torch.device("cuda", 0)])
def test_accepted_devices(device):
    # Only the name is checked here: a CUDA device need not be present to build a config.
    config = CacheConfig(tiers=[PrimaryTier(MiB)], device=device)
    assert config.device == torch.device(device)


@pytest.mark.parametrize("device", ["meta", "mps", "xla", torch.device("meta")])
def test_other_device_types_are_rejected(device):
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
        CacheConfig(tiers=[PrimaryTier(MiB)], device=device)


@pytest.mark.parametrize("device", ["gpu", "", "cuda:x"])
def test_unparseable_device_is_a_value_error(device):
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
        CacheConfig(tiers=[PrimaryTier(MiB)], device=device)


@pytest.mark.parametrize("field", ["tokens_per_block", "snapshot_interval_blocks"])
@pytest.mark.parametrize("value", [True, 1.5, 16.0, "16", None])
def test_block_counts_must_be_ints(field, value):
    with pytest.raises(TypeError, match=re.escape(f"{field} must be an int, got {value!r}")):
        CacheConfig(tiers=[PrimaryTier(MiB)], **{field: value})


@pytest.mark.parametrize("field", ["tokens_per_block", "snapshot_interval_blocks"])
@pytest.mark.parametrize("value", [0, -4])
def test_block_counts_must_be_positive(field, value):
    with pytest.raises(ValueError, match=re.escape(f"{field} must be > 0, got {value}")):
        CacheConfig(tiers=[PrimaryTier(MiB)], **{field: value})


def test_smallest_block_counts():
    config = CacheConfig(tokens_per_block=1, snapshot_interval_blocks=1, tiers=[PrimaryTier(1)])
    assert (config.tokens_per_block, config.snapshot_interval_blocks) == (1, 1)


def test_config_is_frozen():
    config = CacheConfig(tiers=[PrimaryTier(MiB)])
    with pytest.raises(AttributeError):
        config.tokens_per_block = 4  # type: ignore[misc]


# -- tier quotas ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind", [PrimaryTier, HostTier, lambda b: DiskTier(b, "/tmp/kv")], ids=["primary", "host", "disk"]
)
@pytest.mark.parametrize(
    ("quota", "error", "message"),
    [
        (0, ValueError, r"\.bytes must be > 0, got 0"),
        (-1, ValueError, r"\.bytes must be > 0, got -1"),
        (True, TypeError, r"\.bytes must be an int, got True"),
        (1.5, TypeError, r"\.bytes must be an int"),
        ("1024", TypeError, r"\.bytes must be an int"),
    ],
)
def test_tier_quota_checks(kind, quota, error, message):
    with pytest.raises(error, match=message):
        kind(quota)


def test_quota_error_names_the_tier():
    with pytest.raises(ValueError, match=r"^HostTier\.bytes"):
        HostTier(0)
    with pytest.raises(ValueError, match=r"^DiskTier\.bytes"):
        DiskTier(0, "/tmp/kv")


@pytest.mark.parametrize("path", ["", None, 3, b"/tmp/kv"])
def test_disk_tier_needs_a_path(path):
    with pytest.raises(TypeError, match=r"DiskTier\.path must be a non-empty path"):
        DiskTier(MiB, path)


def test_disk_tier_takes_str_and_pathlike(tmp_path):
    assert DiskTier(MiB, str(tmp_path)).path == str(tmp_path)
    assert DiskTier(MiB, Path(tmp_path)).path == Path(tmp_path)
    assert (PrimaryTier(5).bytes, HostTier(6).bytes, DiskTier(7, tmp_path).bytes) == (5, 6, 7)


# -- ReuseScope -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lora_id": True}, "lora_id must be an int, a str or None"),
        ({"lora_id": 1.5}, "lora_id must be an int, a str or None"),
        ({"lora_id": b"adapter"}, "lora_id must be an int, a str or None"),
        ({"lora_id": ("a",)}, "lora_id must be an int, a str or None"),
        ({"salt": 7}, "salt must be a str, bytes or None"),
        ({"salt": bytearray(b"x")}, "salt must be a str, bytes or None"),
    ],
)
def test_scope_rejects_bad_fields(kwargs, message):
    with pytest.raises(TypeError, match=message):
        ReuseScope(**kwargs)


def test_default_scope():
    assert ReuseScope() == DEFAULT_SCOPE
    assert DEFAULT_SCOPE.encode() == b"scope:-|-"
    assert ReuseScope.decode(b"scope:-|-") == DEFAULT_SCOPE


def test_encoding_keeps_kinds_apart():
    scopes = [
        ReuseScope(),
        ReuseScope(lora_id=0),
        ReuseScope(lora_id=1),
        ReuseScope(lora_id="1"),
        ReuseScope(lora_id=-1),
        ReuseScope(salt="1"),
        ReuseScope(salt=b"1"),
        ReuseScope(salt=""),
        ReuseScope(salt=b""),
        ReuseScope(lora_id="", salt=None),
        ReuseScope(lora_id="a|b", salt="c"),
        ReuseScope(lora_id="a", salt="b|c"),
    ]
    encoded = [s.encode() for s in scopes]
    assert len(set(encoded)) == len(scopes)
    for scope, data in zip(scopes, encoded, strict=True):
        back = ReuseScope.decode(data)
        assert back == scope and type(back.lora_id) is type(scope.lora_id) and type(back.salt) is type(scope.salt)


scopes = st.builds(
    ReuseScope,
    lora_id=st.none() | st.integers() | st.text(),
    salt=st.none() | st.text() | st.binary(),
)
tricky_text = st.text(alphabet=st.sampled_from("|:-ibs0é€😀\x00 "), max_size=12)


@settings(max_examples=300, deadline=None)
@given(scopes)
def test_encode_decode_round_trip(scope):
    data = scope.encode()
    assert data.startswith(b"scope:")
    assert data.count(b"|") == 1 and data.count(b":") == 1  # separators never leak in from the fields
    back = ReuseScope.decode(data)
    assert back == scope
    assert type(back.lora_id) is type(scope.lora_id) and type(back.salt) is type(scope.salt)
    assert hash(back) == hash(scope)


@settings(max_examples=200, deadline=None)
@given(tricky_text, tricky_text | st.binary(max_size=8).map(lambda b: b + b"|:"))
def test_round_trip_with_separators_and_unicode(lora, salt):
    scope = ReuseScope(lora_id=lora, salt=salt)
    assert ReuseScope.decode(scope.encode()) == scope


@settings(max_examples=200, deadline=None)
@given(scopes, scopes)
def test_encoding_is_injective(a, b):
    assert (a.encode() == b.encode()) == (a == b)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"scope",
        b"scope:",
        b"scope:-",
        b"scope:-|-|-",
        b"scope:|",
        b"scope:--|-",
        b"scope:-|-x",
        b"scop:-|-",
        b"SCOPE:-|-",
        b"lora:-|-",
        b"scope:x1|-",
        b"scope:i|-",
        b"scope:iabc|-",
        b"scope:szz|-",
        b"scope:s6|-",  # odd number of hex digits
        b"scope:-|sff",  # not UTF-8
        b"scope:b00|-",  # bytes are not a lora id
        b"scope:-|i5",  # an int is not a salt
        b"scope:i1|",
    ],
)
def test_decode_garbage(data):
    with pytest.raises(ValueError, match="not an encoded ReuseScope"):
        ReuseScope.decode(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=24) | st.binary(max_size=16).map(lambda b: b"scope:" + b))
def test_decode_raises_only_value_error(data):
    try:
        scope = ReuseScope.decode(data)
    except ValueError:
        return
    assert isinstance(scope, ReuseScope)
