"""Tiers on a CUDA device: pinned host pages, disk through pinned staging, byte for byte."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, settings

from tests.kvdata import PageOracle
from tests.test_cache_properties import machine
from tests.test_reliability_soak import kill_writers_and_restart
from tests.test_tiers import convo, manager, prefill, run_python


def cascade_and_reload(mgr, path: str | None = None) -> None:
    """Five talks pushed down to host memory and disk, then each resumed byte for byte; ``path``:
    the copy path every copy between the primary tier and host memory must take (None: either)."""
    oracle = PageOracle(mgr)
    for i in range(5):
        prefill(mgr, oracle, convo(i))
    stats = mgr.stats()
    to_host = {k: v for k, v in stats.bytes_copied.items() if k.startswith("primary->host:")}
    paths = {"kernel", "copy_engine"} if path is None else {path}
    assert to_host and set(to_host) <= {f"primary->host:{p}" for p in paths}, stats.bytes_copied
    assert stats.tiers["disk"].pages_used > 0
    for i in range(5):
        tokens = convo(i) + [1, 2]
        cache = mgr.create_cache(tokens)
        assert cache.num_reused_tokens == 24
        assert cache.resume()
        oracle.check(cache, tokens)
        cache.close()
    up = {k for k in mgr.stats().bytes_copied if k.startswith("host->primary:")}
    assert up <= {f"host->primary:{p}" for p in paths}, mgr.stats().bytes_copied
    mgr.check_invariants()


def test_cascade_and_reload_on_gpu(tmp_path):
    mgr = manager(tmp_path, primary=8, host=8, disk=32, device="cuda")
    cascade_and_reload(mgr)
    mgr.close()


def test_primary_to_disk_without_host_on_gpu(tmp_path):
    mgr = manager(tmp_path, primary=8, host=0, disk=32, device="cuda")
    oracle = PageOracle(mgr)
    for i in range(4):
        prefill(mgr, oracle, convo(i))
    assert mgr.stats().bytes_copied["host->disk:file"] > 0
    tokens = convo(0) + [3]
    cache = mgr.create_cache(tokens)
    assert cache.reused_by_tier["disk"] == 24
    assert cache.resume()
    oracle.check(cache, tokens)
    mgr.close()


@pytest.mark.parametrize("kind", ["llama", "swa", "hybrid"])
def test_random_operations_on_gpu(kind):
    m = machine(kind, {"primary": 8, "host": 6, "disk": 20}, device="cuda")
    m.TestCase.settings = settings(
        max_examples=8, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
    )
    m.TestCase().runTest()


def test_a_partly_reused_block_copied_into_a_slot_a_racing_demotion_reads():
    """Found by the random operations above: a plan demotes a primary page to host while its
    group also promotes from host (both directions at once) and copies a partly reused block into
    the slot the demotion reads; the copy ran first, and the demoted page's bytes on host were the
    copy's (served wrong later)."""
    m = machine("swa", {"primary": 8, "host": 6, "disk": 20}, device="cuda")
    state = m()
    state.setup()
    try:
        state.serve(keep=False, prefix=1, prefix_len=16, suffix=[3, 0, 0, 0])
        state.serve(keep=True, prefix=0, prefix_len=8, suffix=[0, 0, 0, 0, 0])
        state.serve(keep=False, prefix=1, prefix_len=13, suffix=[0])
        state.serve(keep=False, prefix=1, prefix_len=16, suffix=[3, 0])  # checks every reused byte
        state.mgr.check_invariants()
    finally:
        state.teardown()


