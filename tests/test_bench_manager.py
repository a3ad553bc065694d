"""``kvtier bench manager`` on a tiny workload: kvtier's figures, the vLLM line, argument checks."""

from __future__ import annotations

import gc
import importlib.util
import json

import pytest

from kvtier.cli import main
from kvtier.cli.bench_manager import (
    TPB,
    KvtierCachedPrompt,
    KvtierDecode,
    Pressure,
    PressureResume,
    _collector_paused,
)
from kvtier.copy import copier
from kvtier.copy.runs import build_runs
from kvtier.tiering import mover

TINY = ["bench", "manager", "--steps", "20", "--prompt-tokens", "160", "--repeats", "3", "--pressure-repeats", "1"]


def _run(capsys, tmp_path, *extra: str) -> tuple[dict, str]:
    path = tmp_path / "mgr.json"
    assert main([*TINY, *extra, "--json", str(path)]) == 0
    return json.loads(path.read_text()), capsys.readouterr().out


def test_kvtier_figures_and_round_trips_without_the_comparison(capsys, tmp_path):
    results, out = _run(capsys, tmp_path, "--no-vllm")
    decode, cached = results["decode_us_per_request_step"], results["cached_prompt_ms"]
    assert 0 < decode["median"] <= decode["max"]
    assert cached["median"] >= cached["create_median"] > 0 and cached["resume_median"] > 0
    assert cached["resize_median"] > 0 and cached["suspend_median"] > 0 and cached["close_median"] > 0
    assert set(results["round_trip_us_per_page"]) == {"host", "host+disk"}
    assert all(v > 0 for v in results["round_trip_us_per_page"].values())
    pressure = results["pressure_resume_ms"]
    assert set(pressure) == {"on", "off", "prefetch"}
    for figures in pressure.values():
        assert 0 < figures["min"] <= figures["median"] <= figures["max"]
        assert figures["promotions"] == figures["demotions"] == 2048
        assert figures["drops"] == 0  # the victims wait in the swap scratch: the host keeps every other page
    assert "resume of a 2,048-page prefix from host, both tiers full, write-through off, cpu, host ms" in out
    assert "prefetch of a 2,048-page prefix from host, both tiers full, write-through off, cpu, host ms" in out
    assert results["pressure_device"] == "cpu"
    assert results["vllm"] == {"missing": "vLLM not measured (--no-vllm)"}
    assert "ratios_vllm_over_kvtier" not in results
    assert "decode step, us per request (256 requests)" in out
    assert "vLLM not measured (--no-vllm): kvtier's figures only" in out
    # a 160-token prompt is not judged against the 32K prompt's targets (before: "met")
    cached_line = next(line for line in out.splitlines() if line.startswith("cached 160-token prompt"))
    assert "not judged" in cached_line and "met" not in cached_line


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_bench_says_it_was_not_found(capsys, tmp_path):
    results, out = _run(capsys, tmp_path, "--no-tiers", "--no-pressure")
    assert results["vllm"]["missing"].startswith("vLLM was not found")
    assert "vLLM was not found" in out
    assert "round_trip_us_per_page" not in results
    assert "pressure_resume_ms" not in results


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--steps", "0", "must be >= 1"),
        ("--repeats", "-1", "must be >= 1"),
        ("--prompt-tokens", "31", "must be >= 32"),
        ("--pressure-repeats", "0", "must be >= 1"),
    ],
)
def test_bad_sizes_are_refused_before_anything_runs(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "manager", flag, value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_decode_workload_commits_every_token_across_block_boundaries():
    decode = KvtierDecode(requests=3, context=2 * TPB + 5, steps=TPB)
    try:
        for _ in range(TPB):
            assert decode.step() > 0
        decode.check()
        for cache in decode.caches:
            assert cache.num_committed_tokens == cache.capacity == 3 * TPB + 5
        decode.caches[0].resize(decode.caches[0].capacity + 1)  # a token given but never committed
        with pytest.raises(RuntimeError, match="did not commit"):
            decode.check()
    finally:
        decode.close()


def test_the_cached_prompt_is_reused_up_to_its_last_token_and_a_miss_is_refused():
    cached = KvtierCachedPrompt(5 * TPB)
    try:
        times = cached.once()
        assert times["total"] >= times["create"] > 0 and times["resume"] > 0 and times["resize"] > 0
        cached.prompt = [t + 1_000_000 for t in cached.prompt]  # a prompt nothing cached
        with pytest.raises(RuntimeError, match="reused 0 tokens"):
            cached.once()
    finally:
        cached.close()


@pytest.mark.parametrize("collect", [True, False])
def test_the_resume_under_pressure_finds_both_tiers_full_and_the_prefix_in_host_memory(collect):
    sizes = Pressure(prefix_blocks=32, primary_pages=48, host_pages=128, prompts=4, prompt_blocks=16, filler_blocks=32)
    for write_through in (True, False):
        side = PressureResume(write_through, sizes)
        try:
            run = side.once(collect=collect)
            assert gc.isenabled() and not gc.get_freeze_count()  # the collector as it was
            assert run["seconds"] > 0
            assert run["promotions"] == run["demotions"] == 32
            assert run["drops"] == 0  # the victims wait in the swap scratch: no head start
            side.manager.check_invariants()
            with pytest.raises(RuntimeError, match=r"not full|not found in host memory"):
                side.once()  # the prefix is in the primary tier now
        finally:
            side.close()


def test_pausing_the_collector_leaves_it_as_it_was_found():
    assert gc.isenabled()
    with _collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with _collector_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause outlasts the bench's
    finally:
        gc.enable()


def test_the_prefetch_under_pressure_swaps_the_prefix_up_as_a_resume_does():
    sizes = Pressure(prefix_blocks=32, primary_pages=48, host_pages=128, prompts=4, prompt_blocks=16, filler_blocks=32)
    side = PressureResume(False, sizes)
    try:
        run = side.once(prefetch=True)
        assert run["seconds"] > 0
        assert run["promotions"] == run["demotions"] == 32 and run["drops"] == 0
        side.manager.check_invariants()
        with pytest.raises(RuntimeError, match=r"not full|prefetch under pressure failed"):
            side.once(prefetch=True)  # nothing left to promote
    finally:
        side.close()


@pytest.mark.parametrize("scratch", [True, False])
def test_a_used_manager_still_copies_runs_of_slots(monkeypatch, scratch):
    """Pages and slots are paired in slot order: after a first swap has mixed up which slots hold
    what, the demotions that push the prefix back down and a second swap still copy a few runs of
    slots (one copy each), as the first swap does; through the swap scratch or with a head start."""
    if not scratch:
        monkeypatch.setattr(mover, "SWAP_SCRATCH_BYTES", 0)
    sizes = Pressure(prefix_blocks=64, primary_pages=96, host_pages=256, prompts=4, prompt_blocks=32, filler_blocks=64)
    side = PressureResume(False, sizes)
    copies = 192 if scratch else 128  # each victim into the scratch and out of it, each promoted page up
    runs_per_call: list[tuple[int, int]] = []

    def counting(pairs, *args, **kwargs):
        runs = build_runs(pairs, *args, **kwargs)
        runs_per_call.append((pairs.shape[0], runs.shape[0]))
        return runs

    try:
        monkeypatch.setattr(copier, "build_runs", counting)
        for _ in range(3):
            runs_per_call.clear()
            assert side.once()["promotions"] == 64
            assert sum(pages for pages, _ in runs_per_call) == copies  # no page copied more often
            assert max(runs for _, runs in runs_per_call) <= 2, runs_per_call
            runs_per_call.clear()
            side.push_prefix_down()
            assert max(runs for _, runs in runs_per_call) <= 2, runs_per_call
        side.manager.check_invariants()
    finally:
        side.close()
