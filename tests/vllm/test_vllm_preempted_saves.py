"""A request preempted between steps (``reset_prefix_cache``) whose saves are still in flight:
vLLM frees its blocks at once, so the saves must be fenced before the next forward writes them."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 or 0.34 (bash .ci/vllm_env.sh)")

from kvtier.vllm import worker
from tests.vllm.harness import prompt
from tests.vllm.lagging_transfer import LaggingTransfer
from tests.vllm.test_vllm_connector import engine, first_step_of, run_until_computed


@pytest.mark.parametrize("abort", [True, False], ids=["aborted", "resumed"])
def test_saves_of_a_request_preempted_then_aborted_are_fenced_before_its_blocks_are_reused(
    tmp_path, monkeypatch, abort
):
    """The RL weight-sync pattern: ``reset_prefix_cache(reset_running_requests=True)`` preempts r1
    while its saves wait on a lagging transfer stream, then r1 is aborted. Before, only a request
    asked again had its saves fenced; an aborted one's ran after r2 had written the freed blocks,
    and r2's bytes were published under r1's tokens (r3, r1's prefix, was served them)."""
    monkeypatch.setattr(worker, "BlockTransfer", LaggingTransfer)
    monkeypatch.setattr(LaggingTransfer, "lag", 8)
    e = engine(tmp_path, blocks=14)  # 13 usable blocks
    shared = prompt(1, 100)
    e.add("r1", shared, max_tokens=50)
    run_until_computed(e, "r1", 100)  # its full blocks' saves wait on the stream
    assert e.kv_scheduler._jobs
    assert e.scheduler.reset_prefix_cache(reset_running_requests=True)
    if abort:
        e.abort("r1")
    e.add("r2", prompt(2, 190), max_tokens=2)  # takes every free block, r1's freed ones too
    monkeypatch.setattr(LaggingTransfer, "lag", 0)
    e.run()
    e.assert_no_leaks()
    e.add("r3", shared[:96] + [5], max_tokens=2)
    e.run()  # the harness checks every block it loads against the bytes its tokens compute
    assert first_step_of(e, "r3")[0] == 96  # r1's six blocks, from kvtier
    e.assert_no_leaks()
