"""The engine never stalls, never lets one bad request poison the others, and loses no save.

- A memory-bound ``max_utilization`` run with only a primary tier finishes (recompute preemption),
  token-identical to the dense oracle.
- A request that can never be served is refused before anything is queued (``ValueError``
  naming the field), in O(1) however large ``max_tokens`` is; one that fails while served
  finishes with ``finish_reason="error"`` and frees its pages while the others go on.
- ``generate`` returns once its saves are on the store; an engine never closed is closed at
  interpreter exit, so a script that forgets ``close()`` loses neither its saves nor its disk tier.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtier
from kvtier.connector import FileSystemConnector, FileSystemStore, RedisConnector, StoreConnector
from kvtier.engine import LLMEngine, SamplingParams, SchedulerConfig
from kvtier.models import build_model
from tests.test_connector import GatedStore
from tests.test_engine import TPB, check_against_oracle, engine, page_bytes, prompts_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", "cpu", torch.float64, seed=0)


def lengths(seed: int, count: int, low: int, high: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (count,), generator=g).tolist()


# -- a stalled engine ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_max_utilization_with_only_a_primary_tier_recomputes_instead_of_stalling(llama, seed):
    # 30 prompts of 20-100 tokens in a 64-page primary tier: preempted requests used to keep
    # their pages (nothing below to demote them to) until nothing could run at all.
    prompts = prompts_for(llama, lengths(seed, 30, 20, 100), seed=100 + seed)
    eng = engine(llama, primary_blocks=64, policy="max_utilization")
    outs = eng.generate(prompts, SamplingParams(max_tokens=8))
    assert [o.finish_reason for o in outs] == ["length"] * 30
    check_against_oracle(llama, prompts, outs, 8)
    # every preemption closed its cache (and so did waiting requests' caches that pinned pages)
    assert eng.scheduler.num_preemptions > 0 and eng.scheduler.num_recomputes >= eng.scheduler.num_preemptions
    eng.cache_manager.check_invariants()
    eng.close()


def _steps_until_done(eng: LLMEngine, arrivals: dict[int, list[tuple[list[int], int, int]]], limit: int):
    """Step ``eng``, adding each step's arrivals (prompt, max_tokens, priority) first, until every
    request finished or ``limit`` steps passed. Returns ({id: output}, {id: (prompt, max_tokens)})."""
    outputs, asked = {}, {}
    for step in range(limit):
        for prompt, max_tokens, priority in arrivals.get(step, []):
            request_id = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens), priority=priority)
            asked[request_id] = (prompt, max_tokens)
        outputs.update((o.request_id, o) for o in eng.step())
        if step >= max(arrivals) and not eng.has_unfinished_requests():
            break
    return outputs, asked


def test_a_running_request_takes_the_pages_waiting_caches_pin_without_a_lower_tier():
    """A waiting request whose admission failed keeps its cache suspended; with no tier below the
    primary one its pages cannot move. A running request that needs them closes such caches
    before it preempts anyone. Before, it preempted itself, was admitted again, recomputed and
    preempted itself again, for ever (491 preemptions in 2,000 steps)."""
    model = build_model("tiny-hybrid", "cpu", torch.float64, seed=0)
    eng = engine(model, primary_blocks=11, policy="max_utilization", max_num_tokens=33, max_batch_size=3)
    g = torch.Generator().manual_seed(0)
    x, a, b = (torch.randint(0, model.vocab_size, (n,), generator=g).tolist() for n in (1, 111, 176))
    outputs, asked = _steps_until_done(eng, {0: [(x, 40, 80), (a, 100, 0), (b, 1, 10)]}, limit=1000)
    assert not eng.has_unfinished_requests()
    for request_id, (prompt, max_tokens) in asked.items():
        assert outputs[request_id].token_ids == model.reference_generate(prompt, max_tokens)
    assert eng.scheduler.num_preemptions < 10
    eng.cache_manager.check_invariants()
    eng.close()


def test_the_reuse_of_a_request_whose_first_cache_never_ran_is_reported():
    """A request's first cache is blocked at resume and then closed to unblock the queue: the reuse
    its next cache reads is the request's. Before, the output reported none."""
    model = build_model("tiny-swa", "cpu", torch.float64, seed=0)
    pb = page_bytes(model)
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(21 * pb), kvtier.HostTier(4 * pb)], snapshot_interval_blocks=1)
    scheduler = SchedulerConfig(
        policy="max_utilization",
        max_num_tokens=256,
        chunked_prefill=False,
        prefetch_policy="off",
        recompute_when_faster=False,
    )
    eng = LLMEngine(model, config, scheduler)
    g = torch.Generator().manual_seed(1)
    random = [torch.randint(0, model.vocab_size, (n,), generator=g).tolist() for n in (39, 232, 40, 124)]
    shared = random[0]
    arrivals = {0: [(random[1], 100, 35)], 2: [(shared + random[2], 16, 10)], 7: [(shared + random[3], 40, 0)]}
    outputs, asked = _steps_until_done(eng, arrivals, limit=3000)
    for request_id, (prompt, max_tokens) in asked.items():
        out = outputs[request_id]
        assert out.token_ids == model.reference_generate(prompt, max_tokens)
        assert out.num_computed_prompt_tokens + sum(out.reused_tokens_by_tier.values()) >= out.num_prompt_tokens
    assert sum(outputs[2].reused_tokens_by_tier.values()) == 39
    eng.close()


