"""Saves of pages to a store (a finished request's, a vLLM write-through), written in batches.

A store call costs a round trip whatever it carries: over a distant store (a Redis 0.4 s away)
sixteen requests' saves of one check and one write each took seconds, request after request.
Here each save is queued, and a save thread that becomes free takes every save
queued by then (up to ``MAX_BATCH_BYTES`` of pages, at least one save) and hands them to
``write`` as one batch: one existence check and one write for all of them, a block that several
requests share written once. While a batch is in flight the next ones gather, so the saves of a
busy engine cost a few round trips, not a few per request.

Invariant: every save's future ends done (a result, or the batch's exception) once a thread has
taken it (it is running meanwhile: a cancel then fails), and every save queued is followed in the
pool's queue by a drain of its own, so none is left behind (``shutdown`` runs the drains queued);
a save that ``submit`` refused is not queued.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

from kvtier.connector.daemon_pool import DaemonPool

MAX_BATCH_BYTES: Final = 256 << 20  # pages a batch copies out of the cache at most (one save may be larger)


@dataclass(slots=True, eq=False)
class Save:
    """One request's pages to save, as ``(key, group, slot, missing)`` (``missing``: its ask
    found the key missing from the store), the event after the forwards that wrote them (None off
    CUDA), their bytes, and the future its caller waits on."""

    pages: list[tuple[str, int, int, bool]]
    written: Any
    nbytes: int
    done: Future = field(default_factory=Future)


class SaveBatches:
    """Saves queued by ``submit``, written by ``threads`` daemon threads in batches (``write``)."""

    def __init__(self, threads: int, name: str, write: Callable[[list[Save]], None]) -> None:
        self._write = write
        self._queued: list[Save] = []
        self._closed = False
        self._lock = threading.Lock()
        self._pool = DaemonPool(threads, name)

    def submit(self, pages: list[tuple[str, int, int, bool]], written: Any, nbytes: int) -> Future:
        """Queue a request's save; its future ends when the batch that took it is written."""
        save = Save(pages, written, nbytes)
        with self._lock:
            if self._closed:
                raise RuntimeError("save batches: submit after shutdown")
            self._queued.append(save)
        try:
            self._pool.submit(self._drain)
        except RuntimeError:  # no thread could be started: not taken, unless a drain took it meanwhile
            with self._lock:
                if save in self._queued:
                    self._queued.remove(save)
                    raise
        return save.done

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Take no more saves and wait until those queued are written (at most ``timeout_s``; None: no limit)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, timeout=timeout_s)

    def _drain(self) -> None:
        """Write the saves queued now, oldest first, as one batch (nothing when others took them)."""
        with self._lock:
            taken, nbytes = 0, 0
            for save in self._queued:
                if taken and nbytes + save.nbytes > MAX_BATCH_BYTES:
                    break
                taken += 1
                nbytes += save.nbytes
            batch, self._queued = self._queued[:taken], self._queued[taken:]
        batch = [save for save in batch if save.done.set_running_or_notify_cancel()]  # (a cancelled one is not written)
        if not batch:
            return
        try:
            self._write(batch)
        except BaseException as exc:  # each request's reader sees it (``get_finished`` logs it)
            for save in batch:
                save.done.set_exception(exc)
            return
        for save in batch:
            save.done.set_result(None)
