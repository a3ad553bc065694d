"""Bad values on the command line are argparse errors naming the option, before anything runs."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from kvtier.cli import main

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None  # the demo's --hf


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--conversations", "0"], "argument --conversations: must be >= 1, got 0"),
        (["demo", "--turns", "two"], "argument --turns: must be an integer, got 'two'"),
        (["demo", "--user-tokens", "0"], "argument --user-tokens: must be >= 1, got 0"),
        (["demo", "--primary-mib", "0"], "argument --primary-mib: must be > 0, got 0"),
        (["demo", "--host-mib", "nan"], "argument --host-mib: must be > 0, got nan"),
        (["demo", "--device", "gpu"], "argument --device: must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
        (["bench", "copy", "--iters", "0"], "argument --iters: must be >= 1, got 0"),
        (["bench", "e2e", "--primary-gib", "-1"], "argument --primary-gib: must be > 0, got -1"),
        (["bench", "hf", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        (["bench", "vllm", "--layers", "0"], "argument --layers: must be >= 1, got 0"),
        (["probe", "--device", "cuda:x"], "argument --device: must be 'cpu', 'cuda' or 'cuda:N', got 'cuda:x'"),
        (["demo", "--metrics-port", "70000"], "argument --metrics-port: must be a TCP port (1-65535), got 70000"),
        (["bench", "manager", "--json", "/nonexistent/m.json"], "argument --json: /nonexistent/m.json: no directory"),
        (["demo", "--plot", "/nonexistent/ttft.png"], "argument --plot: /nonexistent/ttft.png: no directory"),
        # Before: these ran the whole job, then ended in a traceback (or, for --plot, wrote "tests/.png").
        (["demo", "--json", "tests"], "argument --json: tests: a directory; name a file to write"),
        (["bench", "manager", "--json", "tests/"], "argument --json: tests/: a directory; name a file to write"),
        (["demo", "--plot", "tests/"], "argument --plot: tests/: a directory; name a file to write"),
        # Before: a directory that takes no file (as root, os.access said yes) ran the whole job first.
        (["demo", "--json", "/proc/kvtier-demo.json"], "argument --json: /proc/kvtier-demo.json: cannot be written"),
        (["demo", "--plot", "/proc/ttft.png"], "argument --plot: /proc/ttft.png: cannot be written"),
        (["demo", "--plot", "ttft.txt"], "argument --plot: ttft.txt: name a file ending in one of ['eps', 'pdf',"),
        (["bench", "e2e", "--prefixes", "-64"], "argument --prefixes: must be >= 1, got -64 (a comma-separated"),
        (["bench", "e2e", "--prefixes", "64,abc"], "argument --prefixes: must be an integer, got 'abc' (a comma-"),
        (["bench", "hf", "--histories", "0"], "argument --histories: must be >= 1, got 0 (a comma-separated"),
        (["probe", "--disk-mib", "-5"], "argument --disk-mib: must be >= 256, got -5"),
        (["probe", "--disk-mib", "9000"], "argument --disk-mib: must be <= 4096, got 9000"),
        # Before: refused only once running (the seed, the model, the size, after the model was
        # built; the timeout after ~20 s of benchmark), or a traceback (--system-tokens).
        (["demo", "--seed", str(10**30)], "argument --seed: must be <= 18446744073709551615, got 1000"),
        (["demo", "--model", ""], "argument --model: must not be empty"),
        (["demo", "--primary-mib", "1e-9"], "argument --primary-mib: must be at least 1 byte (9.54e-07 MiB), got 1e-9"),
        (["bench", "e2e", "--disk-gib", "1e-10"], "argument --disk-gib: must be at least 1 byte (9.31e-10 GiB)"),
        (["demo", "--system-tokens", str(10**12)], "argument --system-tokens: must be <= 1048576, got 1000000000000"),
        (["bench", "e2e", "--prefetch-timeout-s", "nan"], "argument --prefetch-timeout-s: must be a finite number"),
        (["bench", "e2e", "--prefetch-timeout-s", "-1"], "argument --prefetch-timeout-s: must be a finite number"),
        (["bench", "e2e", "--model", ""], "argument --model: must not be empty"),
        # Before: the disk cases ran without a disk tier, then a traceback (e2e) or exit 0 (hf).
        (
            ["bench", "e2e", "--disk-path", "/proc/kvtier-e2e"],
            "argument --disk-path: /proc/kvtier-e2e: cannot be written",
        ),
        (["bench", "hf", "--disk-path", "/proc/kvtier-hf"], "argument --disk-path: /proc/kvtier-hf: cannot be written"),
        (
            ["bench", "hf", "--disk-path", "/etc/passwd/d"],
            "argument --disk-path: /etc/passwd/d: '/etc/passwd' is a file",
        ),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_the_option(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_a_cuda_device_without_cuda_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["demo", "--device", "cuda"])
    assert stop.value.code == 2
    assert "argument --device: cuda: CUDA is not available here" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--model", "/nonexistent"], "kvtier demo: error: unknown model '/nonexistent'"),
        # Before: --hf ran its own random Llama whatever --model named.
        (["demo", "--hf", "--model", "tiny-llama"], "kvtier demo: error: --model 'tiny-llama' is the engine's"),
        (
            ["demo", "--model", "tiny-llama", "--conversations", "1", "--turns", "1", "--primary-mib", "1"],
            "kvtier demo: error: prompts[0] (",
        ),
        # Before: accepted, and nothing was probed.
        (
            ["probe", "--disk-mib", "1024"],
            "kvtier probe: error: --disk-mib sizes the file of the disk probe: give --disk",
        ),
    ],
)
def test_a_value_refused_while_running_ends_the_command_with_its_message(capsys, argv, message):
    """Before, a Python traceback ended in the same message."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