@pytest.mark.parametrize("name", ["tiny-swa", "tiny-hybrid"])
def test_recompute_preemption_reuses_what_the_victim_published(name):
    model = build_model(name, "cpu", torch.float64, seed=1)
    prompts = prompts_for(model, lengths(7, 8, 20, 90), seed=8, shared=24)
    eng = engine(model, primary_blocks=20, policy="max_utilization", max_num_tokens=96)
    outs = eng.generate(prompts, SamplingParams(max_tokens=12))
    check_against_oracle(model, prompts, outs, 12)
    assert eng.scheduler.num_recomputes > 0
    eng.cache_manager.check_invariants()
    eng.close()


def test_swapped_out_requests_that_fill_every_tier_are_recomputed(llama):
    # A host tier of 2 pages cannot take the suspended requests' pages: once nothing runs, the
    # waiting requests' caches are closed, and they are recomputed.
    prompts = prompts_for(llama, lengths(3, 10, 40, 100), seed=9)
    eng = engine(llama, primary_blocks=16, host_blocks=2, policy="max_utilization")
    outs = eng.generate(prompts, SamplingParams(max_tokens=24))
    check_against_oracle(llama, prompts, outs, 24)
    assert eng.scheduler.num_recomputes > 0 and eng.scheduler.num_preemptions > eng.scheduler.num_recomputes
    eng.cache_manager.check_invariants()
    eng.close()


# -- bad requests ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("seed", {"seed": "x"}),
        ("seed", {"seed": -1}),
        ("seed", {"seed": 1 << 64}),
        ("seed", {"seed": True}),
        ("seed", {"seed": 1.5}),
        ("temperature", {"temperature": "hot"}),
        ("temperature", {"temperature": math.nan}),
        ("temperature", {"temperature": math.inf}),
        ("temperature", {"temperature": -0.5}),
        ("max_tokens", {"max_tokens": 2.0}),
        ("max_tokens", {"max_tokens": True}),
        ("stop_token_ids", {"stop_token_ids": ["a"]}),
        ("stop_token_ids", {"stop_token_ids": [-1]}),
        ("stop_token_ids", {"stop_token_ids": [1.5]}),
        ("stop_token_ids", {"stop_token_ids": "12"}),
        ("stop_token_ids", {"stop_token_ids": 7}),
    ],
)
def test_sampling_params_of_the_wrong_type_or_range_are_refused(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_sampling_params_are_kept():
    import numpy as np

    params = SamplingParams(max_tokens=3, temperature=1, seed=(1 << 64) - 1, stop_token_ids=[np.int64(5), 0])
    assert params.stop_token_ids == (5, 0) and params.seed == (1 << 64) - 1
    with pytest.raises(ValueError, match="chunked_prefill"):
        SchedulerConfig(chunked_prefill="yes")


def bad_prompts(model) -> list[tuple[str, list, SamplingParams]]:
    """(what the error names, prompt, params) for requests that can never be served by ``engine(model, 40)``."""
    ok = SamplingParams(max_tokens=4)
    return [
        ("empty", [], ok),
        ("vocabulary", [1, 2, model.vocab_size], ok),
        ("vocabulary", [1, 2, 1 << 40], ok),
        (r"0\.\.2\*\*64", [1, -2, 3], ok),
        ("integer", [1, "2", 3], ok),
        ("integer", [1, 2.5], ok),
        ("bools", [1, True, 3], ok),
        ("ordered", {5: 1, 6: 2}, ok),  # a dict's keys, a set's arbitrary order: not a prompt
        ("ordered", {5, 6, 7}, ok),
        ("bytearray", bytearray(b"\x05\x06"), ok),
        ("max_tokens", [1, 2, 3], SamplingParams(max_tokens=10**12)),
        ("max_tokens", list(range(200)) * 4, ok),  # 800 tokens: 50 pages, the primary tier has 40
    ]


@pytest.mark.timeout(120)
def test_generate_refuses_a_bad_request_before_queuing_anything(llama):
    eng = engine(llama, primary_blocks=40)
    good = prompts_for(llama, [30, 45], seed=11)
    for what, prompt, params in bad_prompts(llama):
        with pytest.raises((ValueError, TypeError), match=what) as info:
            eng.generate([good[0], prompt], [SamplingParams(max_tokens=4), params])
        assert "prompts[1]" in str(info.value)
        assert not eng.has_unfinished_requests(), f"{what}: the good request stayed queued"
        with pytest.raises((ValueError, TypeError), match=what):
            eng.add_request(prompt, params)
        assert not eng.has_unfinished_requests()
    outs = eng.generate(good, SamplingParams(max_tokens=4))  # the engine is not poisoned
    check_against_oracle(llama, good, outs, 4)
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.generate(good, [SamplingParams(), {"max_tokens": 3}])
    with pytest.raises(TypeError, match="scope"):
        eng.generate(good, scope="tenant-a")
    with pytest.raises(ValueError, match="priority"):
        eng.add_request(good[0], SamplingParams(), priority=101)
    assert not eng.has_unfinished_requests()
    eng.close()


def test_a_prompt_longer_than_a_step_without_chunked_prefill_is_refused(llama):
    eng = engine(llama, primary_blocks=40, max_num_tokens=64, chunked_prefill=False)
    good, long = prompts_for(llama, [30, 65], seed=12)
    with pytest.raises(ValueError, match="max_num_tokens"):
        eng.generate([good, long])
    assert not eng.has_unfinished_requests()
    check_against_oracle(llama, [good], eng.generate([good], SamplingParams(max_tokens=3)), 3)
    eng.close()


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_the_largest_request_that_fits_runs_and_one_token_more_is_refused(llama, policy):
    eng = engine(llama, primary_blocks=8, policy=policy)  # 8 pages of 16 tokens
    prompt = prompts_for(llama, [100], seed=13)[0]
    fits = SamplingParams(max_tokens=8 * TPB - len(prompt) + 1)  # prompt + max_tokens - 1 = 128 tokens
    check_against_oracle(llama, [prompt], eng.generate([prompt], fits), fits.max_tokens)
    with pytest.raises(ValueError, match="needs 9 pages"):
        eng.generate([prompt], SamplingParams(max_tokens=fits.max_tokens + 1))
    eng.close()


def damaged_model(bad_token: int):
    """tiny-llama whose embedding of ``bad_token`` is infinite: any sequence holding it gives NaN."""
    model = build_model("tiny-llama", "cpu", torch.float64, seed=0)
    model.model.embed_tokens.weight.data[bad_token] = math.inf
    return model


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_that_fails_while_served_finishes_with_an_error_and_the_others_go_on(temperature):
    model = damaged_model(bad_token=7)
    ok = prompts_for(model, [40, 70, 25], seed=14)
    ok = [[t if t != 7 else 8 for t in p] for p in ok]
    expected = [model.reference_generate(p, 6) for p in ok]
    assert all(7 not in out for out in expected)
    bad = ok[1][:30] + [7] + ok[1][30:]
    eng = engine(model, primary_blocks=30)
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=temperature, seed=5)]
    outs = eng.generate([ok[0], bad, ok[1], ok[2]], [params[0], params[1], params[0], params[0]])
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert "non-finite logits" in outs[1].error and outs[1].token_ids == [] and math.isnan(outs[1].ttft_s)
    assert [outs[0].token_ids, outs[2].token_ids, outs[3].token_ids] == expected
    assert outs[0].error is None
    assert not eng.has_unfinished_requests()
    # Its pages were freed: a request needing the whole primary tier still runs.
    whole = prompts_for(model, [30 * TPB - 3], seed=15)[0]
    whole = [t if t != 7 else 8 for t in whole]
    assert eng.generate([whole], SamplingParams(max_tokens=2))[0].finish_reason == "length"
    eng.cache_manager.check_invariants()
    eng.close()


