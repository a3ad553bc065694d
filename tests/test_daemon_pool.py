"""``DaemonPool``: calls on daemon threads, given up on when hung, never lost."""

from __future__ import annotations

import threading

import pytest

from kvtier.connector.daemon_pool import DaemonPool


def test_a_thread_that_cannot_be_started_loses_no_call(monkeypatch):
    """Before, the call was queued first: with no thread started it waited for ever, and the
    thread that never started counted as one of the pool's (``shutdown`` then raised)."""
    pool = DaemonPool(2, "test-pool")
    assert pool.submit(lambda: 1).result(timeout=5) == 1  # one thread runs
    start = threading.Thread.start

    def refused(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refused)
    assert pool.submit(lambda: 2).result(timeout=5) == 2  # the running thread takes it
    empty = DaemonPool(1, "test-empty")
    with pytest.raises(RuntimeError, match="start new thread"):
        empty.submit(lambda: 3)
    monkeypatch.setattr(threading.Thread, "start", start)
    assert empty.submit(lambda: 4).result(timeout=5) == 4  # nothing of the refusal is left queued
    empty.shutdown(wait=True, timeout=5)
    pool.shutdown(wait=True, timeout=5)


def test_threads_given_up_on_once_are_not_given_up_on_again():
    """A call's future names the threads it was queued for: giving those up a second time (another
    caller hung on them) leaves the new threads and their calls alone."""
    pool = DaemonPool(1, "test-abandon")
    gate = threading.Event()
    hung = pool.submit(gate.wait)
    pool.abandon(hung.generation)
    assert pool.hung_threads() == 1
    fresh = pool.submit(lambda: "sound")
    pool.abandon(hung.generation)  # again, for the same old threads: nothing happens
    assert fresh.result(timeout=5) == "sound" and not fresh.cancelled()
    gate.set()
    pool.shutdown(wait=True, timeout=5)
