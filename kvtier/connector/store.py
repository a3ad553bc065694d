"""The interface of an external block store: batched get, put, contains and delete of pages by key.

A store maps string keys (``BlockKeyspace.key``) to page payloads. It owns the page encoding:
``put_many`` takes raw payloads and stores them framed by ``block_codec`` (magic, version,
length, checksum); ``get_many`` verifies every value and returns the raw payload, or None. So a
caller never sees framing bytes, and a value that is missing, damaged, truncated, of another
format or of the wrong size is a miss, never wrong bytes.

Contract of every store (``FileSystemStore``, ``RedisStore``):

- Results are positional: entry ``i`` answers ``keys[i]`` (or ``items[i]``).
- A store never raises for a failure of what is behind it (I/O errors, a full or read-only
  disk, an unreachable or failing server): it logs a WARNING and reports misses and failures.
  It raises ``TypeError``/``ValueError`` only for bad arguments, and ``ValueError`` once closed.
- ``contains_many`` is cheap (existence only) and may say True for a value that ``get_many``
  then rejects; ``get_many`` is the authority.
- Values are whole: a reader sees a complete value written by one ``put_many``, or nothing.
- A value ``get_many`` finds damaged (not merely of another size than the caller expected) is
  removed, so that the next ``put_many`` of its key writes it again (``contains_many`` would
  otherwise count it as present for good).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvtier.connector.block_codec import Buffer


@runtime_checkable
class BlockStore(Protocol):
    """A key-value store of pages, batched; see the module docstring for the contract."""

    def get_many(self, keys: Sequence[str], expected_sizes: Sequence[int] | None = None) -> list[bytes | None]:
        """Per key its verified payload, or None (missing, damaged, or not ``expected_sizes[i]`` bytes)."""
        ...

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store each payload under its key (replacing any old value); per item True if it was stored."""
        ...

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Per key whether a value exists (not verified)."""
        ...

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove the values of ``keys``; missing keys are fine."""
        ...

    def close(self) -> None:
        """Release files, threads and connections. Idempotent; the store is unusable afterwards."""
        ...


def check_keys(keys: Sequence[str]) -> list[str]:
    """``keys`` as a list; ``TypeError`` unless every key is a non-empty str that UTF-8 can encode."""
    out = list(keys)
    for key in out:
        if not isinstance(key, str) or not key:
            raise TypeError(f"store keys must be non-empty str, got {key!r}")
        try:
            key.encode()
        except UnicodeEncodeError:
            raise TypeError(f"store keys must be valid text (UTF-8), got {key!r}") from None
    return out


def check_sizes(expected_sizes: Sequence[int] | None, count: int) -> list[int | None]:
    """Per key the payload size to require (None: any); ``ValueError`` if the lengths differ."""
    if expected_sizes is None:
        return [None] * count
    sizes = list(expected_sizes)
    if len(sizes) != count:
        raise ValueError(f"expected_sizes has {len(sizes)} entries for {count} keys")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise TypeError(f"expected sizes must be ints >= 0, got {size!r}")
    return sizes
