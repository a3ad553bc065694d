"""The bytes of one stored page: a fixed header, then the payload.

Layout (little-endian, ``HEADER_BYTES`` = 24)::

    magic      4 bytes   b"KVTB"
    version    uint16    FORMAT_VERSION
    reserved   uint16    0
    length     uint64    payload bytes
    checksum   8 bytes   XXH3-64 (big-endian digest) of the store key, a NUL, then the payload
    payload    length bytes

Every header byte is checked on decode, so any single damaged byte, a truncation, trailing
bytes, or a value of another format reads as a miss (None). The key is part of the checksum,
so a value copied under another key is a miss too. ``decode_page`` never raises on bad data
and never copies the payload. The checksum detects damage and misfiled values, not tampering (a
store is trusted by whoever configures it). Version 2 used blake2b: its values read as misses.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

Buffer = bytes | bytearray | memoryview | np.ndarray
"""A page payload: any C-contiguous object with the buffer protocol (a CPU tensor via ``.numpy()``)."""

MAGIC = b"KVTB"
FORMAT_VERSION = 3
CHECKSUM_BYTES = 8
_HEADER = struct.Struct(f"<4sHHQ{CHECKSUM_BYTES}s")  # magic, version, reserved, payload bytes, checksum
HEADER_BYTES = _HEADER.size


def payload_checksum(payload: memoryview, key: str = "") -> bytes:
    """The 8-byte digest stored in the header (xxhash releases the GIL while hashing the payload)."""
    digest = xxhash.xxh3_64(key.encode() + b"\0")
    digest.update(payload)
    return digest.digest()


def encode_page(data: Buffer, key: str = "") -> bytes:
    """The stored form of a payload: header + payload. ``TypeError`` for a non-contiguous or non-buffer object."""
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(
            f"a page payload must support the buffer protocol (bytes, memoryview, numpy array), "
            f"got {type(data).__name__}; pass a CPU tensor as tensor.numpy()"
        ) from None
    if not view.c_contiguous:
        raise TypeError("a page payload must be C-contiguous")
    payload = view.cast("B")
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, payload.nbytes, payload_checksum(payload, key)) + payload


def decode_page(
    blob: bytes | bytearray | memoryview, expected_size: int | None = None, key: str = ""
) -> memoryview | None:
    """The payload inside ``blob`` (a view, no copy), or None if anything is wrong with it.

    Wrong means: shorter than a header, another magic, version or reserved field, a length that
    is not the bytes that follow (or not ``expected_size`` when given), or a checksum mismatch
    (which includes a value stored under another ``key``).
    """
    view = memoryview(blob).cast("B")
    if view.nbytes < HEADER_BYTES:
        return None
    magic, version, reserved, length, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC or version != FORMAT_VERSION or reserved != 0:
        return None
    if length != view.nbytes - HEADER_BYTES or (expected_size is not None and length != expected_size):
        return None
    payload = view[HEADER_BYTES:]
    if payload_checksum(payload, key) != checksum:
        return None
    return payload
