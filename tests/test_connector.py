"""The connector protocol against the real scheduler, and the shipped connectors end to end.

Protocol: asked once per allocation across a deferral; the clamp hands back exactly the tail; an
offer dropped before delivery, or one reserve cannot back while nothing else runs, is handed back
with cancel_load (while others run, it waits for their pages); update_state_after_alloc once per
delivered offer; sliding-window block ids keep BAD_PAGE_INDEX in place. End to end (float64, CPU):
tokens always equal the dense oracle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import kvtier
from kvtier.connector import FileSystemConnector, FileSystemStore, RedisConnector, StoreConnector, store_speed
from kvtier.connector.base import ConnectorRequest
from kvtier.engine import LLMEngine, SamplingParams, SchedulerConfig, connector_driver
from kvtier.models import build_model
from tests.test_engine import check_against_oracle, page_bytes, prompts_for

TPB = 16
ROOT = Path(__file__).resolve().parents[1]


class RecordingConnector(FileSystemConnector):
    """The shipped filesystem connector, recording every protocol call it receives."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.calls: list[tuple] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self.calls.append(("ask", request.request_id, num_computed_tokens, result[0]))
        return result

    def update_state_after_alloc(self, request, block_ids_by_layer_group):
        self.calls.append(("deliver", request.request_id, [list(ids) for ids in block_ids_by_layer_group]))
        super().update_state_after_alloc(request, block_ids_by_layer_group)

    def cancel_load(self, request, start, end):
        self.calls.append(("cancel", request.request_id, start, end))
        super().cancel_load(request, start, end)

    def request_finished(self, request, block_ids_by_layer_group) -> bool:
        pages = sum(len(ids) for ids in block_ids_by_layer_group)
        self.calls.append(("finished", request.request_id, request.num_computed_tokens, pages))
        return super().request_finished(request, block_ids_by_layer_group)

    def build_connector_meta(self, scheduler_output):
        self.calls.extend(("ended", request_id) for request_id in scheduler_output.finished_request_ids)
        return super().build_connector_meta(scheduler_output)

    def of(self, kind: str, request_id: int | None = None) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind and (request_id is None or c[1] == request_id)]


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", "cpu", torch.float64, seed=0)


def engine(model, blocks, connector, host_blocks=0, **scheduler) -> LLMEngine:
    tiers = [kvtier.PrimaryTier(page_bytes(model) * blocks)]
    if host_blocks:
        tiers.append(kvtier.HostTier(page_bytes(model) * host_blocks))
    # These tests check what the store gives back. A tiny model on the CPU recomputes a short prompt
    # faster than a store answers, and the connector would then (rightly) not ask: asks are forced.
    scheduler.setdefault("recompute_when_faster", False)
    return LLMEngine(model, kvtier.CacheConfig(TPB, tiers), SchedulerConfig(**scheduler), connector=connector)


def seed_store(model, path, prompts, max_tokens=2) -> None:
    """Another engine computes the prompts and saves their blocks to the store."""
    with engine(model, 200, FileSystemConnector(path)) as eng:
        eng.generate(prompts, SamplingParams(max_tokens=max_tokens))


def test_filesystem_cold_then_warm_across_engines(llama, tmp_path):
    prompts = prompts_for(llama, [100, 140, 60], seed=1)
    with engine(llama, 200, FileSystemConnector(tmp_path)) as cold:
        outs = cold.generate(prompts, SamplingParams(max_tokens=5))
        assert all(o.reused_tokens_by_tier.get("connector", 0) == 0 for o in outs)
    assert len(list(tmp_path.rglob("*.page"))) >= 6 + 8 + 3
    with engine(llama, 200, FileSystemConnector(tmp_path)) as warm:
        outs = warm.generate(prompts, SamplingParams(max_tokens=5))
        check_against_oracle(llama, prompts, outs, 5)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.reused_tokens_by_tier["connector"] == (len(prompt) - 1) // TPB * TPB
            assert out.num_computed_prompt_tokens == len(prompt) - out.reused_tokens_by_tier["connector"]


@pytest.mark.parametrize(("policy", "saved"), [("priority>=50", [False, True]), ("seen>=2", [False, False])])
def test_a_filesystem_connector_saves_by_its_save_policy(llama, tmp_path, policy, saved):
    """``save_policy`` as ``RedisConnector`` takes it. Before, ``FileSystemConnector`` refused the
    argument (``TypeError``): selective saving to a directory needed a hand-built connector."""
    prompts = prompts_for(llama, [70, 90], seed=2)
    connector = FileSystemConnector(tmp_path, save_policy=policy)
    assert connector.save_policy == kvtier.connector.SavePolicy.parse(policy)
    with engine(llama, 200, connector) as eng:
        for prompt, priority in zip(prompts, [10, 60], strict=True):
            eng.generate([prompt], SamplingParams(max_tokens=2), priority=priority)
    with engine(llama, 200, FileSystemConnector(tmp_path)) as warm:
        outs = warm.generate(prompts, SamplingParams(max_tokens=2))
    check_against_oracle(llama, prompts, outs, 2)
    assert [o.reused_tokens_by_tier.get("connector", 0) > 0 for o in outs] == saved


def test_a_bad_save_policy_is_refused_before_the_directory_is_made(tmp_path):
    with pytest.raises(ValueError, match="save policy"):
        FileSystemConnector(tmp_path / "store", save_policy="hot")
    assert not (tmp_path / "store").exists()


def test_asked_once_per_allocation_across_a_deferral(llama, tmp_path):
    prompts = prompts_for(llama, [30, 100], seed=2)
    seed_store(llama, tmp_path, [prompts[1]])
    conn = RecordingConnector(tmp_path)
    # A holds 5 of 13 pages: B's offer (6 pages) is reserved, its prompt + max_tokens (9) is not: deferred
    with engine(llama, 13, conn, policy="guaranteed_no_evict", max_num_tokens=256) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=40))
        check_against_oracle(llama, prompts, outs, 40)
    b = outs[1].request_id
    assert len(conn.of("ask", b)) == 1
    assert len(conn.of("deliver", b)) == 1
    assert outs[1].reused_tokens_by_tier["connector"] == 96


