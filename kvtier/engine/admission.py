"""What the engine checks at the door, before a request is queued.

A request is refused with a ``ValueError`` naming the field when it can never be served: an
empty prompt, a token outside the vocabulary, a prompt longer than one step without chunked
prefill, or a prompt + ``max_tokens`` whose pages could never be in the primary tier at once
(an ACTIVE cache holds all of its live pages there). The page count is a lower bound computed
in O(1) (so ``max_tokens=10**12`` is refused at once): what the request needs at the point
where it needs the least, given the scheduling policy. A request that passes may still fail
later, e.g. when its model gives non-finite logits; it then finishes with ``finish_reason``
"error" (kvtier.engine.batch_scheduler, kvtier.engine.runner).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.engine.params import SamplingParams, SchedulerConfig
from kvtier.lifecycle import GroupRule
from kvtier.manager import KVCacheManager
from kvtier.reuse.tokens import as_token_array


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The limits of one engine: vocabulary, step budget, and primary pages per layer group."""

    vocab_size: int
    tokens_per_block: int
    rules: tuple[GroupRule, ...]
    primary_pages: tuple[int, ...]  # indexed by group id
    guaranteed: bool  # the policy reserves prompt + max_tokens at admission
    max_num_tokens: int
    chunked_prefill: bool

    @classmethod
    def of(cls, vocab_size: int, mgr: KVCacheManager, config: SchedulerConfig) -> RequestLimits:
        tpb = mgr.tokens_per_block
        slots = {g.group_id: g.regions[0].num_slots for g in mgr.layout().groups}
        return cls(
            vocab_size,
            tpb,
            tuple(GroupRule.of(g, tpb) for g in mgr.layer_groups),
            tuple(slots[g.group_id] for g in mgr.layer_groups),
            config.policy == "guaranteed_no_evict",
            config.max_num_tokens,
            config.chunked_prefill,
        )

    def check(self, prompt: Sequence[int], params: object, where: str = "prompt") -> array:
        """The prompt as a token array, or ``ValueError``/``TypeError`` saying what is wrong."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params for {where} must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, list | tuple) and any([type(token) is bool for token in prompt]):
            raise TypeError(f"{where}: tokens must be integer ids, not bools")
        try:
            tokens = as_token_array(prompt)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
        if not tokens:
            raise ValueError(f"{where} is empty: a prompt needs at least one token")
        if max(tokens) >= self.vocab_size:
            raise ValueError(f"{where} has token {max(tokens)}, outside the model's vocabulary of {self.vocab_size}")
        if not self.chunked_prefill and len(tokens) > self.max_num_tokens:
            raise ValueError(
                f"{where} has {len(tokens)} tokens, more than max_num_tokens={self.max_num_tokens}, and "
                "chunked_prefill is off: shorten it or turn chunked_prefill on"
            )
        for rule in self.rules:
            need = self.min_pages(rule, len(tokens), params.max_tokens)
            have = self.primary_pages[rule.group_id]
            if need > have:
                raise ValueError(
                    f"{where} ({len(tokens)} tokens) with max_tokens={params.max_tokens} needs {need} pages of "
                    f"layer group {rule.group_id} at once, but the primary tier has {have}: lower max_tokens, "
                    "shorten the prompt or give the primary tier more memory"
                )
        return tokens

    def chunk_that_fits(self, start: int, history: int, want: int) -> int:
        """The most tokens, up to ``want``, that a chunk from ``start`` may compute while the cache's
        history is ``history``, with every group's live pages in the primary tier at once (at
        least 1): a long prompt of a sliding-window model is computed in chunks its window fits."""
        low, high = 1, want
        while low < high:  # the pages a chunk needs grow with its end
            mid = (low + high + 1) // 2
            if self.fits_at_once(start + mid, history):
                low = mid
            else:
                high = mid - 1
        return low

    def fits_at_once(self, end: int, history: int) -> bool:
        """Whether a cache of capacity ``end`` at this history has every group's live pages in the
        primary tier at once (a sliding-window request too long for it is computed in chunks)."""
        return all(rule.pages_needed(end, history) <= self.primary_pages[rule.group_id] for rule in self.rules)

    def min_pages(self, rule: GroupRule, num_prompt: int, max_tokens: int) -> int:
        """The fewest pages of a group that the request must hold at once, in O(1).

        At most ``num_prompt + max_tokens - 1`` tokens are computed (the last sampled token never
        is). Guaranteed admission reserves them all when the history is at most ``num_prompt - 1``
        (the longest reuse); otherwise the last decode step computes one token after all others.
        """
        end = num_prompt + max_tokens - 1
        history = num_prompt - 1 if self.guaranteed else end - 1
        return rule.pages_needed(end, history)  # a recurrent group: its live state (snapshots are skipped)
