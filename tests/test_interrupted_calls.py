"""Calls cut short: Ctrl-C while a resume waits for its disk reads, a copy that raises (a CUDA
error, out of memory), a disk write that raises, an interrupt inside ``close``.

Whatever was cut short, no page is served with bytes it never received (now, or after a restart
on the same directory), no page stays locked or held by a call that is gone, and the call can
be made again.
"""

from __future__ import annotations

import gc
import signal
import threading
from pathlib import Path

import pytest

import kvtier
import kvtier.cache as cache_module
import kvtier.storage.page_files as page_files
from kvtier.copy.copier import PageCopier
from kvtier.tiering.mover import Mover
from kvtier.tiering.residency import Residency
from kvtier.tiering.tier import Tier
from tests.kvdata import PageOracle, small_spec
from tests.test_tiers import TPB, page_demand, prefill


def three_tiers(path: Path, primary: int = 8, host: int = 8, disk: int = 32, write_through: bool = False):
    spec = small_spec("llama")
    d = page_demand(spec)
    tiers = [
        kvtier.PrimaryTier(int(d * primary) + 1),
        kvtier.HostTier(int(d * host) + 1, write_through=write_through),
        kvtier.DiskTier(int(d * disk) + 1, path),
    ]
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block=TPB, tiers=tiers))


def conversation(i: int, n: int = 12) -> list[int]:
    return [10_000 * (i + 1) + 37 * j + 5 for j in range(n)]


PROMPTS = [conversation(i) for i in range(6)]


def serve_every_prompt(mgr: kvtier.KVCacheManager) -> None:
    """Every prompt's reused prefix holds exactly its own bytes; the invariants hold."""
    oracle = PageOracle(mgr)
    for prompt in PROMPTS:
        tokens = [*prompt, 1]
        cache = mgr.create_cache(tokens)
        assert cache.resume()
        oracle.check(cache, tokens)
        cache.close()
    mgr.check_invariants()
    assert mgr.stats().checksum_failures == 0


def interrupt_disk_reads(monkeypatch, times: int = 1) -> None:
    """The next ``times`` waits for page reads raise KeyboardInterrupt (Ctrl-C while waiting)."""
    real = page_files._run
    left = [times]

    def run(pool, fn, *iterables):
        if left[0] and "out" in fn.__code__.co_varnames:  # the page read's worker
            left[0] -= 1
            raise KeyboardInterrupt
        return real(pool, fn, *iterables)

    monkeypatch.setattr(page_files, "_run", run)


def failing_copies(monkeypatch, error: BaseException) -> None:
    def copy(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(PageCopier, "copy", copy)


@pytest.mark.parametrize("fault", ["ctrl-c during the disk read", "a copy raising"])
def test_a_resume_cut_short_never_serves_bytes_that_did_not_arrive(tmp_path, monkeypatch, fault):
    mgr = three_tiers(tmp_path)
    oracle = PageOracle(mgr)
    for prompt in PROMPTS:
        prefill(mgr, oracle, prompt)  # 6 x 3 pages through 8 + 8: the first prompt ends on disk
    tokens = [*PROMPTS[0], 1]
    cache = mgr.create_cache(tokens)
    assert cache.reused_by_tier["disk"] > 0
    with monkeypatch.context() as patch:
        if fault == "a copy raising":
            failing_copies(patch, RuntimeError("CUDA error: out of memory"))
            expected = RuntimeError
        else:
            interrupt_disk_reads(patch)
            expected = KeyboardInterrupt
        with pytest.raises(expected):
            cache.resume()
    assert cache.state is kvtier.CacheState.SUSPENDED
    mgr.check_invariants()
    assert cache.resume()  # the call made again: exact bytes (re-read, or recomputed after a miss)
    oracle.check(cache, tokens)
    cache.close()
    serve_every_prompt(mgr)
    mgr.close()
    restarted = three_tiers(tmp_path)
    serve_every_prompt(restarted)
    restarted.close()


def test_resumes_cut_short_leave_no_page_locked(tmp_path, monkeypatch):
    mgr = three_tiers(tmp_path, disk=64)
    oracle = PageOracle(mgr)
    prompts = [conversation(i) for i in range(10)]
    for prompt in prompts:
        prefill(mgr, oracle, prompt)
    for prompt in prompts[:5]:
        cache = mgr.create_cache([*prompt, 1])
        with monkeypatch.context() as patch:
            interrupt_disk_reads(patch)
            with pytest.raises(KeyboardInterrupt):
                cache.resume()
        cache.close()
        mgr.check_invariants()
    whole = mgr.create_cache([3])  # every primary page can still be had
    assert whole.resume() and whole.resize(8 * TPB)
    whole.close()
    mgr.close()


def test_write_through_cut_short_leaves_no_copy_without_its_bytes(tmp_path, monkeypatch):
    mgr = three_tiers(tmp_path, host=24, write_through=True)
    oracle = PageOracle(mgr)
    for prompt in PROMPTS[:5]:
        prefill(mgr, oracle, prompt)
        mgr.maintain()
    prefill(mgr, oracle, PROMPTS[5])
    with monkeypatch.context() as patch:
        failing_copies(patch, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            mgr.maintain()
    for _ in range(3):
        mgr.maintain()
    serve_every_prompt(mgr)  # demoting a page onto a copy that was never written would serve other bytes
    mgr.close()
    restarted = three_tiers(tmp_path, host=24, write_through=True)
    serve_every_prompt(restarted)
    restarted.close()


def test_a_close_interrupted_then_made_again_releases_each_page_once(monkeypatch):
    spec = small_spec("llama")
    d = page_demand(spec)
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(int(d * 8) + 1)]))
    oracle = PageOracle(mgr)
    shared = conversation(0, 8)  # two full blocks
    first = prefill(mgr, oracle, [*shared, 7, 7, 7], keep=True)
    second = mgr.create_cache([*shared, 9])  # holds the two shared pages too
    assert second.num_reused_tokens == 8

    def interrupted(self, pages):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Tier, "reindex_all", interrupted)
        with pytest.raises(KeyboardInterrupt):
            first.close()
    assert first.state is kvtier.CacheState.CLOSED
    first.close()  # made again: releases nothing a second time
    assert [page.refs for page in second._table.live_pages()] == [1, 1]
    filler = mgr.create_cache(conversation(5, 1))  # pressure: the second cache's pages must survive it
    assert filler.resume()
    filler.resize(6 * TPB)
    filler.close()
    assert second.resume()
    oracle.check(second, [*shared, 9])
    second.close()
    mgr.close()