class OffersTheLastToken(RecordingConnector):
    """Offers the prompt's last token too, its sliding-window pages picked at the prompt's end: a
    connector that does not know the engine computes that token itself."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        longer = dataclasses.replace(request, prompt_token_ids=[*request.prompt_token_ids, 0])
        return super().get_num_new_matched_tokens(longer, num_computed_tokens)


def test_an_offer_stops_before_the_last_prompt_token_or_is_clamped_there(llama, tmp_path):
    prompt = prompts_for(llama, [96], seed=3)[0]  # exactly six blocks, all in the store
    seed_store(llama, tmp_path, [prompt])
    for conn, offered, cancels in ((RecordingConnector(tmp_path), 95, 0), (OffersTheLastToken(tmp_path), 96, 1)):
        with engine(llama, 200, conn) as eng:
            out = eng.generate([prompt], SamplingParams(max_tokens=3))[0]
        assert conn.of("ask")[0][3] == offered
        assert conn.of("cancel") == [("cancel", out.request_id, 95, 96)] * cancels  # the engine clamps the tail
        assert out.reused_tokens_by_tier["connector"] == 95
        assert out.token_ids == llama.reference_generate(prompt, 3)


def test_a_sliding_window_offer_holds_the_blocks_live_where_the_engine_takes_it(tmp_path):
    """With one token a block and a window of 48, the history before the prompt's last token needs
    one block more than the prompt's end: the shipped connector picks its pages there (here that
    block was never saved, so it offers only the sink); an offer picked at the end is handed back
    whole. Before, that block got a page nothing loaded, and the tokens went wrong."""
    model = build_model("tiny-swa", "cpu", torch.float64, seed=0)
    config = kvtier.CacheConfig(1, [kvtier.PrimaryTier(page_bytes(model) // TPB * 300)])  # 300 one-token blocks
    prompt = prompts_for(model, [80], seed=13)[0]
    with LLMEngine(model, config, connector=FileSystemConnector(tmp_path)) as first:
        history = prompt + first.generate([prompt], SamplingParams(max_tokens=12))[0].token_ids[:11]
    expected = model.reference_generate(history, 4)
    fillers = prompts_for(model, [200, 200, 200], seed=9)  # every slot holds other keys before the load
    for conn, cancel in ((RecordingConnector(tmp_path), None), (OffersTheLastToken(tmp_path), (0, 91))):
        with LLMEngine(model, config, SchedulerConfig(recompute_when_faster=False), connector=conn) as eng:
            eng.generate(fillers, SamplingParams(max_tokens=1))
            out = eng.generate([history], SamplingParams(max_tokens=4))[0]
        assert out.token_ids == expected
        asked = conn.of("ask", out.request_id)[0][3]
        assert conn.of("cancel", out.request_id) == ([] if cancel is None else [("cancel", out.request_id, *cancel)])
        assert out.reused_tokens_by_tier.get("connector", 0) == (asked if cancel is None else 0)


def test_a_sliding_window_prompt_served_whole_counts_no_missed_page(tmp_path):
    """A sliding-window model's prompt saved, then served whole from the store: no page missed.
    Before, the pages stale at the prompt's end (never saved) counted as misses of every ask: 21
    on a perfect hit of a 400-token prompt, a miss rate that could never reach 0."""
    model = build_model("tiny-swa", "cpu", torch.float64, seed=0)
    prompt = prompts_for(model, [400], seed=14)[0]
    for cold in (True, False):
        conn = FileSystemConnector(tmp_path)
        with engine(model, 64, conn) as eng:
            out = eng.generate([prompt], SamplingParams(max_tokens=2))[0]
        assert out.token_ids == model.reference_generate(prompt, 2)
        stats = conn.stats()
        if cold:
            assert stats.saved_pages > 0 and stats.missed_pages == stats.saved_pages  # what it then saved
        else:
            assert out.reused_tokens_by_tier["connector"] == 399 and stats.missed_pages == 0


@pytest.mark.parametrize("local", [0, 16, 20, 40])
def test_an_offer_handed_back_whole_leaves_nothing_staged(llama, tmp_path, local):
    """Also when the local prefix ends inside a block: that block holds offered tokens only."""
    prompt = prompts_for(llama, [80], seed=3)[0]
    seed_store(llama, tmp_path, [prompt])
    conn = FileSystemConnector(tmp_path)
    with engine(llama, 200, conn):  # registers the layout
        request = ConnectorRequest(7, prompt, prompt[:local], kvtier.ReuseScope(), local)
        offered, _ = conn.get_num_new_matched_tokens(request, local)
        assert offered == 79 - local  # up to the last prompt token, which the engine computes
        conn.cancel_load(request, local, local + offered)
        assert conn._staged == {}
        conn.get_num_new_matched_tokens(request, local)  # a tail handed back keeps the block the rest needs
        conn.cancel_load(request, 79, 80)
        assert sorted({block for block, _ in conn._staged[7].pages}) == list(range(local // TPB, 5))


def test_loads_reuse_one_staging_buffer_across_steps(llama, tmp_path):
    prompts = prompts_for(llama, [100, 80, 60], seed=11)
    seed_store(llama, tmp_path, prompts)
    conn = FileSystemConnector(tmp_path)
    buffers = []
    with engine(llama, 200, conn) as eng:
        for prompt in prompts:  # one load per generate call: a step each, largest first
            out = eng.generate([prompt], SamplingParams(max_tokens=3))[0]
            assert out.reused_tokens_by_tier["connector"] == min(len(prompt) // TPB * TPB, len(prompt) - 1)
            assert out.token_ids == llama.reference_generate(prompt, 3)
            buffers.append(conn._staging)
    assert buffers[0] is not None and all(b is buffers[0] for b in buffers)
    assert conn._staging is None  # released when the connector closed


def test_offer_dropped_before_delivery_is_handed_back(llama, tmp_path):
    prompts = prompts_for(llama, [30, 100], seed=4)
    seed_store(llama, tmp_path, [prompts[1]])
    conn = RecordingConnector(tmp_path)
    eng = engine(llama, 13, conn, policy="guaranteed_no_evict", max_num_tokens=256)
    eng.add_request(prompts[0], SamplingParams(max_tokens=40))
    b = eng.add_request(prompts[1], SamplingParams(max_tokens=40))
    eng.step()  # A runs; B is asked and reserved but cannot get its pages: deferred, not delivered
    assert len(conn.of("ask", b)) == 1 and not conn.of("deliver", b)
    eng.abort_request(b)
    assert conn.of("cancel", b) == [("cancel", b, 0, 96)]
    eng.cache_manager.check_invariants()
    eng.close()


def test_an_offer_whose_pages_are_taken_waits_for_them(llama, tmp_path):
    """An offer whose pages cannot be had while another request runs keeps its request waiting (as
    vLLM's waits for blocks) and is loaded once they come back. Before, it was handed back and the
    prefix recomputed."""
    prompts = prompts_for(llama, [100, 100], seed=5)
    seed_store(llama, tmp_path, [prompts[1]])
    conn = RecordingConnector(tmp_path)
    # max_utilization: A holds 4 of 8 pages; B's reserve needs 6 at once and cannot have them yet
    with engine(llama, 8, conn, policy="max_utilization", max_num_tokens=64, max_batch_size=2) as eng:
        eng.add_request(prompts[0][:60], SamplingParams(max_tokens=4))
        eng.step()
        b = eng.add_request(prompts[1], SamplingParams(max_tokens=4))
        outputs = run_until(eng, lambda done: len(done) == 2)
        eng.cache_manager.check_invariants()
    assert not conn.of("cancel", b) and len(conn.of("ask", b)) == 1
    assert outputs[b].reused_tokens_by_tier["connector"] == 96
    assert outputs[b].token_ids == llama.reference_generate(prompts[1], 4)


_STEP_HOOKS = ("build_connector_meta", "start_load_kv", "wait_for_layer_load")  # called at every step


class FailsOnce(FileSystemConnector):
    """The shipped filesystem connector, whose hook named ``hook`` raises the first time it is
    called once armed (a hook called at every step: in the step that delivers an offer)."""

    def __init__(self, path, load_async: bool) -> None:
        super().__init__(path, load_async=load_async)
        self.hook: str | None = None
        self.delivered = False

    def update_state_after_alloc(self, request, block_ids_by_layer_group):
        self.delivered = True
        super().update_state_after_alloc(request, block_ids_by_layer_group)

    def __getattribute__(self, name):
        attribute = super().__getattribute__(name)
        state = object.__getattribute__(self, "__dict__")
        if name != state.get("hook") or (name in _STEP_HOOKS and not state.get("delivered")):
            return attribute

        def once(*args, **kwargs):
            self.hook = None
            raise RuntimeError(f"{name} failed")

        return once


@pytest.mark.parametrize(
    "hook",
    [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        *_STEP_HOOKS,
        "save_kv_layer",
        "wait_for_save",
        "request_finished",
    ],
)
@pytest.mark.parametrize("load_async", [False, True])
def test_a_connector_hook_that_raises_costs_at_most_the_offers_it_was_loading(llama, tmp_path, hook, load_async):
    """A third-party connector's bug is contained: a load that raised is a miss for the requests it
    was loading (recomputed, their connector not asked again); any other hook loses an offer or a
    save at most. Every request finishes with the dense tokens. Before, a load hook that raised
    left its offers marked loaded (wrong tokens), and a save hook left the batch's requests
    running with nothing left to compute (a hang); then, the requests it was loading failed."""
    shared = prompts_for(llama, [70], seed=5)[0]
    seed_store(llama, tmp_path, [shared])
    others = prompts_for(llama, [30, 45], seed=6)
    prompts = [shared[:64] + others[0][:10], others[0], others[1]]  # the first is offered 64 tokens
    conn = FailsOnce(tmp_path, load_async)
    with engine(llama, 200, conn) as eng:
        eng.generate(prompts_for(llama, [250, 250], seed=7), SamplingParams(max_tokens=1))  # stale KV in pages
        conn.hook = hook
        outs = eng.generate(prompts, SamplingParams(max_tokens=6))
        eng.step()  # the connector reports what it dropped: the pages kept for it go back
        assert not eng.connector.loading and not eng.connector.in_flight
        eng.cache_manager.check_invariants()
    assert conn.hook is None  # it raised
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length"
        assert out.token_ids == llama.reference_generate(prompt, 6)
    missed = hook in ("get_num_new_matched_tokens", "update_state_after_alloc", *_STEP_HOOKS)  # (asked once)
    assert outs[0].reused_tokens_by_tier["connector"] == (0 if missed else 64)


class HoldsReports(StoreConnector):
    """The shipped connector over a filesystem store (a path, or the store), whose finished loads
    are reported only once ``ready(id)``."""

    def __init__(self, path_or_store, **options) -> None:
        store = path_or_store if isinstance(path_or_store, FileSystemStore) else FileSystemStore(path_or_store)
        super().__init__(store, load_async=True, **options)
        self.landed: set[int] = set()

    def ready(self, request_id: int) -> bool:
        raise NotImplementedError

    def get_finished(self, finished_gen_ids, started_loading_ids):
        saved, loaded = super().get_finished(finished_gen_ids, started_loading_ids)
        self.landed.update(loaded)
        reported = [r for r in started_loading_ids if r in self.landed and self.ready(r)]
        self.landed.difference_update(reported)
        return saved, reported


class LoadsLate(HoldsReports):
    """Reports loads finished only once ``release`` is set."""

    release = False

    def ready(self, request_id: int) -> bool:
        return self.release


def test_an_asynchronous_load_never_reported_is_a_miss(llama, tmp_path, monkeypatch):
    """A load in flight longer than ``ASYNC_LOAD_WAIT_S`` is given up on: its request is recomputed
    (the connector not asked again) and the others finish. Its old pages stay held (the connector
    may still write them) until it reports the load. Before, the step waited for ever: every
    request stalled; then, its request failed."""
    monkeypatch.setattr(connector_driver, "ASYNC_LOAD_WAIT_S", 0.2)
    shared = prompts_for(llama, [70], seed=5)[0]
    seed_store(llama, tmp_path, [shared])
    others = prompts_for(llama, [30, 45], seed=6)
    prompts = [shared[:64] + others[0][:10], *others]
    conn = LoadsLate(tmp_path)
    with engine(llama, 200, conn) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=4))
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == llama.reference_generate(prompt, 4)
        assert outs[0].reused_tokens_by_tier["connector"] == 0 and eng.connector.loading
        held = eng.cache_manager.stats().tiers["primary"].pages_used
        conn.release = True
        eng.step()  # the connector reports the load: its pages go back
        assert eng.cache_manager.stats().tiers["primary"].pages_used < held
        assert not eng.connector.loading
        eng.cache_manager.check_invariants()


def run_until(eng, done, steps=400) -> dict[int, object]:
    """Step ``eng`` until ``done(outputs so far)``; the outputs by request id."""
    outputs: dict[int, object] = {}
    for _ in range(steps):
        outputs.update((o.request_id, o) for o in eng.step())
        if done(outputs):
            return outputs
    raise AssertionError(f"not done after {steps} steps: {sorted(outputs)} finished")


def test_an_asynchronous_load_in_flight_lets_the_other_requests_run(llama, tmp_path, monkeypatch):
    """While a connector's asynchronous load is in flight, its request sits the steps out and the
    others run: one finishes before the connector reports the load, then the loaded request runs
    from its offer's end. Before, the step waited for the load (up to ``ASYNC_LOAD_WAIT_S``):
    every request stalled, and a load slower than that failed its request."""
    monkeypatch.setattr(connector_driver, "ASYNC_LOAD_WAIT_S", 5.0)
    shared = prompts_for(llama, [70], seed=5)[0]
    seed_store(llama, tmp_path, [shared])
    loaded_prompt, other = shared[:64] + [3, 4, 5], prompts_for(llama, [30], seed=6)[0]
    conn = LoadsLate(tmp_path)
    with engine(llama, 200, conn) as eng:
        loaded = eng.add_request(loaded_prompt, SamplingParams(max_tokens=4))
        quick = eng.add_request(other, SamplingParams(max_tokens=6))
        t0 = time.monotonic()
        outputs = run_until(eng, lambda outs: quick in outs)
        assert time.monotonic() - t0 < 2.0, "the steps waited for the load"
        assert outputs[quick].token_ids == llama.reference_generate(other, 6)
        assert loaded not in outputs and eng.connector.in_flight.keys() == {loaded}
        conn.release = True
        outputs = run_until(eng, lambda outs: loaded in outs)
        assert outputs[loaded].token_ids == llama.reference_generate(loaded_prompt, 4)
        assert outputs[loaded].reused_tokens_by_tier["connector"] == 64
        eng.cache_manager.check_invariants()


def test_a_request_aborted_while_its_load_is_in_flight_keeps_its_pages_until_reported(llama, tmp_path):
    """Aborted while the connector still loads into its pages, a request keeps them (no one else
    can be given them) until the connector reports the load; then they go back."""
    shared = prompts_for(llama, [70], seed=8)[0]
    seed_store(llama, tmp_path, [shared])
    conn = LoadsLate(tmp_path)
    with engine(llama, 200, conn) as eng:
        idle = eng.cache_manager.stats().tiers["primary"].pages_used
        loaded = eng.add_request(shared[:64] + [9], SamplingParams(max_tokens=3))
        assert eng.step() == [] and loaded in eng.connector.in_flight
        eng.abort_request(loaded)
        assert loaded in eng.connector.loading and not eng.has_unfinished_requests()
        held = eng.cache_manager.stats().tiers["primary"].pages_used
        other = prompts_for(llama, [40], seed=9)[0]
        assert eng.generate([other], SamplingParams(max_tokens=3))[0].token_ids == llama.reference_generate(other, 3)
        assert eng.cache_manager.stats().tiers["primary"].pages_used >= held > idle
        conn.release = True
        eng.step()  # the connector reports the load: its pages go back
        assert not eng.connector.loading
        eng.cache_manager.check_invariants()


def test_a_request_whose_load_is_in_flight_is_never_preempted(llama, tmp_path, monkeypatch):
    """Under ``max_utilization`` a running request that must grow preempts the most recently
    admitted one, but never one whose load is in flight (suspending it would let its pages be
    demoted while the connector writes them): it waits instead, and both end with their own tokens."""
    monkeypatch.setattr(connector_driver, "ASYNC_LOAD_WAIT_S", 5.0)
    shared = prompts_for(llama, [70], seed=10)[0]
    seed_store(llama, tmp_path, [shared])
    grower, loaded_prompt = prompts_for(llama, [40], seed=11)[0], shared[:64] + [1, 2]
    conn = LoadsLate(tmp_path)
    with engine(llama, 10, conn, host_blocks=40, policy="max_utilization") as eng:
        first = eng.add_request(grower, SamplingParams(max_tokens=70))
        eng.step()
        loaded = eng.add_request(loaded_prompt, SamplingParams(max_tokens=2))
        run_until(eng, lambda outs: eng.scheduler.num_preemptions > 0)  # the grower preempted itself
        assert loaded in eng.connector.in_flight, "the request in flight was preempted"
        assert [r.request_id for r in eng.scheduler.waiting] == [first]
        conn.release = True
        outputs = run_until(eng, lambda outs: {first, loaded} <= outs.keys())
        assert outputs[first].token_ids == llama.reference_generate(grower, 70)
        assert outputs[loaded].token_ids == llama.reference_generate(loaded_prompt, 2)
        assert outputs[loaded].reused_tokens_by_tier["connector"] == 64
        eng.cache_manager.check_invariants()


class SavesLate(LoadsLate):
    """Loads reported once ``release`` is set; saves copy the request's pages only once ``gate`` is."""

    def __init__(self, path) -> None:
        super().__init__(path, save_policy="priority>=10")
        self.gate = threading.Event()

    def _save_batch(self, saves) -> None:
        self.gate.wait(timeout=30)
        super()._save_batch(saves)


def test_the_save_of_a_request_whose_load_was_given_up_keeps_its_pages_past_the_loads_report(
    llama, tmp_path, monkeypatch
):
    """A request's load is given up on (in flight too long), so it is recomputed and finishes; its
    save has not copied its pages yet when the connector at last reports the old load. Only the
    old load's cache closes: the save copies the request's own bytes. Before, that report closed
    the cache the save was about to read, whose pages other requests then overwrote: the store
    got their bytes under this prompt's keys (a later reuse: other tokens)."""
    monkeypatch.setattr(connector_driver, "ASYNC_LOAD_WAIT_S", 0.2)
    shared, tail = prompts_for(llama, [70, 40], seed=40)
    prompt = shared[:64] + tail
    seed_store(llama, tmp_path, [shared])
    conn = SavesLate(tmp_path)
    with engine(llama, 40, conn) as eng:
        request_id = eng.add_request(prompt, SamplingParams(max_tokens=2))
        run_until(eng, lambda outs: request_id in outs)  # given up on, recomputed, finished: its save waits
        assert request_id in eng.connector.saving and request_id in eng.connector.loading
        conn.release = True
        eng.step()  # the old load is reported
        assert request_id in eng.connector.saving and request_id not in eng.connector.loading
        filler = prompts_for(llama, [300], seed=41)
        eng.generate(filler, SamplingParams(max_tokens=1), priority=0)  # takes any page freed; not saved
        conn.gate.set()
        assert eng.connector.wait_for_saves(timeout_s=30)
    with engine(llama, 200, FileSystemConnector(tmp_path)) as fresh:
        out = fresh.generate([prompt + [3]], SamplingParams(max_tokens=3))[0]
    assert out.reused_tokens_by_tier["connector"] == 96
    assert out.token_ids == llama.reference_generate(prompt + [3], 3)


@pytest.mark.parametrize("reported_first", ["load", "save"])
def test_a_request_aborted_while_its_load_is_in_flight_saves_what_it_computed_before_its_pages_go(
    llama, tmp_path, reported_first
):
    """Aborted while the connector loads its offer, a request is reported finished (as vLLM does)
    with the blocks it holds: the connector saves the prefix the engine computed. Its cache then
    closes only once both the load and the save are reported, in either order: the save copies
    the request's own bytes, and the load writes no one else's page. Before, the connector heard
    nothing of the request: the blocks were never saved."""
    shared = prompts_for(llama, [70], seed=84)[0]
    seed_store(llama, tmp_path / "probe", [shared[:33]])  # the file names of the prefix's two blocks
    seed_store(llama, tmp_path / "store", [shared])
    for name in (tmp_path / "probe").rglob("*.page"):
        (tmp_path / "store" / name.relative_to(tmp_path / "probe")).unlink()  # the store lacks them
    conn = SavesLate(tmp_path / "store")  # saves of priority >= 10 only
    prompt = shared[:64] + [9]
    with engine(llama, 40, conn) as eng:
        eng.generate([shared[:33]], SamplingParams(max_tokens=1), priority=0)  # computed here, not saved
        request_id = eng.add_request(prompt, SamplingParams(max_tokens=3))
        assert eng.step() == [] and request_id in eng.connector.in_flight  # 32 tokens local, 32 loading
        eng.abort_request(request_id)
        cache = eng.connector.saving[request_id]
        assert eng.connector.loading[request_id] is cache
        if reported_first == "save":
            conn.gate.set()
            assert eng.connector.wait_for_saves(timeout_s=30)
            assert cache.state is kvtier.CacheState.ACTIVE  # the load may still write its pages
        conn.release = True
        deadline = time.monotonic() + 30
        while request_id in eng.connector.loading and time.monotonic() < deadline:
            eng.step()  # until the load is reported
        assert request_id not in eng.connector.loading
        if reported_first == "load":
            assert cache.state is kvtier.CacheState.ACTIVE  # the save still reads its pages
            filler = prompts_for(llama, [300], seed=85)
            eng.generate(filler, SamplingParams(max_tokens=1), priority=0)  # takes any page freed; not saved
            conn.gate.set()
            assert eng.connector.wait_for_saves(timeout_s=30)
        assert cache.state is kvtier.CacheState.CLOSED
        eng.cache_manager.check_invariants()
    with engine(llama, 200, FileSystemConnector(tmp_path / "store")) as fresh:
        out = fresh.generate([prompt], SamplingParams(max_tokens=3))[0]
    assert out.reused_tokens_by_tier["connector"] == 64
    assert out.token_ids == llama.reference_generate(prompt, 3)


class FailedLoadsRaiseOnce(FileSystemConnector):
    """``get_failed_loads`` raises once, when armed, right after a ``get_finished`` that reported
    something (a transient error in a third-party connector's report)."""

    armed = False
    reported = False

    def get_finished(self, finished_gen_ids, started_loading_ids):
        saved, loaded = super().get_finished(finished_gen_ids, started_loading_ids)
        self.reported = bool(saved or loaded)
        return saved, loaded

    def get_failed_loads(self):
        if self.armed and self.reported:
            self.armed = False
            raise ConnectionError("transient error in get_failed_loads")
        return super().get_failed_loads()


@pytest.mark.parametrize("seeded", [False, True])
def test_a_failed_loads_report_that_raises_loses_no_save_and_holds_no_page(llama, tmp_path, seeded):
    """``get_failed_loads`` raises after the ``get_finished`` that reported a save (unseeded: the
    request computes everything) or a load (seeded: it loads 64 tokens): the save is taken, and the
    loads of that report are misses (recomputed), their pages freed. Before, both reports were
    lost: ``generate`` waited for the save for ever, or the landed load's pages stayed held."""
    prompt = prompts_for(llama, [70], seed=4)[0]
    if seeded:
        seed_store(llama, tmp_path, [prompt])
    conn = FailedLoadsRaiseOnce(tmp_path, load_async=True)
    eng = engine(llama, 200, conn)
    try:
        conn.armed = True
        outputs: list = []
        generate = lambda: outputs.extend(eng.generate([prompt], SamplingParams(max_tokens=3)))  # noqa: E731
        call = threading.Thread(target=generate, daemon=True)
        call.start()
        call.join(20)
        assert not call.is_alive(), "generate waited for a save reported already"
        assert not conn.armed  # it raised
        assert outputs[0].token_ids == llama.reference_generate(prompt, 3)
        assert not eng.connector.saving and not eng.connector.loading
        assert eng.cache_manager.stats().tiers["primary"].pages_used == 4  # its 72 tokens' full blocks, published
    finally:
        eng.close_within(5.0)


class AnswersShortOnce(FileSystemStore):
    """A store whose first ``get_many`` answers one page short (a third-party store's bug)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self._calls = itertools.count()

    def get_many(self, keys, expected_sizes=None):
        first = next(self._calls) == 0  # (fetches run on two threads)
        out = super().get_many(keys, expected_sizes)
        return out[:-1] if first else out


def test_a_store_answering_short_fails_that_load_alone(llama, tmp_path):
    """One fetch answers a page short: that load is a miss (recomputed), the other request's load
    lands, nothing stays held, and the counters say so. Before, the error escaped
    ``get_finished``: every load waiting with it was dropped (never reported, their pages held
    for good), and the saves it had taken were never reported (``generate`` waited for ever)."""
    a, b = prompts_for(llama, [70, 70], seed=80)
    seed_store(llama, tmp_path, [a, b])
    conn = StoreConnector(AnswersShortOnce(tmp_path), load_async=True)
    with engine(llama, 200, conn) as eng:
        first, second = (eng.add_request(p, SamplingParams(max_tokens=3)) for p in (a, b))
        outputs = run_until(eng, lambda outs: {first, second} <= outs.keys())
        assert outputs[first].token_ids == llama.reference_generate(a, 3)
        assert outputs[second].token_ids == llama.reference_generate(b, 3)
        assert sorted(o.reused_tokens_by_tier["connector"] for o in outputs.values()) == [0, 64]
        assert not eng.connector.loading and not eng.connector.in_flight
        assert conn.stats().errors == 4 and conn.stats().loaded_pages == 4


class SlowStore(FileSystemStore):
    """A remote store answering every read in ``delay_s``."""

    delay_s = 20.0

    def get_many(self, keys, expected_sizes=None):
        time.sleep(self.delay_s)
        return super().get_many(keys, expected_sizes)


def test_closing_an_engine_does_not_wait_for_a_fetch(llama, tmp_path):
    """``close_within(1.0)`` while a fetch runs returns within its bound. Before, the connector's
    close waited for the fetch (20 s here; for ever on a hung network mount)."""
    prompt = prompts_for(llama, [70], seed=4)[0]
    seed_store(llama, tmp_path, [prompt])
    closes_within_its_bound_while_fetching(
        engine(llama, 200, StoreConnector(SlowStore(tmp_path), load_async=True)), prompt
    )


def closes_within_its_bound_while_fetching(eng: LLMEngine, prompt: list[int]) -> None:
    """Start ``prompt``'s fetch, then ``close_within(1.0)``: it returns True within 5 s."""
    eng.add_request(prompt, SamplingParams(max_tokens=3))
    eng.step()
    assert eng.connector.in_flight
    t0 = time.monotonic()
    assert eng.close_within(1.0)
    assert time.monotonic() - t0 < 5.0


def test_closing_an_engine_does_not_wait_for_a_hung_store_read(llama, tmp_path):
    """The store's value files block on open (FIFOs: a hung network mount) while a fetch reads them:
    ``close_within(1.0)`` returns within its bound. Before, the store's close waited for its
    reads, for as long as they hung."""
    prompt = prompts_for(llama, [70], seed=4)[0]
    seed_store(llama, tmp_path, [prompt])
    values = sorted(tmp_path.rglob("*.page"))
    for value in values:
        value.unlink()
        os.mkfifo(value, 0o600)
    done = threading.Event()

    def let_the_reads_go() -> None:  # after 8 s: each FIFO opened gives an empty value (a miss)
        done.wait(8)
        for _ in range(100):
            for value in values:
                with contextlib.suppress(OSError):
                    os.close(os.open(value, os.O_WRONLY | os.O_NONBLOCK))
            time.sleep(0.02)

    threading.Thread(target=let_the_reads_go, daemon=True).start()
    try:
        closes_within_its_bound_while_fetching(
            engine(llama, 200, FileSystemConnector(tmp_path, load_async=True)), prompt
        )
    finally:
        done.set()


HUNG_READ_EXIT = """
import os, sys, torch
sys.path.insert(0, {root!r})
import kvtier
from kvtier.connector import FileSystemConnector
from kvtier.engine import LLMEngine, SamplingParams
from kvtier.models import build_model
from tests.test_engine import prompts_for, page_bytes
model = build_model("tiny-llama", "cpu", torch.float64, seed=0)
config = kvtier.CacheConfig(16, [kvtier.PrimaryTier(page_bytes(model) * 200)])
eng = LLMEngine(model, config, connector=FileSystemConnector({path!r}, load_async=True))
eng.add_request(prompts_for(model, [70], seed=4)[0], SamplingParams(max_tokens=3))
eng.step()
assert eng.connector.in_flight
other = prompts_for(model, [40], seed=5)[0]  # computed and saved while the read hangs
assert eng.generate([other], SamplingParams(max_tokens=2))[0].token_ids == model.reference_generate(other, 2)
if {close!r}:
    assert eng.close_within(1.0)
print("leaving", flush=True)
"""


@pytest.mark.parametrize("close", [True, False], ids=["closed", "never-closed"])
def test_a_process_exits_while_a_store_read_hangs(llama, tmp_path, close):
    """A fetch hangs for good (the store's values are FIFOs no one writes: a dead network mount):
    another request is computed and saved meanwhile, and the process exits all the same, whether it
    closed its engine or not. Before, the interpreter's exit joined the connector's fetch threads,
    and the process never ended; then the save queued behind the hung reads on the store's threads."""
    prompt = prompts_for(llama, [70], seed=4)[0]
    seed_store(llama, tmp_path, [prompt])
    for value in sorted(tmp_path.rglob("*.page")):
        value.unlink()
        os.mkfifo(value, 0o600)
    script = textwrap.dedent(HUNG_READ_EXIT.format(root=str(ROOT), path=str(tmp_path), close=close))
    try:
        peer = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process did not exit while its store read hung: {exc.stdout!r}")
    assert peer.returncode == 0 and "leaving" in peer.stdout, peer.stderr[-2000:]


class ReportsBreakDown(FileSystemConnector):
    """``get_finished`` raises while ``broken`` (its report channel's peer died)."""

    broken = False

    def get_finished(self, finished_gen_ids, started_loading_ids):
        if self.broken:
            raise ConnectionError("report channel down")
        return super().get_finished(finished_gen_ids, started_loading_ids)


def test_a_connector_that_stops_reporting_holds_no_call_for_ever(llama, tmp_path, monkeypatch):
    """Every ``get_finished`` raises: after ``ASYNC_LOAD_WAIT_S`` of that, the saves are given up on
    (their pages held until a report) and ``generate`` returns with the model's tokens; once the
    connector reports again, their pages go back. Before, ``generate`` (and ``close``) waited for
    ever."""
    monkeypatch.setattr(connector_driver, "ASYNC_LOAD_WAIT_S", 0.3)
    a, b = prompts_for(llama, [70, 40], seed=3)
    seed_store(llama, tmp_path, [a])
    conn = ReportsBreakDown(tmp_path)
    eng = engine(llama, 200, conn)
    try:
        conn.broken = True
        outputs: list = []
        call = threading.Thread(target=lambda: outputs.extend(eng.generate([a, b], SamplingParams(max_tokens=3))))
        call.daemon = True
        call.start()
        call.join(20)
        assert not call.is_alive(), "generate waited for a connector that never reports"
        assert [o.token_ids for o in outputs] == [llama.reference_generate(p, 3) for p in (a, b)]
        assert eng.connector.unreported_saves and not eng.connector.saving
        conn.broken = False
        eng.step()
        assert not eng.connector.unreported_saves and not eng.connector.loading
    finally:
        conn.broken = False
        eng.close_within(5.0)


def test_one_connector_given_to_two_engines_is_refused_for_the_second(llama, tmp_path):
    """A connector keeps one engine's layout, pages and requests: a second engine is refused
    while the first is open, and after (closing the engine closed its connector). Before, it was
    taken: the first engine's saves copied the second's pages and published them under its own
    tokens, and its loads wrote the second's buffer."""
    prompts = prompts_for(llama, [70, 40], seed=3)
    conn = FileSystemConnector(tmp_path)
    with engine(llama, 200, conn) as first:
        with pytest.raises(ValueError, match="already serves another engine"):
            engine(llama, 200, conn)
        outs = first.generate(prompts, SamplingParams(max_tokens=3))
        assert [o.token_ids for o in outs] == [llama.reference_generate(p, 3) for p in prompts]
    with pytest.raises(ValueError, match="this connector was closed"):  # with the engine it served
        engine(llama, 200, conn)  # before: taken, every ask and save then a silent miss
    with engine(llama, 200, FileSystemConnector(tmp_path)) as fresh:  # what the first saved is its own
        out = fresh.generate([prompts[0][:64] + [5, 6]], SamplingParams(max_tokens=3))[0]
        assert out.reused_tokens_by_tier.get("connector", 0) == 64
        assert out.token_ids == llama.reference_generate(prompts[0][:64] + [5, 6], 3)


class LoadsAfterAWhile(HoldsReports):
    """Reports each load finished 0.2 s after it was first asked about; saves a little slow (a
    remote store)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.asked: dict[int, float] = {}

    def _save_batch(self, saves) -> None:
        time.sleep(0.05)
        super()._save_batch(saves)

    def ready(self, request_id: int) -> bool:
        now = time.monotonic()
        return now - self.asked.setdefault(request_id, now) > 0.2


def test_a_save_reported_while_a_step_waits_for_a_load_is_not_lost(llama, tmp_path):
    """A request's save ends while the next step waits for an asynchronous load: the connector
    reports it there, once. Before, the wait threw that report away: the finished request's
    cache stayed locked and ``generate`` (and ``close``) waited for the save for ever."""
    shared, other = prompts_for(llama, [70, 40], seed=1)
    seed_store(llama, tmp_path, [shared])
    eng = engine(llama, 200, LoadsAfterAWhile(tmp_path), max_batch_size=1)
    outputs: list = []
    call = threading.Thread(target=lambda: outputs.extend(eng.generate([other, shared], SamplingParams(max_tokens=1))))
    call.start()
    call.join(20)
    assert not call.is_alive(), "generate never returned"
    assert [o.token_ids for o in outputs] == [llama.reference_generate(p, 1) for p in (other, shared)]
    assert outputs[1].reused_tokens_by_tier.get("connector", 0) > 0
    assert not eng.connector.saving
    eng.close()


def test_loads_never_reported_do_not_hold_back_the_requests_that_need_their_pages(llama, tmp_path, monkeypatch):
    """Two loads given up on hold most of a small primary tier, and the connector never reports
    them: the requests that need those pages (theirs, recomputed, among them) wait
    ``ASYNC_LOAD_WAIT_S`` more, then run or fail alone. Before, they waited for the connector for
    ever (``generate`` never returned)."""
    monkeypatch.setattr(connector_driver, "ASYNC_LOAD_WAIT_S", 0.2)
    shared, short, longer = prompts_for(llama, [70, 50, 60], seed=2)
    seed_store(llama, tmp_path, [shared])
    eng = engine(llama, 12, LoadsLate(tmp_path), max_batch_size=4)
    first = eng.generate([shared, short, longer, shared], SamplingParams(max_tokens=3))
    for prompt, out in zip((shared, short, longer, shared), first, strict=True):
        assert out.token_ids == llama.reference_generate(prompt, 3) or "cannot run even alone" in out.error
    assert eng.connector.loading
    outputs: list = []
    call = threading.Thread(target=lambda: outputs.extend(eng.generate([short, longer], SamplingParams(max_tokens=3))))
    call.start()
    call.join(20)
    assert not call.is_alive(), "generate waited for the connector"
    for prompt, out in zip((short, longer), outputs, strict=True):
        assert out.token_ids == llama.reference_generate(prompt, 3) or (out.finish_reason == "error" and out.error)
    eng.connector.connector.release = True
    eng.close()


class RaisesOnceInDeliver(FileSystemConnector):
    """``update_state_after_alloc`` raises once, when armed (a third-party connector's bug)."""

    armed = False

    def update_state_after_alloc(self, request, block_ids_by_layer_group):
        if self.armed:
            self.armed = False
            raise RuntimeError("deliver failed once")
        super().update_state_after_alloc(request, block_ids_by_layer_group)


def test_a_hook_raising_for_one_offer_misses_every_offer_of_its_step(llama, tmp_path):
    """Two offers in one batch, the deliver hook raising for the first: both are misses (their
    requests recomputed), and nothing is published over pages no load wrote. Before, the second
    ran from its offer's end over stale pages and published them under its tokens (a later prompt
    reused them: other tokens), or the next step raised ``InvariantError``."""
    a, b = prompts_for(llama, [70, 100], seed=21)
    seed_store(llama, tmp_path, [a, b[:65]])
    conn = RaisesOnceInDeliver(tmp_path, load_async=True)
    with engine(llama, 34, conn) as eng:
        eng.generate(prompts_for(llama, [250, 250], seed=7), SamplingParams(max_tokens=1))  # other KV in the pages
        conn.armed = True
        outs = eng.generate([a, b], SamplingParams(max_tokens=3))
        for prompt, out in zip((a, b), outs, strict=True):
            assert out.token_ids == llama.reference_generate(prompt, 3)
            assert out.reused_tokens_by_tier["connector"] == 0
        eng.cache_manager.check_invariants()
        later = b[64:96] + a[:10]
        assert eng.generate([later], SamplingParams(max_tokens=4))[0].token_ids == llama.reference_generate(later, 4)
        assert not eng.connector.loading  # (before: both offers' pages held for good)
        whole = prompts_for(llama, [500], seed=8)[0]  # needs nearly every page of the tier
        assert eng.generate([whole], SamplingParams(max_tokens=2))[0].token_ids == llama.reference_generate(whole, 2)


class GatedFetches(FileSystemStore):
    """A real filesystem store whose reads wait for ``go`` (a slow remote store)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.go = threading.Event()

    def get_many(self, keys, expected_sizes=None):
        self.go.wait(timeout=30)
        return super().get_many(keys, expected_sizes)


class RaisesOnceWhilePolled(StoreConnector):
    """The shipped connector over ``GatedFetches``; ``get_finished`` raises once when ``raise_once``
    is set (a transient connection error)."""

    raise_once = False

    def get_finished(self, finished_gen_ids, started_loading_ids):
        if self.raise_once:
            self.raise_once = False
            raise ConnectionError("transient error while polling")
        return super().get_finished(finished_gen_ids, started_loading_ids)


class CountsAsks(StoreConnector):
    """The shipped connector, counting its asks per request."""

    def __init__(self, store) -> None:
        super().__init__(store, load_async=True)
        self.asks: dict[int, int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.asks[request.request_id] = self.asks.get(request.request_id, 0) + 1
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def test_a_slow_store_fetch_lets_the_running_requests_go_on(llama, tmp_path):
    """A store slow to deliver a prefix (a remote store under load): the running requests go on,
    and one finishes, while it fetches on the connector's thread; then the prefix lands and its
    request runs from there. Before, the fetch ran in the ask, on the engine's thread: every
    running request waited for it."""
    shared, other = prompts_for(llama, [70, 30], seed=14)
    seed_store(llama, tmp_path, [shared])
    store = GatedFetches(tmp_path)
    with engine(llama, 200, StoreConnector(store, load_async=True)) as eng:
        running = eng.add_request(other, SamplingParams(max_tokens=8))
        eng.step()
        slow = eng.add_request(shared[:64] + [7, 8], SamplingParams(max_tokens=3))
        t0 = time.monotonic()
        outputs = run_until(eng, lambda outs: running in outs)
        assert time.monotonic() - t0 < 5.0 and slow in eng.connector.in_flight
        store.go.set()
        outputs = run_until(eng, lambda outs: slow in outs)
    assert outputs[slow].token_ids == llama.reference_generate(shared[:64] + [7, 8], 3)
    assert outputs[slow].reused_tokens_by_tier["connector"] == 64


def test_a_load_whose_pages_vanish_after_the_ask_is_recomputed(llama, tmp_path):
    """The store's values go (another process evicted them) between the ask, which found them, and
    the fetch: the load fails, nothing of it is committed, and the request is recomputed without
    asking the store again; its tokens are the model's, and the others' too."""
    prompt, other = prompts_for(llama, [100, 40], seed=12)
    seed_store(llama, tmp_path, [prompt])
    store = GatedFetches(tmp_path)
    conn = CountsAsks(store)
    with engine(llama, 200, conn) as eng:
        failed = eng.add_request(prompt, SamplingParams(max_tokens=4))
        beside = eng.add_request(other, SamplingParams(max_tokens=4))
        eng.step()
        assert failed in eng.connector.in_flight
        for value in tmp_path.rglob("*.page"):
            value.unlink()
        store.go.set()
        outputs = run_until(eng, lambda outs: {failed, beside} <= outs.keys())
        assert outputs[failed].token_ids == llama.reference_generate(prompt, 4)
        assert outputs[failed].reused_tokens_by_tier["connector"] == 0 and conn.asks[failed] == 1
        assert outputs[beside].token_ids == llama.reference_generate(other, 4)
        assert conn.stats().errors > 0 and conn.stats().loaded_pages == 0
        eng.cache_manager.check_invariants()


def test_a_load_given_up_by_a_raising_report_keeps_its_pages_until_reported(llama, tmp_path):
    """``get_finished`` raises while an asynchronous load is in flight: the load is given up on (its
    request recomputed), and the pages it loads into stay held until the connector reports it.
    Before, they were freed at once; the load's late write landed in another request's published
    pages (a later reuse: other tokens)."""
    a, b = prompts_for(llama, [70, 70], seed=31)
    seed_store(llama, tmp_path, [a])
    store = GatedFetches(tmp_path)
    conn = RaisesOnceWhilePolled(store, load_async=True)
    with engine(llama, 12, conn) as eng:
        conn.raise_once = True
        first = eng.generate([a], SamplingParams(max_tokens=1))[0]
        assert first.token_ids == llama.reference_generate(a, 1) and first.reused_tokens_by_tier["connector"] == 0
        assert eng.connector.loading
        assert eng.generate([b], SamplingParams(max_tokens=1))[0].token_ids == llama.reference_generate(b, 1)
        store.go.set()
        for load, _ in conn._waiting:  # the given-up fetch is over; its copy waits for a report
            load.staged.fetch.result(timeout=30)
        again = eng.generate([b], SamplingParams(max_tokens=4))[0]  # its first step lands the late load
        assert again.reused_tokens_by_tier["primary"] == 64
        assert again.token_ids == llama.reference_generate(b, 4)
        assert conn.stats().loaded_pages > 0 and not eng.connector.loading  # landed, reported: its pages went back


class ReportsInItsOwnWay(FileSystemConnector):
    """Follows vLLM's habits: ``get_finished`` answers None for nothing finished, a save is reported
    done at ``wait_for_save`` (before ``request_finished`` keeps the pages for it), and there is
    no ``close``."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.finished_saves: list[int] = []

    def request_finished(self, request, block_ids_by_layer_group) -> bool:
        saving = super().request_finished(request, block_ids_by_layer_group)
        if saving:
            self._saves.pop(request.request_id).result()  # written here; reported by the next poll
            self.finished_saves.append(request.request_id)
        return saving

    def get_finished(self, finished_gen_ids, started_loading_ids):
        _, loaded = super().get_finished(finished_gen_ids, started_loading_ids)
        saved, self.finished_saves = self.finished_saves, []
        return saved or None, loaded or None

    def __getattribute__(self, name):
        if name == "close":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_a_connector_reporting_in_its_own_way_is_served(llama, tmp_path):
    """None for "nothing finished" (before: a bare ``TypeError`` out of ``generate`` and every
    ``close``), a save reported at once (before: ignored, and ``generate`` waited for it for ever),
    no ``close`` method (before: ``AttributeError`` at close, and the connector stayed bound)."""
    prompts = prompts_for(llama, [70, 40], seed=4)
    conn = ReportsInItsOwnWay(tmp_path)
    eng = engine(llama, 200, conn)
    outputs: list = []
    call = threading.Thread(target=lambda: outputs.extend(eng.generate(prompts, SamplingParams(max_tokens=3))))
    call.start()
    call.join(20)
    assert not call.is_alive(), "generate waited for a save reported already"
    assert [o.token_ids for o in outputs] == [llama.reference_generate(p, 3) for p in prompts]
    eng.close()
    with engine(llama, 200, conn) as again:  # closed: free for another engine
        out = again.generate([prompts[0][:64] + [7]], SamplingParams(max_tokens=2))[0]
        assert out.reused_tokens_by_tier["connector"] == 64


def test_an_offer_delivered_is_never_handed_back(llama, tmp_path):
    """A request whose offer was loaded, then preempted (swapped out) and resumed: ``cancel_load``
    is for offers never delivered. Before, it was called for the loaded one too."""
    a, b = prompts_for(llama, [40, 40], seed=51)
    seed_store(llama, tmp_path, [a])
    conn = RecordingConnector(tmp_path)
    with engine(llama, 7, conn, host_blocks=40, policy="max_utilization", max_num_tokens=64) as eng:
        outs = eng.generate([b, a], SamplingParams(max_tokens=40))
        check_against_oracle(llama, [b, a], outs, 40)
        assert eng.scheduler.num_preemptions > 0
    loaded = outs[1].request_id
    assert outs[1].reused_tokens_by_tier["connector"] == 32
    assert conn.of("deliver", loaded) and not conn.of("cancel", loaded)


def test_a_running_request_aborted_is_reported_finished_to_the_connector(llama, tmp_path):
    """As vLLM tells its connector of every finished request: one aborted while running (its offer
    delivered) is reported, and the blocks it computed are saved. Before, the connector heard
    nothing of it (per-request state kept for ever)."""
    shared, other = prompts_for(llama, [70, 50], seed=81)
    seed_store(llama, tmp_path, [shared])
    conn = RecordingConnector(tmp_path)
    prompt = shared[:64] + other
    with engine(llama, 200, conn) as eng:
        request_id = eng.add_request(prompt, SamplingParams(max_tokens=10))
        while not conn.stats().loaded_pages:
            eng.step()  # delivered; in the step its load lands, the rest computed, a first token sampled
        eng.abort_request(request_id)
        assert conn.of("deliver", request_id) and conn.of("finished", request_id)
    with engine(llama, 200, FileSystemConnector(tmp_path)) as fresh:
        out = fresh.generate([prompt + [5]], SamplingParams(max_tokens=2))[0]
        assert out.reused_tokens_by_tier["connector"] == 112  # its 7 full blocks were saved
        assert out.token_ids == llama.reference_generate(prompt + [5], 2)


def test_every_request_that_ends_is_reported_finished_once(tmp_path):
    """As vLLM tells its connector of every request that ends, once, and lists it in the next
    step's ``finished_request_ids``: one that finished, one aborted while running (its pages
    shown), one aborted in the queue and one that failed (no pages: nothing of it saved). Before,
    only the first two were reported, and ``finished_request_ids`` was always empty."""
    from tests.test_engine_reliability import damaged_model  # (it imports this module)

    model = damaged_model(bad_token=7)
    done, running, queued, bad = (
        [t if t != 7 else 8 for t in p] for p in prompts_for(model, [40, 50, 30, 35], seed=82)
    )
    bad[20] = 7  # non-finite logits: the request fails
    conn = RecordingConnector(tmp_path)
    with engine(model, 200, conn) as eng:
        ids = [eng.add_request(p, SamplingParams(max_tokens=3)) for p in (done, running, bad)]
        outs = {o.request_id: o for o in eng.step()}  # the three run their prompts
        ids.append(eng.add_request(queued, SamplingParams(max_tokens=3)))
        eng.abort_request(ids[3])  # still in the queue
        eng.abort_request(ids[1])
        while eng.has_unfinished_requests():
            outs.update((o.request_id, o) for o in eng.step())
        assert outs[ids[0]].finish_reason == "length" and outs[ids[2]].finish_reason == "error"
        last = eng.generate([done], SamplingParams(max_tokens=1))[0].request_id  # one more step: ends told
        finished = {call[1]: call[2:] for call in conn.of("finished")}
        assert len(conn.of("finished")) == len(finished)  # each told once
        assert finished.keys() == {*ids, *outs, last}
        assert finished[ids[1]][1] > 0 and finished[ids[1]][0] >= len(running)  # its computed pages shown
        assert finished[ids[2]] == (0, 0) and finished[ids[3]] == (0, 0)  # no pages: nothing saved
        ended = [call[1] for call in conn.of("ended")]
        assert sorted(ended) == sorted(set(ended)) and set(ids) <= set(ended)
        eng.cache_manager.check_invariants()


def test_a_request_aborted_by_on_finish_ends_generate_with_its_abort(llama):
    """``on_finish`` of the first request to finish aborts the two others: ``generate`` returns."""
    prompts = prompts_for(llama, [30, 45, 50], seed=8)
    params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=20), SamplingParams(max_tokens=20)]

    def first_answer_is_enough(out) -> None:
        if out.finish_reason == "length" and len(out.token_ids) == 1:
            eng.abort_request(out.request_id + 1)
            eng.abort_request(out.request_id + 2)

    with engine(llama, 64, None) as eng:
        outs = eng.generate(prompts, params, on_finish=first_answer_is_enough)
        assert not eng.has_unfinished_requests()
    assert [o.finish_reason for o in outs] == ["length", "abort", "abort"]


