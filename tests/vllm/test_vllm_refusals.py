"""What KVTierConnector refuses at construction, and what importing kvtier does not do."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 or 0.34 (bash .ci/vllm_env.sh)")

import torch
from vllm.config import ParallelConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

import kvtier
from kvtier.vllm import KVTierConnector, host_pool
from kvtier.vllm.connector import check_one_process
from tests.vllm.harness import BLOCK, attention_spec, kv_cache_config, layer_names, vllm_config


def test_importing_kvtier_never_imports_vllm():
    code = "import sys, kvtier, kvtier.engine, kvtier.connector, kvtier.copy; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_recurrent_state_group_is_refused_by_name(tmp_path):
    config = vllm_config(tmp_path, {})
    mamba = MambaSpec(block_size=BLOCK, shapes=((16,), (16,)), dtypes=(torch.float32,), mamba_cache_mode="all")
    groups = [KVCacheGroupSpec(layer_names(2), attention_spec()), KVCacheGroupSpec(["mamba.0", "mamba.1"], mamba)]
    kv_config = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(NotImplementedError, match=r"KV cache group 1 \(MambaSpec"):
            KVTierConnector(config, role, kv_config)
    assert host_pool.lookup(str(config.kv_transfer_config.engine_id)) is None  # nothing was set up


def test_a_non_causal_prefix_lm_model_is_refused(tmp_path):
    """Layers that attend non-causally over the prompt (a Prefix LM): a position's keys and values
    depend on the whole prompt, so no prefix can be shared. Before, such a model was accepted and a
    request sharing 80 prompt tokens with another was loaded the other's blocks."""
    config = vllm_config(tmp_path, {})
    spec = dataclasses.replace(attention_spec(), non_causal=True)
    kv_config = kv_cache_config(config, [(layer_names(3), spec)], 16)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(NotImplementedError, match="non-causally"):
            KVTierConnector(config, role, kv_config)
    assert host_pool.lookup(str(config.kv_transfer_config.engine_id)) is None


def test_more_than_one_process_is_refused(tmp_path):
    config = vllm_config(tmp_path, {})
    config.parallel_config = ParallelConfig(tensor_parallel_size=1, distributed_executor_backend="mp")
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=1"):
        check_one_process(config)


@pytest.mark.parametrize("version", ["0.35.0", "0.34.0"])
def test_a_release_the_connector_is_not_tested_with_is_warned_of(tmp_path, monkeypatch, caplog, version):
    monkeypatch.setattr("kvtier.vllm.connector.vllm_version", lambda: version)
    config = vllm_config(tmp_path, {})
    kv_config = kv_cache_config(config, [(layer_names(3), attention_spec())], 16)
    with caplog.at_level("WARNING", logger="kvtier.vllm.connector"):
        KVTierConnector(config, KVConnectorRole.WORKER, kv_config)
    warned = [r.getMessage() for r in caplog.records if "is tested with vLLM" in r.getMessage()]
    assert warned == (
        [
            f"kvtier.vllm is tested with vLLM 0.33 and 0.34, not {version}: its scheduler or model runner "
            "may call the connector otherwise (pip install 'kvtier[vllm]' installs a tested release)"
        ]
        if version == "0.35.0"
        else []
    )


def test_bad_extra_config_is_refused_before_anything_is_built(tmp_path):
    config = vllm_config(tmp_path, {"host_bytes": "lots"})
    kv_config = kv_cache_config(config, [(layer_names(3), attention_spec())], 16)
    with pytest.raises(TypeError, match="host_bytes must be an int"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_config)


@pytest.mark.parametrize("extra", [{"host_bytes": 100}, {"disk_bytes": 100}], ids=["host", "disk"])
def test_a_tier_too_small_for_one_page_names_the_setting(tmp_path, extra):
    if "disk_bytes" in extra:
        extra["disk_path"] = str(tmp_path / "disk")
    config = vllm_config(tmp_path, extra)
    kv_config = kv_cache_config(config, [(layer_names(3), attention_spec())], 16)
    with pytest.raises(ValueError, match=r"host_bytes=.* and disk_bytes=.*too small: .* no page"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    assert host_pool.lookup(str(config.kv_transfer_config.engine_id)) is None


@pytest.mark.parametrize("multi_connector", [False, True], ids=["alone", "in-multi-connector"])
def test_a_load_failure_policy_that_fails_requests_is_warned_about_where_kvtier_reads_it(
    tmp_path, caplog, multi_connector
):
    config = vllm_config(tmp_path, {"host_bytes": 1 << 20}, multi_connector=multi_connector)
    if multi_connector:  # kvtier's entry without the policy: vLLM recomputes, kvtier cannot tell
        del config.kv_transfer_config.kv_connector_extra_config["connectors"][0]["kv_load_failure_policy"]
    else:
        config.kv_transfer_config.kv_load_failure_policy = "fail"
    kv_config = kv_cache_config(config, [(layer_names(3), attention_spec())], 16)
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_config)
    warned = [r.getMessage() for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
    assert len(warned) == 1 and "'fail'" in warned[0] and "in kvtier's entry too" in warned[0]
    connector.shutdown()


def test_a_disk_tier_too_large_to_track_names_the_setting(tmp_path):
    """Before: ``OutOfPagesError: cannot allocate the tiers' memory ()``, naming nothing."""
    config = vllm_config(tmp_path, {"disk_bytes": 2**59, "disk_path": str(tmp_path / "disk")})
    kv_config = kv_cache_config(config, [(layer_names(3), attention_spec())], 16)
    with pytest.raises(kvtier.OutOfPagesError, match=r"host_bytes=.* and disk_bytes=.*out of memory"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    assert host_pool.lookup(str(config.kv_transfer_config.engine_id)) is None
    beyond = vllm_config(tmp_path, {"disk_bytes": 2**62, "disk_path": str(tmp_path / "disk")})
    with pytest.raises(ValueError, match=r"disk_bytes must be at most 2\*\*60"):
        KVTierConnector(beyond, KVConnectorRole.SCHEDULER, kv_config)
