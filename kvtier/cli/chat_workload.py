"""A multi-turn chat workload: conversations sharing a system prompt, turn after turn.

Turn ``t`` of a conversation is its previous prompt, the answer the engine gave, and new user
text. Token ids are random (the demo's model has random weights), drawn from a seed, so two runs
of the same workload ask exactly the same questions as long as they give the same answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.engine import LLMEngine, RequestOutput, SamplingParams


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    conversations: int = 8
    turns: int = 5
    system_tokens: int = 512
    user_tokens: int = 48
    answer_tokens: int = 24
    seed: int = 0

    def user_texts(self, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
        """The system prompt, and per conversation and turn the new user tokens."""
        g = torch.Generator().manual_seed(self.seed)
        system = torch.randint(0, vocab, (self.system_tokens,), generator=g).tolist()
        users = [
            [torch.randint(0, vocab, (self.user_tokens,), generator=g).tolist() for _ in range(self.turns)]
            for _ in range(self.conversations)
        ]
        return system, users


@dataclass(slots=True)
class TurnRecord:
    turn: int
    conversation: int
    output: RequestOutput


@dataclass(slots=True)
class RunRecord:
    """Everything one run of the workload produced."""

    label: str
    turns: list[TurnRecord] = field(default_factory=list)
    wall_s: float = 0.0

    def answers(self) -> list[list[int]]:
        return [r.output.token_ids for r in self.turns]


def run_workload(
    engine: LLMEngine, workload: ChatWorkload, label: str, on_request: Callable[[], None] | None = None
) -> RunRecord:
    """Serve every turn of every conversation; a turn's conversations are submitted together."""
    import time

    system, users = workload.user_texts(engine.model.vocab_size)
    history = [list(system) for _ in range(workload.conversations)]
    record = RunRecord(label)
    params = SamplingParams(max_tokens=workload.answer_tokens)
    t0 = time.perf_counter()
    for turn in range(workload.turns):
        prompts = [history[c] + users[c][turn] for c in range(workload.conversations)]
        outputs = engine.generate(prompts, params, on_finish=lambda _o: on_request() if on_request else None)
        for c, out in enumerate(outputs):
            record.turns.append(TurnRecord(turn, c, out))
            history[c] = prompts[c] + out.token_ids
    record.wall_s = time.perf_counter() - t0
    return record
