"""The vLLM connector's settings and the parts of ``kvtier.vllm`` that need no vLLM."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from kvtier.vllm.settings import DEFAULT_HOST_BYTES, ConnectorSettings, untested_vllm


def test_defaults_and_a_full_configuration():
    assert ConnectorSettings.parse(None) == ConnectorSettings(DEFAULT_HOST_BYTES)
    s = ConnectorSettings.parse(
        {
            "host_bytes": 1 << 30,
            "disk_bytes": 1 << 40,
            "disk_path": "/nvme/kv",
            "store_url": None,
            "model_id": "m@1",
            "disk_read_wait_s": 0,
        }
    )
    assert (s.host_bytes, s.disk_bytes, s.disk_path, s.store_url, s.model_id, s.disk_read_wait_s) == (
        1 << 30,
        1 << 40,
        "/nvme/kv",
        None,
        "m@1",
        0.0,
    )
    assert ConnectorSettings.parse({"disk_read_wait_s": 2.5}).disk_read_wait_s == 2.5
    assert ConnectorSettings.parse({}).prefill_tokens_per_s is None
    assert not ConnectorSettings.parse({}).recompute_when_faster
    weighed = ConnectorSettings.parse({"recompute_when_faster": True, "prefill_tokens_per_s": 20_000})
    assert weighed.recompute_when_faster and weighed.prefill_tokens_per_s == 20_000.0
    assert ConnectorSettings.parse({}).queued_reads_share == 0.5
    assert ConnectorSettings.parse({"queued_reads_share": 1}).queued_reads_share == 1.0


@pytest.mark.parametrize(
    ("extra", "error", "words"),
    [
        ({"host_byte": 1}, ValueError, "unknown kv_connector_extra_config keys"),
        ({"host_bytes": "4GB"}, TypeError, "host_bytes must be an int"),
        ({"host_bytes": 0}, ValueError, "host_bytes must be > 0"),
        ({"host_bytes": True}, TypeError, "host_bytes must be an int"),
        ({"disk_bytes": 1 << 30}, ValueError, "both disk_bytes and disk_path"),
        ({"disk_bytes": 1 << 30, "disk_path": ""}, TypeError, "disk_path must be a non-empty path"),
        ({"store_url": 5}, TypeError, "store_url must be a non-empty str"),
        ({"model_id": ""}, TypeError, "model_id must be a non-empty str"),
        ({"disk_read_wait_s": "1s"}, TypeError, "disk_read_wait_s must be a number"),
        ({"disk_read_wait_s": True}, TypeError, "disk_read_wait_s must be a number"),
        ({"disk_read_wait_s": -1}, ValueError, "disk_read_wait_s must be >= 0"),
        ({"disk_read_wait_s": float("inf")}, ValueError, "finite"),
        ({"disk_read_wait_s": float("nan")}, ValueError, "finite"),
        ({"recompute_when_faster": "yes"}, TypeError, "recompute_when_faster must be a bool"),
        ({"prefill_tokens_per_s": "fast"}, TypeError, "prefill_tokens_per_s must be a number"),
        ({"prefill_tokens_per_s": 0}, ValueError, "prefill_tokens_per_s must be > 0"),
        ({"prefill_tokens_per_s": float("inf")}, ValueError, "finite"),
        ({"prefill_tokens_per_s": 1e4}, ValueError, "only with recompute_when_faster=True"),
        ({"queued_reads_share": 0}, ValueError, "queued_reads_share must be > 0 and at most 1"),
        ({"queued_reads_share": 1.5}, ValueError, "queued_reads_share must be > 0 and at most 1"),
        ({"queued_reads_share": "half"}, TypeError, "queued_reads_share must be a number"),
        ({"queued_reads_share": float("nan")}, ValueError, "finite"),
        # Before: OverflowError (an int past float's range), and a ValueError of dict() for a string.
        ({"disk_read_wait_s": 10**400}, ValueError, "disk_read_wait_s must be finite"),
        ({"recompute_when_faster": True, "prefill_tokens_per_s": 10**400}, ValueError, "must be finite"),
        ("host_bytes=1", TypeError, "kv_connector_extra_config must be a dict, got str"),
        (["host_bytes"], TypeError, "kv_connector_extra_config must be a dict, got list"),
    ],
)
def test_bad_settings_are_refused_with_what_to_fix(extra, error, words):
    with pytest.raises(error, match=words):
        ConnectorSettings.parse(extra)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_data_path_imports_and_the_connector_says_what_to_install():
    code = (
        "import sys, kvtier, kvtier.vllm.transfer, kvtier.vllm\n"
        "assert 'vllm' not in sys.modules\n"
        "try:\n    kvtier.vllm.KVTierConnector\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "needs vLLM 0.33 or 0.34" in out.stdout


@pytest.mark.parametrize(
    "version, untested",
    [("0.33.0", False), ("0.33.1", False), ("0.34.0", False), ("0.34.2rc1", False), ("0.35.0", True), ("0.3.3", True)],
)
def test_the_releases_the_connector_is_tested_with(version, untested):
    assert untested_vllm(version) is untested
