"""CopyPolicy: the path truth table, the knobs' parsing, and the read-once environment."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.copy.policy import (
    COHERENT_COPY_KERNEL_ENV,
    COPY_ENGINE_MIN_BYTES_ENV,
    DEFAULT_COPY_ENGINE_MIN_BYTES,
    SEPARATE_COPY_RUNS,
    CopyPolicy,
    parse_coherent_copy_kernel,
    parse_min_bytes,
)

REPO = Path(__file__).resolve().parents[1]
SIZES = (0, 16, 65_536, DEFAULT_COPY_ENGINE_MIN_BYTES - 1, DEFAULT_COPY_ENGINE_MIN_BYTES, 884_736, 217_055_232)


@pytest.mark.parametrize("page", SIZES)
@pytest.mark.parametrize("threshold", [None, 0, 1, 4096, DEFAULT_COPY_ENGINE_MIN_BYTES, 1 << 40])
@pytest.mark.parametrize("coherent_kernel", [False, True])
def test_truth_table(page: int, threshold: int | None, coherent_kernel: bool) -> None:
    policy = CopyPolicy(copy_engine_min_bytes=threshold, coherent_copy_kernel=coherent_kernel)
    on_pcie = "copy_engine" if threshold is not None and page >= threshold else "kernel"
    assert policy.choose(page) == on_pcie
    assert policy.choose(page, coherent_link=False) == on_pcie
    assert policy.choose(page, coherent_link=True) == ("kernel" if coherent_kernel else "copy_engine")


def test_default_policy_splits_small_and_large_pages() -> None:
    policy = CopyPolicy()
    assert policy.copy_engine_min_bytes == DEFAULT_COPY_ENGINE_MIN_BYTES
    assert 16 * 1024 < DEFAULT_COPY_ENGINE_MIN_BYTES <= 1 << 20  # measured crossover (docs/copy.md)
    assert policy.choose(16 * 1024) == policy.choose(16) == "kernel"
    assert policy.choose(65_536) == policy.choose(884_736) == policy.choose(217_055_232) == "copy_engine"
    assert policy.choose(16, coherent_link=True) == "copy_engine"


@pytest.mark.parametrize("runs", [None, 1, SEPARATE_COPY_RUNS, SEPARATE_COPY_RUNS + 1, 10_000])
@pytest.mark.parametrize("threshold", [None, 0, DEFAULT_COPY_ENGINE_MIN_BYTES])
def test_calls_of_a_few_runs_go_to_the_copy_engines_unless_the_kernel_takes_every_size(runs, threshold) -> None:
    policy = CopyPolicy(copy_engine_min_bytes=threshold)
    few = runs is not None and runs <= SEPARATE_COPY_RUNS
    small_page = "copy_engine" if threshold is not None and (threshold == 0 or few) else "kernel"
    assert policy.choose(4096, runs=runs) == small_page
    assert policy.choose(217_055_232, runs=runs) == ("kernel" if threshold is None else "copy_engine")
    assert policy.choose(4096, runs=runs, coherent_link=True) == "copy_engine"  # the coherent knob alone decides


def test_choose_rejects_a_negative_size() -> None:
    with pytest.raises(ValueError, match="page_bytes"):
        CopyPolicy().choose(-1)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4096"])
def test_policy_rejects_a_bad_threshold(bad: object) -> None:
    with pytest.raises(ValueError, match="copy_engine_min_bytes"):
        CopyPolicy(copy_engine_min_bytes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, DEFAULT_COPY_ENGINE_MIN_BYTES),
        ("0", 0),
        ("16777216", 16 << 20),
        (" 65536 ", 65536),
        ("-1", None),
        ("-9223372036854775808", None),
        ("9223372036854775807", (1 << 63) - 1),
        ("+00000000000000000000065536", 65536),
    ],
)
def test_min_bytes_valid_values(raw: str | None, expected: int | None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse_min_bytes(raw) == expected
    assert not caplog.records


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("", "not an integer"),
        ("abc", "not an integer"),
        ("4abc", "not an integer"),
        ("1.5", "not an integer"),
        ("99999999999999999999", "out of range"),
        ("9223372036854775808", "out of range"),
        ("-9223372036854775809", "out of range"),
        # Before, taken as numbers by Python's int(): underscores, other scripts' digits.
        ("1_000", "not an integer"),
        ("\u0666\u0665\u0665\u0663\u0666", "not an integer"),
        ("\uff16\uff15\uff15\uff13\uff16", "not an integer"),
        ("9" * 5000, "out of range"),  # (before: "not an integer", past Python's digit limit)
    ],
)
def test_min_bytes_bad_values_warn_and_keep_the_default(
    raw: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse_min_bytes(raw) == DEFAULT_COPY_ENGINE_MIN_BYTES
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert COPY_ENGINE_MIN_BYTES_ENV in record.getMessage() and reason in record.getMessage()


@pytest.mark.parametrize(("raw", "expected", "warns"), [(None, False, False), ("0", False, False), ("1", True, False),
                                                        ("true", False, True), ("", False, True), (" 1", False, True),
                                                        ("2", False, True)])  # fmt: skip
def test_coherent_copy_kernel_is_exactly_one(raw: str | None, expected: bool, warns: bool, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse_coherent_copy_kernel(raw) is expected
    assert bool(caplog.records) is warns
    if warns:
        assert COHERENT_COPY_KERNEL_ENV in caplog.records[0].getMessage()


def test_parse_reads_both_knobs_from_a_mapping() -> None:
    policy = CopyPolicy.parse({COPY_ENGINE_MIN_BYTES_ENV: "-5", COHERENT_COPY_KERNEL_ENV: "1"})
    assert policy == CopyPolicy(copy_engine_min_bytes=None, coherent_copy_kernel=True)
    assert CopyPolicy.parse({}) == CopyPolicy()


# One fresh process per environment value: the knobs are read once, at the first from_env().
# The children load policy.py by itself (it needs only the standard library) so that they start
# in a blink; the "unset" case goes through the package import as a user would.
CHILD = """
import importlib.util, json, logging, os, sys
logging.basicConfig(format="%(levelname)s:%(name)s:%(message)s")
if sys.argv[1] == "package":
    from kvtier.copy import CopyPolicy
