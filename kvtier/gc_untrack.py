"""Records that Python's cyclic garbage collector need not scan.

Every cached block costs the collector its ``Node``, its ``Page`` and the node's page list, which a
full collection walks one by one: on a host and disk tier of many blocks that is a pause of its
own on whichever thread it falls (vLLM's scheduler thread under ``kvtier.vllm``: about 0.7 ms per
1,000 blocks on the development CPU, docs/benchmarks.md section 70). ``untrack`` takes such an
object out of the collector's sight; reference counting still frees it.

Invariant: only objects whose reference cycles kvtier breaks itself are untracked. A cycle
through an untracked object is never collected, so the reuse tree, the one structure whose records
point at each other (a node and its parent, a page and its node), is taken apart when its pool
dies (``RadixTree.dismantle``). Objects an untracked one refers to stay tracked and are never
freed early: its references count as references from outside the collector's reach.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from typing import TypeVar

T = TypeVar("T")

_UNTRACK = ctypes.pythonapi.PyObject_GC_UnTrack if sys.implementation.name == "cpython" else None
if _UNTRACK is not None:
    _UNTRACK.argtypes = [ctypes.py_object]
    _UNTRACK.restype = None


def untrack(obj: T) -> T:
    """``obj``, no longer scanned by the cyclic garbage collector (a dict is scanned again once a
    tracked value goes in; elsewhere than CPython, nothing changes)."""
    if _UNTRACK is not None and gc.is_tracked(obj):
        _UNTRACK(obj)
    return obj
