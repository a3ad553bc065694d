"""Ctrl-C is deferred to the end of a claimed call, so it never lands inside the bookkeeping.

A claimed call (``kvtier.exclusive``) moves counts, locks, slots and tree links in many small
steps; a ``KeyboardInterrupt`` raised between two of them would leave pages held by no cache and
slots owned by no page, for good. Python runs signal handlers on the main thread only, between
two bytecodes, so the SIGINT handler is wrapped once (``defer_ctrl_c``, when a manager is
created on the main thread): while the main thread is inside a claimed call, a SIGINT is kept;
it is handed to the wrapped handler (Python's default raises ``KeyboardInterrupt``) when the
outermost claimed call returns or raises. A second SIGINT during the same call is handed on at
once, so a call that waits long (a ``close`` persisting many pages) can still be cut short.
What a call so cut short made (a cache, a prefetch) is let go of before the interrupt is raised
(``kvtier.exclusive``): its caller never receives it.

Invariants: only the main thread's claimed calls are counted (other threads never receive a
Python signal handler's exception); a handler the process installs later replaces the wrapper,
and no SIGINT is kept from then on; SIG_IGN and SIG_DFL are never wrapped.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_MAIN_THREAD = threading.main_thread().ident
_depth = 0  # claimed calls the main thread is inside
_kept = False  # a SIGINT arrived inside one, not handed on yet
_wrapped: Callable[[int, FrameType | None], Any] | None = None


def defer_ctrl_c() -> None:
    """Wrap the process's Python SIGINT handler (once; on the main thread only)."""
    global _wrapped
    if threading.get_ident() != _MAIN_THREAD:
        return
    current = signal.getsignal(signal.SIGINT)
    if current is _on_sigint or not callable(current):
        return
    _wrapped = current
    signal.signal(signal.SIGINT, _on_sigint)


def enter() -> bool:
    """A claimed call starts; True when it is the main thread's (``leave`` after it, in a finally)."""
    global _depth
    if threading.get_ident() != _MAIN_THREAD:
        return False
    _depth += 1
    return True


def kept_for_this_call() -> bool:
    """Whether a SIGINT was kept during the main thread's outermost claimed call, now ending."""
    return _depth == 1 and _kept


def leave() -> None:
    """A claimed call of the main thread ends: a SIGINT kept during the outermost one is handed on."""
    global _depth, _kept
    _depth -= 1
    if _depth == 0 and _kept:
        _kept = False
        _hand_on(signal.SIGINT, None)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _kept
    if _depth and not _kept:
        _kept = True
        return
    _kept = False
    _hand_on(signum, frame)


def _hand_on(signum: int, frame: FrameType | None) -> None:
    handler = _wrapped if _wrapped is not None else signal.default_int_handler
    handler(signum, frame)