@pytest.mark.parametrize("error", [MemoryError("checksum buffer"), OSError(5, "Input/output error")])
def test_a_disk_write_that_raises_is_a_page_not_written(tmp_path, monkeypatch, error):
    mgr = three_tiers(tmp_path)
    oracle = PageOracle(mgr)

    def checksum(data):
        raise error

    with monkeypatch.context() as patch:
        patch.setattr(page_files, "page_checksum", checksum)
        for prompt in PROMPTS:
            prefill(mgr, oracle, prompt)  # victims pushed out of host memory are dropped, not written
    assert mgr.stats().tiers["disk"].pages_used == 0
    mgr.check_invariants()
    serve_every_prompt(mgr)
    mgr.close()


def test_an_interrupted_disk_write_frees_its_slots(tmp_path, monkeypatch):
    mgr = three_tiers(tmp_path)
    oracle = PageOracle(mgr)
    for prompt in PROMPTS[:5]:
        prefill(mgr, oracle, prompt)
    disk_slots = mgr._pool.tiers[2].storage.slots[0]
    free = disk_slots.num_free

    def interrupted(self, pages, slots):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Mover, "write_pages", interrupted)
        with pytest.raises(KeyboardInterrupt):
            prefill(mgr, oracle, PROMPTS[5])  # host memory is full: its victims go to disk
    assert disk_slots.num_free == free
    mgr.check_invariants()
    serve_every_prompt(mgr)
    mgr.close()


def test_a_create_cache_interrupted_while_it_adopts_its_prefix_holds_nothing(tmp_path, monkeypatch):
    mgr = three_tiers(tmp_path)
    oracle = PageOracle(mgr)
    prefill(mgr, oracle, PROMPTS[0])

    def interrupted(self, reused):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(kvtier.KVCache, "_count_reuse_by_tier", interrupted)
        with pytest.raises(KeyboardInterrupt):
            mgr.create_cache([*PROMPTS[0], 1])
    mgr.check_invariants()  # a page held by no open cache would be reported
    serve_every_prompt(mgr)
    mgr.close()