def test_a_second_thread_driving_the_engine_is_refused_before_anything_changes(llama):
    """While one thread is inside ``generate``, another's ``generate`` or ``step`` raises
    ``CacheStateError`` at once and queues nothing. Before, both calls went on and failed with
    errors that named neither thread (``commit past capacity``, a closed cache)."""
    prompts = prompts_for(llama, [30, 45], seed=9)
    refused: list[BaseException] = []

    def second_thread(_out) -> None:
        def drive() -> None:
            for call in (lambda: eng.generate([prompts[0]], SamplingParams(max_tokens=2)), eng.step):
                try:
                    call()
                except kvtier.CacheStateError as exc:
                    refused.append(exc)

        worker = threading.Thread(target=drive)
        worker.start()
        worker.join()

    with engine(llama, 64, None) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=3), on_finish=second_thread)
        assert not eng.has_unfinished_requests()
        again = eng.generate([prompts[0]], SamplingParams(max_tokens=3))  # from this thread: served
    assert len(refused) == 4 and all("another thread" in str(exc) for exc in refused)
    assert [o.token_ids for o in outs] == [llama.reference_generate(p, 3) for p in prompts]
    assert again[0].token_ids == outs[0].token_ids


def test_sliding_window_block_ids_keep_bad_page_index_in_place(tmp_path):
    model = build_model("tiny-swa", "cpu", torch.float64, seed=0)
    prompt = prompts_for(model, [160], seed=6)[0]
    seed_store(model, tmp_path, [prompt])
    conn = RecordingConnector(tmp_path)
    with engine(model, 200, conn) as eng:
        out = eng.generate([prompt], SamplingParams(max_tokens=4))[0]
    check_against_oracle(model, [prompt], [out], 4)
    ((_, _, block_ids),) = conn.of("deliver")
    window_group = next(g.group_id for g in model.spec.groups if g.window)
    ids = block_ids[window_group]
    assert len(ids) == len(block_ids[1 - window_group]) == 11  # positional: one entry per block of capacity 164
    assert ids[0] != kvtier.BAD_PAGE_INDEX  # the sink block
    assert kvtier.BAD_PAGE_INDEX in ids[1:-3] and ids[-1] != kvtier.BAD_PAGE_INDEX
    assert out.reused_tokens_by_tier["connector"] == 159  # all ten blocks, up to the prompt's last token


