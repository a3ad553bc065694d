"""The manager's front door: use after close, bad settings, two threads, and closing at interpreter exit."""

from __future__ import annotations

import copy
import gc
import importlib.util
import inspect
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtier
from kvtier.knobs import debug_enabled, parse_switch
from tests.kvdata import PageOracle, small_spec

ROOT = Path(__file__).resolve().parents[1]
TPB = 4


def manager(pages: int = 64) -> kvtier.KVCacheManager:
    """A manager of ``small_spec()`` (one full-attention group) with ``pages`` primary pages."""
    spec = small_spec()
    page_bytes = 2 * 2 * TPB * 2 * 8 * 2  # layers x roles x tokens x heads x dim x float16
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(pages * page_bytes)]))


def fresh_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1, 50_000, n)]


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env
    )


# ------------------------------------------------------------------------------------ after close


def public_methods(obj: object) -> list[str]:
    return sorted(
        name
        for name, member in inspect.getmembers(type(obj))
        if not name.startswith("_") and callable(member) and not isinstance(member, type)
    )


def test_every_manager_method_after_close_raises_cache_state_error():
    rng = np.random.default_rng(13)
    mgr = manager()
    tokens = fresh_tokens(rng, 18)
    cache = mgr.create_cache(tokens)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens)
    mgr.close()

    calls = {
        "create_cache": lambda: mgr.create_cache(tokens),
        "prefetch": lambda: mgr.prefetch(tokens),
        "maintain": mgr.maintain,
        "prefetch_to_host": lambda: mgr.prefetch_to_host(tokens),
        "cached_tokens": lambda: mgr.cached_tokens(tokens),
        "set_prefill_rate": lambda: mgr.set_prefill_rate(1000.0),
        "forget_scope": lambda: mgr.forget_scope(kvtier.ReuseScope()),
        "kv_views": lambda: mgr.kv_views(0),
        "layout": mgr.layout,
        "stats": mgr.stats,
        "page_bytes": lambda: mgr.page_bytes(0),
        "check_invariants": mgr.check_invariants,
    }
    assert sorted([*calls, "close"]) == public_methods(mgr), "a public method is not covered here"
    for call in calls.values():
        with pytest.raises(kvtier.CacheStateError, match="closed"):
            call()
    with pytest.raises(kvtier.CacheStateError, match="closed"), mgr:
        pass
    mgr.close()  # idempotent: nothing happens
    mgr.close(persist=False)


def test_every_cache_method_after_the_manager_closed_raises_cache_state_error():
    rng = np.random.default_rng(14)
    mgr = manager()
    tokens = fresh_tokens(rng, 10)
    active = mgr.create_cache(tokens)
    assert active.resume() and active.resize(len(tokens))
    suspended = mgr.create_cache(fresh_tokens(rng, 7))
    mgr.close()
    for cache in (active, suspended):
        assert cache.state is kvtier.CacheState.CLOSED
        calls = {
            "resume": cache.resume,
            "suspend": cache.suspend,
            "resize": lambda cache=cache: cache.resize(40),
            "commit": lambda cache=cache: cache.commit([5]),
            "page_indices": lambda cache=cache: cache.page_indices(0),
            "page_indices of no group": lambda cache=cache: cache.page_indices(7),  # (before: ValueError)
            "shorten_to_memory": cache.shorten_to_memory,
            "shorten_reuse": lambda cache=cache: cache.shorten_reuse(0),
            "recompute_from": lambda cache=cache: cache.recompute_from(0),
            "cache_for_prefix": lambda cache=cache: cache.cache_for_prefix(0),
            "release_prefix": lambda cache=cache: cache.release_prefix(0),
            "match_again": lambda cache=cache: cache.match_again([1, 2]),
        }
        assert sorted({*(name.split()[0] for name in calls), "close"}) == public_methods(cache), (
            "a public method is not covered here"
        )
        for call in calls.values():
            with pytest.raises(kvtier.CacheStateError):
                call()
        cache.close()  # idempotent


