"""Bad arguments to the public APIs: a TypeError or ValueError naming the argument, and nothing changed.

Before, each of these was accepted, or failed with an exception that named something else
(OverflowError, torch's RuntimeError, a comparison's TypeError).
"""

from __future__ import annotations

import dataclasses
import threading
from array import array
from concurrent.futures import Future

import pytest
import torch

import kvtier
from kvtier.config import MAX_DISK_BYTES
from kvtier.connector import FileSystemStore, RedisConnector, StoreConnector
from kvtier.copy import CopyPolicy, PageCopier
from kvtier.reuse.tokens import as_token_array
from kvtier.spec import MAX_UNIFORM_LAYERS
from kvtier.storage.slots import SlotAllocator
from kvtier.tiering.host_prefetch import HostPrefetch

SPEC = kvtier.ModelSpec.uniform(2, 2, 4, torch.float32)


def manager() -> kvtier.KVCacheManager:
    return kvtier.KVCacheManager(SPEC, kvtier.CacheConfig(4, [kvtier.PrimaryTier(1 << 16)]))


@pytest.mark.parametrize(
    "tokens",
    [
        [True, False, 5],
        (5, 7, False),
        [7] * 500 + [True],  # long enough for the check on the converted array
        [1, 0] * 300 + [False],
    ],
)
def test_bools_are_not_token_ids(tokens):
    """Before, True and False were tokens 1 and 0, sharing blocks with the ints 1 and 0."""
    with pytest.raises(TypeError, match="not bools"):
        as_token_array(tokens)


class TokenBuffer(array):
    """An ``array('i')`` subclass, as vLLM 0.34 keeps a request's tokens."""

    __slots__ = ()


@pytest.mark.parametrize("typecode", list("bBhHiIlLqQ"))
def test_an_integer_array_converts_to_the_same_tokens_as_its_list(typecode):
    tokens = [0, 1, 7, 100, 127] * 40
    assert as_token_array(array(typecode, tokens)) == as_token_array(tokens)
    assert as_token_array(TokenBuffer("i", tokens)) == as_token_array(tokens)
    assert as_token_array(array("Q", [2**64 - 1])) == array("Q", [2**64 - 1])


def test_an_array_of_negatives_or_floats_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        as_token_array(TokenBuffer("i", [5, -1, 6]))
    with pytest.raises(TypeError, match="integer"):
        as_token_array(array("d", [1.0, 2.0]))


def test_ints_0_and_1_are_still_token_ids():
    assert list(as_token_array([0, 1, 5])) == [0, 1, 5]
    assert list(as_token_array((1, 0) * 300)) == [1, 0] * 300


def test_the_manager_refuses_bool_tokens_and_changes_nothing():
    mgr = manager()
    cache = mgr.create_cache([3, 4, 5, 6, 7])
    cache.resume()
    cache.resize(8)
    before = (dataclasses.asdict(mgr.stats()), cache.num_committed_tokens)
    for call in (
        lambda: mgr.create_cache([True, False, 5]),
        lambda: cache.commit([3, True]),
        lambda: mgr.prefetch([True, False]),
        lambda: mgr.prefetch_to_host([True]),
        lambda: mgr.cached_tokens([True, 4]),
    ):
        with pytest.raises(TypeError, match="tokens must be integer ids, not bools"):
            call()
    assert (dataclasses.asdict(mgr.stats()), cache.num_committed_tokens) == before
    mgr.check_invariants()
    mgr.close()


@pytest.mark.parametrize("size", [10**30, 2**63, 2**62, MAX_DISK_BYTES + 1])
def test_a_disk_tier_past_any_file_system_is_refused_before_anything_is_created(tmp_path, size):
    """Before, 10**30 raised OverflowError and 2**62 OutOfPagesError, after creating the directory."""
    with pytest.raises(ValueError, match=r"DiskTier.bytes must be at most 2\*\*60"):
        kvtier.DiskTier(size, tmp_path / "disk")
    assert not (tmp_path / "disk").exists()
    assert kvtier.DiskTier(MAX_DISK_BYTES, tmp_path / "disk").bytes == MAX_DISK_BYTES


def test_slot_bookkeeping_too_large_for_memory_is_a_plain_memory_error(capsys):
    """Before, the failed allocation also printed a stray SystemError about exported buffers."""
    with pytest.raises(MemoryError):
        SlotAllocator(2**62)
    assert "SystemError" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("device", "error"), [("gpu", ValueError), ("", ValueError), (5, TypeError), (None, TypeError)]
)
def test_page_copier_names_a_bad_device(device, error):
    """Before, torch's RuntimeError ("Expected one of cpu, cuda, ...", or about accelerators for 5)."""
    with pytest.raises(error, match="device must be 'cpu', 'cuda'"):
        PageCopier(device)


@pytest.mark.parametrize(("page_bytes", "error"), [("64", TypeError), (float("nan"), TypeError), (64.0, TypeError)])
def test_copy_policy_choose_takes_an_int_page_size(page_bytes, error):
    """Before, nan chose "kernel" and "64" failed comparing str with int."""
    with pytest.raises(error, match="page_bytes must be an int"):
        CopyPolicy().choose(page_bytes)


def test_uniform_model_spec_bounds_its_layer_count():
    """Before, ModelSpec.uniform(10**30, ...) built layers until memory ran out."""
    for num_layers in (10**30, MAX_UNIFORM_LAYERS + 1):
        with pytest.raises(ValueError, match=f"num_layers must be <= {MAX_UNIFORM_LAYERS}, got {num_layers}"):
            kvtier.ModelSpec.uniform(num_layers, 2, 4)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"ttl_seconds": 10**400}, "ttl_seconds must be a finite number"),  # before: OverflowError
        ({"ttl_seconds": 1e300}, "ttl_seconds must be at most"),  # before: accepted, every save then refused
        ({"timeout_s": 0}, "RedisConnector's timeout_s) must be > 0"),  # before: named socket_timeout_s only
        ({"timeout_s": 10**400}, "timeout_s) must be a finite number"),
    ],
)
def test_redis_connector_settings_name_the_argument(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        RedisConnector("redis://127.0.0.1:1", **kwargs)


@pytest.mark.parametrize("policy", ["priority>=²", "seen>=٣", "priority>=", "seen>=1.5"])
def test_a_save_policy_number_is_ascii_digits(tmp_path, policy):
    """Before, 'priority>=²' passed the digit check and failed in int() with an unrelated message."""
    with pytest.raises(ValueError, match="bad save policy"):
        StoreConnector(FileSystemStore(tmp_path), save_policy=policy)


def running_prefetch() -> tuple[HostPrefetch, Future]:
    job = HostPrefetch([], [], [])
    job.future = Future()
    return job, job.future


@pytest.mark.parametrize("timeout", [1e300, float("inf"), 10**400])
def test_a_host_prefetch_waits_without_limit_past_the_longest_timeout(timeout):
    """Before, concurrent.futures raised OverflowError (timestamp out of range)."""
    job, future = running_prefetch()
    threading.Timer(0.05, future.set_result, [None]).start()
    assert job.wait(timeout) is True


@pytest.mark.parametrize(("timeout", "error"), [(float("nan"), ValueError), ("1", TypeError), (True, TypeError)])
def test_a_host_prefetch_refuses_a_timeout_that_is_no_number(timeout, error):
    job, future = running_prefetch()
    with pytest.raises(error, match="timeout must be a number of seconds or None"):
        job.wait(timeout)
    assert job.wait(0) is False and job.wait(-1) is False
    future.set_result(None)
    assert job.wait(None) is True
