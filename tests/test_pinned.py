"""kvtier.storage.pinned: chunk plans on page boundaries, the chunk knob, and plain host buffers."""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtier.storage.pinned import (
    HOST_REGISTER_CHUNK_BYTES_ENV,
    allocate_host_buffer,
    parse_chunk_bytes,
    plan_chunks,
)

REPO = Path(__file__).resolve().parents[1]


@given(
    page=st.sampled_from([16, 24, 4096, 65_536, 884_736, 15_261_696]),
    pages=st.integers(1, 5000),
    chunk=st.one_of(st.none(), st.integers(1, 1 << 32)),
)
def test_chunks_cover_the_buffer_and_split_on_page_boundaries(page: int, pages: int, chunk: int | None) -> None:
    num_bytes = page * pages
    chunks = plan_chunks(num_bytes, page, chunk)
    assert chunks[0][0] == 0
    assert sum(size for _, size in chunks) == num_bytes
    for (offset, size), (following, _) in itertools.pairwise(chunks):
        assert offset + size == following
        assert following % page == 0 and following % mmap.PAGESIZE == 0
    if chunk is not None and len(chunks) > 1:
        assert chunks[0][1] <= max(chunk, page * mmap.PAGESIZE)


def test_one_chunk_without_a_chunk_size_or_with_a_large_one() -> None:
    assert plan_chunks(10 * 884_736, 884_736, None) == [(0, 10 * 884_736)]
    assert plan_chunks(10 * 884_736, 884_736, 1 << 40) == [(0, 10 * 884_736)]


def test_chunk_size_rounds_down_to_whole_pages() -> None:
    page = 884_736  # 216 OS pages of 4 KiB
    chunks = plan_chunks(10 * page, page, 3 * page + page // 2)
    assert [size for _, size in chunks] == [3 * page, 3 * page, 3 * page, page]


@pytest.mark.parametrize(("raw", "expected"), [(None, None), ("1048576", 1 << 20), (" 4096 ", 4096)])
def test_chunk_knob_valid_values(raw: str | None, expected: int | None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse_chunk_bytes(raw) == expected
    assert not caplog.records


@pytest.mark.parametrize(
    ("raw", "reason"),
    [("", "not an integer"), ("2GiB", "not an integer"), ("0", "out of range"), ("-5", "out of range"),
     ("99999999999999999999", "out of range")],
)  # fmt: skip
def test_chunk_knob_bad_values_warn(raw: str, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse_chunk_bytes(raw) is None
    [record] = caplog.records
    assert HOST_REGISTER_CHUNK_BYTES_ENV in record.getMessage() and reason in record.getMessage()


def test_chunk_knob_is_read_once_per_process() -> None:
    child = """
import logging, os
logging.basicConfig(format="%(levelname)s:%(message)s")
from kvtier.storage.pinned import chunk_bytes_from_env
first = chunk_bytes_from_env()
os.environ["KVTIER_HOST_REGISTER_CHUNK_BYTES"] = "4096"
print(first, chunk_bytes_from_env())
"""
    env = {**os.environ, HOST_REGISTER_CHUNK_BYTES_ENV: "lots"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "None"]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING:")]
    assert len(warnings) == 1 and HOST_REGISTER_CHUNK_BYTES_ENV in warnings[0]


def test_cpu_buffer_is_plain_memory() -> None:
    with allocate_host_buffer(10 * 4096, 4096, "cpu") as buffer:
        assert buffer.tensor.dtype == torch.uint8 and buffer.num_bytes == 10 * 4096
        assert buffer.tensor.is_contiguous() and not buffer.pinned and buffer.chunks == ()
        buffer.tensor.fill_(7)
    buffer.release()  # idempotent
    assert bool((buffer.tensor == 7).all())


@pytest.mark.parametrize(
    ("num_bytes", "page_bytes", "kwargs"),
    [
        (0, 4096, {}),
        (4096, 0, {}),
        (4096, 8192, {}),
        (8192, 4096, {"chunk_bytes": 0}),
        (8192, 4096, {"device": "meta"}),
    ],
)
def test_bad_arguments(num_bytes: int, page_bytes: int, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        allocate_host_buffer(num_bytes, page_bytes, **kwargs)