# ---------------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize("name", ["enable_reuse", "enable_partial_reuse"])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, np.bool_(True)])
def test_reuse_switches_must_be_bools(name, value):
    with pytest.raises(TypeError, match=name):
        kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)], **{name: value})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)], device="cuda")  # a description: fine
    with pytest.raises(RuntimeError, match="CUDA is not available") as info:
        kvtier.KVCacheManager(small_spec(), config)
    assert not isinstance(info.value, AssertionError)


@pytest.mark.parametrize("tier", [kvtier.PrimaryTier(2**62), kvtier.HostTier(2**62)])
def test_a_quota_beyond_the_machine_is_a_clear_error(tier):
    tiers = [tier] if isinstance(tier, kvtier.PrimaryTier) else [kvtier.PrimaryTier(1 << 20), tier]
    with pytest.raises(ValueError, match=f"{type(tier).__name__}.*cannot be allocated"):
        kvtier.KVCacheManager(small_spec(), kvtier.CacheConfig(TPB, tiers))


def test_memory_that_cannot_be_had_is_out_of_pages():
    """A quota the machine has but this process may not allocate (RLIMIT_AS): a real allocation failure."""
    out = run_python("""
        import resource
        import torch, kvtier
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        spec = kvtier.ModelSpec.uniform(2, 2, 64, torch.float16)
        try:
            kvtier.KVCacheManager(spec, kvtier.CacheConfig(16, [kvtier.PrimaryTier(8 << 30)]))
        except kvtier.OutOfPagesError as exc:
            print("OutOfPagesError", exc)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("OutOfPagesError cannot allocate"), out.stdout


def test_debug_switch_other_than_0_or_1_warns_once(monkeypatch, caplog):
    parse_switch.cache_clear()
    for raw, on in ((None, False), ("0", False), ("1", True)):
        if raw is None:
            monkeypatch.delenv("KVTIER_DEBUG", raising=False)
        else:
            monkeypatch.setenv("KVTIER_DEBUG", raw)
        with caplog.at_level(logging.WARNING, logger="kvtier.knobs"):
            assert debug_enabled() is on
        assert caplog.text == ""
    monkeypatch.setenv("KVTIER_DEBUG", "true")
    with caplog.at_level(logging.WARNING, logger="kvtier.knobs"):
        manager().close()
        manager().close()
    warnings = [r for r in caplog.records if "KVTIER_DEBUG" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "'true'" in warnings[0].getMessage() and "stays off" in warnings[0].getMessage()
    assert debug_enabled() is False


# ------------------------------------------------------------------------------------ two threads


class GatedTokens:
    """Tokens handed out only once ``gate`` opens: a caller reading them waits inside its call."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.inside = threading.Event()
        self.gate = threading.Event()

    def __iter__(self):
        self.inside.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return iter(self.tokens)


def test_a_second_thread_inside_the_manager_is_refused_and_changes_nothing():
    rng = np.random.default_rng(16)
    mgr = manager()
    oracle = PageOracle(mgr)
    tokens = fresh_tokens(rng, 21)
    first = mgr.create_cache(tokens)
    assert first.resume() and first.resize(len(tokens))
    oracle.write(first, tokens, 0, len(tokens))
    first.commit(tokens)
    first.suspend()

    gated = GatedTokens(tokens + fresh_tokens(rng, 5))
    created: list[kvtier.KVCache] = []
    holder = threading.Thread(target=lambda: created.append(mgr.create_cache(gated)))
    holder.start()
    try:
        assert gated.inside.wait(30)
        before = mgr.stats()
        refused = {
            "create_cache": lambda: mgr.create_cache(tokens),
            "prefetch": lambda: mgr.prefetch(tokens),
            "resume": first.resume,
            "close": first.close,
            "check_invariants": mgr.check_invariants,
            "manager close": mgr.close,
        }
        for call in refused.values():
            with pytest.raises(kvtier.CacheStateError, match="another thread"):
                call()
        assert mgr.stats() == before  # reads are fine from any thread, and nothing changed
        assert first.state is kvtier.CacheState.SUSPENDED
    finally:
        gated.gate.set()
        holder.join(30)
    assert created and created[0].num_reused_tokens == 20  # the holder's call finished normally
    mgr.check_invariants()
    assert first.resume()
    oracle.check(first, tokens)
    mgr.close()


def test_a_manager_handed_between_threads_works():
    """Created on one thread, driven by another, closed by a third: sequential use is legitimate."""
    rng = np.random.default_rng(17)
    mgr = manager()
    oracle = PageOracle(mgr)
    tokens = fresh_tokens(rng, 30)
    cache = mgr.create_cache(tokens)
    errors: list[BaseException] = []

    def drive() -> None:
        try:
            assert cache.resume() and cache.resize(len(tokens))
            oracle.write(cache, tokens, 0, len(tokens))
            cache.commit(tokens)
            for t in fresh_tokens(rng, 9):  # decode steps
                assert cache.resize(cache.capacity + 1)
                cache.commit([t])
            cache.suspend()
        except BaseException as exc:  # reported to the main thread
            errors.append(exc)

    worker = threading.Thread(target=drive)
    worker.start()
    worker.join(30)
    assert not errors, errors
    again = mgr.create_cache(tokens + [1])
    assert again.num_reused_tokens == 30
    closer = threading.Thread(target=mgr.close)
    closer.start()
    closer.join(30)
    assert cache.state is kvtier.CacheState.CLOSED and again.state is kvtier.CacheState.CLOSED


def test_a_check_on_another_thread_while_a_cache_decodes_finds_nothing_wrong():
    """The decode step claims nothing, so another thread's claimed calls (``check_invariants``, or
    any call with ``KVTIER_DEBUG=1``) may read a cache between its steps' statements: they must
    find its lengths in order. Before, one check in two raised a false ``InvariantError``."""
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    block = 1 << 20  # every commit below is a decode step: none completes a block
    spec = kvtier.ModelSpec.uniform(1, 1, 2, torch.float32)
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(block, [kvtier.PrimaryTier(1 << 26)]))
    cache = mgr.create_cache([1, 2, 3])
    assert cache.resume() and cache.resize(block - 1)
    stop = threading.Event()
    failed: list[BaseException] = []

    def decode() -> None:
        try:
            while not stop.is_set() and cache.num_committed_tokens < block - 2:
                cache.commit([7])
        except BaseException as exc:  # (a thread's exception fails the test, not only a warning)
            failed.append(exc)

    worker = threading.Thread(target=decode)
    try:
        worker.start()
        for _ in range(3000):
            mgr.check_invariants()
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(old_interval)
    assert not failed, failed  # the first commit too: a cache without reuse has no hits to settle
    mgr.check_invariants()
    mgr.close()


