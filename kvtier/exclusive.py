"""One thread at a time inside a manager: calls that change shared state claim it, others are refused.

A ``KVCacheManager`` and its caches share one tree, one set of tiers and one page table, with no
lock around them: two threads inside them at once would break their invariants silently. So
every call that changes that shared state (``create_cache``, ``prefetch``, ``close``, a cache's
``resume`` / ``suspend`` / ``close``, a ``resize`` that adds or frees blocks, a ``commit`` that
publishes) claims the manager's guard for its duration, without waiting: a call from a second
thread while the first is inside raises ``CacheStateError`` before it changes anything.

What is detected is concurrent use, not a change of thread: a manager created on one thread and
driven from another, or handed between threads between calls, works. Calls that change only one
cache's own lengths (``resize`` within its blocks, ``commit`` inside a block: the decode step)
and reads (``stats``, ``kv_views``, ``layout``, ``page_indices``) do not claim it, so they cost
nothing extra; a cache itself belongs to one thread at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Final, Protocol, TypeVar

from kvtier import interrupts
from kvtier.errors import CacheStateError

CONCURRENT_USE: Final = (
    "another thread is inside a call on this KVCacheManager or one of its caches: drive a manager from one "
    "thread at a time (hand it over between calls, or serialise the calls with a lock)"
)


class Guarded(Protocol):
    """An object whose calls claim ``_guard``: a ``threading.RLock`` shared by a manager and its caches."""

    _guard: Any


F = TypeVar("F", bound=Callable[..., Any])
_NOTHING: Final = object()  # a claimed call that returned nothing yet


def exclusive(method: F) -> F:
    """Run ``method`` with its object's manager claimed; ``CacheStateError`` if another thread holds it.

    The guard is reentrant: a claimed call may make others on the same thread (``close`` closes
    caches). It never waits, so a misuse fails at once instead of deadlocking. A Ctrl-C on the
    main thread during the call is raised when it ends (``kvtier.interrupts``).
    """

    @functools.wraps(method)
    def claimed(self: Guarded, *args: Any, **kwargs: Any) -> Any:
        on_main_thread = interrupts.enter()  # a Ctrl-C from here on waits for the call's end
        result = _NOTHING
        try:
            guard = self._guard
            if not guard.acquire(False):
                raise CacheStateError(CONCURRENT_USE)
            try:
                result = method(self, *args, **kwargs)
            finally:
                guard.release()
        finally:
            if on_main_thread:
                try:
                    interrupts.leave()  # a Ctrl-C kept during the call is handed on now
                except BaseException:
                    if result is not _NOTHING:
                        _let_go_of(result)  # the caller never receives it: the interrupt is raised instead
                    raise
        return result

    return claimed  # type: ignore[return-value]


def _let_go_of(result: Any) -> None:
    """What a call cut short by Ctrl-C made is let go of: a cache closed, a prefetch cancelled."""
    for name in ("close", "cancel"):
        let_go = getattr(result, name, None)
        if callable(let_go):
            let_go()
            return
