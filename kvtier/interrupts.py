"""Ctrl-C is deferred to the end of a claimed call, so it never lands inside the bookkeeping.

A claimed call (``kvtier.exclusive``) moves counts, locks, slots and tree links in many small
steps; a ``KeyboardInterrupt`` raised between two of them would leave pages held by no cache and
slots owned by no page, for good. Python runs signal handlers on the main thread only, between
two bytecodes. So when the main thread enters its outermost claimed call, the process's Python
SIGINT handler is wrapped if it is not already (a handler installed since, as Jupyter installs
one before every cell, is wrapped again): while the main thread is inside a claimed call, a
SIGINT is kept; it is handed on to the handler when the outermost claimed call ends, and a
second SIGINT during the same call is handed on at once (so a call that waits long, a ``close``
persisting many pages, can still be cut short). The caller (``kvtier.exclusive``) lets go of
what a call made when the handler it was handed on to raises.

Invariants: only the main thread's claimed calls are counted (other threads never receive a
Python signal handler's exception); each wrapper calls the handler it wrapped, so handlers that
chain to the one they replaced run once per SIGINT; SIG_IGN and SIG_DFL are never wrapped.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any]

_MAIN_THREAD = threading.main_thread().ident
_depth = 0  # claimed calls the main thread is inside
_kept = False  # a SIGINT arrived inside one and was not handed on yet
_passing = False  # a SIGINT is being handed on down a chain of handlers: every wrapper lets it through


def enter() -> bool:
    """A claimed call starts; True when it is the main thread's (``leave`` after it, in a finally)."""
    global _depth
    if threading.get_ident() != _MAIN_THREAD:
        return False
    if _depth == 0:
        _wrap_current_handler()
    _depth += 1
    return True


def leave() -> None:
    """A claimed call of the main thread ends: a SIGINT kept during the outermost one is handed on
    to the SIGINT handler now (which raises ``KeyboardInterrupt``, unless it was replaced by one
    that does not)."""
    global _depth, _kept
    _depth -= 1
    if _depth == 0 and _kept:
        _kept = False
        _hand_on(signal.SIGINT, None)


def _wrap_current_handler() -> None:
    current = signal.getsignal(signal.SIGINT)
    if callable(current) and not getattr(current, "defers_in_claimed_calls", False):
        signal.signal(signal.SIGINT, _wrapper_of(current))


def _wrapper_of(inner: Handler) -> Handler:
    def on_sigint(signum: int, frame: FrameType | None) -> Any:
        global _kept
        if _passing:  # handed on by a wrapper above this one
            return inner(signum, frame)
        if _depth and not _kept:  # inside a claimed call: kept until its end
            _kept = True
            return None
        _kept = False
        return _pass_down(inner, signum, frame)

    on_sigint.defers_in_claimed_calls = True  # type: ignore[attr-defined]
    return on_sigint


def _hand_on(signum: int, frame: FrameType | None) -> None:
    """Run the SIGINT handler installed now, as if the signal arrived now."""
    current = signal.getsignal(signal.SIGINT)
    if current is signal.SIG_IGN:
        return
    _pass_down(current if callable(current) else signal.default_int_handler, signum, frame)


def _pass_down(handler: Handler, signum: int, frame: FrameType | None) -> None:
    global _passing
    outer, _passing = _passing, True
    try:
        handler(signum, frame)
    finally:
        _passing = outer
