"""``kvtier bench hf --tiny``: the smoke run its help promises on a machine without CUDA."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import warnings

import pytest
import torch

from kvtier.cli import main
from kvtier.cli.bench_hf import TIER_GIB, TINY_TIER_GIB, _fill_defaults

CASES = ["recompute", "resident", "gpu", "host", "disk", "disk-load", "restart"]
HISTORY = 64


def test_a_tiny_run_on_the_cpu_times_every_case_and_reuses_the_history(tmp_path, monkeypatch):
    """Without ``--disk-path`` the disk tiers live in a temporary directory, removed after the run."""
    path = tmp_path / "hf.json"
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    out = io.StringIO()
    argv = ["bench", "hf", "--tiny", "--device", "cpu", "--dtype", "float32", "--histories", str(HISTORY)]
    argv += ["--suffix", "8", "--repeats", "1", "--tokens-per-block", "16"]
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json", str(path)]) == 0
    assert list(temp.glob("kvtier*")) == []
    result = json.loads(path.read_text())
    rows = {row["case"]: row for row in result["rows"]}
    assert list(rows) == CASES
    assert result["args"]["primary_gib"] == TINY_TIER_GIB["primary_gib"]
    for case in ("gpu", "host", "disk-load"):  # every cached block loaded
        assert rows[case]["reused_tokens"] == HISTORY
    for case in CASES[2:]:
        assert rows[case]["same_argmax"]
        assert rows[case]["logit_rel_err"] < 1e-4
    assert " disk-load " in out.getvalue()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_tiny_run_on_the_gpu_passes_host_prompts_without_generates_warning(tmp_path):
    """The bench hands ``generate`` its prompts on the host on purpose (its docstring): the warning
    transformers gives for that beside a GPU model is not the user's to read."""
    argv = ["bench", "hf", "--tiny", "--device", "cuda", "--dtype", "float32", "--histories", str(HISTORY)]
    argv += ["--suffix", "8", "--repeats", "1", "--tokens-per-block", "16", "--disk-path", str(tmp_path)]
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("always")
        assert main(argv) == 0
    assert not [w for w in caught if "input_ids" in str(w.message)]


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(**({"device": None, "tiny": False} | dict.fromkeys(TIER_GIB) | given))


def test_the_device_and_the_tier_sizes_follow_tiny_and_cuda():
    tiny = _args(tiny=True)
    assert _fill_defaults(tiny, cuda=False)
    assert tiny.device == "cpu" and tiny.primary_gib == TINY_TIER_GIB["primary_gib"]
    full = _args()
    assert _fill_defaults(full, cuda=True)
    assert full.device == "cuda" and (full.primary_gib, full.host_gib, full.disk_gib) == tuple(TIER_GIB.values())
    given = _args(tiny=True, device="cpu", host_gib=2.0)
    assert _fill_defaults(given, cuda=True)
    assert given.device == "cpu" and given.host_gib == 2.0


def test_the_full_model_without_cuda_is_refused_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["bench", "hf", "--histories", "64"]) == 2
    assert "kvtier bench hf: error: it times an 8B-shaped model and needs a CUDA device" in capsys.readouterr().err


def test_caches_opened_before_one_that_fails_are_closed(tmp_path, monkeypatch):
    """As an 80 GB GPU too small for the third cache's GPU tier left the first two open (until the
    interpreter exited) and the run's temporary directory behind."""
    import kvtier.hf

    opened = []
    real = kvtier.hf.PrefixCache

    def third_fails(*args, **kwargs):
        if len(opened) == 2:
            raise kvtier.OutOfPagesError("cannot allocate the tiers' memory (the test's)")
        opened.append(real(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(kvtier.hf, "PrefixCache", third_fails)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["bench", "hf", "--tiny", "--device", "cpu", "--histories", str(HISTORY)]) == 2
    assert "cannot allocate the tiers' memory (the test's)" in err.getvalue()
    assert len(opened) == 2 and all(pc.manager._closed for pc in opened)
    assert list(temp.glob("kvtier*")) == []