def test_scopes_never_see_each_others_blocks(llama, tmp_path):
    prompt = prompts_for(llama, [80], seed=7)[0]
    with engine(llama, 200, FileSystemConnector(tmp_path)) as eng:
        eng.generate([prompt], SamplingParams(max_tokens=2), scope=kvtier.ReuseScope(lora_id=1))
    with engine(llama, 200, FileSystemConnector(tmp_path)) as eng:
        other = eng.generate([prompt], SamplingParams(max_tokens=2), scope=kvtier.ReuseScope(lora_id=2))[0]
        same = eng.generate([prompt], SamplingParams(max_tokens=2), scope=kvtier.ReuseScope(lora_id=1))[0]
    assert other.reused_tokens_by_tier.get("connector", 0) == 0
    assert same.reused_tokens_by_tier["connector"] == 79


def test_corrupted_block_file_is_a_miss(llama, tmp_path):
    prompt = prompts_for(llama, [100], seed=8)[0]
    seed_store(llama, tmp_path, [prompt])
    files = sorted(tmp_path.rglob("*.page"))
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    with engine(llama, 200, FileSystemConnector(tmp_path)) as eng:
        out = eng.generate([prompt], SamplingParams(max_tokens=4))[0]
    assert out.reused_tokens_by_tier.get("connector", 0) < 96  # stops before the damaged block
    assert out.token_ids == llama.reference_generate(prompt, 4)
    # That run wrote the damaged block again (before: it counted as present, so no save replaced it
    # and the prefix missed there for good).
    with engine(llama, 200, FileSystemConnector(tmp_path)) as eng:
        out = eng.generate([prompt], SamplingParams(max_tokens=4))[0]
    assert out.reused_tokens_by_tier["connector"] == 96
    assert out.token_ids == llama.reference_generate(prompt, 4)