else:
    spec = importlib.util.spec_from_file_location("kvtier_copy_policy", sys.argv[2])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    CopyPolicy = module.CopyPolicy
first = CopyPolicy.from_env()
os.environ["KVTIER_COPY_ENGINE_MIN_BYTES"] = "123"
os.environ["KVTIER_COHERENT_COPY_KERNEL"] = "1"
again = CopyPolicy.from_env()
print(json.dumps({
    "threshold": first.copy_engine_min_bytes,
    "coherent_kernel": first.coherent_copy_kernel,
    "read_once": again is first,
    "pcie": [first.choose(s) for s in (16, 65536, 1 << 20, 1 << 30)],
    "coherent": first.choose(16, coherent_link=True),
}))
"""
POLICY_FILE = REPO / "kvtier" / "copy" / "policy.py"

ENV_CASES = {
    "unset": ({}, DEFAULT_COPY_ENGINE_MIN_BYTES, False, None),
    "zero": ({COPY_ENGINE_MIN_BYTES_ENV: "0"}, 0, False, None),
    "never": ({COPY_ENGINE_MIN_BYTES_ENV: "-1"}, None, False, None),
    "one_mib": ({COPY_ENGINE_MIN_BYTES_ENV: "1048576"}, 1 << 20, False, None),
    "not_int": ({COPY_ENGINE_MIN_BYTES_ENV: "abc"}, DEFAULT_COPY_ENGINE_MIN_BYTES, False, COPY_ENGINE_MIN_BYTES_ENV),
    "empty": ({COPY_ENGINE_MIN_BYTES_ENV: ""}, DEFAULT_COPY_ENGINE_MIN_BYTES, False, COPY_ENGINE_MIN_BYTES_ENV),
    "huge": ({COPY_ENGINE_MIN_BYTES_ENV: "1" * 20}, DEFAULT_COPY_ENGINE_MIN_BYTES, False, COPY_ENGINE_MIN_BYTES_ENV),
    "coherent_kernel": ({COHERENT_COPY_KERNEL_ENV: "1"}, DEFAULT_COPY_ENGINE_MIN_BYTES, True, None),
    "coherent_zero": ({COHERENT_COPY_KERNEL_ENV: "0"}, DEFAULT_COPY_ENGINE_MIN_BYTES, False, None),
    "coherent_bad": ({COHERENT_COPY_KERNEL_ENV: "yes"}, DEFAULT_COPY_ENGINE_MIN_BYTES, False, COHERENT_COPY_KERNEL_ENV),
}


@pytest.fixture(scope="module")
def children() -> dict[str, subprocess.CompletedProcess[str]]:
    """Runs every case's child process at once (they spend their time importing torch)."""
    base = {k: v for k, v in os.environ.items() if k not in (COPY_ENGINE_MIN_BYTES_ENV, COHERENT_COPY_KERNEL_ENV)}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    running = {
        name: subprocess.Popen(
            [sys.executable, "-c", CHILD, "package" if name == "unset" else "module", str(POLICY_FILE)],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (env, *_) in ENV_CASES.items()
    }
    done = {}
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=120)
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return done


@pytest.mark.parametrize("case", ENV_CASES)
def test_from_env_reads_once_per_process(children, case: str) -> None:
    _, threshold, coherent_kernel, warned = ENV_CASES[case]
    child = children[case]
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout)
    assert got["threshold"] == threshold
    assert got["coherent_kernel"] is coherent_kernel
    assert got["read_once"] is True
    expected = CopyPolicy(copy_engine_min_bytes=threshold, coherent_copy_kernel=coherent_kernel)
    assert got["pcie"] == [expected.choose(s) for s in (16, 65536, 1 << 20, 1 << 30)]
    assert got["coherent"] == ("kernel" if coherent_kernel else "copy_engine")
    warnings = [line for line in child.stderr.splitlines() if line.startswith("WARNING:")]
    if warned is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warned in warnings[0]
