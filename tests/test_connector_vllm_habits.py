"""Connectors written to vLLM's habits, served by the engine as vLLM would serve them.

A load that fails without raising, reported by block id (``get_block_ids_with_load_errors``); a
``request_finished`` answering vLLM's ``(delay_free_blocks, params)`` tuple; saves deferred to the
start of the next step (stepped without a forward, as vLLM steps its connector); a per-step
saver reading ``SchedulerOutput`` as vLLM fills it (the tokens each request computes in the step);
an ask answering None ("ask again later").
End to end on the CPU (float64): tokens always equal the dense oracle.
"""

from __future__ import annotations

import threading

import pytest
import torch

import kvtier
from kvtier.connector import FileSystemConnector, StoreConnector
from kvtier.engine import SamplingParams, connector_driver
from kvtier.models import build_model
from kvtier.pages import BAD_PAGE_INDEX
from tests.test_connector import engine, prompts_for, run_until, seed_store


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", "cpu", torch.float64, seed=0)


class FailsLoadsQuietly(StoreConnector):
    """The shipped connector over a filesystem store, whose loads fail without raising once
    ``failing`` is set (a transfer that lost its peer): the pages are zeroed, not filled, and the
    failure is told only by vLLM's report of the block ids.

    Asynchronous ``timing``: "lands at start" waits for the fetch in the deliver hook, so the load
    lands (and its failure is reported) in ``start_load_kv``; "reported late" reports each finished
    load one ``get_finished`` after the one whose failure report named its blocks."""

    def __init__(self, path, load_async: bool, timing: str = "") -> None:
        super().__init__(kvtier.connector.FileSystemStore(path), load_async=load_async)
        self.failing = True
        self.bad: set[int] = set()
        self.timing = timing
        self.held: list[int] = []

    def update_state_after_alloc(self, request, block_ids_by_layer_group):
        staged = self._staged.get(request.request_id)
        if self.timing == "lands at start" and staged is not None:
            staged.fetch.result()
        super().update_state_after_alloc(request, block_ids_by_layer_group)

    def _land(self, load, stream) -> bool:
        if not self.failing:
            return super()._land(load, stream)
        for (_, group), slot in zip(load.staged.pages, load.slots, strict=True):
            if slot != BAD_PAGE_INDEX:
                self._group(group).regions[0].as_tensor()[slot].zero_()
                self.bad.add(slot)
        return True

    def get_finished(self, finished_gen_ids, started_loading_ids):
        saved, loaded = super().get_finished(finished_gen_ids, started_loading_ids)
        if self.timing == "reported late":
            loaded, self.held = self.held, list(loaded)
        return saved, loaded

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self.bad = self.bad, set()
        return bad


@pytest.mark.parametrize(
    ("load_async", "timing"),
    [(False, ""), (True, ""), (True, "lands at start"), (True, "reported late")],
    ids=["sync", "async", "async-lands-at-start", "async-reported-late"],
)
def test_loads_failed_by_block_id_are_misses_for_their_request_and_the_next(llama, tmp_path, load_async, timing):
    """A load reported failed through ``get_block_ids_with_load_errors`` (vLLM's report; a
    synchronous load has no other way to fail without raising) is a miss, whenever the report
    comes before the load is reported finished: the request recomputes its prefix, and the next
    request sharing it reuses the recomputed pages. Before, the report was never read (then, read
    only for the loads finished in the same call): the zeroed pages were committed and published
    (other tokens for both)."""
    shared = prompts_for(llama, [70], seed=90)[0]
    seed_store(llama, tmp_path, [shared])
    first, second = shared[:64] + [3, 4, 5], shared[:64] + [7, 8]
    conn = FailsLoadsQuietly(tmp_path, load_async, timing)
    with engine(llama, 200, conn) as eng:
        out = eng.generate([first], SamplingParams(max_tokens=6))[0]
        assert out.token_ids == llama.reference_generate(first, 6)
        assert out.reused_tokens_by_tier["connector"] == 0
        out = eng.generate([second], SamplingParams(max_tokens=6))[0]
        assert out.token_ids == llama.reference_generate(second, 6)
        assert out.reused_tokens_by_tier["primary"] == 64
        eng.cache_manager.check_invariants()


