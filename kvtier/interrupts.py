"""Ctrl-C is deferred to the end of a claimed call, so it never lands inside the bookkeeping.

A claimed call (``kvtier.exclusive``) moves counts, locks, slots and tree links in many small
steps; a ``KeyboardInterrupt`` raised between two of them would leave pages held by no cache and
slots owned by no page, for good. Python runs signal handlers on the main thread only, between
two bytecodes. So while the main thread is inside its outermost claimed call, the process's
Python SIGINT handler is wrapped: a SIGINT that arrives then is kept, and handed on to the
handler when the call ends (the handler is put back first, so outside claimed calls the process
sees exactly its own handler, as ``asyncio.run`` and Jupyter expect). A wait marked
``may_be_cut_short`` (the disk I/O a long call waits for, written to be interrupted) is the
exception: a kept SIGINT is handed on as it starts, and one arriving during it at once. The
caller (``kvtier.exclusive``) lets go of what a call made when the handler it was handed on to
raises. ``interrupt_main`` does the same for another signal's handler (the command line's
SIGTERM): a ``KeyboardInterrupt``, kept likewise until the claimed call it lands in ends.

Invariants: only the main thread's claimed calls are counted (other threads never receive a
Python signal handler's exception); the wrapper is installed only inside the main thread's
outermost claimed call and removed as it ends, unless the handler was replaced meanwhile;
SIG_IGN and SIG_DFL are never wrapped.
"""

from __future__ import annotations

import _signal
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any]

_SIGINT = int(signal.SIGINT)
_MAIN_THREAD = threading.main_thread().ident
_depth = 0  # claimed calls the main thread is inside
_waiting = 0  # waits that may be cut short the main thread is inside
_kept: Callable[[], None] | None = None  # what interrupts the main thread once its claimed call ends
_installed: Any = None  # the wrapper while it is installed (``kvtier_wraps``: the handler it wraps)
_last_wrapper: Any = None  # the wrapper made last: made again only for another handler


def enter() -> bool:
    """A claimed call starts; True when it is the main thread's (``leave`` after it, in a finally)."""
    global _depth, _installed
    if threading.get_ident() != _MAIN_THREAD:
        return False
    if _depth == 0:
        current = _signal.getsignal(_SIGINT)
        current = getattr(current, "kvtier_wraps", current)  # one left by a Ctrl-C at the edge of a call
        if callable(current):
            _installed = _wrapper_of(current)
            _signal.signal(_SIGINT, _installed)
    _depth += 1
    return True


def leave() -> None:
    """A claimed call of the main thread ends. At the outermost one, the wrapped handler is put
    back, and a SIGINT kept meanwhile is handed on to it (which raises ``KeyboardInterrupt``,
    unless it is a handler that does not)."""
    global _depth, _installed, _kept
    _depth -= 1
    if _depth:
        return
    wrapper, _installed = _installed, None
    if wrapper is not None and _signal.getsignal(_SIGINT) is wrapper:
        _signal.signal(_SIGINT, wrapper.kvtier_wraps)
    if _kept is not None:
        interrupt, _kept = _kept, None
        interrupt()


def interrupt_main() -> None:
    """From a signal handler on the main thread: raise ``KeyboardInterrupt`` as Python's SIGINT
    handler does, now or, inside a claimed call's bookkeeping, when that call ends."""
    global _kept
    if _depth and not _waiting:
        _kept = _raise_interrupt
        return
    _raise_interrupt()


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def may_be_cut_short() -> Iterator[None]:
    """A wait inside a claimed call that is written to be interrupted (its caller undoes or marks
    what it waited for): a Ctrl-C kept so far is raised as it starts, one arriving during it at once."""
    global _waiting, _kept
    if threading.get_ident() != _MAIN_THREAD:
        yield
        return
    if _kept is not None:
        interrupt, _kept = _kept, None
        interrupt()
    _waiting += 1
    try:
        yield
    finally:
        _waiting -= 1


def _wrapper_of(inner: Handler) -> Handler:
    """The wrapper of ``inner``: it keeps a SIGINT inside a claimed call, else calls ``inner``."""
    global _last_wrapper
    if _last_wrapper is not None and _last_wrapper.kvtier_wraps is inner:
        return _last_wrapper

    def on_sigint(signum: int, frame: FrameType | None) -> Any:
        global _kept
        if _depth and not _waiting:  # inside a claimed call's bookkeeping: kept until its end
            _kept = _hand_on
            return None
        return inner(signum, frame)

    on_sigint.kvtier_wraps = inner  # type: ignore[attr-defined]
    _last_wrapper = on_sigint
    return on_sigint


def _hand_on() -> None:
    """Run the process's SIGINT handler (the one the wrapper wraps, while it is installed) now."""
    current = _signal.getsignal(_SIGINT)
    if current is not None and current is _installed:
        current = _installed.kvtier_wraps
    if current == signal.SIG_IGN:
        return
    handler = current if callable(current) else signal.default_int_handler
    handler(_SIGINT, None)
