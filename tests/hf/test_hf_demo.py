"""``kvtier demo --hf``: the workload through ``kvtier.hf``, with the demo's own options honoured."""

from __future__ import annotations

import socket

from kvtier.cli import main

SMALL = ["--conversations", "1", "--turns", "2", "--system-tokens", "16", "--user-tokens", "4", "--answer-tokens", "2"]


def test_the_hf_demo_serves_its_metrics_on_the_port_asked(tmp_path, capsys):
    """Before, ``--metrics-port`` was ignored with ``--hf``: nothing was served, nothing said."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["demo", "--hf", *SMALL, "--metrics-port", str(port), "--plot", str(tmp_path / "ttft.png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"metrics: http://127.0.0.1:{port}/metrics" in out
    assert "both produced the same tokens" in out