def ctrl_c_inside(monkeypatch, cls, name: str, times: int = 1) -> list[str]:
    """``cls.name`` receives ``times`` real SIGINTs (Ctrl-C) as it starts (Python handles them at
    its next bytecode); the list returned gets ``name`` each time the method itself runs."""
    original = getattr(cls, name)
    ran: list[str] = []

    def interrupted(*args, **kwargs):
        for _ in range(times):
            signal.raise_signal(signal.SIGINT)
        ran.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(cls, name, interrupted)
    return ran


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_a_ctrl_c_inside_a_close_waits_for_its_end(monkeypatch):
    """Before, the KeyboardInterrupt landed inside the release of the cache's pages: the pages not yet
    released kept a hold and a lock of no cache, for good (a later request for the whole tier failed).
    An early cut of the deferral raised a second Ctrl-C at once, there again."""
    spec = small_spec("llama")
    d = page_demand(spec)
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(int(d * 8) + 1)]))
    oracle = PageOracle(mgr)
    handler_before = signal.getsignal(signal.SIGINT)
    cache = prefill(mgr, oracle, conversation(1, 6 * TPB - 1), keep=True)
    with monkeypatch.context() as patch:
        ctrl_c_inside(patch, Residency, "release_all")
        with pytest.raises(KeyboardInterrupt):
            cache.close()
    assert cache.state is kvtier.CacheState.CLOSED
    mgr.check_invariants()
    whole = mgr.create_cache(conversation(2, 1))
    assert whole.resume() and whole.resize(8 * TPB)  # every primary page can be had
    whole.close()
    cache = prefill(mgr, oracle, conversation(3, 5), keep=True)
    with monkeypatch.context() as patch:  # Ctrl-C pressed twice: one interrupt, at the end too
        ran = ctrl_c_inside(patch, Residency, "release_all", times=2)
        with pytest.raises(KeyboardInterrupt):
            cache.close()
    assert ran  # the release ran, and then the interrupt was raised
    mgr.check_invariants()
    assert signal.getsignal(signal.SIGINT) is handler_before  # outside calls: the process's own handler
    mgr.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_the_command_lines_sigterm_inside_a_close_waits_for_its_end(monkeypatch, sigint_handler):
    """``kvtier``'s SIGTERM handler interrupts as Ctrl-C does, kept to the end of the call even where
    SIGINT is ignored (a background job of a script: no SIGINT wrapper is installed then)."""
    from kvtier.cli import _sigterm_as_interrupt

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mgr = eight_page_manager()
    oracle = PageOracle(mgr)
    cache = prefill(mgr, oracle, conversation(7, 6 * TPB - 1), keep=True)
    original = Residency.release_all
    ran = []

    def terminated(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)
        ran.append("release_all")
        return original(*args, **kwargs)

    handler_before = signal.getsignal(signal.SIGTERM)
    with _sigterm_as_interrupt() as got, monkeypatch.context() as patch:
        patch.setattr(Residency, "release_all", terminated)
        with pytest.raises(KeyboardInterrupt):
            cache.close()
    assert set(got) == {signal.SIGTERM} and len(ran) == len(got)  # every release ran, then one interrupt
    assert signal.getsignal(signal.SIGTERM) is handler_before
    assert cache.state is kvtier.CacheState.CLOSED
    mgr.check_invariants()
    whole = mgr.create_cache(conversation(8, 1))
    assert whole.resume() and whole.resize(8 * TPB)  # every primary page can be had
    whole.close()
    mgr.close()


@pytest.mark.parametrize("where", ["chain", "match"])
def test_a_create_cache_cut_short_while_it_builds_the_cache_leaves_the_next_call_working(monkeypatch, where):
    """Cut short as it makes its published chain, or in its match. Before, the half-built cache was
    taken for one dropped without ``close``, and the next call raised ``AttributeError: 'KVCache'
    object has no attribute '_pending'`` (or ``'_hits'``, cut short in the match) as it closed it."""
    spec = small_spec("llama")
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(int(page_demand(spec) * 8) + 1)]))

    def cut_short(*args, **kwargs):
        raise MemoryError(where)

    with monkeypatch.context() as patch:
        if where == "chain":
            patch.setattr(cache_module, "PublishedChain", cut_short)
        else:
            patch.setattr(type(mgr._pool), "match", cut_short)
        with pytest.raises(MemoryError):
            mgr.create_cache(conversation(4, 9))
    gc.collect()
    cache = mgr.create_cache(conversation(4, 9))
    assert cache.resume()
    cache.close()
    mgr.check_invariants()
    mgr.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_a_cache_whose_creation_a_ctrl_c_cut_short_is_closed_before_it_is_raised(monkeypatch, caplog):
    """The cache made by the call is never returned, so it is closed then. Before, it was found
    dropped without ``close`` at the next call, with a WARNING blaming the caller."""
    spec = small_spec("llama")
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(int(page_demand(spec) * 8) + 1)]))
    oracle = PageOracle(mgr)
    prefill(mgr, oracle, conversation(5, 3 * TPB))
    with monkeypatch.context() as patch:
        ctrl_c_inside(patch, type(mgr._pool), "match")
        with pytest.raises(KeyboardInterrupt):
            mgr.create_cache([*conversation(5, 3 * TPB), 1])
    gc.collect()
    serve = mgr.create_cache([*conversation(5, 3 * TPB), 1])
    assert serve.num_reused_tokens == 3 * TPB and serve.resume()
    oracle.check(serve, [*conversation(5, 3 * TPB), 1])
    serve.close()
    mgr.check_invariants()
    assert "dropped without close" not in caplog.text
    mgr.close()


