"""The load-or-recompute decision (``kvtier.tiering.load_cost``) and its use at ``create_cache``."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import pytest
import torch

import kvtier
from kvtier.engine.prefill_meter import PrefillMeter
from kvtier.tiering import load_cost
from kvtier.tiering.load_cost import LoadCost
from tests.kvdata import PageOracle
from tests.test_remembered_rates import TPB as TPB_DISK
from tests.test_write_through import TPB, fill_primary, manager, serve


def test_the_best_point_weighs_what_each_loads_against_recompute():
    cost = LoadCost(3)
    cost.set_prefill_rate(1000.0)  # 1 ms a token
    tpb = 16
    points = [0, 16, 32, 48, 64, 80, 96]  # blocks: 2 resident (free), 2 at 5 ms each, 2 at 40 ms each
    seconds = [0.0, 0.0, 0.0, 0.005, 0.010, 0.050, 0.090]
    assert cost.best_point(points, seconds, 6 * tpb + 1) == 4
    assert cost.best_point([0, 16, 32, 48], [0.0, 0.040, 0.080, 0.120], 3 * tpb + 1) == 0
    assert cost.best_point([0, 16, 32, 48], [0.0, 0.001, 0.002, 0.003], 3 * tpb + 1) == 3
    assert cost.best_point([0], [0.0], 10) == 0
    # a point's load need not grow with it (a sliding window, a recurrent snapshot): each is priced alone
    assert cost.best_point([0, 16, 32], [0.0, 0.100, 0.001], 33) == 2


def test_no_prefill_rate_loads_everything():
    cost = LoadCost(2)
    assert cost.best_point([0, 16, 32], [0.0, 10.0, 20.0], 33) == 2


def test_unmeasured_tier_is_assumed_to_win():
    cost = LoadCost(3)
    cost.observe(1, 1 << 20, 0.001)
    assert cost.point_seconds(np.array([[1 << 30, 0, 1 << 30]])).tolist() == [0.0]
    assert cost.point_seconds(np.array([[0, 1 << 20, 0]]))[0] == pytest.approx(0.001)


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
    mgr.prefetch(prompt + [2])  # moves nothing, and recomputes nothing: no request is made
    assert mgr.stats().recomputed_tokens == 0
    assert serve(mgr, oracle, prompt + [2]) == 0
    assert mgr.stats().recomputed_tokens == 4 * TPB
    mgr.set_prefill_rate(1e-3)  # recomputing is slow: everything cached is loaded
    assert serve(mgr, oracle, prompt + [3]) == 4 * TPB
    mgr.check_invariants()
    mgr.close()


def test_each_decision_is_logged_at_debug_with_its_inputs_named(caplog):
    """Before, only a cut was logged, its bandwidths an unnamed list (``[inf, None, 1.0]``)."""
    mgr, oracle, _ = manager(primary_pages=6, host_pages=16, write_through=False)
    prompt = [900 + i for i in range(4 * TPB + 1)]
    serve(mgr, oracle, prompt)
    fill_primary(mgr, oracle, 5, 5000)
    assert serve(mgr, oracle, prompt + [1]) == 4 * TPB  # the host's bandwidth is measured now
    fill_primary(mgr, oracle, 5, 6000)
    with caplog.at_level(logging.DEBUG, logger="kvtier.pool"):
        mgr.set_prefill_rate(1e-3)
        assert serve(mgr, oracle, prompt + [2]) == 4 * TPB
        fill_primary(mgr, oracle, 5, 7000)
        mgr.set_prefill_rate(1e18)
        assert serve(mgr, oracle, prompt + [3]) == 0
    loaded, cut = [r.getMessage() for r in caplog.records if "cached tokens" in r.getMessage()]
    assert loaded.startswith(f"loading all {4 * TPB} cached tokens")
    assert "prefill 0.001 tokens/s; primary inf GB/s" in loaded
    assert cut.startswith(f"recomputing {4 * TPB} cached tokens of {4 * TPB}") and "host " in cut and "GB/s" in cut
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
    meter = PrefillMeter(torch.device("cpu"))
    assert meter.start(10) is None and meter.finish(None) is None and meter.rate is None
    assert meter.finish((1000, time.perf_counter() - 0.5)) == pytest.approx(2000.0, rel=0.02)
    assert meter.finish((1000, time.perf_counter() - 1.0)) == pytest.approx(0.7 * 2000 + 0.3 * 1000, rel=0.02)
    mark = meter.start(1000)
    assert mark is not None and mark[0] == 1000


def test_an_engine_knows_its_prefill_rate_before_its_first_step():
    """Calibrated when built (a warm-up forward, then a timed one): the first request that finds
    its prefix on a slow tier is weighed against recomputing too."""
    from kvtier.engine import LLMEngine, SamplingParams, SchedulerConfig
    from kvtier.models import build_model

    model = build_model("tiny-llama", torch.device("cpu"), torch.float32, seed=0)
    config = kvtier.CacheConfig(16, [kvtier.PrimaryTier(8 << 20)])
    with LLMEngine(model, config, SchedulerConfig(max_num_tokens=512)) as engine:
        calibrated = engine.prefill.rate
        assert calibrated is not None and calibrated > 0
        assert engine.cache_manager._pool.load_cost.prefill_rate == calibrated
        engine.generate([[1 + i % 300 for i in range(400)]], SamplingParams(max_tokens=2))
        assert engine.prefill.rate != calibrated  # the step's own sample moved it
        assert engine.cache_manager._pool.load_cost.prefill_rate == engine.prefill.rate


def test_an_engine_recomputes_a_prefix_on_a_tier_slower_than_its_prefill(tmp_path):
    """The disk measured slow: the engine recomputes the cached prefix, tokens unchanged; with
    ``recompute_when_faster=False`` the same prefix is loaded."""
    from kvtier.engine import SamplingParams
    from kvtier.models import build_model
    from tests.test_engine import check_against_oracle, engine, prompts_for

    model = build_model("tiny-llama", torch.device("cpu"), torch.float64, seed=0)
    prompt, *others = prompts_for(model, [80, 80, 80, 80], seed=5)
    for weigh in (True, False):
        path = tmp_path / str(weigh)
        with engine(model, 16, disk_blocks=64, path=path, recompute_when_faster=weigh) as eng:
            eng.generate([prompt], SamplingParams(max_tokens=2))
            eng.generate(others, SamplingParams(max_tokens=2))  # the prompt's pages go down to disk
            assert eng.cache_manager.stats().tiers["primary"].pages_used > 0
            eng.cache_manager._pool.load_cost.observe(1, 1, 1.0)  # the disk read one byte a second
            out = eng.generate([prompt], SamplingParams(max_tokens=3))
            check_against_oracle(model, [prompt], out, 3)
            recomputed = eng.cache_manager.stats().recomputed_tokens
            if weigh:
                assert sum(out[0].reused_tokens_by_tier.values()) == 0 and recomputed >= 64
            else:
                assert out[0].reused_tokens_by_tier["disk"] == len(prompt) - 1 and recomputed == 0


@pytest.mark.parametrize("rate", [np.float32(2500.0), np.int64(2500), 2500, 2500.0])
def test_a_prefill_rate_may_be_any_real_number(rate):
    mgr, _, _ = manager(primary_pages=4, host_pages=4)
    mgr.set_prefill_rate(rate)
    assert mgr._pool.load_cost.prefill_rate == 2500.0
    mgr.close()


@pytest.mark.parametrize(("rate", "error"), [(10**400, ValueError), (True, TypeError), ("9", TypeError)])
def test_a_prefill_rate_out_of_floats_or_not_a_number_is_refused(rate, error):
    mgr, _, _ = manager(primary_pages=4, host_pages=4)
    with pytest.raises(error, match="prefill rate"):
        mgr.set_prefill_rate(rate)
    assert mgr._pool.load_cost.prefill_rate is None
    mgr.close()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_recompute_when_faster_must_be_a_bool(value):
    from kvtier.engine import SchedulerConfig

    with pytest.raises(ValueError, match="recompute_when_faster must be a bool"):
        SchedulerConfig(recompute_when_faster=value)


def test_a_stale_estimate_is_probed_past_the_cut_once_an_interval(monkeypatch):
    cost = LoadCost(3)
    cost.observe(2, 1 << 20, 10.0)  # the disk (tier 2) read 100 KB/s
    blocks = np.arange(11)[:, None] * np.array([0, 1 << 20, 1 << 20])  # each block: 1 MiB on host, 1 MiB on disk
    assert cost.with_probe(0, blocks) == 0  # just sampled
    monkeypatch.setattr(load_cost, "PROBE_INTERVAL_S", 0.0)
    assert cost.with_probe(0, blocks) == 4  # stale: 4 MiB of the disk's past the cut
    assert cost.with_probe(10, blocks) == 10  # nothing past the cut
    assert cost.with_probe(7, blocks) == 10  # less than 4 MiB past it: to the last point
    host_only = np.arange(6)[:, None] * np.array([0, 1 << 20, 0])
    assert cost.with_probe(2, host_only) == 2  # host pages only: never measured, nothing to probe
    primary_grows = np.arange(11)[:, None] * np.array([1 << 20, 0, 0]) + np.array([0, 0, 1 << 20])
    assert cost.with_probe(0, primary_grows) == 0  # primary pages cost nothing: never probed
    monkeypatch.setattr(load_cost, "PROBE_INTERVAL_S", 3600.0)
    assert cost.with_probe(0, blocks) == 0  # the probe counts as a sample


def test_a_disk_measured_slow_once_is_measured_again_and_loads_resume(tmp_path, monkeypatch):
    """The cut stops the loads that would measure the disk: a stale estimate is probed, and a disk
    that reads fast now is loaded from again."""
    from tests.test_remembered_rates import disk_manager, push_down

    mgr = disk_manager(tmp_path)
    oracle = PageOracle(mgr)
    prompt = [900 + i for i in range(4 * TPB_DISK + 1)]
    serve(mgr, oracle, prompt)
    push_down(mgr, oracle, 30_000)
    mgr.set_prefill_rate(1e4)
    mgr._pool.load_cost.observe(1, 1, 1.0)  # a read once took a second a byte (a cold page cache)
    assert serve(mgr, oracle, [*prompt, 1]) == 0
    push_down(mgr, oracle, 40_000)
    monkeypatch.setattr(load_cost, "PROBE_INTERVAL_S", 0.0)
    assert serve(mgr, oracle, [*prompt, 2]) > 0  # the probe loads past the cut and measures the disk
    push_down(mgr, oracle, 50_000)
    monkeypatch.setattr(load_cost, "PROBE_INTERVAL_S", 3600.0)
    mgr.set_prefill_rate(100)  # a recompute of 0.64 s: any read measured now wins, under a loaded CPU too
    assert serve(mgr, oracle, [*prompt, 3]) == 4 * TPB_DISK  # fast now: the whole prefix loads
    mgr.close()
