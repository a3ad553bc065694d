"""Block keys, the page codec, and the file-system block store, with real files and real OS failures."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.connector import BlockKeyspace, BlockStore, FileSystemStore, decode_page, encode_page, fs_store
from kvtier.connector.block_codec import HEADER_BYTES
from kvtier.reuse.block_keys import block_key, scope_key
from kvtier.reuse.tokens import encode_tokens

ROOT = Path(__file__).resolve().parents[1]
FINGERPRINT = "0123456789abcdef0123456789abcdef"


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="12345")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env
    )


def chained_keys(tokens: list[int], scope: kvtier.ReuseScope, tpb: int = 4) -> list[bytes]:
    """The block keys of ``tokens``' full blocks, as the radix tree chains them."""
    from array import array

    keys, parent = [], scope_key(scope)
    for start in range(0, len(tokens) - tpb + 1, tpb):
        parent = block_key(parent, encode_tokens(array("Q", tokens[start : start + tpb])))
        keys.append(parent)
    return keys


def random_page(rng: np.random.Generator, size: int) -> np.ndarray:
    """A page of non-zero random bytes."""
    return rng.integers(1, 256, size, dtype=np.uint8)


# ---------------------------------------------------------------------------------------- keys


def test_keys_differ_in_every_part():
    spec_a = kvtier.ModelSpec.uniform(2, 2, 8)
    spec_b = kvtier.ModelSpec.uniform(2, 2, 16)
    spaces = [
        BlockKeyspace.for_model(spec_a, 16),
        BlockKeyspace.for_model(spec_b, 16),
        BlockKeyspace.for_model(spec_a, 32),
        BlockKeyspace.for_model(spec_a, 16, tp_rank=1, tp_world_size=2),
        BlockKeyspace.for_model(spec_a, 16, tp_rank=0, tp_world_size=2),
    ]
    scopes = [
        kvtier.DEFAULT_SCOPE,
        kvtier.ReuseScope(lora_id=1),
        kvtier.ReuseScope(lora_id="1"),
        kvtier.ReuseScope(salt="tenant-a"),
        kvtier.ReuseScope(salt=b"tenant-a"),
        kvtier.ReuseScope(salt=""),
    ]
    blocks = chained_keys(list(range(12)), kvtier.DEFAULT_SCOPE)
    keys = [space.key(s, b, g) for space in spaces for s in scopes for b in blocks for g in range(3)]
    assert len(set(keys)) == len(keys) == len(spaces) * len(scopes) * len(blocks) * 3
    assert all(set(k) <= set("0123456789abcdefghijklmnopqrstuvwxyz/") for k in keys)
    assert spaces[0].fingerprint == spec_a.fingerprint()


def test_key_format_is_pinned():
    """The layout of keys is part of what other processes and machines rely on: it changes only with
    the stored page format (``v3``: ``block_codec.FORMAT_VERSION``), so that releases writing other
    values never share a key. Before, format 3 used format 2's ``v1`` keys: a rolling upgrade's two
    releases took each other's values for damaged ones and deleted them."""
    space = BlockKeyspace(FINGERPRINT, 16, tp_rank=1, tp_world_size=4)
    assert space.key(kvtier.ReuseScope(lora_id=7, salt="t"), bytes(range(16)), 2) == (
        "kvtier/v3/0123456789abcdef0123456789abcdef/tpb16/tp1of4/"
        "0135e4823a9fd99b23c091f7ae959085/000102030405060708090a0b0c0d0e0f/g2"
    )


