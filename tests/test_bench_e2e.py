"""``kvtier bench e2e`` end to end on the CPU with a tiny model: every case's row, tokens as the dense path's."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile

import pytest

from kvtier.cli import main

CASES = [
    "recompute",
    "gpu",
    "host",
    "recompute-engine",
    "disk",
    "host-full-wt",
    "host-full-nowt",
    "host-queued",
    "disk-queued",
]
TINY = [
    *("bench", "e2e", "--model", "tiny-llama", "--device", "cpu", "--dtype", "float32"),
    *("--prefixes", "64", "--suffix", "8", "--tokens-per-block", "8", "--repeats", "2", "--greedy-tokens", "2"),
    *("--chunk", "64", "--primary-gib", "0.0005", "--host-gib", "0.001", "--disk-gib", "0.001"),
    *("--pressure-primary-gib", "0.0005", "--pressure-host-gib", "0.001"),
]


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> tuple[dict[str, dict], str, list[str]]:
    """One run without ``--disk-path``: its disk tiers in temporary directories under ``temp``."""
    path = tmp_path_factory.mktemp("e2e") / "e2e.json"
    temp = tmp_path_factory.mktemp("temp")
    out = io.StringIO()
    saved, tempfile.tempdir = tempfile.tempdir, str(temp)
    try:
        with contextlib.redirect_stdout(out):
            assert main([*TINY, "--json", str(path)]) == 0
    finally:
        tempfile.tempdir = saved
    rows = {r["case"]: r for r in json.loads(path.read_text())["rows"]}
    return rows, out.getvalue(), sorted(p.name for p in temp.glob("kvtier*"))  # (torch keeps its own there)


def test_the_temporary_disk_directories_are_removed(bench):
    """Before, the disk case's directory (twice the prefix's KV bytes) stayed after every run."""
    assert bench[2] == []


def test_every_case_has_a_row_in_the_json_and_the_table(bench):
    rows, out, _ = bench
    assert list(rows) == CASES
    for case in CASES:
        assert f" {case} " in out
        assert rows[case]["ttft_ms"] > 0
        assert rows[case]["ttft_over_recompute"] == pytest.approx(1 / rows[case]["speedup_vs_recompute"])
    assert "TTFT/recomp" in out


def test_a_cpu_run_says_it_has_no_link_ceiling(bench):
    """Before, a CPU run printed a link ceiling of 0.0 GB/s beside its nan link columns."""
    assert "link ceiling: none on a CPU device" in bench[1] and "0.0 GB/s" not in bench[1]


def test_the_disk_target_is_the_engine_recomputing_a_prompt_as_long(bench):
    rows, out, _ = bench
    disk, engine = rows["disk"], rows["recompute-engine"]
    assert disk["target"]["what"] == "TTFT/engine" and "TTFT/engine" in out
    assert disk["ttft_over_engine_recompute"] == pytest.approx(disk["ttft_ms"] / engine["ttft_ms"])
    assert disk["target"]["value"] == disk["ttft_over_engine_recompute"]
    assert "agreement" not in engine  # its prompts are new: nothing to compare, nothing reused


def test_tokens_agree_with_the_dense_path(bench):
    rows, _, _ = bench
    for case in CASES[1:]:
        if case == "recompute-engine":
            continue
        agreement = rows[case]["agreement"]
        assert agreement["same_argmax"], case
        assert agreement["common_prefix"] == agreement["of"] == 2, case
        assert agreement["logit_rel_err"] < 1e-4, case
        assert agreement["reused_tokens"] >= 64, case  # the prefix, and the check suffix once a case ran it


def test_host_full_evicts_a_full_primary_tier_and_write_through_moves_no_victim_byte(bench):
    rows, _, _ = bench
    with_copies, without = rows["host-full-wt"], rows["host-full-nowt"]
    assert with_copies["primary_full"] and without["primary_full"]
    assert with_copies["reused_by_tier"]["host"] == without["reused_by_tier"]["host"] == 64
    assert with_copies["victim_bytes_down"] == 0
    assert without["victim_bytes_down"] > 0
    assert with_copies["reload_gbps"] > 0 and with_copies["reload_ms"] > 0


def test_queued_cases_start_from_host_and_from_disk_only(bench):
    rows, _, _ = bench
    assert rows["host-queued"]["prefix_placement_before"] == {"host": 64}
    assert rows["disk-queued"]["prefix_placement_before"] == {"disk": 64}
    disk = rows["disk-queued"]
    assert disk["ttft_vs_host"] == pytest.approx(disk["ttft_ms"] / rows["host-queued"]["ttft_ms"])
    assert 0 < disk["own_ms"] <= disk["ttft_ms"]
    assert sum(disk["reused_by_tier"].values()) == 64


def test_unset_tier_sizes_are_multiples_of_the_longest_prefix():
    """The 8B shape at 32K tokens keeps the sizes its recorded runs used; other models scale."""
    import argparse

    import torch

    from kvtier.cli.bench_e2e import PREFIXES_PER_TIER, fill_tier_sizes
    from kvtier.models.architecture import NAMED_CONFIGS

    def filled(model: str, prefixes: list[int], **given) -> argparse.Namespace:
        args = argparse.Namespace(prefixes=prefixes, tokens_per_block=32, **(dict.fromkeys(PREFIXES_PER_TIER) | given))
        fill_tier_sizes(args, NAMED_CONFIGS[model].spec(torch.bfloat16))
        return args

    big = filled("llama-8b-shape", [4096, 16384, 32768], host_gib=3.0)
    assert (big.primary_gib, big.host_gib, big.disk_gib) == (24.0, 3.0, 8.0)
    assert (big.pressure_primary_gib, big.pressure_host_gib) == (12.0, 20.0)
    tiny = filled("tiny-llama", [256])
    assert tiny.primary_gib == 6 * 256 * 4 * 2 * 2 * 16 * 2 / (1 << 30)  # layers x K,V x heads x dim x bf16


def test_a_prefix_shorter_than_a_block_is_refused_before_a_model_is_built(capsys):
    """Before, ``--prefixes 4`` ran: no page to reuse, "primary full: False", an empty "prefix
    before", and still a "met" for the queued disk target."""
    args = [*TINY[: TINY.index("--prefixes")], "--prefixes", "64,4", *TINY[TINY.index("--prefixes") + 2 :]]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--prefixes: each prefix holds at least one block of --tokens-per-block 8 tokens" in err
    assert err.rstrip().endswith("got 4")