class GatedStore(FileSystemStore):
    """A real filesystem store whose writes wait for a gate (to hold a save in flight)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.gate = threading.Event()

    def put_many(self, items):
        self.gate.wait(timeout=30)
        return super().put_many(items)


class LateChecksStore(FileSystemStore):
    """A real filesystem store whose existence checks answer ``delay_s`` late (a distant or loaded
    server), counted with the thread each ran on."""

    def __init__(self, path, delay_s: float) -> None:
        super().__init__(path)
        self.delay_s = delay_s
        self.checks_on: list[str] = []

    def contains_many(self, keys):
        self.checks_on.append(threading.current_thread().name)
        time.sleep(self.delay_s)
        return super().contains_many(keys)


def test_a_slow_store_stalls_the_engine_only_for_asks_and_says_so(llama, tmp_path, caplog):
    """A request's end asked the store which of its blocks it lacked on the engine's thread: 8
    requests whose prefixes were local hits cost 8 round trips there, uncounted in any warning.
    Now a save asks (on its own thread) only of blocks its request's ask did not look up, and a
    slow call on the engine's thread is logged."""
    store = LateChecksStore(tmp_path, delay_s=0.15)
    connector = StoreConnector(store)
    prompts = prompts_for(llama, [40, 50, 60], seed=31)
    with caplog.at_level(logging.WARNING, logger="kvtier"), engine(llama, 200, connector) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=2))
        check_against_oracle(llama, prompts, outs, 2)
        engine_thread = threading.current_thread().name
        asks = len(store.checks_on)
        # one existence check per ask, on the engine's thread; none at the ends: the asks found the
        # blocks missing, so the saves write them without asking again
        assert store.checks_on == [engine_thread] * len(prompts)
        assert connector.stats().stall_s < (asks + 1) * 0.15 + 0.5
        assert len(list(tmp_path.rglob("*.page"))) == sum((len(p) + 1) // TPB for p in prompts)
    slow = [r.getMessage() for r in caplog.records if "slow store calls" in r.getMessage()]
    assert slow and "existence check" in slow[0] and "load_async=True" in slow[0]


def test_a_prompt_served_whole_from_the_store_costs_no_save(llama, tmp_path):
    """Its ask read every block intact: nothing to ask or write at its end (before, the end asked
    the store again for every block, on the engine's thread)."""
    prompts = prompts_for(llama, [96, 80], seed=35)  # two generated tokens complete no block
    seed_store(llama, tmp_path, prompts)
    store = LateChecksStore(tmp_path, delay_s=0.0)
    connector = StoreConnector(store)
    with engine(llama, 200, connector) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=2))
        check_against_oracle(llama, prompts, outs, 2)
        assert [out.reused_tokens_by_tier["connector"] for out in outs] == [95, 79]
    assert store.checks_on == [threading.current_thread().name] * 2  # the asks only
    assert connector.stats().saved_pages == 0