@pytest.mark.parametrize("failing_call", [1, 2, 3])
def test_a_copy_failing_midway_on_gpu_never_serves_what_did_not_arrive(tmp_path, monkeypatch, failing_call):
    """A resume whose ``failing_call``-th copy raises (copies before it are queued on the device's
    streams, both directions of the link at once): the pages the plan was writing are dropped,
    and every prompt is served exact bytes afterwards, before and after a restart. (A copy into
    the staging buffer of a disk write fails that write instead: the resume goes on.)"""
    from kvtier.copy.copier import PageCopier

    mgr = manager(tmp_path, primary=8, host=8, disk=32, device="cuda")
    oracle = PageOracle(mgr)
    prompts = [convo(i) for i in range(6)]
    for tokens in prompts:
        prefill(mgr, oracle, tokens)
    real, calls = PageCopier.copy, [0]

    def copy(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == failing_call:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(self, *args, **kwargs)

    cache = mgr.create_cache([*prompts[1], 1])
    monkeypatch.setattr(PageCopier, "copy", copy)
    with contextlib.suppress(RuntimeError):  # raised, unless the failing copy was a disk write's
        cache.resume()
    monkeypatch.setattr(PageCopier, "copy", real)
    assert calls[0] >= failing_call  # the fault fired inside the resume
    assert cache.resume()
    oracle.check(cache, [*prompts[1], 1])
    cache.close()
    mgr.check_invariants()
    serve_exact(mgr, prompts)
    mgr.close()
    restarted = manager(tmp_path, primary=8, host=8, disk=32, device="cuda")
    serve_exact(restarted, prompts)
    restarted.close()


def serve_exact(mgr, prompts) -> None:
    oracle = PageOracle(mgr)
    for tokens in prompts:
        cache = mgr.create_cache([*tokens, 1])
        assert cache.resume()
        oracle.check(cache, [*tokens, 1])
        cache.close()
    mgr.check_invariants()


def test_promotions_without_a_prefill_rate_keep_a_bounded_timing_record(tmp_path):
    from kvtier.tiering.mover import TIMED_COPIES

    mgr = manager(tmp_path, primary=8, host=8, disk=0, device="cuda")
    oracle = PageOracle(mgr)
    prompts = [convo(i) for i in range(4)]
    for tokens in prompts:
        prefill(mgr, oracle, tokens)
    for round_ in range(60):  # each resume promotes a prompt back from host memory
        tokens = [*prompts[round_ % 4], 1]
        cache = mgr.create_cache(tokens)
        assert cache.resume()
        cache.close()
    assert len(mgr._pool.mover._timed) <= TIMED_COPIES
    mgr.close()


def test_a_manager_on_bare_cuda_names_the_device_current_when_it_was_built(tmp_path):
    """So that making another device current later moves none of its copies there
    (``tests/gpu/test_two_devices.py`` drives that on two GPUs)."""
    import torch

    mgr = manager(tmp_path, primary=8, host=8, disk=32, device="cuda")
    here = torch.device("cuda", torch.cuda.current_device())
    assert mgr.device == here and mgr.config.device == here
    assert all(view.device == here for view in mgr.kv_views(0).values())
    mgr.close()


def test_a_manager_with_tiers_below_builds_its_copy_kernel_before_any_request(tmp_path):
    """Small pages moving between tiers take the copy kernel: a manager with a tier below the
    primary one builds it as it is made, so the first resume a request waits for does not (0.6-1.3
    s of Triton's build or cache load on the device hosts); a manager with only the primary tier
    moves pages between tiers never and builds nothing."""
    with_tiers = manager(tmp_path / "a", primary=8, host=8, disk=32, device="cuda")
    alone = manager(tmp_path / "b", primary=8, host=0, disk=0, device="cuda")
    try:
        assert with_tiers._pool.mover.copier._kernel is not None
        assert alone._pool.mover.copier._kernel is None
        cascade_and_reload(with_tiers)
    finally:
        with_tiers.close()
        alone.close()


NO_KERNEL_CHILD = """
import sys
for name in {missing!r}:
    sys.modules[name] = None  # as if it were not installed: importing it raises ImportError
from pathlib import Path
from tests.gpu.test_tiers_gpu import cascade_and_reload
from tests.test_tiers import manager
mgr = manager(Path({path!r}), primary=8, host=8, disk=32, device="cuda")
built = "built" if mgr._pool.mover.copier._kernel is not None else "unbuilt"  # before any copy
cascade_and_reload(mgr, path={copy_path!r})
paths = sorted({{key.split(":")[1] for key in mgr.stats().bytes_copied if key.startswith("primary->host:")}})
mgr.close()
print("exact", built, *paths, flush=True)
"""


@pytest.mark.parametrize("broken", ["no C compiler", "no Triton"])
def test_a_manager_whose_copy_kernel_cannot_be_built_moves_pages_through_the_copy_engines(tmp_path, broken):
    """A process where Triton cannot build the kernel's launcher (its compiler missing, an empty
    Triton cache), or where Triton cannot be imported: the manager is still made, with one WARNING
    naming the cause, and its small pages move between tiers through the copy engines, byte for
    byte."""
    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton")}  # empty: Triton's launcher is compiled again
    if broken == "no C compiler":
        env["CC"] = str(tmp_path / "no-such-cc")
    missing = [] if broken == "no C compiler" else ["triton"]
    code = NO_KERNEL_CHILD.format(missing=missing, path=str(tmp_path / "disk"), copy_path="copy_engine")
    child = run_python(code, timeout=300, **env)
    assert child.returncode == 0 and child.stdout.split() == ["exact", "unbuilt", "copy_engine"], child.stderr[-3000:]
    kernel = [line for line in child.stderr.splitlines() if "the copy kernel cannot be built" in line]
    assert len(kernel) == 1, child.stderr[-3000:]
    assert ("no-such-cc" if broken == "no C compiler" else "triton") in kernel[0]
    assert "needs cuda-bindings" not in child.stderr


def test_a_manager_without_cuda_bindings_builds_the_copy_kernel_and_moves_pages_byte_for_byte(tmp_path):
    """``pip install kvtier`` without the gpu extra on a CUDA machine: no cuda-bindings, but Triton
    (torch brings it). The manager is made, builds the copy kernel as it is made (for calls of many
    runs: ``tests/gpu/test_copy_gpu.py`` drives those), and moves its pages between tiers byte for
    byte (these calls are of a few runs: torch copies), with one WARNING, about the batched
    copy-engine call."""
    code = NO_KERNEL_CHILD.format(missing=["cuda.bindings"], path=str(tmp_path / "disk"), copy_path=None)
    child = run_python(code, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split()[:2] == ["exact", "built"], child.stdout
    assert "the copy kernel cannot be built" not in child.stderr, child.stderr[-3000:]
    assert child.stderr.count("needs cuda-bindings") == 1, child.stderr[-3000:]


@pytest.mark.parametrize("layout", ["three-tiers", "primary-and-disk"])
def test_a_process_killed_mid_write_on_gpu_restarts_with_exact_pages(tmp_path, layout):
    # the GPU tier's disk reads and writes go through staging one page a part (primary-and-disk:
    # every demotion; three tiers: hot prefixes copied down with their first child), so a kill
    # lands between parts
    assert kill_writers_and_restart(tmp_path, layout, device="cuda", chunk_bytes=1) >= 3