@pytest.mark.parametrize("max_num_tokens", [256, 16], ids=["one-chunk", "chunked"])
def test_a_failed_requests_pages_are_never_served_to_the_requests_after_it(max_num_tokens):
    """Before: a chunk was committed before its logits were checked, and a non-finite value spreads
    to every position of its chunk through attention: a later good request reusing the prefix was
    served those pages and failed too (and after a restart, from disk)."""
    model = damaged_model(bad_token=7)
    good = [t if t != 7 else 8 for t in prompts_for(model, [40], seed=16)[0]]
    expected = model.reference_generate(good, 4)
    eng = engine(model, primary_blocks=60, max_num_tokens=max_num_tokens)
    bad = good[:20] + [7] + good[20:]
    assert eng.generate([bad], SamplingParams(max_tokens=4))[0].finish_reason == "error"
    out = eng.generate([good], SamplingParams(max_tokens=4))[0]
    assert out.token_ids == expected
    # Chunks before the failing one are kept: 16 tokens when the prompt goes in chunks of 16.
    assert sum(out.reused_tokens_by_tier.values()) == (16 if max_num_tokens == 16 else 0)
    eng.cache_manager.check_invariants()
    eng.close()


def test_reuse_counts_leave_out_disk_pages_that_fail_their_checksum(llama, tmp_path):
    """The resume gives up pages whose bytes fail their checksum; the request counts what it kept."""
    prompt = prompts_for(llama, [120], seed=2)[0]
    with engine(llama, 64, disk_blocks=64, path=tmp_path) as first:
        first.generate([prompt], SamplingParams(max_tokens=4))
    for pages in tmp_path.rglob("group*.pages"):  # a byte in every 256 flipped: every page damaged
        data = bytearray(pages.read_bytes())
        data[::256] = bytes(b ^ 0xFF for b in data[::256])
        pages.write_bytes(bytes(data))
    with engine(llama, 64, disk_blocks=64, path=tmp_path) as second:
        out = second.generate([prompt], SamplingParams(max_tokens=4))[0]
        assert second.cache_manager.stats().checksum_failures > 0
    assert out.token_ids == llama.reference_generate(prompt, 4)
    assert sum(out.reused_tokens_by_tier.values()) + out.num_computed_prompt_tokens == len(prompt)
    assert out.reused_tokens_by_tier["disk"] == 0