@pytest.mark.parametrize("target", ["copy", "vllm", "hf"])
def test_a_gpu_benchmark_without_cuda_is_refused_on_stderr(capsys, target):
    """Before, the refusal went to stdout, lost to a script that captures errors."""
    assert main(["bench", target]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"kvtier bench {target}: error: it ") and "needs a CUDA device" in err and not out


def test_a_model_larger_than_the_machine_is_refused_before_it_is_built(capsys, monkeypatch):
    """Before, ``llama-8b-shape`` in float64 (60 GiB) on a smaller machine ended in the allocator's
    traceback, or in the out-of-memory killer."""
    monkeypatch.setattr("kvtier.config._host_memory_bytes", lambda: 16 << 30)
    assert main(["demo", "--model", "llama-8b-shape"]) == 2
    err = capsys.readouterr().err
    assert "kvtier demo: error: the model's weights (59.8 GiB in torch.float64) cannot be allocated: it is more " in err
    assert "than all of host memory (16.0 GiB); choose a smaller model or dtype" in err and "Traceback" not in err


def test_an_existing_or_new_disk_directory_is_taken_and_left_as_it_was(tmp_path, monkeypatch):
    import argparse

    from kvtier.cli.arguments import kept_directory

    assert kept_directory(str(tmp_path)) == str(tmp_path) and list(tmp_path.iterdir()) == []
    new = tmp_path / "a" / "b"
    assert kept_directory(str(new)) == str(new) and list(tmp_path.iterdir()) == []  # made by the run, not now
    monkeypatch.setenv("HOME", str(tmp_path))  # ``~``, as the disk tier reads it: the home, not ./~
    assert kept_directory("~/kv") == str(tmp_path / "kv")
    (tmp_path / "gone").symlink_to(tmp_path / "missing")  # before: its parent was probed, then the run failed
    with pytest.raises(argparse.ArgumentTypeError, match="is a link to nothing"):
        kept_directory(str(tmp_path / "gone" / "kv"))


@pytest.mark.parametrize(
    ("hf", "stop", "status", "said"),
    [
        (False, signal.SIGINT, 130, "interrupted"),
        pytest.param(
            True, signal.SIGINT, 130, "interrupted", marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="--hf")
        ),
        (False, signal.SIGTERM, 143, "terminated"),
    ],
)
def test_ctrl_c_or_sigterm_ends_the_demo_with_one_line_and_its_temporary_directory_removed(
    tmp_path, hf, stop, status, said
):
    """Before, Ctrl-C printed a Python traceback of 38-113 lines ending in ``KeyboardInterrupt``,
    and SIGTERM ended the process at once, its temporary disk tier left behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "-m", "kvtier", "demo", "--plot", str(tmp_path / "ttft.png"), *(["--hf"] if hf else [])]
    demo = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(tmp)}
    )
    deadline = time.monotonic() + 120
    while not any(p.name.startswith("kvtier-") for p in tmp.iterdir()):  # the run's disk tier: it is running
        assert demo.poll() is None and time.monotonic() < deadline, "the demo never started its run"
        time.sleep(0.02)
    demo.send_signal(stop)
    _, err = demo.communicate(timeout=120)
    assert demo.returncode == status
    assert err.decode() == f"kvtier demo: {said}\n"
    assert not any(p.name.startswith("kvtier-") for p in tmp.iterdir())


def test_a_metrics_port_in_use_is_a_usage_error_before_the_run(capsys):
    """Before, the demo ran its baseline first and then failed with a traceback at the server's bind."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as stop:
            main(["demo", "--metrics-port", str(port)])
    assert stop.value.code == 2
    assert f"argument --metrics-port: port {port} cannot be listened on here" in capsys.readouterr().err


def test_an_output_file_checked_before_the_run_is_left_as_it_was(tmp_path):
    """The check opens the file for writing: a new one is removed again, an existing one is untouched."""
    from kvtier.cli.arguments import output_file

    new = tmp_path / "new.json"
    assert output_file(str(new)) == str(new) and not new.exists()
    old = tmp_path / "old.json"
    old.write_text("kept")
    assert output_file(str(old)) == str(old) and old.read_text() == "kept"
    (tmp_path / "results").mkdir()
    link = tmp_path / "out.json"  # a link to a file the run will make
    link.symlink_to(tmp_path / "results" / "run1.json")
    assert output_file(str(link)) == str(link)
    assert link.is_symlink() and list((tmp_path / "results").iterdir()) == []


def test_tiers_the_machine_cannot_allocate_end_the_command_with_the_message(capsys, monkeypatch):
    """As a GPU too full for ``kvtier bench hf``'s three caches did (80 GB): before, a traceback
    ended in ``OutOfPagesError``."""

    def no_memory(*args, **kwargs):
        raise MemoryError("the test's allocator has no memory")

    monkeypatch.setattr("kvtier.pool.build_tiers", no_memory)
    assert main(["demo", "--turns", "1"]) == 2
    err = capsys.readouterr().err
    assert "kvtier demo: error: cannot allocate the tiers' memory (the test's allocator has no memory)" in err
    assert "Traceback" not in err