class TellsLoadErrorsBadly(FailsLoadsQuietly):
    """Its report of failed block ids raises: every load that report covers is taken as failed."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        raise ConnectionError("lost the transfer agent")


def test_a_block_error_report_that_raises_fails_the_loads_it_covers(llama, tmp_path):
    shared = prompts_for(llama, [70], seed=91)[0]
    seed_store(llama, tmp_path, [shared])
    prompt = shared[:64] + [3]
    with engine(llama, 200, TellsLoadErrorsBadly(tmp_path, load_async=False)) as eng:
        out = eng.generate([prompt], SamplingParams(max_tokens=4))[0]
    assert out.token_ids == llama.reference_generate(prompt, 4)
    assert out.reused_tokens_by_tier["connector"] == 0


def assert_the_store_serves(llama, path, prompt: list[int], tokens: int) -> None:
    """A fresh engine over the store at ``path`` loads ``tokens`` of ``prompt``'s from it."""
    with engine(llama, 200, FileSystemConnector(path)) as fresh:
        out = fresh.generate([prompt + [5]], SamplingParams(max_tokens=2))[0]
    assert out.reused_tokens_by_tier["connector"] == tokens


class AnswersAsVllm(FileSystemConnector):
    """``request_finished`` answers vLLM's ``(delay_free_blocks, kv_transfer_params)``."""

    def request_finished(self, request, block_ids_by_layer_group):
        return super().request_finished(request, block_ids_by_layer_group), None


def in_thread(call, timeout_s: float = 20.0):
    """``call()`` on a daemon thread; its result, or AssertionError if it is still running after
    ``timeout_s`` (a hang)."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(call()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert box, f"still running after {timeout_s:g} s"
    return box[0]


def test_a_vllm_style_answer_of_request_finished_is_read_by_its_flag(llama, tmp_path):
    """``(False, None)`` frees the pages at once, ``(True, None)`` keeps them until the save is
    reported. Before, any tuple read as a save running: ``generate`` and ``close`` waited for a
    report that never came, the pages held."""
    prompts = prompts_for(llama, [40, 70], seed=92)
    eng = engine(llama, 200, AnswersAsVllm(tmp_path))
    try:
        outs = in_thread(lambda: eng.generate(prompts, SamplingParams(max_tokens=3)))  # saved: (True, None)
        assert [o.token_ids for o in outs] == [llama.reference_generate(p, 3) for p in prompts]
        again = in_thread(lambda: eng.generate(prompts, SamplingParams(max_tokens=3)))  # in the store: (False, None)
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
        assert not eng.connector.saving  # no cache held for a save
    finally:
        assert eng.close_within(5)
    assert_the_store_serves(llama, tmp_path, prompts[1], 64)


class SavesAtTheNextStep(FileSystemConnector):
    """Defers its saves to the start of the engine's next step (``start_load_kv``), as vLLM's
    offloading connector does, and frees its per-request state on ``finished_request_ids``."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.deferred: list[tuple] = []
        self.done: list[int] = []
        self.state: set[int] = set()  # per-request state, freed once the request is listed ended

    def build_connector_meta(self, scheduler_output):
        self.state.update(r.request_id for r in scheduler_output.scheduled)
        self.state.difference_update(scheduler_output.finished_request_ids)
        return super().build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids_by_layer_group):
        self.deferred.append((request, [list(ids) for ids in block_ids_by_layer_group]))
        return True

    def start_load_kv(self, stream):
        super().start_load_kv(stream)
        deferred, self.deferred = self.deferred, []
        for request, block_ids in deferred:
            super().request_finished(request, block_ids)  # the save starts now
            self.done.append(request.request_id)

    def get_finished(self, finished_gen_ids, started_loading_ids):
        saved, loaded = super().get_finished(finished_gen_ids, started_loading_ids)
        done, self.done = self.done, []
        return [*saved, *done], loaded


