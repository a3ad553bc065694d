"""Page checksums: XXH3-64 on the disk tier and in the store codec; what older versions wrote is never served.

Version 2 of the disk index and of the store codec checksummed pages with blake2b-64 (a third of
the disk tier's read throughput). A directory or a stored value written that way must read as
missing (reported, for a directory), never as valid data and never as a crash.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import struct

import numpy as np
import pytest
import xxhash

from kvtier.connector.block_codec import HEADER_BYTES, MAGIC, decode_page, encode_page
from kvtier.storage.disk_index import SCHEMA_VERSION, PageRow
from kvtier.storage.page_files import default_io_threads, page_checksum, parse_io_threads
from tests.kvdata import PageOracle
from tests.test_tiers import convo, manager, persist_conversations, serve_intact


def fresh_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("size", [1, 63, 4096, 1 << 20])
def test_page_checksum_is_xxh3_64_as_a_signed_int(size):
    data = fresh_bytes(np.random.default_rng(size), size)
    value = page_checksum(data)
    assert -(1 << 63) <= value < 1 << 63  # fits SQLite's INTEGER
    assert value % (1 << 64) == xxhash.xxh3_64_intdigest(data.tobytes())
    damaged = data.copy()
    damaged[size // 2] ^= 0x01
    assert page_checksum(damaged) != value


def test_page_checksum_takes_a_page_of_any_shape_and_dtype():
    data = np.random.default_rng(5).standard_normal((4, 3, 64)).astype(np.float16)
    assert page_checksum(data) == page_checksum(data.view(np.uint8).reshape(-1))


def test_a_directory_of_the_blake2b_version_is_reported_and_started_empty(tmp_path, caplog):
    """Before: schema 2 was current, so its pages would be served (under a new checksum, every one a failure)."""
    persist_conversations(tmp_path)
    index = next(tmp_path.rglob("index.sqlite"))
    pages_file = next(tmp_path.rglob("group0.pages")).read_bytes()
    without_disk = manager(tmp_path, primary=8, host=0, disk=0)
    page_bytes = without_disk.page_bytes(0)
    without_disk.close()
    db = sqlite3.connect(index)  # rewrite it as version 2 wrote it: blake2b-64 checksums, schema "2"
    rows = db.execute("SELECT block_key, grp, snapshot_offset, slot, priority FROM pages").fetchall()
    assert rows
    for key, grp, offset, slot, priority in rows:
        page = pages_file[slot * page_bytes : (slot + 1) * page_bytes]
        old = int.from_bytes(hashlib.blake2b(page, digest_size=8).digest(), "little", signed=True)
        seal = PageRow(key, grp, offset, slot, old, priority).seal()
        db.execute(
            "UPDATE pages SET checksum = ?, seal = ? WHERE block_key = ? AND grp = ? AND snapshot_offset = ?",
            (old, seal, key, grp, offset),
        )
    db.execute("UPDATE meta SET value = '2' WHERE name = 'schema'")
    db.commit()
    db.close()
    with caplog.at_level(logging.ERROR):
        again = manager(tmp_path, primary=8, host=0, disk=32)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"schema 2, this is {SCHEMA_VERSION}" in errors[0], errors
    assert again.stats().disk_resets == 1
    assert again.stats().tiers["disk"].pages_used == 0
    assert [again.create_cache(convo(i) + [1]).num_reused_tokens for i in range(3)] == [0, 0, 0]
    serve_intact(again, 3)  # and the emptied directory works


def test_pages_written_now_restore_and_verify(tmp_path):
    persist_conversations(tmp_path)
    again = manager(tmp_path, primary=8, host=0, disk=32)
    tokens = convo(1) + [1]
    cache = again.create_cache(tokens)
    assert cache.reused_by_tier["disk"] == 24
    assert cache.resume()
    PageOracle(again).check(cache, tokens)
    assert again.stats().checksum_failures == 0
    again.close()


def blake2b_value(payload: bytes, key: str) -> bytes:
    """A value as format version 2 stored it (blake2b-64 over key, NUL, payload)."""
    digest = hashlib.blake2b(key.encode() + b"\0", digest_size=8)
    digest.update(payload)
    return struct.pack("<4sHHQ8s", MAGIC, 2, 0, len(payload), digest.digest()) + payload


def test_store_values_of_the_blake2b_version_are_misses():
    payload = fresh_bytes(np.random.default_rng(7), 4096).tobytes()
    assert decode_page(blake2b_value(payload, "kvtier/k"), 4096, "kvtier/k") is None
    assert bytes(decode_page(encode_page(payload, "kvtier/k"), 4096, "kvtier/k")) == payload


def test_store_checksum_is_xxh3_64_over_key_and_payload():
    payload = fresh_bytes(np.random.default_rng(8), 1000).tobytes()
    blob = encode_page(payload, "kvtier/k")
    assert blob[HEADER_BYTES - 8 : HEADER_BYTES] == xxhash.xxh3_64(b"kvtier/k\0" + payload).digest()
    assert decode_page(blob, 1000, "kvtier/k2") is None  # a value under the wrong key stays a miss
    assert decode_page(blob, 1000, "kvtier/") is None


@pytest.mark.parametrize("threads", ["1", "3"])
def test_the_disk_tier_reads_and_writes_with_the_threads_the_knob_sets(tmp_path, monkeypatch, threads):
    monkeypatch.setenv("KVTIER_DISK_IO_THREADS", threads)
    persist_conversations(tmp_path)
    again = manager(tmp_path, primary=8, host=0, disk=32)
    disk = next(t for t in again._pool.tiers if t.is_disk)
    assert disk.storage.io_threads == int(threads)
    serve_intact(again, 3)


@pytest.mark.parametrize("raw", ["0", "65", "-2", "four", ""])
def test_a_disk_io_threads_value_out_of_range_or_not_an_integer_warns_once_and_keeps_the_default(raw, caplog):
    parse_io_threads.cache_clear()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert parse_io_threads(raw) == default_io_threads()
        assert parse_io_threads(raw) == default_io_threads()  # a second disk tier opened: no second line
    assert "KVTIER_DISK_IO_THREADS" in caplog.text and "default" in caplog.text
    assert len(caplog.records) == 1
    assert parse_io_threads(None) == default_io_threads() and parse_io_threads(" 12 ") == 12