def test_a_request_that_cannot_run_even_alone_fails_and_the_others_finish(llama):
    # Pages locked by a cache the engine does not own leave too little room for the long request.
    eng = engine(llama, primary_blocks=40)
    outside = eng.cache_manager.create_cache(prompts_for(llama, [30 * TPB], seed=16)[0])
    assert outside.resume() and outside.resize(30 * TPB)
    short, long = prompts_for(llama, [20, 170], seed=17)
    outs = eng.generate([long, short], SamplingParams(max_tokens=4))
    assert [o.finish_reason for o in outs] == ["error", "length"]
    assert "cannot run even alone" in outs[0].error
    check_against_oracle(llama, [short], outs[1:], 4)
    outside.close()
    check_against_oracle(llama, [long], eng.generate([long], SamplingParams(max_tokens=4)), 4)
    eng.cache_manager.check_invariants()
    eng.close()


def test_an_exception_inside_generate_leaves_nothing_queued(llama):
    eng = engine(llama, primary_blocks=60, max_batch_size=1)
    prompts = prompts_for(llama, [30, 40, 50], seed=18)

    def explode(output):
        raise RuntimeError("the caller's callback failed")

    with pytest.raises(RuntimeError, match="callback"):
        eng.generate(prompts, SamplingParams(max_tokens=3), on_finish=explode)
    assert not eng.has_unfinished_requests()
    check_against_oracle(llama, prompts, eng.generate(prompts, SamplingParams(max_tokens=3)), 3)
    eng.cache_manager.check_invariants()
    eng.close()


def test_a_closed_engine_refuses_work(llama):
    eng = engine(llama, primary_blocks=20)
    eng.add_request(prompts_for(llama, [10])[0], SamplingParams(max_tokens=4))
    eng.step()  # running when the engine closes: dropped, not left unfinished for ever
    eng.close()
    eng.close()  # idempotent
    assert not eng.has_unfinished_requests()
    with pytest.raises(kvtier.CacheStateError, match="closed"):
        eng.generate(prompts_for(llama, [10]))
    with pytest.raises(kvtier.CacheStateError, match="closed"):
        eng.step()


def test_an_engine_copied_or_pickled_is_a_type_error_and_serves_on(llama):
    eng = engine(llama, primary_blocks=20)
    for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=r"LLMEngine cannot be copied or pickled.*in each process"):
            duplicate(eng)
    prompts = prompts_for(llama, [10, 12], seed=5)
    check_against_oracle(llama, prompts, eng.generate(prompts, SamplingParams(max_tokens=3)), 3)
    eng.close()


# -- resize in O(1) -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-swa"])
def test_resize_beyond_the_tiers_fails_at_once(name):
    model = build_model(name, "cpu", torch.float64)
    pb = page_bytes(model)
    with kvtier.KVCacheManager(model.spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(20 * pb)])) as mgr:
        cache = mgr.create_cache(list(range(1, 40)))
        assert cache.resume() and cache.resize(40)
        for capacity in (10**12, 10**15):
            assert not cache.resize(capacity)
            assert not cache.resize(capacity, history=40)
        assert (cache.capacity, cache.history_length) == (40, 0)
        assert cache.resize(10 * TPB)  # what fits still does
        mgr.check_invariants()


@pytest.mark.timeout(60)
def test_a_huge_max_tokens_is_refused_at_once(llama):
    for policy in ("guaranteed_no_evict", "max_utilization"):
        eng = engine(llama, primary_blocks=40, policy=policy)
        with pytest.raises(ValueError, match="max_tokens=1000000000000"):
            eng.generate(prompts_for(llama, [20]), SamplingParams(max_tokens=10**12))
        assert not eng.has_unfinished_requests()
        eng.close()


# -- saves that outlive the script ----------------------------------------------------------------

CHILD = """
import sys, torch, kvtier
from kvtier.connector import FileSystemConnector, FileSystemStore, RedisConnector, StoreConnector
from kvtier.engine import LLMEngine, SamplingParams
from kvtier.models import build_model

store, disk, how = sys.argv[1], sys.argv[2], sys.argv[3]
model = build_model("tiny-llama", "cpu", torch.float64)
page = {page_bytes}
tiers = [kvtier.PrimaryTier(200 * page), kvtier.DiskTier(200 * page, disk)]
config = kvtier.CacheConfig(16, tiers, snapshot_interval_blocks=2)
engine = LLMEngine(model, config, connector=FileSystemConnector(store))
prompts = {prompts}
if how == "generate":
    engine.generate(prompts, SamplingParams(max_tokens=3))
else:  # the step API: saves are still running when the script ends
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=3))
    finished = 0
    while finished < len(prompts):
        finished += len(engine.step())
print("done without close()")
"""


def page_files(path: Path) -> int:
    return len(list(path.rglob("*.page")))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["generate", "step"])
