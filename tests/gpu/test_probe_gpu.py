"""``kvtier probe`` on a CUDA device: the copy kernel's row, built or not, and the paths it implies."""

from __future__ import annotations

import re

import pytest

from tests.test_tiers import run_python

PROBE = """
import sys
from kvtier.cli import main
sys.exit(main(["probe", "--device", "cuda"]))
"""


def probe(env: dict[str, str]) -> dict[str, str]:
    """The rows of ``kvtier probe --device cuda`` run in a process of its own with ``env`` set."""
    done = run_python(PROBE, timeout=300, **env)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in done.stdout.splitlines())


@pytest.mark.parametrize("compiler", ["found", "missing"])
def test_the_probe_says_whether_the_copy_kernel_can_be_built(tmp_path, compiler):
    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton")}  # empty: the launcher is compiled again
    if compiler == "missing":
        env["CC"] = str(tmp_path / "no-such-cc")
    rows = probe(env)
    if compiler == "found":
        assert rows["copy kernel"].startswith("Triton ") and "built" in rows["copy kernel"]
        assert rows["path 4,096 B"] == "kernel"
    else:
        assert rows["copy kernel"].startswith("unavailable (") and "no-such-cc" in rows["copy kernel"]
        assert rows["path 4,096 B"] == "copy_engine (the kernel cannot be built)"
    assert rows["path 217,055,232 B"] == "copy_engine"


PROBE_WITHOUT_BINDINGS = """
import sys
sys.modules["cuda.bindings"] = None  # as if cuda-bindings were not installed
from kvtier.cli import main
sys.exit(main(["probe", "--device", "cuda"]))
"""


def test_the_probe_without_cuda_bindings_says_where_calls_go():
    """No cuda-bindings: the copy engines' row says what goes where instead of the batched call, the
    kernel is built, and the rows of the copy engines' page sizes name the torch copies, and the
    kernel for calls of many short runs."""
    done = run_python(PROBE_WITHOUT_BINDINGS, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in done.stdout.splitlines())
    assert rows["copy engines"].startswith("no batched call (") and "kvtier[gpu]" in rows["copy engines"]
    assert rows["copy kernel"].startswith("Triton ") and "built" in rows["copy kernel"]
    assert rows["path 4,096 B"] == "kernel"
    assert rows["path 65,536 B"] == (
        "copy_engine (torch copies: no cuda-bindings); kernel for calls of more than 4 runs below 1 MiB on average"
    )
    assert rows["path 217,055,232 B"] == "copy_engine (torch copies: no cuda-bindings)"
