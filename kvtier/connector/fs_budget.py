"""The byte budget of a ``FileSystemStore``'s directory: least recently used values are removed.

Values live in fan-out directories ``<root>/<xx>/<yy>/`` (two hex digits each) as ``<h>.page``
files; a file's modification time is its value's last use. Temporary files (``.<name>.tmp``)
are a writer's while it writes; one older than ``STALE_TEMP_S`` was left by a killed writer and is
removed by the next scan. Other entries under the root are not the store's and are never touched.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvtier.connector.daemon_pool import DaemonPool

log = logging.getLogger(__name__)

VALUE_SUFFIX: Final = ".page"
TEMP_SUFFIX: Final = ".tmp"
EVICT_TO: Final = 0.9  # an eviction pass leaves at most this share of the budget
STALE_TEMP_S: Final = 600.0  # a temporary file this old was left by a killed writer
FUTURE_STAMP_S: Final = 300.0  # a value stamped further ahead was written before the clock went back
PROGRESS_TIMEOUT_S: Final = 2.0  # ``make_room`` gives up on passes that neither scan nor remove for this long
_HEX: Final = frozenset("0123456789abcdef")


@dataclass(slots=True)
class _Value:
    """A value file found by a scan: its size and last use (modification time) then."""

    path: str
    size: int
    mtime_ns: int


class StoreBudget:
    """Keeps a store's directory under ``max_bytes``, and within a full file system, by evicting the
    least recently used values.

    Each process keeps an estimate of the directory's bytes: its last scan (at its first write,
    then at each pass), less what that pass removed, plus what it wrote since. When the estimate
    passes ``max_bytes``, or the process has written ``(1 - EVICT_TO) * max_bytes`` since its last
    scan (what others wrote meanwhile is in no estimate of its own), it scans the directory again,
    so every process's files count, and removes the values used longest ago until at most
    ``EVICT_TO`` of the budget is left; a value used again since the scan (its time changed) is
    kept. So between passes each writing process adds at most about ``(1 - EVICT_TO) *
    max_bytes`` (and one batch) unseen by the others, and P processes writing at once may overshoot
    by about P times that. A value larger than ``EVICT_TO`` of the budget could not outlive a pass
    (it would take the others with it): the store refuses it (``value_limit``).

    A file system smaller than ``max_bytes`` (or a quota) fills before the estimate passes it:
    writes then fail for want of space, and ``make_room`` runs a pass sized by the bytes the scan
    finds and the writes that failed instead. Passes of several processes may overlap: each only
    removes files, and one already gone is fine.

    Passes run on a thread of their own, one at a time, never on a writer's: a scan of a large
    directory takes about a second per 200,000 values on a local disk, far more over a network,
    and a writer (a save ``generate`` waits for) would wait for it. ``add`` starts a pass and
    returns at once (it waits only for writes that outpace the passes). ``make_room`` waits for its
    pass while passes make progress (a directory scanned or a value removed at least every
    ``timeout_s``), else answers that no room was made: a pass on a file system that hangs holds
    only its thread, and no other pass starts behind it until it ends. ``close`` lets the passes
    started end (within its timeout), then stops one between two files. A process that exits
    without ``close`` may leave its last pass undone: the directory stays over the budget by what it
    wrote since its last pass (at most about ``1 - EVICT_TO`` of it) until another writer's pass.
    """

    def __init__(self, root: Path, max_bytes: int, timeout_s: float = PROGRESS_TIMEOUT_S) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._used: int | None = None  # None until the first pass has counted the directory
        self._added = 0  # bytes written since the running (or last) pass ended its scan
        self._worker = DaemonPool(1, "kvtier-fs-store-budget")
        self._counting: Future | None = None  # the last pass ``add`` started
        self._passes: list[Future] = []  # passes started and perhaps not ended
        self._hung: Future | None = None  # a pass waited for in vain (not waited for again; none queued behind it)
        self._progress = time.monotonic()  # when a pass last scanned a directory or removed a value
        self._closed = False

    @property
    def value_limit(self) -> int:
        """The largest value a pass leaves in place when it is the only one: ``EVICT_TO`` of the budget."""
        return int(self.max_bytes * EVICT_TO)

    def add(self, written: int) -> None:
        """Count ``written`` new bytes; past the budget, past ``1 - EVICT_TO`` of it written since the
        last scan, or before the first count, start a pass unless one runs. Waits only when the
        estimate is more than ``1 - EVICT_TO`` of the budget over it while a pass runs (writes
        outpacing the passes): for that pass, while it makes progress (not again for a pass given
        up on)."""
        if not written:
            return
        with self._lock:
            self._added += written
            if self._used is not None:
                self._used += written
            running = self._counting
            unseen = self._added > self.max_bytes - self.value_limit  # others' writes are in no estimate here
            over = self._used is None or self._used > self.max_bytes or unseen
            if over and (running is None or running.done()):
                self._counting = self._start(self._count_and_evict)
                return
            far_over = self._used is not None and self._used > self.max_bytes * (2 - EVICT_TO)
        if far_over and running is not None and running is not self._hung and not self._ended(running):
            self._hung = running

    def make_room(self, sizes: list[int], quota_spent: bool = False) -> list[int]:
        """After writes of ``sizes`` bytes each found no space: the indices, ascending, of those that
        removing values made room for (none when the passes made no progress for ``timeout_s``, or
        while a pass given up on that way still runs), once the least recently used values are removed until at
        most ``EVICT_TO`` of the value bytes there are left and at least those writes' bytes are gone.
        Concurrent callers' passes run one after the other.

        The room is the blocks the values take plus the space the file system still has free, none
        when a quota is spent (``quota_spent``: a quota is not in ``statvfs``); writes are taken
        smallest first, in whole blocks, while they fit. A write that could not fit even in
        an emptied store removes nothing for itself."""
        with self._lock:
            if self._hung is not None and not self._hung.done():
                return []  # a pass given up on still runs: its file system hangs
            future = self._start(self._room_for, sizes, quota_spent)
        if future is None:
            return []
        if not self._ended(future):
            self._hung = future
            return []
        try:
            return future.result()
        except Exception:  # cancelled by ``close``, or the pass failed (``_report`` logged it)
            return []

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until the passes started so far, and those they queued after them, have ended; False
        after ``timeout_s`` (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                marker = self._worker.submit(_nothing)
            except RuntimeError:  # closed: no pass starts any more, a running one stops at its next file
                return True
            try:
                marker.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                marker.cancel()  # (not left queued behind a pass that hangs)
                return False
            with self._lock:
                queued = self._counting
            if queued is None or queued.done():
                return True

    def close(self, timeout_s: float | None = None) -> None:
        """Take no more passes; let those started end within ``timeout_s`` (None: no limit), then
        stop one still running between two files."""
        self._worker.shutdown(wait=True, timeout=timeout_s)
        self._closed = True

    def _start(self, fn: Callable[..., Any], *args: Any) -> Future | None:
        """``fn(*args)`` queued on the passes' thread (the caller holds the lock), or None once closed."""
        if self._closed:
            return None
        self._passes = [f for f in self._passes if not f.done()]
        if not self._passes:
            self._progress = time.monotonic()  # nothing runs: the wait starts now
        try:
            future = self._worker.submit(fn, *args)
        except RuntimeError:  # closed meanwhile, or no thread can be started: no pass this time
            return None
        future.add_done_callback(self._report)
        self._passes.append(future)
        return future

    def _report(self, future: Future) -> None:
        """Log a pass that raised (nobody else reads an ``add`` pass's future)."""
        if not future.cancelled() and future.exception() is not None:
            log.warning("kvtier fs store: an eviction pass under %s failed: %r", self.root, future.exception())

    def _ended(self, future: Future) -> bool:
        """Wait for a pass while passes make progress; False (and a WARNING) once none was made for ``timeout_s``."""
        while True:
            idle = time.monotonic() - self._progress
            try:
                future.exception(timeout=max(0.0, self.timeout_s - idle))
                return True
            except FutureTimeout:
                if time.monotonic() - self._progress >= self.timeout_s:
                    log.warning(
                        "kvtier fs store: an eviction pass under %s made no progress for %g s (the file "
                        "system hangs?); writes go on without it (those that found the disk full fail)",
                        self.root,
                        self.timeout_s,
                    )
                    return False
            except CancelledError:
                return True

    def _count_and_evict(self) -> None:
        """A pass of ``add``: count the directory's values, evict past the budget. When writes made
        meanwhile put the estimate over the budget again, the next pass is queued at once: no later
        write need come for it (a burst of saves ending during a pass left the directory over the
        budget until the next save). Without such writes none is: a pass whose removals failed (a
        read-only mount, values of other users) is not repeated until the next write."""
        values = self._scan_afresh()
        used = sum(v.size for v in values)
        if used > self.max_bytes:
            used = self.evict(values, self.value_limit)
        with self._lock:
            self._used = used + self._added
            written = self._added  # (nothing written meanwhile: no pass follows, even one that evicted too little)
            if written and (self._used > self.max_bytes or written > self.max_bytes - self.value_limit):
                self._counting = self._start(self._count_and_evict)

    def _room_for(self, sizes: list[int], quota_spent: bool) -> list[int]:
        """A pass of ``make_room``."""
        values = self._scan_afresh()
        present = sum(v.size for v in values)
        free, block = _space(self.root)
        room = sum(_in_blocks(v.size, block) for v in values) + (0 if quota_spent else free)
        taken: list[int] = []
        needed = held = 0  # the taken writes' bytes, and the blocks they take
        for i in sorted(range(len(sizes)), key=sizes.__getitem__):
            blocks = _in_blocks(sizes[i], block)
            if held + blocks > room:
                break
            taken.append(i)
            needed += sizes[i]
            held += blocks
        if taken:
            left = self.evict(values, max(0, min(int(present * EVICT_TO), present - needed)))
            with self._lock:
                self._used = left + self._added
        return sorted(taken)

    def _scan_afresh(self) -> list[_Value]:
        """``scan`` for a pass; ``_added`` restarts as it starts: a value written while the scan runs
        may be in it or not, so it stays counted as written since (an estimate too high by what the
        scan did see costs at most one pass more; one too low, as before, left values uncounted)."""
        with self._lock:
            self._added = 0
        return self.scan()

    def scan(self) -> list[_Value]:
        """Every value file under the root. Temporary files older than ``STALE_TEMP_S`` are removed,
        and so are those stamped more than ``FUTURE_STAMP_S`` ahead (left by a writer killed while
        the clock was ahead), and fan-out directories found empty (left by a pass cut short)."""
        values = []
        now = time.time_ns()
        stale_before, ahead = now - int(STALE_TEMP_S * 1e9), now + int(FUTURE_STAMP_S * 1e9)
        for leaf in self._leaf_dirs():
            if self._closed:
                break  # (a pass cut short by ``close``: what it found so far)
            self._progress = time.monotonic()
            entries = _entries(leaf)
            if not entries:
                _remove_if_empty(leaf)
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                name = entry.name
                if name.endswith(VALUE_SUFFIX) and not name.startswith("."):
                    values.append(_Value(entry.path, st.st_size, st.st_mtime_ns))
                elif name.endswith(TEMP_SUFFIX) and not stale_before <= st.st_mtime_ns <= ahead:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        return values

    def evict(self, values: list[_Value], target: int) -> int:
        """Remove the least recently used of ``values`` (a scan) until at most ``target`` bytes of them
        remain; the bytes left. A value stamped more than ``FUTURE_STAMP_S`` ahead was written while
        the clock was ahead and not used since it was set back (a use stamps it now): it counts as
        the least recent. One stamped a little ahead (another host's clock, a file server's) is
        as recent as its stamp says. Fan-out directories left empty are removed (a writer makes
        them again), so the directory's size follows the values it holds, not its history."""
        left = sum(v.size for v in values)
        future = time.time_ns() + int(FUTURE_STAMP_S * 1e9)
        values.sort(key=lambda v: v.mtime_ns if v.mtime_ns <= future else 0)
        failed: list[OSError] = []
        removed = 0
        emptied: set[str] = set()  # leaf directories a value was removed from
        for value in values:
            if left <= target or self._closed:
                break
            self._progress = time.monotonic()
            try:
                if os.stat(value.path).st_mtime_ns != value.mtime_ns:
                    continue  # read or rewritten since the scan: recently used after all
                os.unlink(value.path)
                removed += 1
                emptied.add(os.path.dirname(value.path))
            except FileNotFoundError:
                pass  # evicted by another process
            except OSError as exc:
                failed.append(exc)
                continue
            left -= value.size
        for leaf in emptied:
            _remove_if_empty(leaf)
        if failed:
            log.warning("kvtier fs store: %d evictions under %s failed: %s", len(failed), self.root, failed[0])
        log.debug("kvtier fs store: evicted %d values under %s; %d bytes left", removed, self.root, left)
        return left

    def _leaf_dirs(self) -> Iterator[str]:
        """The fan-out directories ``<root>/<xx>/<yy>`` (other entries under the root are not the store's);
        none listed once closed."""
        for top in _entries(self.root):
            if _is_fan_out(top) and not self._closed:
                yield from (leaf.path for leaf in _entries(top.path) if _is_fan_out(leaf))


def _nothing() -> None:
    """A call that marks its place in the passes' queue (``StoreBudget.wait``)."""


def _entries(path: str | Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _remove_if_empty(leaf: str) -> None:
    """Remove a fan-out leaf directory and then its top one, each if empty (a writer makes them again)."""
    for directory in (leaf, os.path.dirname(leaf)):
        try:
            os.rmdir(directory)
        except OSError:  # not empty (or gone): the level above is not either
            return


def _is_fan_out(entry: os.DirEntry) -> bool:
    name = entry.name
    return len(name) == 2 and name[0] in _HEX and name[1] in _HEX and entry.is_dir(follow_symlinks=False)


def _in_blocks(size: int, block: int) -> int:
    """The bytes of the whole blocks that ``size`` bytes take."""
    return -(-size // block) * block


def _space(root: Path) -> tuple[float, int]:
    """(bytes an unprivileged writer may still add to the file system under ``root``, its block
    size); (infinite, 1) when it cannot be told."""
    try:
        st = os.statvfs(root)
    except (OSError, AttributeError):  # no such directory any more; no statvfs on this platform
        return math.inf, 1
    return st.f_bavail * st.f_frsize, max(1, st.f_frsize)