def test_a_script_that_never_closes_its_engine_keeps_its_saves_and_its_disk_tier(llama, tmp_path, how):
    prompts = prompts_for(llama, [100, 130, 70], seed=19)
    expected_dir = tmp_path / "expected"
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(200 * page_bytes(llama))])
    with LLMEngine(llama, config, connector=FileSystemConnector(expected_dir)) as closed:  # what a closed one saves
        closed.generate(prompts, SamplingParams(max_tokens=3))
    expected = page_files(expected_dir)
    assert expected >= (100 + 130 + 70) // TPB

    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD.format(page_bytes=page_bytes(llama), prompts=prompts)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    store, disk = tmp_path / "store", tmp_path / "disk"
    child = subprocess.run(
        [sys.executable, str(script), str(store), str(disk), how], env=env, capture_output=True, text=True, timeout=240
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert page_files(store) == expected

    # The disk tier was persisted at exit too: a new engine on it reloads the prompts.
    with engine(llama, primary_blocks=200, disk_blocks=200, path=disk) as restarted:
        outs = restarted.generate(prompts, SamplingParams(max_tokens=3))
        check_against_oracle(llama, prompts, outs, 3)
        for out, prompt in zip(outs, prompts, strict=True):
            assert out.reused_tokens_by_tier["disk"] == len(prompt) // TPB * TPB


@pytest.mark.timeout(120)
@pytest.mark.parametrize("load_async", [False, True])
def test_a_shared_directory_whose_reads_hang_costs_a_bounded_wait_and_stalls_nobody(llama, tmp_path, load_async):
    """Page files whose reads never return (FIFOs standing in for a hard-mounted network file system
    whose server died). Before, with ``load_async=False`` the engine's step waited for the read for
    ever, and every other request with it; with ``load_async=True`` the hung reads kept the store's
    threads, so loads of sound pages in the same directory each waited the connector's 30 s."""
    prompts = prompts_for(llama, [100], seed=151)
    others = prompts_for(llama, [90, 80], seed=152)
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(200 * page_bytes(llama))])
    store = tmp_path / "store"
    with LLMEngine(llama, config, connector=FileSystemConnector(store)) as first:
        first.generate(prompts, SamplingParams(max_tokens=3))
    fifos = list(store.rglob("*.page"))
    for path in fifos:
        path.unlink()
        os.mkfifo(path, 0o600)
    connector = FileSystemConnector(store, timeout_s=0.5, retry_after_s=60, load_async=load_async)
    try:
        with LLMEngine(llama, config, connector=connector) as eng:
            t0 = time.monotonic()
            outs = eng.generate(prompts + others, SamplingParams(max_tokens=3))
            assert time.monotonic() - t0 < 20
            check_against_oracle(llama, prompts + others, outs, 3)
            assert outs[0].reused_tokens_by_tier["connector"] == 0  # recomputed
    finally:
        for path in fifos:  # end the reads still waiting
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def test_generate_returns_once_its_saves_are_written(llama, tmp_path):
    store = GatedStore(tmp_path)  # its writes wait for the gate
    eng = LLMEngine(
        llama, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(200 * page_bytes(llama))]), connector=StoreConnector(store)
    )
    opener = threading.Timer(0.5, store.gate.set)
    opener.start()
    eng.generate(prompts_for(llama, [90, 120], seed=20), SamplingParams(max_tokens=2))
    assert store.gate.is_set()
    assert page_files(tmp_path) == 91 // TPB + 121 // TPB  # prompt + first token computed, in full blocks
    assert not eng.connector.saving
    opener.join()
    eng.close()


@pytest.mark.parametrize("nested", ["generate", "step"])
def test_generate_returns_when_on_finish_steps_the_engine_itself(llama, nested):
    """``on_finish`` starts the next turn with a nested ``generate`` or ``step``, in which another
    request of the outer call finishes. Before, that output went to the nested call only and the
    outer ``generate`` looped for ever; now it returns every output, and ``on_finish`` sees each once."""
    eng = engine(llama, primary_blocks=40, max_num_tokens=256)
    prompts = prompts_for(llama, [10, 20], seed=4)
    seen: list[int] = []
    follow_ups = []

    def next_turn(out):
        seen.append(out.request_id)
        if out.request_id == 0:
            follow_up = out.prompt_token_ids + out.token_ids + [1, 2]
            follow_ups.append(follow_up)
            if nested == "generate":
                check_against_oracle(llama, [follow_up], eng.generate([follow_up], SamplingParams(max_tokens=4)), 4)
            else:
                eng.add_request(follow_up, SamplingParams(max_tokens=4))
                for _ in range(3):
                    eng.step()

    outs = eng.generate(prompts, [SamplingParams(max_tokens=2), SamplingParams(max_tokens=4)], on_finish=next_turn)
    expected = [llama.reference_generate(p, n) for p, n in zip(prompts, (2, 4), strict=True)]
    assert [out.token_ids for out in outs] == expected
    assert seen.count(0) == 1 and seen.count(1) == 1
    eng.close()


