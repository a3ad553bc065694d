"""A block store in a directory: one file per key, shared safely by several processes.

The value of a key lives in ``<root>/<h[0:2]>/<h[2:4]>/<h>.page``, ``h`` being 32 hex digits of
blake2b over the key (``path_of``): any key maps to a safe fixed-length name, and 65536 leaf
directories spread the files evenly (a million values are about 15 files per directory).

A value is written whole to a temporary file in the same directory
(``.<h>.page.<pid>.<random>.tmp``) and renamed over the old one (``os.replace``), so a reader
sees the old value, the new one, or nothing, never a partial file, even when the writer is
killed mid-write or another process writes the same key. Temporary files never have a value's
name, so a left-over one is never read; nothing removes them (a writer may still own one).

Values are framed by ``block_codec`` and verified on every read. There is no fsync: a store is
a cache, and a value torn by a power loss fails its checksum and reads as a miss.

I/O errors (a read-only or full disk, a file-size limit, a path that cannot exist) are logged at
WARNING, one line per call, and reported as failures and misses, never raised.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvtier.connector.block_codec import HEADER_BYTES, Buffer, decode_page, encode_page
from kvtier.connector.store import check_keys, check_sizes

log = logging.getLogger(__name__)

# File I/O and checksumming both release the GIL, so a few threads overlap them (as in the disk tier).
IO_THREADS = min(8, max(2, os.cpu_count() or 2))
VALUE_SUFFIX = ".page"
TEMP_SUFFIX = ".tmp"


@dataclass(slots=True)
class _Read:
    """What reading one key found: a payload, a damaged value, an I/O error, or (all unset) no file."""

    payload: bytes | None = None
    damaged: bool = False
    error: OSError | None = None


class FileSystemStore:
    """Pages as files under ``path`` (a local or shared file system); a ``BlockStore``."""

    def __init__(self, path: str | os.PathLike[str], io_threads: int = IO_THREADS) -> None:
        if not isinstance(path, str | os.PathLike) or not os.fspath(path):
            raise TypeError(f"FileSystemStore needs a non-empty path, got {path!r}")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads <= 0:
            raise ValueError(f"io_threads must be a positive int, got {io_threads!r}")
        self.root = Path(path)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("kvtier fs store: cannot create %s (%s); every put will fail", self.root, exc)
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-fs-store")

    def path_of(self, key: str) -> Path:
        """The file that holds the value of ``key``."""
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        return self.root / digest[:2] / digest[2:4] / (digest + VALUE_SUFFIX)

    def get_many(self, keys: Sequence[str], expected_sizes: Sequence[int] | None = None) -> list[bytes | None]:
        """Per key its verified payload, or None: missing, unreadable, damaged, or of the wrong size."""
        keys = check_keys(keys)
        sizes = check_sizes(expected_sizes, len(keys))
        reads = list(self._open_pool().map(self._get_one, keys, sizes))
        errors = [r.error for r in reads if r.error is not None]
        damaged = sum(r.damaged for r in reads)
        if errors:
            log.warning(
                "kvtier fs store: %d of %d reads under %s failed: %s", len(errors), len(keys), self.root, errors[0]
            )
        if damaged:
            log.warning("kvtier fs store: %d of %d values under %s failed verification", damaged, len(keys), self.root)
        return [r.payload for r in reads]

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store each payload under its key, atomically; per item True if it was stored."""
        items = list(items)
        keys = check_keys([key for key, _ in items])
        blobs = [encode_page(data, key) for key, (_, data) in zip(keys, items, strict=True)]
        errors = list(self._open_pool().map(self._put_one, keys, blobs))
        failed = [err for err in errors if err is not None]
        if failed:
            log.warning(
                "kvtier fs store: %d of %d writes under %s failed: %s", len(failed), len(keys), self.root, failed[0]
            )
        return [err is None for err in errors]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Per key whether its file exists (not verified)."""
        self._open_pool()
        return [self.path_of(key).is_file() for key in check_keys(keys)]

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove the files of ``keys``; missing files are fine, other failures are logged."""
        self._open_pool()
        failed: list[OSError] = []
        for key in check_keys(keys):
            try:
                self.path_of(key).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                failed.append(exc)
        if failed:
            log.warning("kvtier fs store: %d deletes under %s failed: %s", len(failed), self.root, failed[0])

    def close(self) -> None:
        """Stop the I/O threads. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _open_pool(self) -> ThreadPoolExecutor:
        """The I/O threads; ``ValueError`` once the store is closed."""
        if self._pool is None:
            raise ValueError(f"the FileSystemStore at {self.root} is closed")
        return self._pool

    def _get_one(self, key: str, size: int | None) -> _Read:
        try:
            with open(self.path_of(key), "rb") as f:
                # One byte past the expected length is enough to see that a value is too long.
                blob = f.read() if size is None else f.read(HEADER_BYTES + size + 1)
        except FileNotFoundError:
            return _Read()
        except OSError as exc:
            return _Read(error=exc)
        payload = decode_page(blob, size, key)
        return _Read(damaged=True) if payload is None else _Read(payload=bytes(payload))

    def _put_one(self, key: str, blob: bytes) -> OSError | None:
        """Write ``blob`` to a temporary file next to the value and rename it over; the error, if any."""
        final = self.path_of(key)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            fd = _create(tmp)
        except OSError as exc:
            return exc
        try:
            with open(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):  # a temporary file is never read as a value, even if it stays
                tmp.unlink()
            return exc
        return None


def _create(tmp: Path) -> int:
    """A new file at ``tmp`` (its fan-out directories made if missing), open for writing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        return os.open(tmp, flags, 0o644)
    except FileNotFoundError:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        return os.open(tmp, flags, 0o644)