def test_a_connector_is_stepped_without_a_forward_once_the_batch_is_empty(llama, tmp_path):
    """With nothing left to compute, the engine still steps its connector (build, bind,
    ``start_load_kv``, ``wait_for_save``, reports), as vLLM does: saves it defers to a step's start
    run, and it hears of the requests that ended. Before, ``generate`` waited for ever for the
    last requests' saves, and the connector's per-request state stayed."""
    prompts = prompts_for(llama, [40, 70], seed=93)
    conn = SavesAtTheNextStep(tmp_path)
    eng = engine(llama, 200, conn)
    try:
        outs = in_thread(lambda: eng.generate(prompts, SamplingParams(max_tokens=3)))
        assert [o.token_ids for o in outs] == [llama.reference_generate(p, 3) for p in prompts]
        assert not conn.state and not eng.connector.saving
    finally:
        assert eng.close_within(5)
    assert_the_store_serves(llama, tmp_path, prompts[1], 64)


def a_stored_prefix_and_a_new_prompt(llama, path, seed: int) -> list[list[int]]:
    """Two prompts: one whose first 64 tokens another engine saved to the store at ``path``, and
    one the store has nothing of."""
    shared = prompts_for(llama, [70], seed=seed)[0]
    seed_store(llama, path, [shared])
    return [shared[:64] + [3, 4, 5], prompts_for(llama, [30], seed=seed + 1)[0]]


class RecordsSteps:
    """Per step that ran a forward: what ``SchedulerOutput`` listed (request, tokens computed,
    tokens scheduled) and what the forward computed (request, start, tokens); per request listed,
    how many tokens its view holds and where its chunk ends."""

    def __init__(self, eng, conn) -> None:
        self.steps: list[tuple[list, list]] = []
        self.listed: list = []
        self.known: list[tuple[int, int]] = []  # per listed request: tokens known, tokens up to its chunk's end
        build, run = conn.build_connector_meta, eng.runner.run

        def recording_build(output):
            self.listed = sorted(
                (r.request_id, r.num_computed_tokens, output.num_scheduled_tokens[r.request_id])
                for r in output.scheduled
            )
            self.known.extend(
                (len(r.all_token_ids), r.num_computed_tokens + output.num_scheduled_tokens[r.request_id])
                for r in output.scheduled
            )
            return build(output)

        def recording_run(batch):
            self.steps.append((self.listed, sorted((c.request.request_id, c.start, c.num_tokens) for c in batch)))
            return run(batch)

        conn.build_connector_meta = recording_build
        eng.runner.run = recording_run


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_the_step_output_lists_what_the_forward_computes(llama, tmp_path, load_async):
    """``SchedulerOutput`` lists each request the forward computes, from where: a loaded offer's
    tokens count as computed, and a request whose asynchronous load is delivered computes nothing
    in that step (it is not listed); each listed request's tokens run to its chunk's end, as vLLM's
    do (a saver hashes the blocks it stores). Before, a loaded request was listed from before its offer,
    and one loading asynchronously as computing: a per-step saver read by vLLM's meaning stored
    pages nothing had written (other tokens for a later request reusing them)."""
    prompts = a_stored_prefix_and_a_new_prompt(llama, tmp_path, seed=94)
    conn = StoreConnector(kvtier.connector.FileSystemStore(tmp_path), load_async=load_async)
    with engine(llama, 200, conn) as eng:
        recorder = RecordsSteps(eng, conn)
        outs = eng.generate(prompts, SamplingParams(max_tokens=3))
        assert [o.token_ids for o in outs] == [llama.reference_generate(p, 3) for p in prompts]
        assert outs[0].reused_tokens_by_tier["connector"] == 64
    assert recorder.steps
    for listed, computed in recorder.steps:
        assert listed == computed
    assert all(known == chunk_end for known, chunk_end in recorder.known)  # the chunk's tokens are known
    assert any(entry[1] == 64 for _, computed in recorder.steps for entry in computed)  # from the offer's end