def test_an_outer_generates_outputs_finishing_inside_a_nested_generate_reach_it_once(llama):
    """A ``generate`` started from ``on_finish`` runs the outer call's requests too; those that
    finish inside it belong to the outer call. Before, the nested call also kept them for the next
    ``step``: the outer ``on_finish`` saw them twice and the engine returned them again after."""
    eng = engine(llama, primary_blocks=60, max_num_tokens=256)
    prompts = prompts_for(llama, [10, 20, 15], seed=29)
    seen: list[int] = []

    def next_turn(out):
        seen.append(out.request_id)
        if out.request_id == 0:
            follow_up = out.prompt_token_ids + out.token_ids + [1, 2]
            check_against_oracle(llama, [follow_up], eng.generate([follow_up], SamplingParams(max_tokens=8)), 8)

    lengths = (2, 6, 20)
    outs = eng.generate(prompts, [SamplingParams(max_tokens=n) for n in lengths], on_finish=next_turn)
    expected = [llama.reference_generate(p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert [out.token_ids for out in outs] == expected
    assert sorted(seen) == [0, 1, 2]
    assert not eng.has_unfinished_requests() and eng.step() == []
    eng.close()


def test_the_smallest_temperature_samples_the_greedy_token(llama):
    """Before: a temperature below ~1e-45 divided in float32 gave NaN probabilities, and
    ``torch.multinomial`` raised an untyped ``RuntimeError`` from inside the step."""
    eng = engine(llama, primary_blocks=40)
    prompt = prompts_for(llama, [30], seed=21)[0]
    out = eng.generate([prompt], SamplingParams(max_tokens=5, temperature=5e-324, seed=1))[0]
    assert out.finish_reason == "length" and out.token_ids == llama.reference_generate(prompt, 5)
    eng.close()


def test_a_step_that_raises_leaves_no_request_stalled(llama, monkeypatch):
    """The forward of a step raises after a request beside the caller's was committed in full.
    Before: that request had every token cached and no token sampled; no later step ever ran
    it (``has_unfinished_requests()`` stayed True for ever). Now it fails, and the next step reports it."""
    eng = engine(llama, primary_blocks=40)
    first, second = prompts_for(llama, [20, 30], seed=22)
    beside = eng.add_request(first, SamplingParams(max_tokens=6))
    eng.step()  # prefilled: decoding from now on
    real = eng.runner._sample

    def broken(request, logits):
        if request.request_id != beside:
            raise RuntimeError("a sampler that breaks")
        return real(request, logits)

    monkeypatch.setattr(eng.runner, "_sample", broken)
    with pytest.raises(RuntimeError, match="a sampler that breaks"):
        eng.generate([second], SamplingParams(max_tokens=3))
    monkeypatch.setattr(eng.runner, "_sample", real)
    outs = []
    for _ in range(20):
        outs += eng.step()
        if not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests()
    assert [out.request_id for out in outs] == [beside]
    assert outs[0].finish_reason in ("length", "error")
    if outs[0].finish_reason == "length":
        assert outs[0].token_ids == llama.reference_generate(first, 6)
    eng.cache_manager.check_invariants()
    assert sum(t.pages_used for t in eng.cache_manager.stats().tiers.values()) >= 0
    eng.close()


@pytest.mark.parametrize(("length", "max_tokens"), [(10 * TPB, 1), (10 * TPB - 10, 11), (10 * TPB - 1, 2)])
def test_a_prompt_that_fills_the_primary_tier_runs_again(llama, length, max_tokens):
    """Before: the second run reused the last block partly, whose private copy needs one page
    more than the primary tier has, and failed: "it cannot run even alone"."""
    eng = engine(llama, primary_blocks=10, host_blocks=4, max_num_tokens=512)
    prompt = prompts_for(llama, [length], seed=23)[0]
    expected = llama.reference_generate(prompt, max_tokens)
    for _ in range(2):
        out = eng.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]
        assert (out.finish_reason, out.token_ids) == ("length", expected)
    assert out.reused_tokens_by_tier["primary"] + out.reused_tokens_by_tier["host"] == (length - 1) // TPB * TPB
    assert eng.cache_manager.stats().recomputed_tokens == (length - 1) % TPB
    eng.cache_manager.check_invariants()
    eng.close()


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_a_long_prompt_of_a_sliding_window_model_is_computed_in_chunks_its_window_fits(policy):
    """Only sliding-window layers (as a Mistral checkpoint loads): admission counts the window's
    pages, so a prompt longer than the primary tier is accepted. Before, its first chunk was as
    long as ``max_num_tokens``, needed a page for every block of it at once, and the request
    failed: "it cannot run even alone". Under guaranteed_no_evict (the default) it failed so
    until the request was computed in chunks there too, beside requests that hold every page."""
    from kvtier.models import LayerKind, ModelConfig
    from kvtier.models.random_init import random_model

    config = ModelConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        layer_kinds=(LayerKind.SLIDING_ATTENTION,) * 2,
        sliding_window=3 * TPB,
    )
    model = random_model(config, torch.device("cpu"), torch.float64, 0)
    eng = engine(model, primary_blocks=8, policy=policy, max_num_tokens=16 * TPB)
    prompt = prompts_for(model, [25 * TPB], seed=24)[0]  # three times the primary tier
    out = eng.generate([prompt], SamplingParams(max_tokens=4))[0]
    assert (out.finish_reason, out.token_ids) == ("length", model.reference_generate(prompt, 4))
    again = prompts_for(model, [25 * TPB, 2 * TPB, 3 * TPB], seed=27)  # a new long one beside short ones
    outs = eng.generate(again, SamplingParams(max_tokens=4))
    for p, o in zip(again, outs, strict=True):
        assert (o.finish_reason, o.token_ids) == ("length", model.reference_generate(p, 4))
    eng.cache_manager.check_invariants()
    eng.close()


def test_outputs_of_a_step_whose_on_finish_raised_reach_the_next_step(llama):
    """Two requests queued with ``add_request`` finish in the step where the call's ``on_finish``
    raises at the first output. Before, the outputs after it in that step were lost."""
    eng = engine(llama, primary_blocks=60)
    beside = prompts_for(llama, [20, 20], seed=25)
    ids = [eng.add_request(p, SamplingParams(max_tokens=3)) for p in beside]
    mine = prompts_for(llama, [20], seed=26)

    def explode(output):
        raise RuntimeError("the caller's callback failed")

    with pytest.raises(RuntimeError, match="callback"):
        eng.generate(mine, SamplingParams(max_tokens=3), on_finish=explode)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    # All three finish in one step, in the order they came; on_finish raised at the first one.
    assert {out.request_id: out.token_ids for out in outs} == {ids[1]: llama.reference_generate(beside[1], 3)}
    eng.close()


