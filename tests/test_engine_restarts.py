"""Engines restarted one after another on the same disk directory: every output equals the oracle.

Each round starts a new engine on the directory the previous one closed (alternating the two
scheduling policies, with a filesystem connector every other round), and serves a mix of
prompts: the next turn of each conversation (its previous prompt, the output, new text), new
prompts sharing a system prompt, and a prompt of an earlier round repeated. The primary and host
tiers are small, so pages go to disk and come back; greedy outputs (float64) must equal the
dense oracle's after every restart, and what the disk holds must be reused.
"""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier.connector import FileSystemConnector
from kvtier.engine import LLMEngine, SamplingParams, SchedulerConfig
from kvtier.models import build_model
from tests.test_engine import TPB, page_bytes

MODELS = ["tiny-llama", "tiny-swa", "tiny-hybrid"]
ROUNDS = 4
MAX_TOKENS = 4


class Oracle:
    """``model.reference_generate``, computed once per prompt."""

    def __init__(self, model) -> None:
        self.model = model
        self.known: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.known:
            self.known[key] = self.model.reference_generate(prompt, MAX_TOKENS)
        return self.known[key]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", MODELS)
def test_outputs_equal_the_oracle_after_every_restart(name, tmp_path):
    model = build_model(name, "cpu", torch.float64, seed=2)
    oracle = Oracle(model)
    g = torch.Generator().manual_seed(20 + MODELS.index(name))
    pb = page_bytes(model)
    tiers = [kvtier.PrimaryTier(24 * pb), kvtier.HostTier(8 * pb), kvtier.DiskTier(400 * pb, tmp_path / "disk")]

    def fresh(low: int, high: int) -> list[int]:
        n = int(torch.randint(low, high + 1, (1,), generator=g))
        return torch.randint(0, model.vocab_size, (n,), generator=g).tolist()

    system = fresh(32, 40)
    conversations = [system + fresh(20, 60) for _ in range(3)]
    seen: list[list[int]] = []
    for round_ in range(ROUNDS):
        policy = ("guaranteed_no_evict", "max_utilization")[round_ % 2]
        connector = FileSystemConnector(tmp_path / "store") if round_ % 2 else None
        prompts = [*conversations, system + fresh(10, 40), system + fresh(10, 40)]
        if seen:
            prompts.append(seen[int(torch.randint(0, len(seen), (1,), generator=g))])
        config = kvtier.CacheConfig(TPB, tiers, snapshot_interval_blocks=2)
        eng = LLMEngine(
            model, config, SchedulerConfig(policy, max_num_tokens=128, recompute_when_faster=False), connector=connector
        )
        outs = eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == oracle(prompt), f"round {round_}: request {out.request_id} differs"
        if round_:
            assert sum(o.reused_tokens_by_tier["disk"] for o in outs) > 0, f"round {round_} reused nothing from disk"
        eng.cache_manager.check_invariants()
        eng.close()
        seen += prompts
        conversations = [p + o.token_ids + fresh(5, 20) for p, o in zip(prompts[:3], outs[:3], strict=True)]
