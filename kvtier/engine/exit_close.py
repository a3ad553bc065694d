"""Engines never closed are closed when the interpreter exits, so their saves are not lost.

An engine is tracked weakly from construction until ``close`` (a dropped engine is not kept
alive). At exit two hooks close what is still open, each waiting at most ``SAVE_TIMEOUT_S`` for
the connector's saves in flight:

- before the interpreter stops its thread pools (``threading._register_atexit``, the hook
  ``concurrent.futures`` uses; registered after it, so it runs first): the engines last driven
  by the exiting main thread. Their saves and disk writes still run on their pools here; later
  they could no longer be scheduled and would be lost.
- at ``atexit`` time, after every other thread has ended: the engines other threads drove (a
  thread still serving with one must not see it closed under it). Saves still running then
  may be lost; ``generate`` never leaves any behind.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook is registered first, so it runs after ours)
import logging
import os
import threading
import weakref
from typing import Protocol

log = logging.getLogger(__name__)

SAVE_TIMEOUT_S = 30.0


class Closable(Protocol):
    """What the exit hooks need of an engine (``LLMEngine``)."""

    driver_thread: int  # the thread that last drove it

    def close_within(self, save_timeout_s: float | None) -> bool:
        """Close, waiting at most this long for saves; False if some were still running."""
        ...


_OPEN: weakref.WeakSet[Closable] = weakref.WeakSet()


def track(engine: Closable) -> None:
    _OPEN.add(engine)


def untrack(engine: Closable) -> None:
    _OPEN.discard(engine)


def _forget_after_fork() -> None:
    """In a forked child: the engines open in the parent are the parent's (its managers refuse the
    child, ``kvtier.manager``), so the child's exit does not close them."""
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _close_open_engines(main_thread_only: bool) -> None:
    main = threading.main_thread().ident
    for engine in list(_OPEN):
        if main_thread_only and engine.driver_thread != main:
            continue
        try:
            if not engine.close_within(SAVE_TIMEOUT_S):
                log.error("kvtier engine: connector saves still running %.0f s into exit may be lost", SAVE_TIMEOUT_S)
        except Exception:
            log.exception("kvtier engine: closing an engine at interpreter exit failed")


_register_before_pools_stop = getattr(threading, "_register_atexit", None)
if _register_before_pools_stop is not None:
    _register_before_pools_stop(lambda: _close_open_engines(main_thread_only=True))
atexit.register(lambda: _close_open_engines(main_thread_only=False))