def test_keys_are_the_same_in_another_process():
    scope = kvtier.ReuseScope(lora_id="adapter", salt=b"\x00salt")
    spec = kvtier.ModelSpec([kvtier.AttentionLayer(2, 8), kvtier.RecurrentLayer(64)])
    tokens = list(range(100, 140))
    here = [
        BlockKeyspace.for_model(spec, 4, 1, 2).key(scope, b, g)
        for b in chained_keys(tokens, scope)
        for g in range(len(spec.groups))
    ]
    out = run_python(f"""
        import json, kvtier
        from kvtier.connector import BlockKeyspace
        from tests.test_connector_stores import chained_keys
        scope = kvtier.ReuseScope(lora_id="adapter", salt=b"\\x00salt")
        spec = kvtier.ModelSpec([kvtier.AttentionLayer(2, 8), kvtier.RecurrentLayer(64)])
        space = BlockKeyspace.for_model(spec, 4, 1, 2)
        keys = [space.key(scope, b, g) for b in chained_keys({tokens!r}, scope) for g in range(len(spec.groups))]
        print(json.dumps(keys))
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == here


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("ABC", 16), ValueError),
        (("", 16), ValueError),
        (("a/b", 16), ValueError),
        ((FINGERPRINT, 0), ValueError),
        ((FINGERPRINT, 16, 2, 2), ValueError),
        ((FINGERPRINT, 16, -1, 2), ValueError),
        ((FINGERPRINT, 16, 0, 0), ValueError),
        ((FINGERPRINT, 16.0), TypeError),
        ((FINGERPRINT, 16, True), TypeError),
    ],
)
def test_keyspace_rejects_bad_parts(args, error):
    with pytest.raises(error):
        BlockKeyspace(*args)


def test_key_rejects_bad_arguments():
    space = BlockKeyspace(FINGERPRINT, 16)
    with pytest.raises(ValueError, match="16 bytes"):
        space.key(kvtier.DEFAULT_SCOPE, bytes(15), 0)
    with pytest.raises(ValueError, match="group_id"):
        space.key(kvtier.DEFAULT_SCOPE, bytes(16), -1)
    with pytest.raises(TypeError, match="ReuseScope"):
        space.key("tenant", bytes(16), 0)


# --------------------------------------------------------------------------------------- codec


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 100_003])
def test_codec_round_trip(size):
    payload = random_page(np.random.default_rng(size), size)
    blob = encode_page(payload)
    assert len(blob) == HEADER_BYTES + size
    out = decode_page(blob, size)
    assert out is not None and bytes(out) == payload.tobytes()
    assert bytes(decode_page(blob)) == payload.tobytes()  # without a size: the header's length


def test_codec_takes_any_contiguous_buffer():
    arr = np.arange(24, dtype=np.float16).reshape(4, 6)
    assert bytes(decode_page(encode_page(arr), arr.nbytes)) == arr.tobytes()
    assert bytes(decode_page(encode_page(memoryview(b"abc")))) == b"abc"
    with pytest.raises(TypeError, match="C-contiguous"):
        encode_page(arr[:, ::2])
    with pytest.raises(TypeError, match=r"\.numpy\(\)"):
        encode_page("text")


def test_codec_rejects_every_kind_of_damage():
    payload = random_page(np.random.default_rng(1), 64)
    blob = encode_page(payload)
    for n in range(len(blob)):
        assert decode_page(blob[:n], 64) is None, f"truncated to {n}"
        assert decode_page(blob[:n]) is None, f"truncated to {n}"
    for i in range(len(blob)):
        for flip in (0x01, 0x80, 0xFF):
            damaged = bytearray(blob)
            damaged[i] ^= flip
            assert decode_page(damaged, 64) is None, f"byte {i} ^ {flip:#x}"
            assert decode_page(damaged) is None, f"byte {i} ^ {flip:#x}"
    assert decode_page(blob + b"\x00", 64) is None and decode_page(blob + b"\x00") is None
    assert decode_page(blob, 63) is None and decode_page(blob, 65) is None
    assert decode_page(b"", 0) is None and decode_page(b"\x00" * HEADER_BYTES, 0) is None


# -------------------------------------------------------------------------------- file system


def test_codec_binds_a_value_to_its_key():
    payload = np.arange(1, 257, dtype=np.uint8)
    blob = encode_page(payload, "kvtier/a")
    assert bytes(decode_page(blob, 256, "kvtier/a")) == payload.tobytes()
    assert decode_page(blob, 256, "kvtier/b") is None


def test_fs_store_value_copied_under_another_key_is_a_miss(tmp_path):
    store = FileSystemStore(tmp_path)
    payload = np.arange(1, 65, dtype=np.uint8)
    assert store.put_many([("kvtier/x/1", payload), ("kvtier/x/2", payload[::-1].copy())]) == [True, True]
    store.path_of("kvtier/x/2").write_bytes(store.path_of("kvtier/x/1").read_bytes())
    assert store.get_many(["kvtier/x/1", "kvtier/x/2"], [64, 64]) == [payload.tobytes(), None]
    store.close()


def test_fs_store_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    store = FileSystemStore(tmp_path)
    assert isinstance(store, BlockStore)
    space = BlockKeyspace(FINGERPRINT, 16)
    keys = [
        space.key(kvtier.DEFAULT_SCOPE, b, g)
        for b in chained_keys(list(range(80)), kvtier.DEFAULT_SCOPE)
        for g in (0, 1)
    ]
    pages = [random_page(rng, 4096 if i % 2 else 1000) for i in range(len(keys))]
    assert store.put_many(list(zip(keys, pages, strict=True))) == [True] * len(keys)
    got = store.get_many(keys, [p.nbytes for p in pages])
    assert got == [p.tobytes() for p in pages]
    assert store.get_many(keys) == got
    assert store.contains_many(keys) == [True] * len(keys)

    new = random_page(rng, 4096)
    assert store.put_many([(keys[1], new)]) == [True]  # replaces the old value
    assert store.get_many([keys[1]]) == [new.tobytes()]

    store.delete_many(keys[:10] + ["never-written"])
    assert store.get_many(keys[:12]) == [None] * 10 + got[10:12]
    assert store.contains_many(keys[:12]) == [False] * 10 + [True, True]
    assert store.get_many([]) == [] and store.put_many([]) == [] and store.contains_many([]) == []
    store.close()
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.get_many(keys)

    again = FileSystemStore(tmp_path)  # another store on the same directory sees the values
    assert again.get_many(keys[10:]) == got[10:]
    again.close()


def test_fs_store_maps_any_key_to_a_safe_file_under_its_root(tmp_path):
    store = FileSystemStore(tmp_path / "store")
    keys = ["../../etc/passwd", "/abs/path", "a" * 10_000, "ключ/\x00/☃", ".hidden.tmp"]
    pages = [random_page(np.random.default_rng(i), 100) for i in range(len(keys))]
    assert store.put_many(list(zip(keys, pages, strict=True))) == [True] * len(keys)
    assert store.get_many(keys) == [p.tobytes() for p in pages]
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert files == sorted(store.path_of(k) for k in keys)
    for f in files:
        rel = f.relative_to(tmp_path / "store")
        assert len(rel.parts) == 3 and rel.parts[0] == f.name[:2] and rel.parts[1] == f.name[2:4]
    store.close()


def test_fs_store_misses_for_missing_damaged_and_wrong_size_values(tmp_path, caplog):
    rng = np.random.default_rng(2)
    store = FileSystemStore(tmp_path)
    keys = [f"k{i}" for i in range(6)]
    pages = [random_page(rng, 512) for _ in keys]
    assert all(store.put_many(list(zip(keys, pages, strict=True))))

    raw = bytearray(store.path_of("k0").read_bytes())
    raw[HEADER_BYTES + 100] ^= 0x40  # a flipped payload bit
    store.path_of("k0").write_bytes(raw)
    store.path_of("k1").write_bytes(store.path_of("k1").read_bytes()[:-1])  # truncated
    store.path_of("k2").write_bytes(b"not a page at all")
    store.path_of("k3").unlink()  # missing: a plain miss, not worth a warning

    with caplog.at_level(logging.WARNING, logger="kvtier.connector.fs_store"):
        got = store.get_many(keys, [512] * 6)
    assert got == [None, None, None, None, pages[4].tobytes(), pages[5].tobytes()]
    assert "3 of 6 values" in caplog.text and "failed verification" in caplog.text
    assert store.get_many(["k4", "k5"], [511, 513]) == [None, None]  # wrong size for the caller's layout
    # The damaged values are gone, so that the next put writes them again (before: present for good);
    # values of another size than one caller expected stay.
    assert store.contains_many(["k0", "k1", "k2", "k3", "k4", "k5"]) == [False] * 4 + [True] * 2
    assert store.get_many(["k4", "k5"], [512] * 2) == [pages[4].tobytes(), pages[5].tobytes()]
    store.close()


def test_fs_store_ignores_temporary_files(tmp_path):
    """A complete or half-written temporary file next to a value is never read as a value."""
    rng = np.random.default_rng(3)
    store = FileSystemStore(tmp_path)
    old = random_page(rng, 2048)
    assert store.put_many([("written", old)]) == [True]
    assert list(tmp_path.rglob("*.tmp")) == []  # a finished put leaves no temporary file
    assert store.wait_for_budget(30)  # a pass removes the empty fan-out levels it meets: one made next could go

    for key in ("written", "absent"):
        final = store.path_of(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        whole = encode_page(random_page(rng, 2048))
        (final.parent / f".{final.name}.999.aaaaaaaa.tmp").write_bytes(whole)
        (final.parent / f".{final.name}.999.bbbbbbbb.tmp").write_bytes(whole[: len(whole) // 2])
    assert store.get_many(["written", "absent"], [2048, 2048]) == [old.tobytes(), None]
    assert store.contains_many(["written", "absent"]) == [True, False]
    store.close()


def test_fs_store_unreadable_value_is_a_logged_miss(tmp_path, caplog):
    store = FileSystemStore(tmp_path)
    assert store.put_many([("ok", b"x" * 10)]) == [True]
    assert store.wait_for_budget(30)  # a pass removes the empty fan-out levels it meets: one made next could go
    store.path_of("dir").mkdir(parents=True)  # reading it fails with IsADirectoryError
    with caplog.at_level(logging.WARNING, logger="kvtier.connector.fs_store"):
        assert store.get_many(["dir", "ok"]) == [None, b"x" * 10]
    assert "1 of 2 reads" in caplog.text and "Is a directory" in caplog.text
    store.close()


def test_fs_store_in_an_impossible_directory_fails_without_raising(caplog):
    """Nothing can be created under /proc, even as root: every put fails, every get misses, all logged."""
    with caplog.at_level(logging.WARNING, logger="kvtier.connector.fs_store"):
        store = FileSystemStore("/proc/kvtier-no-such-dir/store")
        assert store.put_many([("a", b"1"), ("b", b"2")]) == [False, False]
        assert store.get_many(["a", "b"]) == [None, None]
        assert store.contains_many(["a"]) == [False]
        store.delete_many(["a"])
    assert "cannot create" in caplog.text and "2 of 2 writes" in caplog.text
    store.close()


@pytest.mark.parametrize("interval", [60.0, 0.0])
def test_fs_store_failing_every_call_warns_once_per_interval(caplog, interval):
    """A disk that keeps failing does not flood the log: one line per kind per ``warn_interval_s``."""
    store = FileSystemStore("/proc/kvtier-no-such-dir/store", warn_interval_s=interval)
    with caplog.at_level(logging.WARNING, logger="kvtier.connector.fs_store"):
        for _ in range(5):
            assert store.put_many([("a", b"1")]) == [False]
    lines = [r.getMessage() for r in caplog.records if "writes" in r.getMessage()]
    assert len(lines) == (1 if interval else 5)
    store.close()


def test_fs_store_under_a_file_size_limit_fails_only_what_does_not_fit(tmp_path):
    """RLIMIT_FSIZE makes a write past the limit fail with EFBIG: a real OS failure, reported per item."""
    out = run_python(f"""
        import resource, signal
        from pathlib import Path
        from kvtier.connector import FileSystemStore
        store = FileSystemStore({str(tmp_path)!r})
        assert store.put_many([("big", b"old" * 10)]) == [True]
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        assert store.put_many([("small", b"s" * 100), ("big", b"b" * 65536)]) == [True, False]
        assert store.get_many(["small", "big"]) == [b"s" * 100, b"old" * 10]  # the old value stays
        assert list(Path({str(tmp_path)!r}).rglob("*.tmp")) == []  # the failed write's temp file is gone
        store.close()
        print("ok")
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
    assert "1 of 2 writes" in out.stderr and "File too large" in out.stderr


def stamped_page(key_index: int, version: int, size: int) -> np.ndarray:
    """A page whose every byte says which write made it: a torn or mixed value cannot pass ``check_stamped``."""
    return np.full(size, (key_index * 31 + version) % 255 + 1, dtype=np.uint8)


def check_stamped(key_index: int, payload: bytes | None, size: int) -> None:
    assert payload is not None, f"key {key_index}: a miss, but the key always has a value"
    arr = np.frombuffer(payload, dtype=np.uint8)
    assert arr.size == size and (arr == arr[0]).all() and arr[0] != 0, f"key {key_index}: a mixed value"


STAMPED_PRELUDE = """
import sys, time
import numpy as np
from kvtier.connector import FileSystemStore
from tests.test_connector_stores import check_stamped, stamped_page
"""


def partial_file(root: Path, whole_bytes: int) -> Path | None:
    """A file under ``root`` (a value or a temporary one) that is still being written, if any."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath, name)
            try:
                if path.stat().st_size < whole_bytes:
                    return path
            except FileNotFoundError:
                pass  # renamed away meanwhile
    return None


def test_fs_store_writer_killed_mid_put_leaves_whole_values(tmp_path):
    """The writer is killed the moment a file is seen half-written: every key still reads a whole value."""
    size, n = 4 << 20, 4
    code = STAMPED_PRELUDE + textwrap.dedent(f"""
        store = FileSystemStore({str(tmp_path)!r})
        keys = [f"key{{i}}" for i in range({n})]
        version = 0
        while True:
            assert all(store.put_many([(k, stamped_page(i, version, {size})) for i, k in enumerate(keys)]))
            if version == 0:
                print("ready", flush=True)
            version += 1
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 10
        while partial_file(tmp_path, HEADER_BYTES + size) is None and time.monotonic() < deadline:
            pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert time.monotonic() < deadline, "never saw a write in progress"
    store = FileSystemStore(tmp_path)
    for i, payload in enumerate(store.get_many([f"key{i}" for i in range(n)], [size] * n)):
        check_stamped(i, payload, size)
    store.close()


def test_fs_store_shared_by_two_processes_sees_only_whole_values(tmp_path):
    """Two processes overwrite and read the same keys at once: every read is a whole value, never a miss."""
    size, n = 256 << 10, 12
    store = FileSystemStore(tmp_path)
    assert all(store.put_many([(f"key{i}", stamped_page(i, 0, size)) for i in range(n)]))
    code = STAMPED_PRELUDE + textwrap.dedent(f"""
        store = FileSystemStore({str(tmp_path)!r})
        rng = np.random.default_rng(int(sys.argv[1]))
        keys = [f"key{{i}}" for i in range({n})]
        writes = reads = 0
        print("ready", flush=True)
        sys.stdin.readline()  # both processes start together
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            chosen = rng.choice({n}, size=4, replace=False)
            pages = [stamped_page(int(i), int(rng.integers(1, 1000)), {size}) for i in chosen]
            assert all(store.put_many([(keys[i], p) for i, p in zip(chosen, pages)]))
            writes += 4
            for i, payload in enumerate(store.get_many(keys, [{size}] * {n})):
                check_stamped(i, payload, {size})
            reads += {n}
        print(writes, reads)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for seed in (1, 2)
    ]
    for proc in procs:
        assert proc.stdout.readline().strip() == b"ready", proc.communicate()[1].decode()[-3000:]
    for proc in procs:
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr.decode()[-3000:]
        writes, reads = map(int, stdout.split())
        assert writes >= 40 and reads >= 120, (writes, reads)
    for i, payload in enumerate(store.get_many([f"key{i}" for i in range(n)], [size] * n)):
        check_stamped(i, payload, size)
    assert list(tmp_path.rglob("*.tmp")) == []
    store.close()


def test_fs_store_rejects_bad_arguments(tmp_path):
    store = FileSystemStore(tmp_path)
    with pytest.raises(TypeError):
        store.get_many([b"bytes-key"])
    with pytest.raises(TypeError):
        store.put_many([("", b"x")])
    with pytest.raises(TypeError, match="UTF-8"):
        store.contains_many(["\ud800"])
    with pytest.raises(ValueError, match="2 entries for 1 keys"):
        store.get_many(["a"], [1, 2])
    with pytest.raises(TypeError):
        store.put_many([("a", object())])
    with pytest.raises(ValueError):
        FileSystemStore(tmp_path, io_threads=0)
    for interval in (-1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="warn_interval_s"):
            FileSystemStore(tmp_path, warn_interval_s=interval)
    for name in ("timeout_s", "retry_after_s"):
        for bad in (0, -1, float("nan"), float("inf"), True, "1"):
            with pytest.raises(ValueError, match=name):
                FileSystemStore(tmp_path, **{name: bad})
    store.close()


def test_fs_store_at_a_path_that_can_never_be_a_directory_is_refused(tmp_path):
    """Before, a path that is a regular file (or lies under one) was taken with one WARNING and then
    missed for ever; a NUL byte raised Python's bare "embedded null byte"."""
    taken = tmp_path / "taken"
    taken.write_bytes(b"a file")
    for path in (taken, taken / "below"):
        with pytest.raises(ValueError, match=r"FileSystemStore path .* cannot be a directory: .* is a file"):
            FileSystemStore(path)
        with pytest.raises(ValueError, match="is a file"):
            kvtier.connector.FileSystemConnector(path)
    with pytest.raises(ValueError, match="FileSystemStore path holds a NUL byte"):
        FileSystemStore(str(tmp_path / "a\0b"))
    with pytest.raises(ValueError, match=r"DiskTier\.path holds a NUL byte"):
        kvtier.DiskTier(1 << 20, str(tmp_path / "a\0b"))
    assert sorted(tmp_path.iterdir()) == [taken] and taken.read_bytes() == b"a file"


def hang_reads_of(store: FileSystemStore, key: str) -> Path:
    """Make ``key``'s value a FIFO: opening it to read waits for a writer, as a read of a hard-mounted
    network file system waits for its dead server. Returns its path (``release`` ends the waits).
    Waits for the budget's pass first: a scan removes a fan-out directory it finds empty."""
    assert store.wait_for_budget(10)
    path = store.path_of(key)
    path.unlink()
    os.mkfifo(path, 0o600)
    return path


def release(fifo: Path) -> None:
    """End every read waiting on ``fifo``: a writer opens and closes it (they read an empty value)."""
    with contextlib.suppress(OSError):  # no reader waits any more
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.timeout(60)
def test_fs_store_built_over_a_mount_that_hangs_returns_backed_off(tmp_path, monkeypatch, caplog):
    """Making the store's directory hangs (a mount whose server died before the engine started):
    the construction returns after ``timeout_s`` and the store answers misses and failures at once.
    Before, building the connector (and the engine) waited for ever."""
    gate = threading.Event()
    make = fs_store._make_private_dirs
    monkeypatch.setattr(fs_store, "_make_private_dirs", lambda path: gate.wait() or make(path))
    try:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kvtier.connector.fs_store"):
            store = FileSystemStore(tmp_path / "store", timeout_s=0.3, retry_after_s=30)
        assert time.monotonic() - started < 2
        assert "hang" in caplog.text
        started = time.monotonic()
        assert store.put_many([("k", np.ones(8, np.uint8))]) == [False]
        assert store.get_many(["k"]) == [None] and store.contains_many(["k"]) == [False]
        assert time.monotonic() - started < 0.5
        store.close()
    finally:
        gate.set()


@pytest.mark.timeout(60)
def test_fs_store_read_that_hangs_costs_a_bounded_wait_then_backs_off(tmp_path, caplog):
    """Before, ``get_many`` waited for a hung read for ever, on the engine's thread (no timeout),
    and hung reads kept the store's threads, so later reads of sound values queued behind them."""
    store = FileSystemStore(tmp_path, io_threads=2, timeout_s=0.3, retry_after_s=0.5)
    values = {f"k{i}": bytes([i + 1]) * 64 for i in range(4)}
    assert store.put_many(list(values.items())) == [True] * 4
    fifo = hang_reads_of(store, "k0")
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.connector.fs_store"):
            for _ in range(3):  # each hangs both threads of its pool: later calls need new ones
                t0 = time.monotonic()
                assert store.get_many(["k0", "k1", "k0"]) == [None, None, None]
                assert time.monotonic() - t0 < 2.0
                t0 = time.monotonic()
                assert store.get_many(["k1"]) == [None]  # backed off: answered at once, no file read
                assert store.put_many([("k9", b"9")]) == [False]
                assert store.contains_many(["k1"]) == [False]
                assert time.monotonic() - t0 < 0.2
                time.sleep(0.6)  # the back-off is over
                assert store.get_many(["k1", "k2"]) == [values["k1"], values["k2"]]  # new threads serve
        hung = [r for r in caplog.records if "the file system hangs" in r.getMessage()]
        assert hung and all(r.levelno == logging.WARNING for r in hung)
        assert "answering misses for 0.5s" in hung[0].getMessage()
        assert store.contains_many(["k1", "k3", "nope"]) == [True, True, False]
        store.delete_many(["k3"])
        assert store.get_many(["k3"]) == [None]
    finally:
        for _ in range(8):
            release(fifo)
        store.close()


@pytest.mark.timeout(60)
def test_fs_store_reads_queued_behind_others_on_a_slow_disk_are_not_taken_for_a_hang(tmp_path, monkeypatch, caplog):
    """A large fetch on a slow but sound disk (50 ms a file, two threads) while existence checks
    run: a read waits in the queue far longer than ``timeout_s``. Before, that wait counted as a
    hang: the call gave up, cancelled the fetch's queued reads and backed the store off for 30 s."""
    store = FileSystemStore(tmp_path, io_threads=2, timeout_s=0.3)
    keys = [f"k{i}" for i in range(30)]
    assert store.put_many([(key, key.encode() * 8) for key in keys]) == [True] * 30
    slow_read = store._get_one

    def read_slowly(key, size):
        time.sleep(0.05)
        return slow_read(key, size)

    monkeypatch.setattr(store, "_get_one", read_slowly)
    fetched = []
    with caplog.at_level(logging.WARNING, logger="kvtier.connector.fs_store"):
        fetch = threading.Thread(target=lambda: fetched.append(store.get_many(keys)))
        fetch.start()
        for _ in range(10):
            assert store.contains_many(keys[:2]) == [True, True]  # never queued behind the reads
        fetch.join()
    assert fetched == [[key.encode() * 8 for key in keys]]
    assert "hangs" not in caplog.text
    store.close()


@pytest.mark.timeout(60)
def test_fs_store_retries_on_a_directory_that_stays_hung_leave_a_bounded_number_of_threads(tmp_path):
    """Before, each retry after the back-off left ``io_threads`` more threads in the hung I/O, without
    bound, until no thread could be started and the store raised."""
    store = FileSystemStore(tmp_path, io_threads=4, timeout_s=0.05, retry_after_s=0.01)
    assert store.put_many([(f"k{i}", b"v") for i in range(8)]) == [True] * 8
    fifos = [hang_reads_of(store, f"k{i}") for i in range(8)]
    before = threading.active_count()
    try:
        for _ in range(20):
            assert store.get_many([f"k{i}" for i in range(8)]) == [None] * 8
            time.sleep(0.02)  # past the back-off
        assert threading.active_count() - before <= fs_store.MAX_HUNG_THREADS + 4
    finally:
        for fifo in fifos:
            release(fifo)
        store.close()


@pytest.mark.timeout(60)
def test_fs_store_close_while_another_thread_waits_on_a_hung_read_returns(tmp_path):
    """Before, ``close`` joined the hung thread for ever (the waiting caller's hand-over, after its
    timeout, did nothing on a closed pool)."""
    store = FileSystemStore(tmp_path, io_threads=1, timeout_s=0.3)
    assert store.put_many([("k", b"v")]) == [True]
    fifo = hang_reads_of(store, "k")
    got = []
    try:
        reader = threading.Thread(target=lambda: got.append(store.get_many(["k"])))
        reader.start()
        time.sleep(0.1)  # the read waits on the FIFO
        t0 = time.monotonic()
        store.close()
        assert time.monotonic() - t0 < 2.0
        reader.join(5)
        assert got == [[None]]
    finally:
        release(fifo)


@pytest.mark.timeout(60)
def test_fs_store_a_caller_on_threads_given_up_already_leaves_the_new_threads_alone(tmp_path, monkeypatch):
    """Two callers hung on one pool's threads: the first gives them up; when the second gives up
    later, the pool's new threads are not given up again. Before, that cancelled a third caller's
    sound reads on the new threads (0 of 20 hits)."""
    store = FileSystemStore(tmp_path, io_threads=2, timeout_s=0.3, retry_after_s=0.01)
    keys = [f"k{i}" for i in range(20)]
    assert all(store.put_many([(key, key.encode() * 8) for key in keys] + [("a", b"x"), ("b", b"y")]))
    fifos = [hang_reads_of(store, key) for key in ("a", "b")]
    sound_read = store._get_one

    def read_slowly(key, size):
        if key in keys:
            time.sleep(0.05)
        return sound_read(key, size)

    monkeypatch.setattr(store, "_get_one", read_slowly)
    try:
        first = threading.Thread(target=store.get_many, args=(["a"],))
        first.start()
        time.sleep(0.1)
        second = threading.Thread(target=store.get_many, args=(["b"],))
        second.start()
        time.sleep(0.25)  # the first gave up at 0.3 s, its back-off is over; the second gives up at 0.4 s
        assert store.get_many(keys) == [key.encode() * 8 for key in keys]
        first.join()
        second.join()
    finally:
        for fifo in fifos:
            release(fifo)
        store.close()
