"""``DaemonPool``: a few daemon threads that run calls in the order submitted.

It stands in for ``concurrent.futures.ThreadPoolExecutor`` where a call may hang for good (a read
from a dead network mount) and nothing needs its result once the process leaves: the
interpreter's exit joins every executor's threads, and so would wait for such a call for ever;
it never waits for a daemon thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any


class DaemonPool:
    """Runs calls on up to ``workers`` daemon threads (started on the first calls), first in, first out.

    Invariant: every future ``submit`` returned ends done (with a result or an exception) or
    cancelled, unless its call never returns; ``shutdown`` cancels the calls not started yet and
    waits for none.
    """

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"a pool needs at least one worker, got {workers}")
        self._workers = workers
        self._name = name
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """A future of ``fn(*args)``, run on one of the pool's threads; ``RuntimeError`` after ``shutdown``."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: submit after shutdown")
            self._calls.put((future, fn, args))
            if len(self._threads) < self._workers:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> list[Any]:
        """``[fn(*args) for args in zip(*iterables)]``, the calls spread over the pool's threads; the
        first exception raised is raised here once every call ended."""
        futures = [self.submit(fn, *args) for args in zip(*iterables, strict=True)]
        return [future.result() for future in futures]

    def shutdown(self, wait: bool = False) -> None:
        """Cancel the calls not started yet; the threads end once their running calls return (with
        ``wait``, this call returns only then)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:
                try:
                    call = self._calls.get_nowait()
                except queue.Empty:
                    break
                if call is not None:
                    call[0].cancel()
            for _ in self._threads:
                self._calls.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the future's reader, as an executor does
                future.set_exception(exc)
            else:
                future.set_result(result)
