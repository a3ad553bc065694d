"""vLLM's scheduler-side ``KVCacheManager`` on ``kvtier bench manager``'s workloads, for the ratios.

Imported only when vLLM is installed (it imports vLLM at once). Everything runs as vLLM's
scheduler drives it, with prefix caching on, one full-attention group, ``TPB`` tokens per block,
and the default prefix-caching hash of vLLM's ``CacheConfig`` (sha256 over pickled tuples in
0.33 and 0.34), chained from the ``NONE_HASH`` that vLLM's engine initialises.

- Decode: after a prefill, one step of a running request is ``allocate_slots`` for one new
  token, then ``num_computed_tokens`` moves by one and the sampled token is appended, which
  hashes a block when it fills (the request block hasher, as vLLM's engine installs it).
- Cached prompt: the prompt's block hashes (the request block hasher over the whole prompt), then
  ``get_computed_blocks`` + ``allocate_slots`` for the rest, then ``free`` (outside the timing).
  Building the ``Request`` (a copy of the token list) is left out of the timing.

Each workload checks, outside the timed region, that vLLM did what the figure claims (every full
block hashed, every token given a slot, the whole cached prefix hit) and raises ``RuntimeError``
otherwise.
"""

from __future__ import annotations

import itertools
import time

import torch
import vllm
from vllm import SamplingParams
from vllm.config import CacheConfig
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

VERSION: str = vllm.__version__
HASH_ALGO: str = CacheConfig().prefix_caching_hash_algo
_request_ids = itertools.count()


def _manager(num_blocks: int, max_model_len: int, tpb: int) -> KVCacheManager:
    """A manager with prefix caching over ``num_blocks`` blocks (one more for vLLM's null block)."""
    spec = FullAttentionSpec(block_size=tpb, num_kv_heads=1, head_size=8, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=num_blocks + 1,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    return KVCacheManager(
        config, max_model_len=max_model_len, scheduler_block_size=tpb, hash_block_size=tpb, enable_caching=True
    )


def _block_hasher(tpb: int):
    """vLLM's request block hasher with its default hash function, as its engine sets it up."""
    hash_fn = get_hash_fn_by_name(HASH_ALGO)
    init_none_hash(hash_fn)
    return get_request_block_hasher(tpb, hash_fn)


def _request(tokens: list[int], max_tokens: int, block_hasher=None) -> Request:
    return Request(
        f"bench-{next(_request_ids)}",
        list(tokens),
        SamplingParams(max_tokens=max_tokens),
        None,
        block_hasher=block_hasher,
    )


class VllmDecode:
    """``requests`` running requests with ``context``-token prompts; ``step()`` decodes one token in each.

    Invariant between steps (as in vLLM's scheduler after a step's output): every request has
    ``num_tokens == num_computed_tokens + 1`` (the sampled token not yet computed), a block hash
    for every full block of its tokens, and slots for its computed tokens.
    """

    def __init__(self, requests: int, context: int, steps: int, tpb: int, sampled_token: int = 7) -> None:
        self.tpb = tpb
        self.sampled_token = sampled_token  # appended by every decode step (the kvtier side passes its own)
        blocks = (context + steps) // tpb + 2
        self.manager = _manager(requests * blocks + 64, context + steps + 2 * tpb, tpb)
        hasher = _block_hasher(tpb)
        self.requests: list[Request] = []
        for r in range(requests):
            prompt = [r * 100_000 + i for i in range(context)]
            request = _request(prompt, steps + 1, hasher)
            computed, hit, _ = self.manager.get_computed_blocks(request)
            if self.manager.allocate_slots(request, context - hit, hit, computed) is None:
                raise RuntimeError("vLLM could not allocate a decode request's prompt")
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = context
            request.append_output_token_ids(self.sampled_token)
            self.requests.append(request)

    def step(self) -> float:
        """One decode step over every request; returns its seconds."""
        manager = self.manager
        token = self.sampled_token
        t0 = time.perf_counter()
        for request in self.requests:
            if manager.allocate_slots(request, 1) is None:
                raise RuntimeError("vLLM ran out of blocks in the decode benchmark")
            request.num_computed_tokens += 1
            request.append_output_token_ids(token)
        return time.perf_counter() - t0

    def check(self) -> None:
        """Raise ``RuntimeError`` unless every request is hashed and slotted as the invariant says."""
        for request in self.requests:
            hashed = len(request.block_hashes) * self.tpb
            slots = len(self.manager.get_block_ids(request.request_id)[0]) * self.tpb
            if hashed != request.num_tokens // self.tpb * self.tpb or slots < request.num_computed_tokens:
                raise RuntimeError(f"vLLM's decode request {request.request_id} is not hashed or slotted as expected")

    def close(self) -> None:
        for request in self.requests:
            self.manager.free(request)
        self.requests.clear()


class VllmCachedPrompt:
    """A ``prompt_tokens``-token prompt whose blocks are all cached; ``once()`` admits it again.

    The first request computes the whole prompt and is freed: its blocks stay in the prefix
    cache. Each ``once()`` is a new request for the same prompt, hit on every full block below
    its last token (vLLM recomputes at least the last token), then freed.
    """

    def __init__(self, prompt_tokens: int, tpb: int) -> None:
        self.tpb = tpb
        self.prompt = list(range(1, prompt_tokens + 1))
        blocks = prompt_tokens // tpb + 1
        self.manager = _manager(2 * blocks + 64, prompt_tokens + 2 * tpb, tpb)
        self.hasher = _block_hasher(tpb)
        first = _request(self.prompt, 1, self.hasher)
        if self.manager.allocate_slots(first, prompt_tokens) is None:
            raise RuntimeError("vLLM could not allocate the cached prompt")
        first.num_computed_tokens = prompt_tokens
        self.manager.free(first)
        self.expected_hit = (prompt_tokens - 1) // tpb * tpb

    def once(self) -> dict[str, float]:
        """Seconds of hashing the prompt, of matching + allocating, and their total."""
        request = _request(self.prompt, 1)
        t0 = time.perf_counter()
        request.block_hashes.extend(self.hasher(request))
        t1 = time.perf_counter()
        computed, hit, _ = self.manager.get_computed_blocks(request)
        allocated = self.manager.allocate_slots(request, len(self.prompt) - hit, hit, computed)
        t2 = time.perf_counter()
        if allocated is None or hit != self.expected_hit:
            raise RuntimeError(f"vLLM hit {hit} cached tokens of the prompt, expected {self.expected_hit}")
        self.manager.free(request)
        return {"total": t2 - t0, "hash": t1 - t0, "match_allocate": t2 - t1}

    def close(self) -> None:
        self.manager.reset_prefix_cache()
