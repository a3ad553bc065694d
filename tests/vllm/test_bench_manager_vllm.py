"""``kvtier bench manager`` against vLLM's real ``KVCacheManager``, on a tiny workload."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs vLLM 0.33 or 0.34 (bash .ci/vllm_env.sh)")

from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils

from kvtier.cli import bench_manager_vllm, main
from kvtier.cli.bench_manager import TPB


def _sha256_chain(tokens: list[int]) -> list[bytes]:
    """vLLM's block hashes of every full block of ``tokens``, with sha256 from its NONE_HASH."""
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - TPB + 1, TPB):
        parent = hashes[-1] if hashes else kv_cache_utils.NONE_HASH
        hashes.append(sha256((parent, tuple(tokens[start : start + TPB]), None)))
    return hashes


def test_the_comparison_prints_vllm_beside_kvtier_with_the_ratios(capsys, tmp_path):
    path = tmp_path / "mgr.json"
    argv = ["bench", "manager", "--steps", "20", "--prompt-tokens", "160", "--repeats", "3", "--no-tiers"]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    results = json.loads(path.read_text())
    vllm = results["vllm"]
    assert vllm["version"] == importlib.metadata.version("vllm") and vllm["hash"] == "sha256"
    assert vllm["cached_prompt_ms"]["hash_median"] > 0 and vllm["cached_prompt_ms"]["match_allocate_median"] > 0
    ratios = results["ratios_vllm_over_kvtier"]
    decode_ratio = vllm["decode_us_per_request_step"]["median"] / results["decode_us_per_request_step"]["median"]
    cached_ratio = vllm["cached_prompt_ms"]["median"] / results["cached_prompt_ms"]["median"]
    assert ratios == {"decode": pytest.approx(decode_ratio), "cached_prompt": pytest.approx(cached_ratio)}
    assert f"{ratios['decode']:.1f}x" in out and f"{ratios['cached_prompt']:.1f}x" in out
    assert "ratio >= 9x" in out  # the decode step's; a 160-token prompt is not judged by the 32K one's
    assert "ratio >= 5x" not in out and "not judged" in out
    assert f"vLLM {vllm['version']} KVCacheManager measured in this process" in out


def test_vllm_decode_hashes_each_block_with_sha256_as_it_fills_and_slots_every_token():
    context, steps = 2 * TPB + 3, TPB + 2
    decode = bench_manager_vllm.VllmDecode(3, context, steps, TPB)
    try:
        for _ in range(steps):
            assert decode.step() > 0
        decode.check()
        for request in decode.requests:
            assert request.num_computed_tokens == context + steps
            tokens = list(request.all_token_ids)
            assert len(tokens) == context + steps + 1
            assert request.block_hashes == _sha256_chain(tokens)  # 3 blocks: two filled while decoding
            assert len(decode.manager.get_block_ids(request.request_id)[0]) == -(-(context + steps) // TPB)
        first = decode.requests[0]
        first.block_hashes.pop()  # a block left unhashed
        with pytest.raises(RuntimeError, match="not hashed or slotted"):
            decode.check()
    finally:
        decode.close()


def test_vllm_cached_prompt_hits_every_block_below_its_last_token_and_a_miss_is_refused():
    cached = bench_manager_vllm.VllmCachedPrompt(5 * TPB, TPB)
    try:
        assert cached.expected_hit == 4 * TPB
        times = cached.once()
        assert times["total"] >= times["hash"] > 0 and times["match_allocate"] > 0
        cached.once()  # freed after each repeat: the prefix is still cached
        assert cached.manager.reset_prefix_cache()
        with pytest.raises(RuntimeError, match=f"hit 0 cached tokens of the prompt, expected {4 * TPB}"):
            cached.once()
    finally:
        cached.close()
