"""Token arrays: the one form tokens take inside kvtier, and their bytes.

Tokens are unsigned 64-bit integers held in an ``array('Q')``; their bytes (``encode_tokens``)
are little-endian on every machine, so the block keys derived from them (``kvtier.reuse.block_keys``)
name the same block everywhere.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Set

import numpy as np

TOKEN_BYTES = 8
MAX_TOKEN = (1 << 64) - 1
_LITTLE_ENDIAN = sys.byteorder == "little"
_SCAN_BELOW = 128  # sequences shorter than this are checked for bools item by item, longer ones by numpy
_INTEGER_TYPECODES = frozenset("bBhHiIlLqQ")  # an ``array``'s integer kinds, numpy's names for the same


def as_token_array(tokens) -> array:
    """Tokens as ``array('Q')`` (unsigned 64-bit); ``TypeError`` for non-integers, ``ValueError`` for negatives.

    Accepts a sequence of ints, an ``array``, a numpy integer array or a CPU torch tensor; refuses
    text and raw bytes (whose items are not token ids), unordered collections (a set, a dict) and
    bools in a list or tuple (``array`` takes ``True`` as token 1). An integer ``array`` (vLLM's
    ``TokenBuffer`` is an ``array('i')``) converts through its buffer, not item by item.
    """
    if type(tokens) is not list:  # (a list, the common case, needs none of these checks)
        if isinstance(tokens, str | bytes | bytearray | memoryview):
            raise TypeError(f"tokens must be a sequence of integer token ids, not {type(tokens).__name__}")
        if isinstance(tokens, Set | Mapping):
            raise TypeError(f"tokens must be an ordered sequence of integer token ids, not a {type(tokens).__name__}")
        if hasattr(tokens, "numpy") and hasattr(tokens, "dtype"):  # a torch tensor
            tokens = tokens.detach().cpu().numpy()
        elif isinstance(tokens, array) and tokens.typecode in _INTEGER_TYPECODES:
            tokens = np.frombuffer(tokens, dtype=tokens.typecode)
        if isinstance(tokens, np.ndarray):
            if tokens.dtype.kind not in "iu" or tokens.ndim != 1:
                raise TypeError(f"tokens must be a 1-D integer array, got {tokens.dtype} with shape {tokens.shape}")
            if tokens.size and tokens.min() < 0:
                raise ValueError("token ids must be >= 0")
            out = array("Q")
            out.frombytes(tokens.astype("<u8", copy=False).tobytes())
            return out
    try:
        if type(tokens) is list:  # the common case: ``fromlist`` converts a list a third faster than ``array(...)``
            out = array("Q")
            out.fromlist(tokens)
        else:
            out = array("Q", tokens)
    except OverflowError:
        raise ValueError("token ids must be in 0..2**64-1") from None
    except TypeError as exc:
        raise TypeError(f"tokens must be integer ids ({exc})") from None
    if (type(tokens) is list or type(tokens) is tuple) and _holds_bool(tokens, out):
        raise TypeError("tokens must be integer ids, not bools")
    return out


def _holds_bool(tokens: list | tuple, converted: array) -> bool:
    """Whether ``tokens`` (converted to ``converted``) holds a bool.

    A bool converts to 0 or 1, so a long sequence has only the items that became 0 or 1 looked
    at, found by numpy; a short one (where numpy's fixed cost dominates) is scanned whole in C.
    """
    if len(tokens) < _SCAN_BELOW:
        return bool in map(type, tokens)
    low = np.flatnonzero(np.frombuffer(converted, dtype=np.uint64) <= 1)
    return bool in map(type, map(tokens.__getitem__, low.tolist()))


def encode_tokens(tokens: array) -> bytes:
    """Little-endian 64-bit bytes of an ``array('Q')``."""
    if _LITTLE_ENDIAN:
        return tokens.tobytes()
    swapped = array("Q", tokens)  # pragma: no cover - big-endian hosts only
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover
