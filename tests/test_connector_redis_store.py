"""The Redis block store against real Redis servers: batching, TTL, damage, sharing, and failures."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.connector import BlockKeyspace, BlockStore, RedisStore, encode_page

redis = pytest.importorskip("redis")

ROOT = Path(__file__).resolve().parents[1]
LOGGER = "kvtier.connector.redis_store"


def fresh_keys(n: int, group: int = 0) -> list[str]:
    """``n`` keys no other test (or earlier run on a shared server) uses."""
    space = BlockKeyspace(uuid.uuid4().hex, 16)
    return [space.key(kvtier.DEFAULT_SCOPE, i.to_bytes(16, "little"), group) for i in range(n)]


def pages(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, size, dtype=np.uint8) for _ in range(n)]


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env
    )


def store_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


@pytest.fixture
def store(redis_url):
    s = RedisStore(redis_url)
    yield s
    s.close()


def test_round_trip(store):
    assert isinstance(store, BlockStore)
    keys = fresh_keys(20)
    data = pages(20, 3000)
    assert store.put_many(list(zip(keys, data, strict=True))) == [True] * 20
    expected = [p.tobytes() for p in data]
    assert store.get_many(keys, [3000] * 20) == expected
    assert store.get_many(keys) == expected
    assert store.get_many(keys, [2999] * 20) == [None] * 20  # not the caller's page size: a miss
    assert store.contains_many(keys + fresh_keys(1)) == [True] * 20 + [False]

    new = pages(1, 3000, seed=1)[0]
    assert store.put_many([(keys[0], new)]) == [True]
    assert store.get_many(keys[:2]) == [new.tobytes(), expected[1]]

    store.delete_many(keys[:5])
    assert store.get_many(keys[:6]) == [None] * 5 + [expected[5]]
    assert store.get_many([]) == [] and store.put_many([]) == [] and store.contains_many([]) == []
    store.delete_many([])
    store.delete_many(keys)


def test_a_key_of_another_type_counts_as_absent_and_the_next_save_replaces_it(store, redis_url):
    """A kvtier key holding a set, list or hash (another tool writing under the prefix): ``MGET``
    reads it as nil. Before, ``EXISTS`` counted it present, so no save wrote it again: its block
    missed for good, unlogged."""
    keys = fresh_keys(3)
    data = pages(3, 512, seed=4)
    with redis.Redis.from_url(redis_url) as client:
        client.sadd(keys[0], "member")
        client.rpush(keys[1], "item")
        client.hset(keys[2], "field", "value")
        assert store.contains_many(keys) == [False] * 3
        assert store.get_many(keys) == [None] * 3
        assert store.put_many(list(zip(keys, data, strict=True))) == [True] * 3
        assert [client.type(key) for key in keys] == [b"string"] * 3
    assert store.contains_many(keys) == [True] * 3
    assert store.get_many(keys, [512] * 3) == [p.tobytes() for p in data]
    store.delete_many(keys)


def test_a_batch_of_500_is_one_request(store, redis_url):
    keys = fresh_keys(500)
    data = pages(500, 4096, seed=2)
    raw = redis.Redis.from_url(redis_url)
    before = raw.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
    assert store.put_many(list(zip(keys, data, strict=True))) == [True] * 500
    assert store.get_many(keys, [4096] * 500) == [p.tobytes() for p in data]
    assert raw.info("commandstats")["cmdstat_mget"]["calls"] == before + 1
    assert store.contains_many(keys) == [True] * 500
    store.delete_many(keys)
    assert store.contains_many(keys) == [False] * 500
    raw.close()


def test_values_expire_after_the_ttl(redis_url):
    store = RedisStore(redis_url, ttl_seconds=1)
    forever = RedisStore(redis_url)
    keys = fresh_keys(3)
    assert store.put_many([(k, b"brief") for k in keys[:2]]) == [True, True]
    assert forever.put_many([(keys[2], b"kept")]) == [True]
    raw = redis.Redis.from_url(redis_url)
    assert 0 < raw.pttl(keys[0]) <= 1000 and raw.pttl(keys[2]) == -1
    assert store.get_many(keys) == [b"brief", b"brief", b"kept"]
    time.sleep(1.1)
    assert store.get_many(keys) == [None, None, b"kept"]
    forever.delete_many(keys)
    raw.close()
    store.close()
    forever.close()


def test_damaged_or_foreign_values_are_misses(store, redis_url, caplog):
    keys = fresh_keys(6)
    good = pages(6, 1024, seed=3)
    assert all(store.put_many(list(zip(keys, good, strict=True))))
    raw = redis.Redis.from_url(redis_url)
    raw.set(keys[0], b"raw garbage that is no page")
    blob = bytearray(encode_page(good[1]))
    blob[-1] ^= 0x01
    raw.set(keys[1], bytes(blob))  # a flipped payload bit
    raw.set(keys[2], encode_page(good[2])[:-10])  # truncated
    raw.set(keys[3], encode_page(good[3][:512]))  # a whole page, of another size
    raw.delete(keys[4])
    raw.rpush(keys[4], b"a list, not a string")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = store.get_many(keys, [1024] * 6)
    assert got == [None] * 5 + [good[5].tobytes()]
    assert any("4 of 6 values failed verification" in m for m in store_warnings(caplog))
    # The damaged ones are gone, so that the next put writes them again (before: present for good).
    assert [raw.exists(key) for key in keys[:3]] == [0, 0, 0] and store.contains_many(keys[5:]) == [True]
    raw.delete(*keys)
    raw.close()


def test_another_process_sees_what_this_one_wrote_and_back(store, redis_url):
    keys = fresh_keys(8)
    mine = pages(4, 2048, seed=7)
    assert store.put_many(list(zip(keys[:4], mine, strict=True))) == [True] * 4
    out = run_python(f"""
        import numpy as np
        from kvtier.connector import RedisStore
        store = RedisStore({redis_url!r})
        rng = np.random.default_rng(7)
        expected = [rng.integers(1, 256, 2048, dtype=np.uint8).tobytes() for _ in range(4)]
        assert store.get_many({keys[:4]!r}, [2048] * 4) == expected
        assert store.put_many([(k, bytes([i + 1]) * 512) for i, k in enumerate({keys[4:]!r})]) == [True] * 4
        print("ok")
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
    assert store.get_many(keys[4:], [512] * 4) == [bytes([i + 1]) * 512 for i in range(4)]
    store.delete_many(keys)


def test_a_stopped_server_gives_quick_misses_then_the_store_recovers(start_redis, caplog):
    server = start_redis()
    store = RedisStore(server.url, socket_timeout_s=0.5, retry_after_s=0.5)
    keys = fresh_keys(10)
    assert store.put_many([(k, b"v" * 100) for k in keys]) == [True] * 10
    server.kill()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(5):
            start = time.monotonic()
            assert store.get_many(keys) == [None] * 10
            assert store.put_many([(keys[0], b"new")]) == [False]
            assert store.contains_many(keys) == [False] * 10
            store.delete_many(keys)
            assert time.monotonic() - start < 0.5
        assert len(store_warnings(caplog)) == 1  # rate-limited: one line for the whole outage
        assert "answering misses" in store_warnings(caplog)[0]

        server.start()  # same port; no persistence, so it comes back empty
        time.sleep(0.6)  # past the back-off
        assert store.put_many([(keys[0], b"again")]) == [True]
        assert store.get_many(keys[:2]) == [b"again", None]
    assert "answers again" in caplog.text
    store.close()


def test_a_stalled_server_costs_one_timeout_then_back_off(start_redis, caplog):
    """SIGSTOP: the connection stays open and nothing answers. One call waits out the socket
    timeout; during the back-off the others answer at once; after it, the store works again."""
    server = start_redis()
    store = RedisStore(server.url, socket_timeout_s=0.3, retry_after_s=0.5)
    keys = fresh_keys(4)
    assert store.put_many([(k, b"x" * 64) for k in keys]) == [True] * 4
    server.pause()
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            start = time.monotonic()
            assert store.get_many(keys) == [None] * 4
            assert 0.25 < time.monotonic() - start < 1.0
            start = time.monotonic()
            assert store.get_many(keys) == [None] * 4
            assert store.put_many([(keys[0], b"y")]) == [False]
            assert time.monotonic() - start < 0.05  # backed off: no network at all
        assert "TimeoutError" in store_warnings(caplog)[0]
    finally:
        server.resume()
    time.sleep(0.55)
    assert store.get_many(keys) == [b"x" * 64] * 4
    store.close()


