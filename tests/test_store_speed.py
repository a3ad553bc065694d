"""``StoreSpeed``: the moving averages of a store's calls, and the ask-or-recompute decision."""

from __future__ import annotations

import math

import pytest

from kvtier.connector.store_speed import PROBE_S, StoreSpeed


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_nothing_is_skipped_until_a_check_was_timed_and_a_rate_is_known():
    """Before a fetch was timed an ask costs at least two of the check's round trips: a store whose
    check alone is slower than recomputing is not asked again while its first fetch is on its way.
    Before, every ask was made until a fetch had been timed (six asks of 0.4-1.6 s on the engine's
    thread with ``load_async=True`` and a Redis 0.4 s away)."""
    speed = StoreSpeed(Clock())
    assert speed.estimate(1 << 20) is None
    assert not speed.faster_to_recompute(10, 1 << 20, 1e6)
    speed.checked(0.5)
    assert speed.estimate(1 << 20) == pytest.approx(1.0)  # no fetch timed yet: the round trips alone
    assert speed.faster_to_recompute(10, 1 << 20, 1e6)  # 10 us of recomputing against at least 1 s
    assert not speed.faster_to_recompute(10_000, 1 << 20, 1e3)  # 10 s of recomputing: asked
    speed.fetched(0.5 + 1.0, 1 << 30)  # a check's latency, then 1 GiB/s
    assert speed.estimate(1 << 30) == pytest.approx(2 * 0.5 + 1.0)
    assert not speed.faster_to_recompute(10, 1 << 20, None)  # no prefill rate: always asked


def test_an_ask_is_skipped_exactly_when_recomputing_is_expected_to_be_faster():
    speed = StoreSpeed(Clock())
    speed.checked(0.01)
    speed.fetched(0.01 + 0.1, 100_000_000)  # 1 GB/s
    expected = speed.estimate(50_000_000)
    assert expected == pytest.approx(0.02 + 0.05)
    rate = 10_000.0  # tokens/s
    assert speed.faster_to_recompute(math.floor(expected * rate) - 1, 50_000_000, rate)
    assert not speed.faster_to_recompute(math.ceil(expected * rate) + 1, 50_000_000, rate)


def test_averages_move_a_quarter_of_the_way_and_a_fetch_below_its_latency_stays_finite():
    speed = StoreSpeed(Clock())
    speed.checked(1.0)
    speed.checked(0.0)
    speed.fetched(0.0, 1000)  # faster than the check's latency: taken as at least a microsecond
    assert speed.estimate(0) == pytest.approx(2 * 0.75)
    assert math.isfinite(speed.estimate(1000))


def test_a_probe_is_made_once_probe_s_passed_since_the_last_timed_call():
    clock = Clock()
    speed = StoreSpeed(clock)
    speed.checked(1.0)
    speed.fetched(2.0, 1000)
    assert speed.faster_to_recompute(100, 1000, 1e6)
    clock.now += PROBE_S
    assert not speed.faster_to_recompute(100, 1000, 1e6)  # asked: the store may have recovered
    speed.checked(1.0)  # that ask is timed: skipping resumes
    assert speed.faster_to_recompute(100, 1000, 1e6)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_a_connector_refuses_a_prefill_rate_that_is_no_positive_finite_number(tmp_path, bad):
    from kvtier.connector import FileSystemStore, StoreConnector

    connector = StoreConnector(FileSystemStore(tmp_path))
    with pytest.raises(ValueError, match="prefill rate"):
        connector.set_prefill_rate(bad)
    connector.set_prefill_rate(None)
    connector.set_prefill_rate(2500)
    connector.close()