class LooksUpLater(FileSystemConnector):
    """Answers None (vLLM's "ask again later") to the first ``later`` asks of each request, as a
    connector whose lookup runs in the background does; records the order requests are asked in."""

    def __init__(self, path, later: int) -> None:
        super().__init__(path)
        self.later = later
        self.asks: list[int] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.asks.append(request.request_id)
        if self.asks.count(request.request_id) <= self.later:
            return None, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def test_an_ask_answered_later_waits_for_the_answer_while_the_others_run(llama, tmp_path):
    """An ask answering None makes its request wait, asked again at later steps, while the request
    behind it runs; the answer, when it comes, is loaded. Before, None was taken for a failed ask:
    nothing loaded, a WARNING with a TypeError."""
    shared = prompts_for(llama, [70], seed=96)[0]
    seed_store(llama, tmp_path, [shared])
    prompts = [shared[:64] + [3, 4], prompts_for(llama, [20], seed=97)[0]]
    conn = LooksUpLater(tmp_path, later=3)
    with engine(llama, 200, conn) as eng:
        first, second = (eng.add_request(p, SamplingParams(max_tokens=2)) for p in prompts)
        outs = run_until(eng, lambda outs: {first, second} <= outs.keys())
        assert [outs[i].token_ids for i in (first, second)] == [llama.reference_generate(p, 2) for p in prompts]
        assert outs[first].reused_tokens_by_tier["connector"] == 64
        assert conn.asks.count(first) == 4 and conn.asks.index(second) < conn.asks.index(first, 1)
        eng.cache_manager.check_invariants()