class SlowReadsStore(FileSystemStore):
    """A real filesystem store whose existence checks and fetches answer ``delay_s`` late; ``asks``
    counts those made on the engine's (this) thread."""

    def __init__(self, path, delay_s: float) -> None:
        super().__init__(path)
        self.delay_s = delay_s
        self.asks = 0

    def _late(self) -> None:
        self.asks += threading.current_thread() is threading.main_thread()
        time.sleep(self.delay_s)

    def contains_many(self, keys):
        self._late()
        return super().contains_many(keys)

    def get_many(self, keys, expected_sizes=None):
        self._late()
        return super().get_many(keys, expected_sizes)


def test_a_store_slower_than_recomputing_is_not_asked_and_is_probed_again(llama, tmp_path, monkeypatch, caplog):
    """With the engine's prefill rate (``recompute_when_faster``, the default), a prompt whose check
    and fetch are expected to take longer than recomputing it is not asked for. Before, each ask
    paid the store's round trips whatever they cost: a store 0.4 s away made 16 short requests take
    24.9 s against 0.04 s without a connector."""
    prompts = prompts_for(llama, [100, 90, 80, 70, 85], seed=33)
    seed_store(llama, tmp_path, prompts)
    prompts, later = prompts[:4], prompts[4]
    store = SlowReadsStore(tmp_path, delay_s=0.05)
    connector = StoreConnector(store)
    with (
        caplog.at_level(logging.DEBUG, logger="kvtier.connector"),
        engine(llama, 200, connector, recompute_when_faster=True) as eng,
    ):
        first = eng.generate(prompts[:1], SamplingParams(max_tokens=2))  # nothing timed yet: asked
        assert first[0].reused_tokens_by_tier["connector"] == 96
        assert store.asks == 2  # a check and a fetch, timed
        rest = eng.generate(prompts[1:], SamplingParams(max_tokens=2))
        check_against_oracle(llama, prompts, first + rest, 2)
        assert store.asks == 2  # 0.1 s of store against a millisecond of recompute: not asked
        assert all(out.reused_tokens_by_tier["connector"] == 0 for out in rest)
        assert connector.stats().unasked_tokens == sum(min(len(p) // TPB * TPB, len(p) - 1) for p in prompts[1:])
        monkeypatch.setattr(store_speed, "PROBE_S", 0.0)  # long enough since the last timed call
        again = eng.generate([later], SamplingParams(max_tokens=2))
        assert store.asks == 4 and again[0].reused_tokens_by_tier["connector"] == 80
        check_against_oracle(llama, [later], again, 2)
    lines = [r.getMessage() for r in caplog.records if "not asked of the store" in r.getMessage()]
    assert len(lines) == 3 and "tokens/s" in lines[0]


def test_pages_stay_locked_while_a_save_is_in_flight(llama, tmp_path):
    store = GatedStore(tmp_path)
    with engine(llama, 200, StoreConnector(store)) as eng:
        request_id = eng.add_request(prompts_for(llama, [70], seed=9)[0], SamplingParams(max_tokens=2))
        while not eng.step():  # step() returns at once; generate() would wait for the save
            pass
        cache = eng.connector.saving[request_id]
        assert cache.state is kvtier.CacheState.ACTIVE  # held, locked in the primary tier
        store.gate.set()
        eng.close()
        assert cache.state is kvtier.CacheState.CLOSED
    assert len(list(tmp_path.rglob("*.page"))) == 4


REDIS_PEER = """
import sys, torch
sys.path.insert(0, {root!r})
import kvtier
from kvtier.connector import RedisConnector
from kvtier.engine import LLMEngine, SamplingParams
from kvtier.models import build_model
from tests.test_engine import prompts_for, page_bytes
model = build_model("tiny-llama", "cpu", torch.float64, seed=0)
config = kvtier.CacheConfig(16, [kvtier.PrimaryTier(page_bytes(model) * 200)])
with LLMEngine(model, config, connector=RedisConnector({url!r})) as eng:
    eng.generate(prompts_for(model, [120, 90], seed=10), SamplingParams(max_tokens=3))
print("saved")
"""


def test_redis_shares_blocks_across_processes(llama, redis_url):
    peer = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(REDIS_PEER.format(root=str(ROOT), url=redis_url))],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert peer.returncode == 0 and "saved" in peer.stdout, peer.stderr[-2000:]
    prompts = prompts_for(llama, [120, 90], seed=10)
    with engine(llama, 200, RedisConnector(redis_url)) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=5))
    check_against_oracle(llama, prompts, outs, 5)
    assert [o.reused_tokens_by_tier["connector"] for o in outs] == [112, 80]


