"""kvtier/tiering/sizing.py: a tier's byte quota split across layer groups."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import AttentionLayer, ModelSpec, RecurrentLayer
from kvtier.layout import page_geometries
from kvtier.tiering.sizing import slots_per_group

TPB = 4


def geometries(spec: ModelSpec):
    return page_geometries(spec, TPB)


SWA_MIX = ModelSpec([AttentionLayer(2, 8), AttentionLayer(1, 8, window=12), AttentionLayer(2, 8)], torch.float16)
HYBRID = ModelSpec([AttentionLayer(2, 8), RecurrentLayer(300), AttentionLayer(2, 8)], torch.float16)


def test_one_group_takes_the_whole_quota():
    geos = geometries(ModelSpec.uniform(2, 2, 8, torch.float16))
    page = geos[0].page_bytes
    assert page == 2 * 2 * TPB * 2 * 8 * 2
    assert slots_per_group(10 * page, geos, 4, "primary") == [10]
    assert slots_per_group(10 * page + page - 1, geos, 4, "primary") == [10]
    assert slots_per_group(page, geos, 4, "primary") == [1]


def test_attention_groups_get_the_same_number_of_pages():
    geos = geometries(SWA_MIX)
    full, window = (g.page_bytes for g in geos)
    assert full != window
    for blocks in (1, 7, 100):
        quota = blocks * (full + window)
        assert slots_per_group(quota, geos, 4, "host") == [blocks, blocks]
        assert slots_per_group(quota + full + window - 1, geos, 4, "host") == [blocks, blocks]


@pytest.mark.parametrize("interval", [1, 2, 3, 4, 8])
def test_recurrent_group_weighs_one_page_per_snapshot_interval(interval):
    geos = geometries(HYBRID)
    attention, recurrent = (g.page_bytes for g in geos)
    # Exactly 24 blocks of history: 24 attention pages and 24 / interval snapshots.
    blocks = 24
    quota = blocks * attention + blocks // interval * recurrent
    assert slots_per_group(quota, geos, interval, "primary") == [blocks, blocks // interval]
    assert slots_per_group(quota - 1, geos, interval, "primary") == [blocks - 1, blocks // interval - 1]


@pytest.mark.parametrize(("interval", "blocks"), [(6, 24), (6, 120), (24, 24)])
def test_exact_fit_with_an_inexact_weight(interval, blocks):
    geos = geometries(HYBRID)
    attention, recurrent = (g.page_bytes for g in geos)
    quota = blocks * attention + blocks // interval * recurrent
    assert slots_per_group(quota, geos, interval, "primary") == [blocks, blocks // interval]


def test_split_is_proportional_to_byte_demand():
    geos = geometries(HYBRID)
    attention, recurrent = (g.page_bytes for g in geos)
    quota = 1 << 20
    got = slots_per_group(quota, geos, 4, "primary")
    demand = attention + recurrent / 4
    assert got == [int(quota / demand), int(quota / 4 / demand)]
    assert got[0] > 3 * got[1]


@pytest.mark.parametrize("tier", ["primary", "host", "disk"])
def test_too_small_a_quota_names_the_bytes_needed(tier):
    geos = geometries(HYBRID)
    attention, recurrent = (g.page_bytes for g in geos)
    interval = 4
    exact = interval * attention + recurrent  # one snapshot page and ``interval`` attention pages
    with pytest.raises(ValueError) as info:
        slots_per_group(exact - 1, geos, interval, tier)
    message = str(info.value)
    assert f"the {tier} tier's quota of {exact - 1} bytes is too small" in message
    assert f"layer group 1 ({recurrent}-byte pages) no page" in message  # the recurrent group gets none first
    need = int(re.search(r"give it at least (\d+) bytes", message).group(1))
    assert exact <= need <= exact + 1
    assert min(slots_per_group(need, geos, interval, tier)) == 1


def test_a_group_whose_page_does_not_fit():
    geos = geometries(SWA_MIX)
    full = geos[0].page_bytes
    with pytest.raises(ValueError, match=r"layer group 0 \(\d+-byte pages\) no page; give it at least"):
        slots_per_group(full - 1, geos, 4, "primary")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.builds(AttentionLayer, st.integers(1, 4), st.sampled_from([4, 8, 12, 40])),
            st.builds(AttentionLayer, st.integers(1, 4), st.just(8), window=st.integers(1, 64)),
            st.builds(RecurrentLayer, st.integers(1, 5000)),
        ),
        min_size=1,
        max_size=5,
    ),
    st.integers(1, 8),
    st.integers(1, 1 << 22),
)
def test_every_group_gets_a_page_within_the_quota_or_a_clear_error(layers, interval, quota):
    geos = geometries(ModelSpec(layers, torch.float16))
    try:
        got = slots_per_group(quota, geos, interval, "primary")
    except ValueError as e:
        need = int(re.search(r"give it at least (\d+) bytes", str(e)).group(1))
        assert need > quota
        got = slots_per_group(need, geos, interval, "primary")  # the named quota is enough
        quota = need
    assert min(got) >= 1
    assert sum(n * g.page_bytes for n, g in zip(got, geos, strict=True)) <= quota


def test_manager_uses_the_split(tmp_path):
    geos = geometries(HYBRID)
    attention, recurrent = (g.page_bytes for g in geos)
    quota = 40 * attention + 10 * recurrent
    config = kvtier.CacheConfig(
        tokens_per_block=TPB,
        tiers=[kvtier.PrimaryTier(quota), kvtier.DiskTier(quota, tmp_path)],
        snapshot_interval_blocks=4,
    )
    mgr = kvtier.KVCacheManager(HYBRID, config)
    try:
        expected = slots_per_group(quota, geos, 4, "primary")
        layout = mgr.layout()
        assert [g.regions[0].num_slots for g in layout.groups] == expected
        assert expected[0] in (39, 40) and expected[1] in (9, 10)
        assert mgr.stats().tiers["disk"].pages_total == sum(expected)
    finally:
        mgr.close()
    with pytest.raises(ValueError, match="the host tier's quota of 64 bytes is too small"):
        kvtier.KVCacheManager(
            HYBRID, kvtier.CacheConfig(tokens_per_block=TPB, tiers=[kvtier.PrimaryTier(quota), kvtier.HostTier(64)])
        )