def test_an_ask_answered_later_for_too_long_runs_without_an_offer(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(connector_driver, "ASYNC_LOAD_WAIT_S", 0.2)
    shared = prompts_for(llama, [70], seed=98)[0]
    seed_store(llama, tmp_path, [shared])
    prompt = shared[:64] + [3]
    with engine(llama, 200, LooksUpLater(tmp_path, later=10**9)) as eng:
        out = eng.generate([prompt], SamplingParams(max_tokens=2))[0]
        assert out.token_ids == llama.reference_generate(prompt, 2)
        assert out.reused_tokens_by_tier.get("connector", 0) == 0


class ReportsNoPageFailed(FileSystemConnector):
    """Lists ``BAD_PAGE_INDEX`` among failed block ids, as a connector copying its ids from the
    block table it was given may: it names no page."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        return {BAD_PAGE_INDEX}


def test_a_failed_block_id_that_names_no_page_fails_no_load(tmp_path):
    """Before, a sliding-window offer, whose stale blocks have ``BAD_PAGE_INDEX`` in its page
    slots, matched it: every such load was a miss (recomputed)."""
    model = build_model("tiny-swa", "cpu", torch.float64, seed=0)
    prompt = prompts_for(model, [400], seed=99)[0]
    seed_store(model, tmp_path, [prompt])
    with engine(model, 64, ReportsNoPageFailed(tmp_path)) as eng:
        out = eng.generate([prompt + [5]], SamplingParams(max_tokens=2))[0]
    assert out.token_ids == model.reference_generate(prompt + [5], 2)
    assert out.reused_tokens_by_tier["connector"] == 400


class BuildRaisesOnce(FileSystemConnector):
    """``build_connector_meta`` raises once, the first time it is shown a request that ended (a
    transient error); records every id it is shown as ended."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.raised = False
        self.ended: list[int] = []

    def build_connector_meta(self, scheduler_output):
        if scheduler_output.finished_request_ids and not self.raised:
            self.raised = True
            raise ConnectionError("transient error")
        self.ended += scheduler_output.finished_request_ids
        return super().build_connector_meta(scheduler_output)


def test_requests_listed_ended_in_a_build_that_raised_are_listed_again(llama, tmp_path):
    """Before, they were dropped: a connector freeing per-request state from the list kept theirs."""
    prompts = prompts_for(llama, [30, 40, 50], seed=100)
    conn = BuildRaisesOnce(tmp_path)
    with engine(llama, 200, conn) as eng:
        params = [SamplingParams(max_tokens=n) for n in (2, 4, 6)]  # they end at different steps
        outs = eng.generate(prompts, params)
        eng.generate([prompts[0]], SamplingParams(max_tokens=1))  # a later step lists the last ones
    assert conn.raised
    assert sorted(conn.ended) == sorted({*conn.ended}) and {o.request_id for o in outs} <= set(conn.ended)


class FreesStrictly(SavesAtTheNextStep):
    """Frees its per-request state as vLLM's connectors do, strictly (``set.remove``): its build
    raises for an ended request it never saw (one aborted in the queue), every time it is shown."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.seen: set[int] = set()
        self.builds = 0
        self.built: dict[int, object] = {}  # build number -> the metadata it returned
        self.saved_with: list[tuple[int, int | None]] = []  # (builds attempted, the build the save hooks saw)

    def build_connector_meta(self, scheduler_output):
        self.builds += 1
        self.seen.update(r.request_id for r in scheduler_output.scheduled)
        for request_id in scheduler_output.finished_request_ids:
            self.seen.remove(request_id)
        self.built[self.builds] = meta = super().build_connector_meta(scheduler_output)
        return meta

    def save_kv_layer(self, layer_id, stream):
        seen = next((n for n, meta in self.built.items() if meta is self._meta), None)
        self.saved_with.append((self.builds, seen))


def test_a_build_that_keeps_raising_on_an_ended_request_stalls_nothing(llama, tmp_path):
    """An ended request a build raises on is listed once more, then dropped: the later builds
    return, the saves deferred to a step's start run, ``generate`` returns, and the save hooks of
    a step whose build raised are not run on an older step's metadata. Before, the request was
    listed at every step for ever: every build raised, the deferred saves never started
    (``generate`` waited for ever) and the save hooks ran on the last good build's block ids."""
    prompts = prompts_for(llama, [40, 70], seed=101)
    conn = FreesStrictly(tmp_path)
    eng = engine(llama, 200, conn)
    try:
        eng.abort_request(eng.add_request(prompts[0], SamplingParams(max_tokens=2)))  # never seen by the connector
        outs = in_thread(lambda: eng.generate(prompts, SamplingParams(max_tokens=3)))
        assert [o.token_ids for o in outs] == [llama.reference_generate(p, 3) for p in prompts]
        assert conn.saved_with and all(builds == meta for builds, meta in conn.saved_with)
    finally:
        assert eng.close_within(5)
    assert_the_store_serves(llama, tmp_path, prompts[1], 64)


class AnswersLaterThenRaises(FileSystemConnector):
    """Answers None to its first ask, then raises (a lookup service that went away)."""

    asks = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.asks += 1
        if self.asks == 1:
            return None, False
        raise ConnectionError("lookup service gone")


def test_an_ask_that_raises_after_a_none_leaves_a_later_allocation_its_own_wait(llama, tmp_path):
    """Before, the first None's start time stayed: after a preemption for recompute, the new
    allocation's first None counted as waited for already (no offer, a TimeoutError logged)."""
    prompt = prompts_for(llama, [40], seed=102)[0]
    conn = AnswersLaterThenRaises(tmp_path)
    with engine(llama, 200, conn) as eng:
        request_id = eng.add_request(prompt, SamplingParams(max_tokens=3))
        request = eng._requests[request_id]
        while conn.asks < 2:
            eng.step()
        assert request.asked_later_since is None and not request.ask_later
        outs = run_until(eng, lambda outs: request_id in outs)
        assert outs[request_id].token_ids == llama.reference_generate(prompt, 3)


class SavesEachStep(FailsLoadsQuietly):
    """Fails its synchronous loads quietly (by block id) and keeps, per step whose save hooks ran,
    what ``recorder`` (``RecordsSteps``) recorded of it: a per-step saver (as vLLM's example storage
    connector) stores the pages of the requests the step's metadata lists."""

    def __init__(self, path) -> None:
        super().__init__(path, load_async=False)
        self.recorder: RecordsSteps | None = None
        self.saved_steps: list[tuple[list, list]] = []

    def save_kv_layer(self, layer_id, stream):
        if layer_id == 0:
            self.saved_steps.append(self.recorder.steps[-1])
        super().save_kv_layer(layer_id, stream)


def test_no_step_saves_pages_a_failed_load_left_unwritten(llama, tmp_path):
    """A synchronous load that fails (reported by block id once the step's metadata is bound) takes
    its request out of the forward, which computes the others: the save hooks of that step do not
    run, since the metadata lists a request whose pages nothing wrote (a per-step saver would store
    them under the prompt's keys). Before, they ran."""
    prompts = a_stored_prefix_and_a_new_prompt(llama, tmp_path, seed=96)
    conn = SavesEachStep(tmp_path)
    with engine(llama, 200, conn) as eng:
        conn.recorder = RecordsSteps(eng, conn)
        outs = eng.generate(prompts, SamplingParams(max_tokens=3))
    assert [o.token_ids for o in outs] == [llama.reference_generate(p, 3) for p in prompts]
    assert outs[0].reused_tokens_by_tier["connector"] == 0
    assert len(conn.saved_steps) < len(conn.recorder.steps)  # the step of the failed load saved nothing
    for listed, computed in conn.saved_steps:
        assert listed == computed


class RaisesOnTheSecondDelivery(StoreConnector):
    """``update_state_after_alloc`` raises for the second offer of a step, after the first was
    recorded; records the requests whose loads land."""

    def __init__(self, path) -> None:
        super().__init__(kvtier.connector.FileSystemStore(path))
        self.delivered = 0
        self.landed: list[int] = []

    def update_state_after_alloc(self, request, block_ids_by_layer_group):
        self.delivered += 1
        if self.delivered == 2:
            raise RuntimeError("lost the scheduler's bookkeeping")
        super().update_state_after_alloc(request, block_ids_by_layer_group)

    def _land(self, load, stream) -> bool:
        self.landed.append(load.request_id)
        return super()._land(load, stream)


def test_a_load_recorded_in_a_step_that_failed_never_lands(llama, tmp_path):
    """Offers delivered in a step whose hooks raised are handed back (``cancel_load``): a load the
    connector recorded for one is dropped, not copied at a later step into pages its request no
    longer holds (they may hold another request's KV by then). Before, it landed at the next step."""
    shared = prompts_for(llama, [70], seed=98)[0]
    seed_store(llama, tmp_path, [shared])
    prompts = [shared[:64] + [3, 4, 5], shared[:64] + [6, 7]]
    conn = RaisesOnTheSecondDelivery(tmp_path)
    with engine(llama, 200, conn) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=3))
        eng.cache_manager.check_invariants()
    assert [o.token_ids for o in outs] == [llama.reference_generate(p, 3) for p in prompts]
    assert conn.delivered == 2
    assert conn.landed == []