def test_redis_stopped_mid_run_gives_misses_and_correct_tokens(llama, start_redis):
    server = start_redis()
    prompts = prompts_for(llama, [90, 70, 110], seed=11)
    conn = RedisConnector(server.url)
    with engine(llama, 200, conn) as eng:
        eng.generate(prompts[:1], SamplingParams(max_tokens=2))
        server.kill()
        outs = eng.generate(prompts, SamplingParams(max_tokens=4))  # asks and saves now fail
        check_against_oracle(llama, prompts, outs, 4)
        assert all(o.reused_tokens_by_tier.get("connector", 0) == 0 for o in outs)


def test_lower_tiers_keep_working_with_a_connector(llama, tmp_path):
    prompts = prompts_for(llama, [100, 100, 100, 100], seed=12)
    pb = page_bytes(llama)
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(pb * 16), kvtier.HostTier(pb * 40)])
    with LLMEngine(llama, config, connector=FileSystemConnector(tmp_path / "store")) as eng:
        eng.generate(prompts, SamplingParams(max_tokens=3))
        outs = eng.generate(prompts, SamplingParams(max_tokens=3))
        check_against_oracle(llama, prompts, outs, 3)
        stats = eng.cache_manager.stats()
        assert stats.demotions > 0 and stats.hit_tokens["host"] > 0
        eng.cache_manager.check_invariants()


