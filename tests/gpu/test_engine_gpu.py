"""The engine on a CUDA device: float64 stays token-identical to the oracle through every tier;
bf16 agrees with the dense path by common prefix and logit closeness."""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier.engine import LLMEngine, SamplingParams, SchedulerConfig
from kvtier.models import build_model
from tests.test_engine import check_against_oracle, page_bytes, prompts_for


def float64_through_host_and_disk(name: str, device: str, path) -> None:
    """Four prompts twice, the second time partly from disk, each answer the oracle's."""
    model = build_model(name, device, torch.float64, seed=0)
    pb = page_bytes(model)
    tiers = [kvtier.PrimaryTier(pb * 16), kvtier.HostTier(pb * 4), kvtier.DiskTier(pb * 200, path)]
    config = kvtier.CacheConfig(16, tiers, device=device, snapshot_interval_blocks=2)
    with LLMEngine(
        model, config, SchedulerConfig(max_num_tokens=256, policy="max_utilization", recompute_when_faster=False)
    ) as eng:
        prompts = prompts_for(model, [100, 100, 100, 100], seed=3)
        eng.generate(prompts, SamplingParams(max_tokens=4))
        outs = eng.generate(prompts, SamplingParams(max_tokens=4))
        check_against_oracle(model, prompts, outs, 4)
        assert sum(o.reused_tokens_by_tier["disk"] for o in outs) > 0
        eng.cache_manager.check_invariants()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-swa", "tiny-hybrid"])
def test_float64_through_host_and_disk_on_gpu(name, tmp_path):
    float64_through_host_and_disk(name, "cuda", tmp_path)


def test_bf16_multi_turn_agrees_with_dense():
    model = build_model("small-llama", "cuda", torch.bfloat16, seed=0)
    pb = page_bytes(model)
    config = kvtier.CacheConfig(16, [kvtier.PrimaryTier(pb * 64), kvtier.HostTier(pb * 400)], device="cuda")
    with LLMEngine(model, config, SchedulerConfig(max_num_tokens=512)) as eng:
        prompts = prompts_for(model, [300, 250, 280, 200], seed=9, shared=200)
        turn1 = eng.generate(prompts, SamplingParams(max_tokens=16))
        follow = [p + o.token_ids + [5, 6, 7] for p, o in zip(prompts, turn1, strict=True)]
        turn2 = eng.generate(follow, SamplingParams(max_tokens=16))
        assert all(o.reused_tokens_by_tier["primary"] + o.reused_tokens_by_tier["host"] > 0 for o in turn2)
        for prompt, out in zip(follow, turn2, strict=True):
            dense = model.reference_generate(prompt, 16)
            common = next((i for i, (a, b) in enumerate(zip(out.token_ids, dense, strict=True)) if a != b), 16)
            assert common >= 4, f"bf16 outputs diverge after {common} tokens"


def test_connector_loads_on_gpu_reuse_one_pinned_staging_buffer(tmp_path):
    from kvtier.connector import FileSystemConnector

    model = build_model("tiny-llama", "cuda", torch.float64, seed=0)
    config = kvtier.CacheConfig(16, [kvtier.PrimaryTier(page_bytes(model) * 64)], device="cuda")
    prompts = prompts_for(model, [100, 80, 60], seed=12)
    with LLMEngine(model, config, connector=FileSystemConnector(tmp_path)) as seed:
        seed.generate(prompts, SamplingParams(max_tokens=2))
    conn = FileSystemConnector(tmp_path)
    buffers = []
    forced = SchedulerConfig(recompute_when_faster=False)  # a tiny model recomputes faster than a store answers
    with LLMEngine(model, config, forced, connector=conn) as eng:
        for prompt in prompts:  # one load a step, the largest first
            out = eng.generate([prompt], SamplingParams(max_tokens=3))[0]
            assert out.reused_tokens_by_tier["connector"] == min(len(prompt) // 16 * 16, len(prompt) - 1)
            assert out.token_ids == model.reference_generate(prompt, 3)
            assert conn._staging is not None and conn._staging.pinned  # registered with CUDA
            buffers.append(conn._staging)
    assert all(b is buffers[0] for b in buffers)