def test_outputs_of_requests_queued_before_a_generate_without_on_finish_reach_the_next_step(llama):
    """A request queued with ``add_request`` that finishes inside a later ``generate`` (no
    ``on_finish``) is returned by the next ``step``. Before, its output was dropped: ``generate``
    returned only its own and the engine had nothing left to give."""
    eng = engine(llama, primary_blocks=60)
    beside = prompts_for(llama, [40], seed=27)[0]
    queued = eng.add_request(beside, SamplingParams(max_tokens=3))
    mine = prompts_for(llama, [30], seed=28)
    outs = eng.generate(mine, SamplingParams(max_tokens=3))
    assert [out.token_ids for out in outs] == [llama.reference_generate(mine[0], 3)]
    assert eng.has_unfinished_requests()
    later = eng.step()
    assert [(out.request_id, out.token_ids) for out in later] == [(queued, llama.reference_generate(beside, 3))]
    assert not eng.has_unfinished_requests() and eng.step() == []
    eng.close()


def test_numpy_numbers_in_the_engines_settings_are_taken_as_python_numbers():
    """Before, ``SamplingParams(max_tokens=np.int64(3))`` and ``temperature=np.float32(0.5)`` were
    refused while a numpy float64 temperature was accepted."""
    params = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), seed=np.uint64(7))
    assert (params.max_tokens, params.temperature, params.seed) == (3, 0.5, 7)
    assert (type(params.max_tokens), type(params.temperature), type(params.seed)) == (int, float, int)
    config = SchedulerConfig(max_num_tokens=np.int32(64), max_batch_size=np.int64(4), max_prefetches=np.uint8(2))
    assert (config.max_num_tokens, config.max_batch_size, config.max_prefetches) == (64, 4, 2)
    assert type(config.max_num_tokens) is int
    for bad in (np.int64(0), np.float64(3.0), np.bool_(True)):
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=bad)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=np.float32("nan"))


# -- arguments and calls refused at the door ------------------------------------------------------


class RefusesTheLayout(FileSystemConnector):
    """Refuses the layout the engine registers, once the engine has built its cache manager."""

    def register_kv_cache_layout(self, layout):
        raise ValueError("this connector refuses the layout")


def test_a_refused_engine_leaves_its_disk_directory_free(llama, tmp_path):
    """Each refusal is kept (as a notebook keeps the last traceback) while the next engine opens
    the same disk directory. Before, ``None`` for the model or the config and a connector that is
    no connector raised ``AttributeError``, and an engine refused after it built its cache manager
    left the manager open: the directory stayed locked (``DiskTierBusyError``)."""
    pb = page_bytes(llama)
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(40 * pb), kvtier.DiskTier(40 * pb, tmp_path / "disk")])
    sc = SchedulerConfig(recompute_when_faster=False)
    refusals = [
        (TypeError, "cache_config", lambda: LLMEngine(llama, None)),
        (TypeError, "model", lambda: LLMEngine(None, config)),
        (TypeError, "connector", lambda: LLMEngine(llama, config, sc, connector=object())),
        (TypeError, "connector", lambda: LLMEngine(llama, config, sc, connector=str(tmp_path / "store"))),
        (ValueError, "refuses the layout", lambda: LLMEngine(llama, config, sc, connector=RefusesTheLayout(tmp_path))),
    ]
    kept = []
    for error, what, build in refusals:
        with pytest.raises(error, match=what) as info:
            build()
        kept.append(info)
        LLMEngine(llama, config, sc).close()  # the directory is free
    with LLMEngine(llama, config, sc) as eng:
        prompt = prompts_for(llama, [30], seed=27)
        check_against_oracle(llama, prompt, eng.generate(prompt, SamplingParams(max_tokens=2)), 2)


@pytest.mark.parametrize(
    ("error", "rank", "world"),
    [(ValueError, 1, 1), (ValueError, 5, 2), (ValueError, -1, 2), (ValueError, 0, 0), (TypeError, "0", 1)]
    + [(TypeError, True, 2), (TypeError, 0, 2.0)],
)
def test_a_connector_with_a_bad_tensor_parallel_shard_is_refused_when_built(tmp_path, error, rank, world):
    """Before, the connectors took any ``tp_rank`` / ``tp_world_size`` and the engine they were given
    to raised, after building its cache manager."""
    with pytest.raises(error, match="tp_"):
        FileSystemConnector(tmp_path / "store", rank, world)
    assert not (tmp_path / "store").exists()
    with pytest.raises(error, match="tp_"):
        RedisConnector("redis://localhost:1", tp_rank=rank, tp_world_size=world)
    with pytest.raises(error, match="tp_"):
        StoreConnector(FileSystemStore(tmp_path / "other"), rank, world)


def test_a_connector_whose_load_async_is_no_bool_is_refused_when_built(tmp_path):
    with pytest.raises(TypeError, match="load_async"):
        FileSystemConnector(tmp_path / "store", load_async="yes")
    assert not (tmp_path / "store").exists()
    with pytest.raises(TypeError, match="load_async"):
        RedisConnector("redis://localhost:1", load_async=1)