class SlowWritesStore(FileSystemStore):
    """A real filesystem store whose writes answer ``delay_s`` late (a distant store); ``puts`` lists
    the keys of each write call."""

    def __init__(self, path, delay_s: float = 0.2) -> None:
        super().__init__(path)
        self.delay_s = delay_s
        self.puts: list[list[str]] = []

    def put_many(self, items):
        items = list(items)
        self.puts.append([key for key, _ in items])
        time.sleep(self.delay_s)
        return super().put_many(items)


def test_saves_of_requests_that_finish_together_are_written_in_batches(llama, tmp_path):
    """Eight requests sharing a two-block prefix finish in one step over a store 0.2 s away: their
    saves are written in a few calls, not one each, the shared blocks once, and every block reads
    back for a new engine. Before, each request's save made its own calls (a store 0.4 s away: 16
    requests took 6.5 s, of which about 4 s of saves)."""
    shared = prompts_for(llama, [32], seed=41)[0]
    prompts = [shared + tail for tail in prompts_for(llama, [40] * 8, seed=42)]
    store = SlowWritesStore(tmp_path)
    connector = StoreConnector(store)
    with engine(llama, 400, connector) as eng:
        check_against_oracle(llama, prompts, eng.generate(prompts, SamplingParams(max_tokens=1)), 1)
    written = [key for call in store.puts for key in call]
    assert len(store.puts) < len(prompts)
    assert len(written) == len(set(written)) == 2 + 8 * 2  # (72 tokens: four full blocks a prompt)
    assert connector.stats().saved_pages == len(written)
    with engine(llama, 400, FileSystemConnector(tmp_path)) as warm:
        outs = warm.generate(prompts, SamplingParams(max_tokens=1))
        check_against_oracle(llama, prompts, outs, 1)
        assert [out.reused_tokens_by_tier.get("connector", 0) for out in outs] == [64] * len(prompts)


class SavesOneAtATime(StoreConnector):
    """Each request's save is written before the next request's is queued, as when requests that
    share a prefix finish steps apart."""

    def request_finished(self, request, block_ids_by_layer_group) -> bool:
        saving = super().request_finished(request, block_ids_by_layer_group)
        if saving:
            self._saves[request.request_id].result()
        return saving


def test_a_block_saved_since_a_request_asked_is_not_written_again(llama, tmp_path):
    """Eight requests share a two-block prefix that none of them found when it asked; their saves
    are written one after another. The shared blocks are written once: a later save asks the store
    about a block this connector wrote after that save's ask, instead of writing it again. Before,
    each save wrote them (32 pages written for 18 blocks; the batching test above failed so when a
    save batch started only after an earlier one had ended)."""
    shared = prompts_for(llama, [32], seed=41)[0]
    prompts = [shared + tail for tail in prompts_for(llama, [40] * 8, seed=43)]
    store = SlowWritesStore(tmp_path, delay_s=0.0)
    connector = SavesOneAtATime(store)
    with engine(llama, 400, connector) as eng:
        check_against_oracle(llama, prompts, eng.generate(prompts, SamplingParams(max_tokens=1)), 1)
    written = [key for call in store.puts for key in call]
    assert len(store.puts) == len(prompts)  # one batch a request
    assert len(written) == len(set(written)) == 2 + 8 * 2
    assert connector.stats().saved_pages == len(written)
    reopened = FileSystemStore(tmp_path)
    assert reopened.contains_many(written) == [True] * len(written)
    reopened.close()