class AbortsAgain(FileSystemConnector):
    """``request_finished`` aborts the request it is told of (a connector tidying up after itself);
    counts the calls per request."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.eng = None
        self.told: list[int] = []

    def request_finished(self, request, block_ids_by_layer_group):
        self.told.append(request.request_id)
        self.eng.abort_request(request.request_id)
        return super().request_finished(request, block_ids_by_layer_group)


def test_a_hook_aborting_a_request_it_is_told_ended_tells_nothing_twice(llama, tmp_path):
    """A request aborted by the user while it waits is told ended once, even though
    ``request_finished`` aborts it again. Before, the nested abort found it still queued and told it
    again, recursively, until Python's recursion limit."""
    prompt = prompts_for(llama, [40], seed=99)[0]
    conn = AbortsAgain(tmp_path)
    with engine(llama, 200, conn) as eng:
        conn.eng = eng
        request_id = eng.add_request(prompt, SamplingParams(max_tokens=2))
        eng.abort_request(request_id)
        assert conn.told == [request_id]
        out = eng.generate([prompt], SamplingParams(max_tokens=2))[0]
        assert out.token_ids == llama.reference_generate(prompt, 2)


class AbortsWhileIdle(SavesAtTheNextStep):
    """Aborts ``victim`` from ``build_connector_meta`` of a step without a forward (its lookup failed
    for good, say); records the ids each step lists ended."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.eng = None
        self.victim: int | None = None
        self.listed: list[int] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id == self.victim:
            return None, False  # "ask again later": it waits in the queue
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output):
        self.listed += scheduler_output.finished_request_ids
        if not scheduler_output.scheduled and self.victim is not None:
            self.eng.abort_request(self.victim)
        return super().build_connector_meta(scheduler_output)


def test_a_request_aborted_by_a_hook_during_a_step_without_a_forward_is_listed_ended(llama, tmp_path):
    """An abort from a hook while ``generate`` waits for saves (the engine steps the connector
    without a forward, outside a step) is listed in the next step's ``finished_request_ids``.
    Before, the build that was running dropped it with the ids it listed."""
    prompts = prompts_for(llama, [40, 40], seed=100)
    conn = AbortsWhileIdle(tmp_path)
    with engine(llama, 200, conn) as eng:
        conn.eng = eng
        conn.victim = eng.add_request(prompts[0], SamplingParams(max_tokens=2))
        out = in_thread(lambda: eng.generate([prompts[1]], SamplingParams(max_tokens=2)))[0]
        assert out.token_ids == llama.reference_generate(prompts[1], 2)
        eng.step()
    assert conn.listed.count(conn.victim) == 1
    assert conn.listed.count(out.request_id) == 1


class CannotHandBack(StoreConnector):
    """After an offer is delivered its next two builds raise (a transient outage), and so does
    ``cancel_load``, before it drops the load it recorded; records the requests whose loads land."""

    def __init__(self, path) -> None:
        super().__init__(kvtier.connector.FileSystemStore(path))
        self.builds_failing = 0
        self.landed: list[int] = []

    def update_state_after_alloc(self, request, block_ids_by_layer_group):
        super().update_state_after_alloc(request, block_ids_by_layer_group)
        self.builds_failing = 2

    def build_connector_meta(self, scheduler_output):
        if self.builds_failing:
            self.builds_failing -= 1
            raise ConnectionError("the store's scheduler side is unreachable")
        return super().build_connector_meta(scheduler_output)

    def cancel_load(self, request, start, end):
        raise ConnectionError("the store's scheduler side is unreachable")

    def _land(self, load, stream) -> bool:
        self.landed.append(load.request_id)
        return super()._land(load, stream)


def test_a_load_a_connector_could_not_take_back_lands_in_pages_nobody_else_holds(llama, tmp_path):
    """A synchronous offer delivered in a step whose build raised, handed back by a ``cancel_load``
    that raises too, keeps its request's pages apart until the connector's next ``start_load_kv``
    returns: the load it recorded lands there, not in another request's KV. Before, the pages were
    freed at once; a request computed into them before the load landed got other tokens."""
    shared, other = prompts_for(llama, [64, 70], seed=101)
    seed_store(llama, tmp_path, [shared + [1]])
    conn = CannotHandBack(tmp_path)
    with engine(llama, 40, conn, recompute_when_faster=False) as eng:
        first = eng.add_request(shared + [3], SamplingParams(max_tokens=4))
        eng.step()  # delivered; the build and the hand-back raise
        eng.abort_request(first)
        second = eng.add_request(other, SamplingParams(max_tokens=8))
        outs = run_until(eng, lambda done: second in done)
        assert outs[second].token_ids == llama.reference_generate(other, 8)
        eng.cache_manager.check_invariants()
    assert conn.landed == [first]
