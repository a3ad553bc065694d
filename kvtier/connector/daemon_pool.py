"""``DaemonPool``: a few daemon threads that run calls in the order submitted.

It stands in for ``concurrent.futures.ThreadPoolExecutor`` where a call may hang for good (a read
from a dead network mount): the interpreter's exit joins every executor's threads, and so would
wait for such a call for ever; it never waits for a daemon thread. Whoever needs a call's result
waits for its future (a save is waited for by the connector's ``close``, and at exit). A caller
that gave up on calls hung that way hands their threads over to them (``abandon``): later calls
run on new threads. To tell a hung call from one queued behind others' work, or from a long one
still making progress, a future's ``active_at`` is set (``time.monotonic()``) when its call
starts and again whenever the call reports progress (``note_progress``), and ``last_finished``
says when the pool last finished a call or one of its calls reported progress (a call queued
behind long ones that progress is not stuck); a future's ``generation`` names the threads it was
queued for.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

_Call = tuple[Future, Callable[..., Any], tuple]
_running = threading.local()  # ``future``, ``finished_at``: the call this pool thread runs, its pool's stamp


def note_progress() -> None:
    """Called inside a pool's call (a chunk of a long read or write done): its future's ``active_at``
    and its pool's ``last_finished`` move to now, so that a caller takes neither a long call that
    makes progress nor a call queued behind it for a hung one. Does nothing on a thread of no pool."""
    future = getattr(_running, "future", None)
    if future is not None:
        now = time.monotonic()
        future.active_at = now
        _running.finished_at[0] = now


class DaemonPool:
    """Runs calls on up to ``workers`` daemon threads (started on the first calls), first in, first out.

    Invariant: every future ``submit`` returned ends done (with a result or an exception) or
    cancelled, unless its call never returns. The threads hold the queue of calls, never the
    pool: a pool dropped without ``shutdown`` stops its threads once their calls are over.
    """

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"a pool needs at least one worker, got {workers}")
        self._workers = workers
        self._name = name
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._finished_at = [time.monotonic()]  # when a call of this generation of threads last ended
        self._abandoned: list[threading.Thread] = []  # threads left to hung calls, perhaps still alive
        self._generation = 0  # of the current threads: one more at each ``abandon``
        self._lock = threading.Lock()
        self._closed = False
        self._stop = weakref.finalize(self, _stop_threads, self._calls, self._threads)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """A future of ``fn(*args)``, run on one of the pool's threads; ``RuntimeError`` after ``shutdown``
        (or when no thread can be started)."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: submit after shutdown")
            if len(self._threads) < self._workers:
                thread = threading.Thread(
                    target=_work,
                    args=(self._calls, self._finished_at),
                    name=f"{self._name}-{len(self._threads)}",
                    daemon=True,
                )
                try:
                    thread.start()
                except RuntimeError:  # no thread can be started now: the pool's others run the call
                    if not self._threads:
                        raise
                else:
                    self._threads.append(thread)
            future.generation = self._generation  # type: ignore[attr-defined]
            self._calls.put((future, fn, args))
        return future

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> list[Any]:
        """``[fn(*args) for args in zip(*iterables)]``, the calls spread over the pool's threads; the
        first exception raised is raised here once every call ended."""
        futures = [self.submit(fn, *args) for args in zip(*iterables, strict=True)]
        return [future.result() for future in futures]

    def last_finished(self) -> float:
        """When a call of the current threads last ended or reported progress (the pool's start, before any)."""
        return self._finished_at[0]

    def hung_threads(self) -> int:
        """Threads handed over to hung calls (``abandon``) that are still alive."""
        with self._lock:
            self._abandoned = [thread for thread in self._abandoned if thread.is_alive()]
            return len(self._abandoned)

    def abandon(self, generation: int) -> None:
        """Leave the running calls (hung, as a read of a dead mount) to their threads, and start afresh:
        the calls queued and not started are cancelled, and later calls run on new threads. The old
        threads end as soon as their calls return (if ever); nothing waits for them. ``generation``:
        the ``generation`` of a hung call's future; threads already given up on are not given up
        on again (which would cancel the calls of the threads that replaced them)."""
        with self._lock:
            if self._closed or generation != self._generation:
                return
            self._generation += 1
            _cancel_queued(self._calls)
            self._stop()  # the old threads' end markers, on the old queue
            self._abandoned += self._threads
            self._calls = queue.SimpleQueue()
            self._threads = []
            self._finished_at = [time.monotonic()]
            self._stop = weakref.finalize(self, _stop_threads, self._calls, self._threads)

    def shutdown(self, wait: bool = False, timeout: float | None = None) -> None:
        """Take no more calls. With ``wait``, the calls queued still run, and this returns once every
        call ended, or after ``timeout`` seconds (None: no limit; a thread still in a call is left to
        it); without, the calls not started yet are cancelled and nothing is waited for."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not wait:
                _cancel_queued(self._calls)
            self._stop()  # after the calls queued: each thread ends on its marker
        if wait:
            deadline = None if timeout is None else time.monotonic() + timeout
            for thread in self._threads:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _cancel_queued(calls: queue.SimpleQueue) -> None:
    """Cancel every call still queued (end markers included: the caller queues new ones)."""
    while True:
        try:
            call = calls.get_nowait()
        except queue.Empty:
            return
        if call is not None:
            call[0].cancel()


def _stop_threads(calls: queue.SimpleQueue, threads: list[threading.Thread]) -> None:
    """One end marker per thread, queued after the calls there."""
    for _ in threads:
        calls.put(None)


def _work(calls: queue.SimpleQueue, finished_at: list[float]) -> None:
    _running.finished_at = finished_at  # (this generation's: an abandoned thread's progress counts for none after)
    while True:
        call = calls.get()
        if call is None:
            return
        _run(*call)
        finished_at[0] = time.monotonic()
        del call  # (nothing of a call outlives it while the thread waits: the pool may be dropped)


def _run(future: Future, fn: Callable[..., Any], args: tuple) -> None:
    if not future.set_running_or_notify_cancel():
        return
    future.active_at = time.monotonic()  # type: ignore[attr-defined]
    _running.future = future
    try:
        result = fn(*args)
    except BaseException as exc:  # handed to the future's reader, as an executor does
        future.set_exception(exc)
    else:
        future.set_result(result)
    finally:
        _running.future = None
