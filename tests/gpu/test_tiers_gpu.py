"""Tiers on a CUDA device: pinned host pages, disk through pinned staging, byte for byte."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tests.kvdata import PageOracle
from tests.test_cache_properties import machine
from tests.test_tiers import convo, manager, prefill


def test_cascade_and_reload_on_gpu(tmp_path):
    mgr = manager(tmp_path, primary=8, host=8, disk=32, device="cuda")
    oracle = PageOracle(mgr)
    for i in range(5):
        prefill(mgr, oracle, convo(i))
    stats = mgr.stats()
    to_host = {k: v for k, v in stats.bytes_copied.items() if k.startswith("primary->host:")}
    assert to_host and set(to_host) <= {"primary->host:kernel", "primary->host:copy_engine"}, stats.bytes_copied
    assert stats.tiers["disk"].pages_used > 0
    for i in range(5):
        tokens = convo(i) + [1, 2]
        cache = mgr.create_cache(tokens)
        assert cache.num_reused_tokens == 24
        assert cache.resume()
        oracle.check(cache, tokens)
        cache.close()
    mgr.check_invariants()
    mgr.close()


def test_primary_to_disk_without_host_on_gpu(tmp_path):
    mgr = manager(tmp_path, primary=8, host=0, disk=32, device="cuda")
    oracle = PageOracle(mgr)
    for i in range(4):
        prefill(mgr, oracle, convo(i))
    assert mgr.stats().bytes_copied["host->disk:file"] > 0
    tokens = convo(0) + [3]
    cache = mgr.create_cache(tokens)
    assert cache.reused_by_tier["disk"] == 24
    assert cache.resume()
    oracle.check(cache, tokens)
    mgr.close()


@pytest.mark.parametrize("kind", ["llama", "swa", "hybrid"])
def test_random_operations_on_gpu(kind):
    m = machine(kind, {"primary": 8, "host": 6, "disk": 20}, device="cuda")
    m.TestCase.settings = settings(
        max_examples=8, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
    )
    m.TestCase().runTest()


def test_a_partly_reused_block_copied_into_a_slot_a_racing_demotion_reads():
    """Found by the random operations above: a plan demotes a primary page to host while its
    group also promotes from host (both directions at once) and copies a partly reused block into
    the slot the demotion reads; the copy ran first, and the demoted page's bytes on host were the
    copy's (served wrong later)."""
    m = machine("swa", {"primary": 8, "host": 6, "disk": 20}, device="cuda")
    state = m()
    state.setup()
    try:
        state.serve(keep=False, prefix=1, prefix_len=16, suffix=[3, 0, 0, 0])
        state.serve(keep=True, prefix=0, prefix_len=8, suffix=[0, 0, 0, 0, 0])
        state.serve(keep=False, prefix=1, prefix_len=13, suffix=[0])
        state.serve(keep=False, prefix=1, prefix_len=16, suffix=[3, 0])  # checks every reused byte
        state.mgr.check_invariants()
    finally:
        state.teardown()
