"""The two kinds of error kvtier raises besides ``ValueError``/``TypeError`` for bad arguments.

- ``OutOfPagesError``: a capacity error. Expected and recoverable: free or close caches, or
  configure more memory, and try again.
- ``InvariantError``: a broken internal invariant. It is a bug in kvtier, never the caller's
  fault; the manager must not be used after one.
- ``CacheStateError``: an operation that the cache's state does not allow (e.g. ``resize`` on a
  suspended cache). The caller's mistake; nothing was changed.
- ``DiskTierBusyError``: a disk tier's directory is held by another manager (an OS lock). Close
  that manager first, or give this one another directory; nothing was changed.
"""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    """No tier could supply the pages an operation needed. Nothing was changed."""


class CacheStateError(RuntimeError):
    """The operation is not allowed in the cache's current state. Nothing was changed."""


class InvariantError(AssertionError):
    """An internal invariant of kvtier does not hold: a bug, not a usage error."""


class DiskTierBusyError(RuntimeError):
    """A disk tier's directory belongs to another manager, in this process or another. Nothing was changed.

    A directory is used by one manager at a time; to share prefixes between processes, use a connector.
    """