@pytest.fixture
def sigint_handler():
    """The test may install SIGINT handlers; the one before is put back after."""
    saved = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, saved)


def eight_page_manager() -> kvtier.KVCacheManager:
    spec = small_spec("llama")
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(int(page_demand(spec) * 8) + 1)]))


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_a_ctrl_c_handler_that_does_not_raise_gets_the_calls_result(monkeypatch, sigint_handler):
    """A handler that only sets a flag (asyncio's first Ctrl-C cancels a task and returns): the
    call's result is the caller's. Before, the cache was closed as if the interrupt were raised."""
    stops = []
    signal.signal(signal.SIGINT, lambda signum, frame: stops.append(signum))
    mgr = eight_page_manager()
    with monkeypatch.context() as patch:
        ctrl_c_inside(patch, type(mgr._pool), "match")
        cache = mgr.create_cache(conversation(6, 9))
    assert stops == [signal.SIGINT]  # handed on once, at the end of the call
    assert cache.state is kvtier.CacheState.SUSPENDED and cache.resume()
    cache.close()
    mgr.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_a_handler_installed_after_the_first_manager_is_deferred_too(monkeypatch, sigint_handler):
    """Jupyter puts Python's default handler back before every cell. Before, only the handler in
    place when the first manager was made was wrapped, so from the next cell on a Ctrl-C landed
    inside the bookkeeping again; and a handler that chains to the one it replaced (a second
    manager made after it) recursed until ``RecursionError``."""
    mgr = eight_page_manager()
    oracle = PageOracle(mgr)
    cache = prefill(mgr, oracle, conversation(7, 3 * TPB), keep=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the next cell
    with monkeypatch.context() as patch:
        ctrl_c_inside(patch, Residency, "release_all")
        with pytest.raises(KeyboardInterrupt):
            cache.close()
    mgr.check_invariants()
    cleanups = []
    wrapped = signal.getsignal(signal.SIGINT)

    def chained(signum, frame):
        cleanups.append(signum)
        wrapped(signum, frame)

    signal.signal(signal.SIGINT, chained)
    second = eight_page_manager()
    cache = prefill(second, PageOracle(second), conversation(8, 3 * TPB), keep=True)
    with monkeypatch.context() as patch:
        ctrl_c_inside(patch, Residency, "release_all")
        with pytest.raises(KeyboardInterrupt):
            cache.close()
    assert cleanups == [signal.SIGINT]
    second.check_invariants()
    second.close()
    mgr.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_a_ctrl_c_while_a_resume_waits_for_its_disk_reads_cuts_the_wait_short(tmp_path, monkeypatch):
    """The disk I/O a call waits for may be cut short (the call marks what did not arrive): a real
    Ctrl-C there is raised at once, not when the resume would have ended."""
    mgr = three_tiers(tmp_path)
    oracle = PageOracle(mgr)
    for prompt in PROMPTS:
        prefill(mgr, oracle, prompt)  # 6 x 3 pages through 8 + 8: the first prompt ends on disk
    real = page_files._run

    def run(pool, fn, *iterables):
        if "out" in fn.__code__.co_varnames:  # the page read's worker: Ctrl-C while it reads
            signal.raise_signal(signal.SIGINT)
        return real(pool, fn, *iterables)

    cache = mgr.create_cache([*PROMPTS[0], 1])
    assert cache.reused_by_tier["disk"] > 0
    with monkeypatch.context() as patch:
        patch.setattr(page_files, "_run", run)
        with pytest.raises(KeyboardInterrupt):
            cache.resume()
    assert cache.state is kvtier.CacheState.SUSPENDED  # the resume was cut short, not finished
    mgr.check_invariants()
    assert cache.resume()
    oracle.check(cache, [*PROMPTS[0], 1])
    cache.close()
    mgr.close()


def test_outside_calls_the_process_keeps_its_own_sigint_handler(sigint_handler):
    """``asyncio.run`` installs its graceful Ctrl-C handler only over Python's default one. Before,
    the wrapper stayed installed after the first call, so it never did."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mgr = eight_page_manager()
    mgr.create_cache(conversation(9, 9)).close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    mgr.close()


def test_a_wrapper_left_installed_is_never_wrapped_again(sigint_handler):
    """A Ctrl-C between the wrapper's installation and the call's count leaves the wrapper in
    place; the next call wraps the handler under it, and puts that one back after."""
    from kvtier import interrupts

    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert interrupts.enter()
    left = signal.getsignal(signal.SIGINT)
    interrupts._depth = 0  # as if the interrupt had come before the count
    interrupts._installed = None
    mgr = eight_page_manager()
    mgr.create_cache(conversation(10, 9)).close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and left is not signal.default_int_handler
    mgr.close()
