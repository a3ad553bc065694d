"""The load-or-recompute decision (``kvtier.tiering.load_cost``) and its use at ``create_cache``."""

from __future__ import annotations

import math

import pytest

import kvtier
from kvtier.engine.prefill_meter import PrefillMeter
from kvtier.tiering.load_cost import LoadCost
from tests.test_write_through import TPB, fill_primary, manager, serve


def test_best_cut_weighs_each_block_against_recompute():
    cost = LoadCost(3)
    cost.set_prefill_rate(1000.0)  # 1 ms a token
    tpb = 16
    # blocks: 2 resident (free), 2 at 5 ms each (cheaper than 16 ms of recompute), 2 at 40 ms each
    seconds = [0.0, 0.0, 0.005, 0.005, 0.040, 0.040]
    assert cost.best_cut(seconds, 6 * tpb + 1, tpb) == 4
    assert cost.best_cut([0.040] * 3, 3 * tpb + 1, tpb) == 0
    assert cost.best_cut([0.001] * 3, 3 * tpb + 1, tpb) == 3
    assert cost.best_cut([], 10, tpb) == 0


def test_no_prefill_rate_loads_everything():
    cost = LoadCost(2)
    assert cost.best_cut([10.0, 10.0], 33, 16) == 2


def test_unmeasured_tier_is_assumed_to_win():
    cost = LoadCost(3)
    cost.observe(1, 1 << 20, 0.001)
    assert cost.block_seconds([(2, 1 << 30), (0, 1 << 30)]) == 0.0
    assert cost.block_seconds([(1, 1 << 20)]) == pytest.approx(0.001)


def test_bandwidth_rises_slowly_and_falls_at_once():
    cost = LoadCost(2)
    cost.observe(1, 100, 1.0)
    cost.observe(1, 200, 1.0)
    assert cost.bandwidth[1] == pytest.approx(130.0)
    cost.observe(1, 50, 1.0)
    assert cost.bandwidth[1] == pytest.approx(50.0)
    cost.observe(0, 100, 1.0)  # the primary tier costs nothing, always
    assert cost.bandwidth[0] == math.inf


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan, math.inf])
def test_bad_prefill_rate_is_a_value_error(rate):
    mgr, _, _ = manager(primary_pages=4, host_pages=4)
    with pytest.raises(ValueError, match="prefill rate"):
        mgr.set_prefill_rate(rate)
    mgr.close()


def test_create_cache_recomputes_what_loads_slower():
    mgr, oracle, _ = manager(primary_pages=6, host_pages=16, write_through=False)
    prompt = [700 + i for i in range(4 * TPB + 1)]
    serve(mgr, oracle, prompt)
    fill_primary(mgr, oracle, 5, 5000)
    assert serve(mgr, oracle, prompt + [1]) == 4 * TPB  # loaded from host: its bandwidth is measured now
    fill_primary(mgr, oracle, 5, 6000)
    mgr.set_prefill_rate(1e18)  # recomputing is (claimed) faster than any copy
    assert serve(mgr, oracle, prompt + [2]) == 0
    assert mgr.stats().recomputed_tokens == 4 * TPB
    mgr.set_prefill_rate(1e-3)  # recomputing is slow: everything cached is loaded
    assert serve(mgr, oracle, prompt + [3]) == 4 * TPB
    mgr.check_invariants()
    mgr.close()


def test_resident_blocks_are_always_reused():
    mgr, oracle, _ = manager(primary_pages=8, host_pages=8, write_through=False)
    prompt = [800 + i for i in range(4 * TPB + 1)]
    serve(mgr, oracle, prompt)
    mgr.set_prefill_rate(1e18)
    assert serve(mgr, oracle, prompt + [1]) == 4 * TPB
    assert mgr.stats().recomputed_tokens == 0
    mgr.close()


def test_prefill_meter_needs_long_enough_steps():
    meter = PrefillMeter()
    assert meter.observe(10, 0.1) is None
    assert meter.observe(1000, 5.0) is None  # the first long step is the cold start: left out
    assert meter.observe(1000, 0.5) == pytest.approx(2000.0)
    assert meter.observe(1000, 1.0) == pytest.approx(0.7 * 2000 + 0.3 * 1000)


def test_engine_reports_its_prefill_rate():
    import torch

    from kvtier.engine import LLMEngine, SamplingParams, SchedulerConfig
    from kvtier.models import build_model

    model = build_model("tiny-llama", torch.device("cpu"), torch.float32, seed=0)
    config = kvtier.CacheConfig(16, [kvtier.PrimaryTier(8 << 20)])
    with LLMEngine(model, config, SchedulerConfig(max_num_tokens=512)) as engine:
        engine.generate([[1 + i % 300 for i in range(400)]], SamplingParams(max_tokens=2))
        assert engine.prefill.rate is None  # one long step so far: the cold start
        engine.generate([[2 + i % 300 for i in range(400)]], SamplingParams(max_tokens=2))
        assert engine.prefill.rate is not None and engine.prefill.rate > 0
        assert engine.cache_manager._pool.load_cost.prefill_rate == engine.prefill.rate
