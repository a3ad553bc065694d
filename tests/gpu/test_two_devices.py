"""Two GPUs in one process: kvtier on a device that is not the current one (skipped below two GPUs).

A notebook with two GPUs puts a model on ``cuda:1`` while ``cuda:0`` stays current; a program
builds a manager on ``"cuda"`` and later makes another device current. Every page and copy stays
on the manager's device (its streams, its driver context, its pinned host memory), byte for byte
and token for token, and the current device is left as it was.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import kvtier
from kvtier.copy.policy import COHERENT_COPY_KERNEL_ENV, COPY_ENGINE_MIN_BYTES_ENV, _process_policy
from tests.gpu.test_tiers_gpu import cascade_and_reload
from tests.test_cache_properties import machine
from tests.test_tiers import manager

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)

SECOND = "cuda:1"


@pytest.fixture(autouse=True)
def first_device_current():
    """The first device is current when each test starts, and again when it ends."""
    torch.cuda.set_device(0)
    yield
    assert torch.cuda.current_device() == 0


@contextlib.contextmanager
def nothing_on(device: int):
    """No tensor is made in ``device``'s memory inside the block, not even for a while."""
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    yield
    assert torch.cuda.max_memory_allocated(device) == before


@pytest.fixture(params=["copy_engine", "kernel"])
def copy_path(request, monkeypatch) -> str:
    """Every copy of the managers built in the test on one path (0: the copy engines take every
    size; negative: none)."""
    monkeypatch.setenv(COPY_ENGINE_MIN_BYTES_ENV, "0" if request.param == "copy_engine" else "-1")
    monkeypatch.setenv(COHERENT_COPY_KERNEL_ENV, "0" if request.param == "copy_engine" else "1")  # (NVLink-C2C hosts)
    _process_policy.cache_clear()
    yield request.param
    _process_policy.cache_clear()


def test_a_manager_on_the_second_device_moves_every_page_there(tmp_path, copy_path):
    with nothing_on(0):
        mgr = manager(tmp_path, primary=8, host=8, disk=32, device=SECOND)
        assert mgr.device == torch.device(SECOND)
        assert all(view.device == torch.device(SECOND) for view in mgr.kv_views(0).values())
        cascade_and_reload(mgr, copy_path)
        mgr.close()


@pytest.mark.parametrize("kind", ["llama", "swa", "hybrid"])
def test_random_operations_on_the_second_device(kind):
    from hypothesis import HealthCheck, settings

    m = machine(kind, {"primary": 8, "host": 6, "disk": 20}, device=SECOND)
    m.TestCase.settings = settings(
        max_examples=6, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
    )
    m.TestCase().runTest()


def test_a_manager_on_bare_cuda_stays_on_the_device_current_when_it_was_built(tmp_path, copy_path):
    mgr = manager(tmp_path, primary=8, host=8, disk=32, device="cuda")
    assert mgr.device == torch.device("cuda", 0)
    torch.cuda.set_device(1)  # the program moves on to the other device
    try:
        with nothing_on(1):
            cascade_and_reload(mgr, copy_path)
    finally:
        mgr.close()
        torch.cuda.set_device(0)


def test_the_engine_on_the_second_device_matches_the_oracle_through_host_and_disk(tmp_path):
    from kvtier.engine import LLMEngine, SchedulerConfig
    from kvtier.models import build_model
    from tests.gpu.test_engine_gpu import float64_through_host_and_disk

    model = build_model("tiny-llama", SECOND, torch.float64, seed=0)
    with pytest.raises(ValueError, match="the same device"):  # "cuda" is the current device, cuda:0
        LLMEngine(model, kvtier.CacheConfig(16, [kvtier.PrimaryTier(1 << 24)], device="cuda"), SchedulerConfig())
    float64_through_host_and_disk("tiny-llama", SECOND, tmp_path)


def test_prefix_cache_with_the_model_on_the_second_device(tmp_path):
    from tests.hf.test_hf_gpu import chat_turns
    from tests.hf.tiny import tiny_model

    chat_turns(tiny_model("llama"), SECOND, tmp_path, seed=41)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_vllm_block_transfers_on_the_second_device(layout):
    from kvtier.storage.pinned import allocate_host_buffer
    from kvtier.vllm.transfer import BlockTransfer, Direction, route_groups
    from tests.test_vllm_transfer import BLOCKS, SLOTS, block_bytes, caches, job, one_group

    views, raw = caches(layout, SECOND)
    plan = one_group(list(views))
    allocation, routes = route_groups([plan], views, BLOCKS)
    with nothing_on(0), allocate_host_buffer(SLOTS * plan.host_page_bytes, plan.host_page_bytes, SECOND) as host:
        transfer = BlockTransfer(allocation, routes, [host.tensor])
        saved = [block_bytes(v, b) for b in (4, 11) for v in views.values()]
        transfer.submit([job(1, Direction.SAVE, [7, 2], [4, 11])])
        transfer.synchronize()
        assert transfer.poll() == [(1, True)]
        raw.fill_(0x3C)  # on the second device's current stream: the load waits for it
        transfer.submit([job(2, Direction.LOAD, [7, 2], [19, 3])])
        transfer.synchronize()
        assert [block_bytes(v, b) for b in (19, 3) for v in views.values()] == saved