def test_two_threads_driving_one_manager_at_once_are_detected():
    """Two real threads run requests on one manager at once: the overlap raises, the invariants hold."""
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    mgr = manager(pages=256)
    refused = [0, 0]
    unexpected: list[BaseException] = []
    stop = threading.Event()

    def serve(worker: int) -> None:
        rng = np.random.default_rng(100 + worker)
        caches: list[kvtier.KVCache] = []
        while not stop.is_set() and not unexpected:
            try:
                if len(caches) > 3:
                    caches[0].close()
                    caches.pop(0)
                cache = mgr.create_cache(fresh_tokens(rng, int(rng.integers(5, 30))))
                caches.append(cache)
                if cache.resume() and cache.resize(cache.num_committed_tokens + 12):
                    cache.commit(fresh_tokens(rng, 12))
                    cache.suspend()
            except kvtier.CacheStateError as exc:
                assert "another thread" in str(exc), exc
                refused[worker] += 1
            except BaseException as exc:  # an invariant broken by the overlap, reported to the main thread
                unexpected.append(exc)
                return
        for cache in caches:
            while True:
                try:
                    cache.close()
                    break
                except kvtier.CacheStateError:
                    time.sleep(0.001)

    threads = [threading.Thread(target=serve, args=(w,)) for w in (0, 1)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while sum(refused) < 20 and time.monotonic() < deadline and not unexpected:
            time.sleep(0.01)
        stop.set()
        for t in threads:
            t.join(30)
    finally:
        sys.setswitchinterval(old_interval)
    assert not unexpected, unexpected[0]
    assert sum(refused) >= 20, f"the overlaps went unnoticed: {refused}"
    mgr.check_invariants()  # every page held by a cache or published: a refused call leaked nothing
    mgr.close()


# --------------------------------------------------------------------------- closing at exit


EXIT_PRELUDE = """
import sys
import torch, kvtier
spec = kvtier.ModelSpec.uniform(2, 2, 8, torch.float16, model_id="front-test")
def manager(path):
    tiers = [kvtier.PrimaryTier(1 << 20), kvtier.DiskTier(1 << 20, path)]
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(4, tiers))
tokens = list(range(1, 42))
"""


def reused_in_a_new_process(path) -> subprocess.CompletedProcess:
    """A new process's manager on ``path`` prints the tokens of ``tokens`` it reuses."""
    return run_python(
        EXIT_PRELUDE
        + textwrap.dedent(f"""
        mgr = manager({str(path)!r})
        print(mgr.create_cache(tokens).num_reused_tokens)
        mgr.close()
    """)
    )


def test_a_manager_never_closed_is_closed_at_exit_and_its_pages_persist(tmp_path):
    wrote = run_python(
        EXIT_PRELUDE
        + textwrap.dedent(f"""
        mgr = manager({str(tmp_path)!r})
        cache = mgr.create_cache(tokens)
        assert cache.resume() and cache.resize(len(tokens))
        cache.commit(tokens)
        cache.close()
        print("exiting without close")
    """)
    )
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    read = reused_in_a_new_process(tmp_path)
    assert read.returncode == 0, read.stderr[-3000:]
    assert int(read.stdout) == 40, "the pages published before exit were lost"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_is_refused_the_parents_manager_and_leaves_its_files_alone(tmp_path):
    """A manager and its caches made before a fork (a DataLoader worker, a preloading server, a
    multiprocessing pool) stay the parent's: in the child every call that would change them raises
    ``CacheStateError`` naming the fork, ``close()`` does nothing, and the child's exit writes
    nothing. Before, the child used them: a read from disk waited forever on the parent's threads,
    and the child's pages went into the parent's locked files (the parent's pages damaged)."""
    out = run_python(
        EXIT_PRELUDE
        + textwrap.dedent(f"""
        import os
        mgr = manager({str(tmp_path)!r})
        active = mgr.create_cache(tokens)
        assert active.resume() and active.resize(len(tokens))
        active.commit(tokens)
        waiting = mgr.create_cache(tokens[:20])
        pid = os.fork()
        if pid == 0:
            refused = []
            calls = [
                lambda: mgr.create_cache([7] * 40),
                lambda: mgr.stats(),
                lambda: mgr.prefetch(tokens),
                lambda: waiting.resume(),
                lambda: active.close(),
            ]
            for call in calls:
                try:
                    call()
                    refused.append(False)
                except kvtier.CacheStateError as refusal:
                    refused.append("forked child" in str(refusal))
            mgr.close()  # the parent's: nothing is done
            print("child", refused, flush=True)
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        active.close()
        waiting.close()
        mgr.close()
    """)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["child [True, True, True, True, True]", "child exit 0"]
    read = reused_in_a_new_process(tmp_path)
    assert read.returncode == 0 and int(read.stdout) == 40, read.stderr[-3000:]
    assert "WARNING" not in read.stderr and "ERROR" not in read.stderr, read.stderr


def test_closing_at_exit_never_waits_on_a_thread_still_inside(tmp_path):
    """A daemon thread stuck inside a call at exit: that manager is skipped (logged), the process exits."""
    out = run_python(
        EXIT_PRELUDE
        + textwrap.dedent(f"""
        import threading
        stuck_inside = threading.Event()
        def never():
            stuck_inside.set()
            threading.Event().wait()
            yield 1
        mgr = manager({str(tmp_path)!r})
        threading.Thread(target=lambda: mgr.create_cache(never()), daemon=True).start()
        stuck_inside.wait()
        print("exiting", flush=True)
    """),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "closing a KVCacheManager at interpreter exit failed" in out.stderr
    assert "another thread" in out.stderr


def test_the_exit_registry_does_not_keep_a_dropped_manager_alive():
    mgr = manager()
    ref = weakref.ref(mgr)
    del mgr
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("state", ["suspended", "active"])
def test_caches_dropped_without_close_give_their_pages_back(caplog, state):
    mgr = manager(pages=16)
    oracle = PageOracle(mgr)
    rng = np.random.default_rng()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for _ in range(12):  # each holds 4 of the 16 pages: without release the fifth could not run
            tokens = fresh_tokens(rng, 4 * TPB)
            cache = mgr.create_cache(tokens)
            assert cache.resume() and cache.resize(len(tokens))
            oracle.write(cache, tokens, 0, len(tokens))
            cache.commit(tokens)
            if state == "suspended":
                cache.suspend()
            ref = weakref.ref(cache)
            del cache  # a script that forgets close()
        assert ref() is not None  # kept until the manager's next call releases it
        mgr.check_invariants()  # which only looks
        assert ref() is not None
        mgr.maintain()
        assert ref() is None
        mgr.check_invariants()
    assert sum("KVCache was dropped without close()" in r.getMessage() for r in caplog.records) == 1
    tokens = fresh_tokens(rng, 16 * TPB - 1)  # the whole tier, for one request
    whole = mgr.create_cache(tokens)
    assert whole.resume() and whole.resize(len(tokens))
    whole.close()
    mgr.close()


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_manager_or_cache_copied_or_pickled_is_a_type_error_naming_it(how):
    """A shallow copy shared the original's page table: closing one left the other holding freed
    pages. Now every way of copying is refused, and the originals work on."""
    mgr = manager()
    rng = np.random.default_rng()
    tokens = fresh_tokens(rng, 3 * TPB)
    cache = mgr.create_cache(tokens)
    assert cache.resume() and cache.resize(len(tokens))
    duplicate = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
    with pytest.raises(TypeError, match=r"KVCacheManager cannot be copied or pickled.*in each process"):
        duplicate(mgr)
    with pytest.raises(TypeError, match=r"KVCache cannot be copied or pickled.*create_cache"):
        duplicate(cache)
    cache.commit(tokens)
    cache.close()
    again = mgr.create_cache(tokens)
    assert again.num_reused_tokens == len(tokens) - 1  # all but the last token, which is computed
    again.close()
    mgr.check_invariants()
    mgr.close()


def test_a_cache_finalized_at_interpreter_exit_is_quiet(monkeypatch):
    """At exit Python may clear ``kvtier.cache``'s names before it finalizes a cache that a cycle
    kept: ``__del__`` then must not read them (it printed "Exception ignored in ... __del__")."""
    mgr = manager()
    caches = [mgr.create_cache([5, 6, 7, 8, 9]) for _ in range(2)]
    caches[0].close()
    monkeypatch.setattr(kvtier.cache, "CacheState", None)  # as module teardown leaves it
    for cache in caches:
        cache.__del__()  # raised AttributeError: 'NoneType' object has no attribute 'CLOSED'
    monkeypatch.undo()
    assert mgr._pool.dropped == [caches[1]]  # the open one is still queued for release
    caches[1].close()
    mgr.close()


def test_a_dropped_manager_and_its_unclosed_caches_free_their_memory_at_once():
    mgr = manager()
    caches = [mgr.create_cache([5, 6, 7, 8, 9, 10 + i]) for i in range(3)]
    assert caches[0].resume()
    pool = weakref.ref(mgr._pool)
    gc.disable()  # freed by reference counting alone, not by a later cycle collection
    try:
        del caches[1]  # dropped while the manager lives: queued for release
        del mgr, caches
        assert pool() is None
    finally:
        gc.enable()


# ------------------------------------------------------------------------------- invariant check


def test_the_invariant_check_holds_under_python_optimize():
    """``python -O`` strips ``assert``: the check must still see a broken invariant."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = """
        import torch, kvtier
        mgr = kvtier.KVCacheManager(kvtier.ModelSpec.uniform(2, 2, 8, torch.float16),
                                    kvtier.CacheConfig(4, [kvtier.PrimaryTier(1 << 20)]))
        cache = mgr.create_cache(list(range(1, 20)))
        assert 1 == 2, "never seen under -O"
        cache.resume(); cache.resize(19); cache.commit(list(range(1, 20)))
        mgr.check_invariants()
        cache._table.blocks[0][0].refs += 1  # a broken invariant, as a bug would leave it
        try:
            mgr.check_invariants()
        except kvtier.InvariantError as exc:
            print("caught:", exc)
    """
    out = subprocess.run(
        [sys.executable, "-O", "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("caught:") and "refs 2 but 1 caches hold it" in out.stdout, out.stdout


def test_views_first_taken_in_inference_mode_are_written_outside_it():
    """Before: views first asked for under ``torch.inference_mode()`` were kept as inference-mode
    views, and every later in-place write through them outside it raised ``RuntimeError``."""
    mgr = manager()
    with torch.inference_mode():
        first = mgr.kv_views(0)
        first["k"][0].fill_(1.0)
    again = mgr.kv_views(0)
    with torch.no_grad():
        again["k"][1].fill_(2.0)
    again["v"][1].fill_(3.0)
    assert again["k"][0].eq(1.0).all() and again["k"][1].eq(2.0).all() and again["v"][1].eq(3.0).all()
    mgr.close()


def test_a_bool_is_neither_a_layer_id_nor_a_prefill_rate():
    """Before: ``kv_views(True)`` returned layer 1's views once they were made, ``set_prefill_rate(True)``
    set 1 token/s and ``set_prefill_rate("100")`` raised a ``TypeError`` about comparing str and int."""
    mgr = manager()
    mgr.kv_views(1)
    with pytest.raises(ValueError, match="unknown layer id True"):
        mgr.kv_views(True)
    for rate in (True, "100", None):
        with pytest.raises(TypeError, match="a prefill rate is a number of tokens per second"):
            mgr.set_prefill_rate(rate)
    mgr.set_prefill_rate(100)
    mgr.close()


def test_a_prefill_rate_too_large_for_a_float_is_refused_in_one_short_line():
    """Before, the message carried all 401 digits of ``10**400``."""
    mgr = manager()
    with pytest.raises(ValueError) as error:
        mgr.set_prefill_rate(10**400)
    assert str(error.value).endswith("got inf") and len(str(error.value)) < 100
    for rate, shown in ((-(10**400), "-inf"), (-1234567, "-1234567")):  # the sign and every digit kept
        with pytest.raises(ValueError, match=f"got {shown}$"):
            mgr.set_prefill_rate(rate)
    assert mgr._pool.load_cost.prefill_rate is None
    mgr.close()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="kvtier.hf needs transformers")
def test_the_submodules_load_on_first_use_after_import_kvtier():
    """``import kvtier`` then ``kvtier.hf.PrefixCache`` (the README's example) works; before, it
    raised ``AttributeError``. Nothing heavy is imported until then."""
    code = (
        "import sys, kvtier\n"
        "assert 'transformers' not in sys.modules and 'kvtier.engine' not in sys.modules\n"
        "print(kvtier.hf.PrefixCache.__name__, kvtier.engine.LLMEngine.__name__, kvtier.models.build_model.__name__)\n"
        "print(kvtier.connector.FileSystemConnector.__name__, kvtier.metrics.__name__)\n"
        "try:\n    kvtier.no_such_module\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == [
        "PrefixCache", "LLMEngine", "build_model", "FileSystemConnector", "kvtier.metrics",
        "module", "'kvtier'", "has", "no", "attribute", "'no_such_module'",
    ]  # fmt: skip


def test_layout_read_while_another_thread_closes_the_manager_is_a_cache_state_error(monkeypatch):
    """``layout`` is read without claiming the manager; a ``close`` that released the tiers after
    its check ends it with ``CacheStateError``. Before, ``IndexError`` from the emptied buffers."""
    mgr = manager()
    seen = []
    release = kvtier.manager._close_pool

    def close_pool_then_read(pool, persist):
        release(pool, persist)
        with pytest.raises(kvtier.CacheStateError, match="closed"):
            mgr.layout()  # as another thread would between the release and the end of close
        seen.append(True)

    monkeypatch.setattr(kvtier.manager, "_close_pool", close_pool_then_read)
    assert mgr.layout().groups
    mgr.close()
    assert seen == [True]


def test_the_first_one_token_commit_of_a_cache_without_reuse_claims_nothing():
    """While another thread is inside a claimed call, a cache that reused nothing commits its first
    token as a decode step (nothing to settle, nothing claimed). Before, its first commit settled
    its hit count under the claim, and raised ``CacheStateError`` meeting another thread's call."""
    spec = kvtier.ModelSpec.uniform(1, 1, 2, torch.float32)
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(16, [kvtier.PrimaryTier(1 << 20)]))
    cache = mgr.create_cache([1, 2, 3])
    assert cache.resume() and cache.resize(8)
    failed: list[BaseException] = []

    def first_commit() -> None:
        try:
            cache.commit([7])
        except BaseException as exc:
            failed.append(exc)

    with mgr._pool.guard:  # another thread's claimed call, under way
        worker = threading.Thread(target=first_commit)
        worker.start()
        worker.join()
    assert not failed, failed
    assert cache.num_committed_tokens == 1
    mgr.close()


def test_cached_tokens_tells_the_reusable_prefix_and_changes_nothing():
    """``cached_tokens``: what ``create_cache`` would find, on any tier and in the scope asked; it
    counts no lookup and no hit, and holds nothing."""
    mgr = manager(pages=16)
    rng = np.random.default_rng(57)  # fixed: a fresh draw may share its first token with ``tokens``
    tokens = fresh_tokens(rng, 5 * TPB + 2)
    cache = mgr.create_cache(tokens)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens)
    cache.close()
    asked = [tokens + [7], tokens[: 2 * TPB + 1], tokens[:3], fresh_tokens(rng, 3 * TPB)]
    before = mgr.stats()
    found = [mgr.cached_tokens(t) for t in asked]
    assert found[0] == 5 * TPB and found[1] == 2 * TPB and found[3] == 0
    assert found[2] == 2  # a partly reused block; a match never covers the last token
    assert mgr.cached_tokens(tokens, kvtier.ReuseScope(salt="other")) == 0
    after = mgr.stats()
    assert (after.lookup_tokens, after.hit_tokens) == (before.lookup_tokens, before.hit_tokens)
    assert after.tiers["primary"].pages_used == before.tiers["primary"].pages_used
    for t, n in zip(asked, found, strict=True):
        cache = mgr.create_cache(t)
        assert cache.num_reused_tokens == n
        cache.close()
    mgr.check_invariants()
    assert mgr.cached_tokens(tokens + [7], in_memory=True) == 5 * TPB  # no disk tier: all in memory
    with pytest.raises(TypeError, match="in_memory"):
        mgr.cached_tokens(tokens, in_memory="yes")
    mgr.close()