def test_password_in_the_url(start_redis, caplog):
    server = start_redis("--requirepass", "s3cret-pw")
    url = server.url.replace("redis://", "redis://:s3cret-pw@")
    store = RedisStore(url)
    keys = fresh_keys(2)
    assert store.put_many([(k, b"p" * 10) for k in keys]) == [True, True]
    assert store.get_many(keys) == [b"p" * 10] * 2
    assert "s3cret-pw" not in repr(store) and "***" in repr(store)

    wrong = RedisStore(url.replace("s3cret-pw", "wrong-pw"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert wrong.get_many(keys) == [None, None]
    assert store_warnings(caplog) and "wrong-pw" not in caplog.text and "***" in caplog.text
    caplog.clear()
    none_given = RedisStore(server.url)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert none_given.get_many(keys) == [None, None]  # no password: refused, not raised
    # before, only redis-py's "HELLO must be called with the client already authenticated ..."
    assert "the server asks for a password, and the URL gives none" in store_warnings(caplog)[0]
    store.close()
    wrong.close()
    none_given.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_through_a_rediss_url(start_redis, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    server = start_redis(tls=(cert, key))
    assert server.url.startswith("rediss://")
    store = RedisStore(server.url)
    keys = fresh_keys(3)
    assert store.put_many([(k, b"t" * 256) for k in keys]) == [True] * 3
    assert store.get_many(keys, [256] * 3) == [b"t" * 256] * 3

    plain = RedisStore(f"redis://127.0.0.1:{server.port}/0", socket_timeout_s=0.5)  # no TLS to a TLS port
    start = time.monotonic()
    assert plain.get_many(keys) == [None] * 3
    assert time.monotonic() - start < 1.5
    store.close()
    plain.close()


def test_a_rejected_put_fails_that_item_and_no_more(start_redis, caplog):
    """Out of memory (maxmemory, noeviction) rejects SETs one by one; the server stays in use."""
    server = start_redis("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    store = RedisStore(server.url)
    keys = fresh_keys(10)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        stored = store.put_many([(k, b"m" * 300_000) for k in keys])
    assert True in stored and False in stored
    assert any("puts rejected" in m and "maxmemory" in m for m in store_warnings(caplog))
    assert store.get_many(keys) == [b"m" * 300_000 if ok else None for ok in stored]  # no back-off
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(5):  # the server stays full: one line per warn_interval_s, not one per call
            assert False in store.put_many([(k, b"m" * 300_000) for k in fresh_keys(10)])
    assert store_warnings(caplog) == []
    store.close()


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:6379",
        "",
        "redis://127.0.0.1:notaport/0",
        "redis://127.0.0.1:99999/0",
        "redis://127.0.0.1:6379/zero",
        "redis://127.0.0.1:6379/0?no_such_option=1",
        "redis://127.0.0.1:6379/0?socket_timeout=soon",
        "rediss://127.0.0.1:6379/0?ssl_cert_reqs=maybe",
        "redis://127.0.0.1:6379/0?decode_responses=true",  # replies as str: values are bytes
        "redis://127.0.0.1:6379/0?decode_responses=false",  # redis-py reads any non-empty string as on
    ],
)
def test_a_bad_url_is_a_value_error(url):
    with pytest.raises(ValueError, match="Redis URL"):
        RedisStore(url)


def test_bad_settings_and_use_after_close():
    with pytest.raises(TypeError):
        RedisStore(None)
    for kwargs in ({"ttl_seconds": 0}, {"ttl_seconds": -1}, {"socket_timeout_s": 0}, {"retry_after_s": float("nan")}):
        with pytest.raises(ValueError):
            RedisStore("redis://127.0.0.1:1/0", **kwargs)
    with pytest.raises(ValueError) as info:
        RedisStore("redis://:topsecret@127.0.0.1:bad/0")
    assert "topsecret" not in str(info.value)
    store = RedisStore("redis://127.0.0.1:1/0")  # nothing connects until the first call
    store.close()
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.get_many(["k"])


def test_the_package_imports_without_redis():
    out = run_python("""
        import sys
        sys.modules["redis"] = None  # as if it were not installed
        import kvtier.connector
        fs = kvtier.connector.FileSystemStore
        try:
            kvtier.connector.RedisStore("redis://127.0.0.1:1/0")
        except ImportError as exc:
            print(exc)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kvtier[redis]" in out.stdout