class DrivesTheEngine(FileSystemConnector):
    """Its first ask calls ``drive``: a hook that drives the engine asking it."""

    drive = None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        drive, self.drive = self.drive, None
        if drive is not None:
            drive()
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


@pytest.mark.parametrize("nested", ["step", "generate"])
def test_a_connector_hook_that_drives_the_engine_is_refused_and_the_engine_goes_on(llama, tmp_path, nested):
    """A hook called while the engine schedules calls ``step`` or ``generate``. Before, the nested
    step admitted requests under the outer schedule: ``generate`` raised ``IndexError`` and a
    request stayed unfinished for ever. Now the nested call raises ``CacheStateError`` (the
    connector's failed ask costs its offer only) and every output equals the oracle."""
    connector = DrivesTheEngine(tmp_path)
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(60 * page_bytes(llama))])
    eng = LLMEngine(llama, config, SchedulerConfig(recompute_when_faster=False), connector=connector)
    prompts = prompts_for(llama, [40, 50, 30], seed=28)
    refused = []

    def drive():
        try:
            eng.step() if nested == "step" else eng.generate(prompts[:1], SamplingParams(max_tokens=2))
        except kvtier.CacheStateError as exc:
            refused.append(str(exc))

    connector.drive = drive
    check_against_oracle(llama, prompts, eng.generate(prompts, SamplingParams(max_tokens=3)), 3)
    assert len(refused) == 1 and "inside a step" in refused[0]
    assert not eng.has_unfinished_requests()
    check_against_oracle(llama, prompts, eng.generate(prompts, SamplingParams(max_tokens=3)), 3)
    eng.cache_manager.check_invariants()
    eng.close()


class AbortsWhatItIsAsked(FileSystemConnector):
    """Its first ask aborts the request it is asked about (as a client that went away would)."""

    engine = None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.abort_request(request.request_id)
            with pytest.raises(kvtier.CacheStateError, match="inside a step"):
                engine.close()
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def test_a_connector_hook_may_abort_a_request_and_never_close_the_engine(llama, tmp_path):
    """Before, a hook's abort closed the request's cache under the schedule asking about it, and
    ``generate`` raised ``CacheStateError: the cache is closed``; a hook's ``close()`` closed the
    cache manager under the step. Now the abort is done as the step ends and the close is refused."""
    connector = AbortsWhatItIsAsked(tmp_path)
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(60 * page_bytes(llama))])
    eng = LLMEngine(llama, config, SchedulerConfig(recompute_when_faster=False), connector=connector)
    prompts = prompts_for(llama, [40, 50, 30], seed=31)
    connector.engine = eng
    outputs = eng.generate(prompts, SamplingParams(max_tokens=3))
    assert outputs[0].finish_reason == "abort"
    check_against_oracle(llama, prompts[1:], outputs[1:], 3)
    assert not eng.has_unfinished_requests()
    check_against_oracle(llama, prompts, eng.generate(prompts, SamplingParams(max_tokens=3)), 3)
    eng.cache_manager.check_invariants()
    eng.close()


def test_generate_refuses_arguments_of_the_wrong_type_before_running_anything(llama):
    """Before, ``on_finish=5`` ran a whole step before raising (its outputs lost), a dict for
    ``params`` was "1 SamplingParams for 2 prompts", and ``None`` prompts or ``params=5`` raised
    ``TypeError: object of type ... has no len()``."""
    eng = engine(llama, primary_blocks=40)
    prompts = prompts_for(llama, [40, 50], seed=29)
    calls = [
        ("on_finish must be a callable", lambda: eng.generate(prompts, SamplingParams(max_tokens=2), on_finish=5)),
        ("params must be a SamplingParams", lambda: eng.generate(prompts, {"max_tokens": 2})),
        ("params must be a SamplingParams", lambda: eng.generate(prompts, 5)),
        ("prompts must be a sequence", lambda: eng.generate(None)),
    ]
    for what, call in calls:
        with pytest.raises(TypeError, match=what):
            call()
        assert not eng.has_unfinished_requests() and eng.cache_manager.stats().lookup_tokens == 0, what
    outs = eng.generate(prompts, SamplingParams(max_tokens=2))
    check_against_oracle(llama, prompts, outs, 2)
    assert [sum(out.reused_tokens_by_tier.values()) for out in outs] == [0, 0]
    eng.close()


def test_close_from_another_thread_during_a_step_names_that_thread(llama):
    """Before, the refusal said the call came "from a connector hook", which it did not."""
    eng = engine(llama, primary_blocks=60)
    inside, release = threading.Event(), threading.Event()
    run = eng.runner.run

    def slow_run(batch):
        inside.set()
        release.wait(10)
        return run(batch)

    eng.runner.run = slow_run
    prompt = prompts_for(llama, [12], seed=40)[0]
    outs = []
    worker = threading.Thread(target=lambda: outs.extend(eng.generate([prompt], SamplingParams(max_tokens=2))))
    worker.start()
    assert inside.wait(10)
    with pytest.raises(kvtier.CacheStateError, match="another thread runs a step"):
        eng.close()
    release.set()
    worker.join(10)
    assert outs[0].token_ids == llama.reference_generate(prompt, 2)
    eng.close()
