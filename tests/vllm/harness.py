"""vLLM's real ``Scheduler`` driving ``KVTierConnector``, and a stand-in model runner on the CPU.

The runner does what vLLM's GPU model runner does around the connector, in its order
(preemptions, bind, forward, loads, saves, transfer results, load errors, worker metadata; with a
drafter the saves start last, as vLLM's ``defer_finalize`` starts them after the drafter), over KV
caches that vLLM's own allocator lays out (``allocate_kv_cache``, layout LBNHC). Its "forward"
writes, for every scheduled token, a value that is a function of (layer, the token's whole
prefix, head, element), so a block holds the right bytes only if it holds exactly this prefix's
KV. Before each forward it checks every position the request counts as computed: what attention
would read must be what this request's prefix wrote (``WrongKV`` otherwise).

With speculative decoding (``vllm_config(spec_tokens=k)``) the runner proposes ``k`` draft tokens
per request after each step, the first few of them right and the rest wrong, writes the drafts'
KV in their positions as a target model's forward does, and accepts drafts as a target model's
greedy verification would: the KV of a rejected draft stays in the block until the position is
computed again. Synchronous scheduling hands the drafts to the scheduler; asynchronous scheduling
keeps them in the runner (the scheduler schedules placeholders, as in vLLM) and the runner places
a step's tokens after the previous step's accepted ones, before the scheduler hears how many of
that step's drafts were rejected.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import sha256
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvtier.vllm import KVTierConnector
from kvtier.vllm.transfer import bytes_at

# vLLM 0.33's model runner output maps request ids to rows; 0.34's rows follow ``req_ids``.
_INDEXED_OUTPUT = "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__

BLOCK = 16
HEADS = 2
HEAD_SIZE = 16
EOS = 999
MiB = 1 << 20
HOST_PAGE = 3 * BLOCK * HEADS * 2 * HEAD_SIZE * 4  # kvtier's page of a 3-layer model: 2 heads x (K + V) x float32
IDLE_PAUSE_S = 0.002  # after a step that moved nothing
ENCODER_BUDGET = 4096  # image placeholder tokens the scheduler may schedule
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": HEADS,
    "head_dim": HEAD_SIZE,
    "num_hidden_layers": 3,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


class WrongKV(AssertionError):
    """A request counts a position as computed whose KV is not its own prefix's."""


def vllm_config(
    tmp_path: Path,
    extra: dict,
    *,
    max_batched: int = 64,
    async_scheduling: bool = False,
    name: str = "model",
    hf_overrides: dict | None = None,
    spec_tokens: int = 0,
    multi_connector: bool = False,
    max_seqs: int = 8,
    inflight_kv_loads: int | None = None,
    policy: str = "fcfs",
) -> VllmConfig:
    """A ``VllmConfig`` for a tiny Llama from a local config.json (no weights, no tokenizer);
    ``spec_tokens``: that many speculative tokens a step (the runner proposes them);
    ``multi_connector``: kvtier's connector as the one entry of vLLM's ``MultiConnector``, configured
    as the README says (the load failure policy at the top, where vLLM reads it, and in kvtier's
    entry, where kvtier does); ``max_seqs``: the running batch's size; ``inflight_kv_loads``:
    vLLM 0.34's ``--max-num-inflight-kv-loads``; ``policy``: the scheduling policy ("fcfs" or
    "priority")."""
    model_dir = tmp_path / name
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    model = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=2048,
        hf_overrides=hf_overrides or {},
    )
    inflight = {} if inflight_kv_loads is None else {"max_num_inflight_kv_loads": inflight_kv_loads}
    scheduler = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
        policy=policy,
        **inflight,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.kv_cache_layout = "LBNHC"  # vLLM resolves the layout before it builds connectors
    kvtier = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if multi_connector:
        transfer = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [{**kvtier, "kv_load_failure_policy": "recompute"}]},
            kv_load_failure_policy="recompute",
        )
    else:
        transfer = KVTransferConfig(**kvtier, kv_load_failure_policy="recompute")
    parallel = ParallelConfig()
    speculative = None
    if spec_tokens:
        speculative = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=spec_tokens,
            prompt_lookup_max=spec_tokens,
            prompt_lookup_min=1,
            target_model_config=model,
            target_parallel_config=parallel,
        )
    return VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        parallel_config=parallel,
        speculative_config=speculative,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def host_pages_engine(
    tmp_path: Path, host_pages: int, policy: str = "fcfs", device_blocks: int = 128, **extra
) -> Engine:
    """An engine with host memory for ``host_pages`` kvtier pages and an 8 MiB disk under
    ``tmp_path``, ``device_blocks`` vLLM blocks (one of them vLLM's null block), scheduling by
    ``policy``; ``extra``: more of ``kv_connector_extra_config``."""
    base = {"host_bytes": host_pages * HOST_PAGE, "disk_bytes": 8 * MiB, "disk_path": str(tmp_path / "disk")}
    config = vllm_config(tmp_path, {**base, **extra}, policy=policy)
    return Engine(config, kv_cache_config(config, [(layer_names(3), attention_spec())], device_blocks))


def push_out_of_host_memory(manager, blocks: int) -> int:
    """Pages of another ``blocks``-block prompt take host memory, pushing out pages that only the
    tree holds there, to disk (where write-behind copied them) or out of the cache; then only the
    tree holds the prompt's pages too. Returns how many pages went to disk."""
    demotions = manager.stats().demotions
    holder = lock_host_memory(manager, blocks)
    holder.commit(prompt(990, blocks * BLOCK))
    holder.close()
    return manager.stats().demotions - demotions


def lock_host_memory(manager, blocks: int):
    """An ACTIVE cache of another ``blocks``-block prompt, its pages locked in host memory: they push
    out pages that only the tree holds there, to disk (where write-behind copied them) or out of the
    cache. Nothing is committed: closing it frees its pages."""
    for _ in range(2):
        manager.maintain()  # a write-behind batch of the released pages, then landed as disk copies
    tokens = prompt(990, blocks * BLOCK)
    holder = manager.create_cache(tokens)
    assert holder.resume() and holder.resize(len(tokens))
    return holder


def run_until_computed(e: Engine, rid: str, tokens: int) -> None:
    while e.requests[rid].num_computed_tokens < tokens:
        e.step()


def attention_spec(window: int | None = None) -> FullAttentionSpec | SlidingWindowSpec:
    if window is None:
        return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    return SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32, sliding_window=window
    )


def kv_cache_config(config: VllmConfig, groups: Sequence[tuple[list[str], object]], num_blocks: int) -> KVCacheConfig:
    """vLLM's own plan of the KV cache tensors for these groups, with ``num_blocks`` blocks."""
    config.cache_config.num_gpu_blocks_override = num_blocks
    specs = [KVCacheGroupSpec(list(names), spec) for names, spec in groups]
    kv_config = get_kv_cache_config_from_groups(config, specs, available_memory=1 << 40)
    config.cache_config.num_gpu_blocks = kv_config.num_blocks
    return kv_config


def layer_names(count: int, first: int = 0) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(first, first + count)]


def prefix_hashes(tokens: Sequence[int]) -> np.ndarray:
    """A rolling hash per position over the whole prefix up to it (int64, < 2**31)."""
    out = np.empty(len(tokens), dtype=np.int64)
    h = 7
    for i, t in enumerate(tokens):
        h = (h * 1_000_003 + int(t) + 1) % 2_147_483_647
        out[i] = h
    return out


def kv_values(hashes: np.ndarray, layer: int) -> torch.Tensor:
    """int32 [positions, heads, elements]: the KV this prefix gives at ``layer``, distinct per entry."""
    heads = np.arange(HEADS, dtype=np.int64)[None, :, None] * 104_729
    elems = np.arange(2 * HEAD_SIZE, dtype=np.int64)[None, None, :] * 15_485_863
    values = (hashes[:, None, None] * 31 + layer * 7_919 + heads + elems) % 2_147_483_647
    return torch.from_numpy(values.astype(np.int32))


def own_storages(caches: dict[str, torch.Tensor], gap: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Views shaped as ``caches``, each over a storage of its own that spans just that layer's
    blocks, ``gap`` bytes apart in one reservation, as vLLM 0.34's extensible KV cache registers
    them (a layer a segment of one reserved address range, padded to its memory granule: for a
    page with an odd factor the segments then start off page boundaries). Returns the views and
    the gaps, which hold 0x5A."""
    sizes = [(view.shape[0] - 1) * view.stride(0) * view.element_size() + view[0].nbytes for view in caches.values()]
    reservation = torch.full((sum(sizes) + gap * len(sizes),), 0x5A, dtype=torch.uint8)
    views, gaps, start = {}, [], 0
    for (name, view), size in zip(caches.items(), sizes, strict=True):
        segment = bytes_at(reservation.data_ptr() + start, size, reservation.device, reservation)
        segment.zero_()
        views[name] = segment.view(view.dtype).as_strided(view.shape, view.stride())
        gaps.append(reservation[start + size : start + size + gap])
        start += size + gap
    return views, gaps


@dataclass
class StepLog:
    """What the runner saw in one step."""

    computed: dict[str, tuple[int, int]] = field(default_factory=dict)  # rid -> positions computed
    loaded: set[str] = field(default_factory=set)  # finished_recving
    sent: set[str] = field(default_factory=set)  # finished_sending
    invalid: set[int] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


class Engine:
    """A scheduler, the worker connector and the stand-in runner over vLLM-laid-out CPU caches."""

    def __init__(self, config: VllmConfig, kv_config: KVCacheConfig, segmented: bool = False) -> None:
        """``segmented``: the worker is given the caches as vLLM 0.34's extensible KV cache gives
        them (``own_storages``, half a page apart) rather than views of one allocation."""
        init_none_hash(sha256)
        self.config = config
        self.kv_config = kv_config
        self.async_scheduling = bool(config.scheduler_config.async_scheduling)
        speculative = config.speculative_config
        self.spec_tokens = speculative.num_speculative_tokens if speculative is not None else 0
        self._drafts_rng = np.random.default_rng(0)
        self.drafted = self.accepted = 0  # draft tokens proposed and accepted so far
        self._drafts: dict[str, list[int]] = {}  # asynchronous scheduling: each request's next drafts
        self._rejected: dict[str, tuple[int, int]] = {}  # rid -> (step, drafts rejected in that step)
        self._steps = 0
        # The worker's connector is built first, as in vLLM.
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_config)
        layout = config.cache_config.get_resolved_kv_cache_layout()
        self.caches = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
        self.segment_gaps: list[torch.Tensor] = []
        if segmented:  # half a page apart: copies move half pages
            self.caches, self.segment_gaps = own_storages(self.caches, BLOCK * HEADS * HEAD_SIZE * 4)
        self.worker.register_kv_caches(self.caches)
        self.scheduler = config.scheduler_config.get_scheduler_cls()(  # AsyncScheduler when asynchronous
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.connector = self.scheduler.connector
        self.layers = [name for group in kv_config.kv_cache_groups for name in group.layer_names]
        self._group_of = {n: g for g, group in enumerate(kv_config.kv_cache_groups) for n in group.layer_names}
        self._hasher = get_request_block_hasher(BLOCK, sha256)
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, list[int]] = {}
        self.log: list[StepLog] = []
        self._pending: tuple | None = None

    # -- requests ------------------------------------------------------------------------------

    def add(
        self,
        rid: str,
        prompt: list[int],
        max_tokens: int = 4,
        salt: str | None = None,
        prompt_logprobs: int | None = None,
        images: Sequence[tuple[str, int, int]] = (),
        priority: int = 0,
    ) -> Request:
        """Queue a request (``prompt_logprobs`` makes vLLM compute every prompt token: it reads no cache).

        ``images``: (identifier, offset, length) of each image's placeholder tokens in ``prompt``; the
        scheduler gets an encoder budget for them (the stand-in runner computes no image features).
        ``priority``: under the priority policy, lower goes first.
        """
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs)
        params.update_from_generation_config({}, EOS)
        features = [
            MultiModalFeatureSpec(data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(at, n))
            for ident, at, n in images
        ]
        if features and not self.scheduler.max_num_encoder_input_tokens:
            self.scheduler.max_num_encoder_input_tokens = ENCODER_BUDGET
            self.scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=ENCODER_BUDGET)
        request = Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            cache_salt=salt,
            block_hasher=self._hasher,
            mm_features=features or None,
            priority=priority,
        )
        self.requests[rid] = request
        self.outputs[rid] = []
        self.scheduler.add_request(request)
        return request

    def abort(self, rid: str) -> None:
        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    # -- steps ---------------------------------------------------------------------------------

    def schedule(self):
        return self.scheduler.schedule()

    def execute(self, out) -> ModelRunnerOutput:
        """The worker's share of one step for scheduler output ``out``."""
        step = StepLog()
        meta = out.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            request = self.requests[rid]
            start = request.num_computed_tokens - n - self._unheard_rejections(rid)
            self.check(rid, start)
            tokens = self.tokens(rid)
            drafts = self._drafts_of(rid, out)
            self._forward(rid, tokens + drafts, start, start + n)
            step.computed[rid] = (start, start + n)
            req_ids.append(rid)
            sampled.append(verify(tokens, drafts) if start + n >= len(tokens) else [])
            self.drafted += len(drafts)
            self.accepted += len(sampled[-1]) - 1 if drafts else 0
            if drafts:
                self._rejected[rid] = (self._steps, len(drafts) + 1 - len(sampled[-1]))
            self.outputs[rid].extend(sampled[-1])
            if self.spec_tokens and self.async_scheduling and sampled[-1]:
                self._drafts[rid] = self._draft(self.tokens(rid))
        self._steps += 1
        w.start_load_kv(None)
        if not self.spec_tokens:
            w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        step.loaded, step.sent, step.failed = (
            set(results.finished_recving),
            set(results.finished_sending),
            set(results.failed_recving),
        )
        step.invalid = w.get_block_ids_with_load_errors()
        worker_meta = w.build_connector_worker_meta()
        if self.spec_tokens:  # with a drafter, vLLM's runner starts the saves after the results
            w.wait_for_save()  # (``defer_finalize``: after the drafter ran)
        w.clear_connector_metadata()
        self.log.append(step)
        kv_out = KVConnectorOutput(
            finished_sending=step.sent or None,
            finished_recving=step.loaded or None,
            failed_recving=step.failed,
            invalid_block_ids=step.invalid,
            kv_connector_worker_meta=worker_meta,
        )
        by_index = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if _INDEXED_OUTPUT else {}
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_out, **by_index)

    def update(self, out, result: ModelRunnerOutput) -> None:
        self.scheduler.update_from_output(out, result)
        for rid in result.req_ids:  # the scheduler drops sampled tokens past a request's stop
            if self.requests[rid].is_finished():
                self.outputs[rid] = list(self.requests[rid].output_token_ids)

    def step(self) -> StepLog:
        """One engine step; with asynchronous scheduling the previous step's output is applied after it."""
        out = self.schedule()
        result = self.execute(out)
        if not self.async_scheduling:
            self.update(out, result)
            if self.spec_tokens:
                self._propose(result.req_ids)
            return self.log[-1]
        if self._pending is not None:
            self.update(*self._pending)
        self._pending = (out, result)
        return self.log[-1]

    def run(self, max_steps: int = 500) -> None:
        """Step until every request is finished and every transfer reported. A step that moves
        nothing (a request waits for its disk pages) is followed by a pause, as an idle engine waits."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                if self._pending is None:
                    return
                self.update(*self._pending)
                self._pending = None
                continue
            step = self.step()
            if not (step.computed or step.loaded or step.sent or step.failed):
                time.sleep(IDLE_PAUSE_S)
        raise AssertionError(f"requests still pending after {max_steps} steps")

    def timed_run(self, max_steps: int = 500) -> list[float]:
        """``run``, returning the seconds of each ``schedule()`` call of vLLM's scheduler (one a step)."""
        times: list[float] = []
        schedule = self.scheduler.schedule

        def timed():
            began = time.perf_counter()
            out = schedule()
            times.append(time.perf_counter() - began)
            return out

        self.scheduler.schedule = timed
        try:
            self.run(max_steps)
        finally:
            self.scheduler.schedule = schedule
        return times

    def _propose(self, rids: list[str]) -> None:
        """Synchronous scheduling: hand the scheduler drafts for the requests of a step that go on
        (it keeps as many as it schedules)."""
        going_on = [rid for rid in rids if not self.requests[rid].is_finished()]
        drafts = [self._draft(self.tokens(rid)) for rid in going_on]
        self.scheduler.update_draft_token_ids(DraftTokenIds(going_on, drafts))

    def _draft(self, tokens: list[int], right: int | None = None) -> list[int]:
        """The next ``spec_tokens`` tokens after ``tokens``, right up to a point (``right``, or a
        random one), wrong after it."""
        seq = list(tokens)
        if right is None:
            right = int(self._drafts_rng.integers(0, self.spec_tokens + 1))
        for i in range(self.spec_tokens):
            seq.append(sample(seq) if i < right else (sample(seq) + 1) % 997)
        return seq[len(tokens) :]

    def _drafts_of(self, rid: str, out) -> list[int]:
        """The drafts a step verifies for ``rid``: the scheduler's, or under asynchronous scheduling
        (where it schedules placeholders) as many of the runner's own. A request whose prefill ends
        in this step (its prompt loaded from the connector) has none yet: its placeholders stand for
        drafts that are all wrong, as vLLM's runner rejects placeholders it never filled."""
        scheduled = list(out.scheduled_spec_decode_tokens.get(rid, ()))
        if not self.async_scheduling or not scheduled:
            return scheduled
        drafts = self._drafts.pop(rid, None)
        if drafts is None:
            drafts = self._draft(self.tokens(rid), right=0)
        return drafts[: len(scheduled)]

    def _unheard_rejections(self, rid: str) -> int:
        """Positions the scheduler counts as computed that the runner rejected in the step just before
        (asynchronous scheduling: it hears of them after scheduling this one, as in vLLM)."""
        step, rejected = self._rejected.get(rid, (-2, 0))
        return rejected if self.async_scheduling and step == self._steps - 1 else 0

    def tokens(self, rid: str) -> list[int]:
        """The request's tokens as the runner knows them (it knows what it sampled before the scheduler does)."""
        return list(self.requests[rid].prompt_token_ids) + self.outputs[rid]

    # -- KV -------------------------------------------------------------------------------------

    def block_table(self, rid: str, layer: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[self._group_of[layer]])

    def _pages(self, layer: str) -> torch.Tensor:
        """int32 [blocks, tokens, heads, elements] view of a layer's cache (vLLM keeps [B, H, N, C])."""
        return self.caches[layer].view(torch.int32).permute(0, 2, 1, 3)

    def prefix_hashes(self, rid: str, tokens: Sequence[int]) -> np.ndarray:
        """What the stand-in model's KV of ``rid``'s tokens is a function of: their rolling hashes (a
        subclass may fold in more, as weights or a cache salt)."""
        return prefix_hashes(tokens)

    def _forward(self, rid: str, tokens: list[int], start: int, end: int) -> None:
        """Write the KV of positions ``[start, end)`` of ``tokens`` (the request's, then any drafts)."""
        end = min(end, len(tokens))
        if end <= start:
            return
        hashes = self.prefix_hashes(rid, tokens[:end])[start:end]
        positions = np.arange(start, end)
        for i, layer in enumerate(self.layers):
            table = np.array(self.block_table(rid, layer))
            blocks = torch.from_numpy(table[positions // BLOCK])
            offsets = torch.from_numpy(positions % BLOCK)
            self._pages(layer)[blocks, offsets] = kv_values(hashes, i)

    def check(self, rid: str, end: int) -> None:
        """Positions ``[0, end)`` of request ``rid`` hold its prefix's KV (null blocks skipped)."""
        if end <= 0:
            return
        hashes = self.prefix_hashes(rid, self.tokens(rid)[:end])
        null = self.scheduler.kv_cache_manager.block_pool.null_block.block_id
        positions = np.arange(end)
        for i, layer in enumerate(self.layers):
            table = np.array(self.block_table(rid, layer))
            blocks = table[positions // BLOCK]
            keep = blocks != null
            got = self._pages(layer)[torch.from_numpy(blocks[keep]), torch.from_numpy(positions[keep] % BLOCK)]
            want = kv_values(hashes[keep], i)
            if not torch.equal(got, want):
                bad = int(positions[keep][(got != want).flatten(1).any(1).numpy()][0])
                raise WrongKV(f"request {rid}, layer {layer}: position {bad} does not hold its prefix's KV")

    def blocks_bytes(self, rid: str, num_blocks: int) -> list[bytes]:
        """The raw bytes of the request's first ``num_blocks`` blocks, every layer."""
        return [
            self.caches[layer][self.block_table(rid, layer)[b]].view(torch.uint8).numpy().tobytes()
            for layer in self.layers
            for b in range(num_blocks)
        ]

    def poison(self) -> None:
        """Overwrite every block of the device caches (fresh memory must never pass for a load)."""
        for layer in self.layers:
            self.caches[layer].view(torch.int32).fill_(-0x5A5A5A5B)

    def reset_prefix_cache(self) -> None:
        assert self.scheduler.reset_prefix_cache(), "vLLM refused to reset its prefix cache"

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()

    # -- what the connector holds ------------------------------------------------------------------

    @property
    def kv_scheduler(self):
        return kvtier_part(self.connector).scheduler

    def assert_no_leaks(self) -> None:
        """No request, block, lease, job or locked host page is left behind."""
        s = self.scheduler
        assert not s.requests and not s.running and len(s.waiting) == 0
        pool = s.kv_cache_manager.block_pool
        assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
        k = self.kv_scheduler
        k.wait_for_store_writes()
        assert not k._leases and not k._jobs and not k._requests and not k._placements
        assert not k.manager._pool.holders, "a kvtier cache is still open"
        w = kvtier_part(self.worker).worker
        assert not w._jobs and not w._saves_of and not w._delayed


def kvtier_part(connector: KVConnectorBase_V1) -> KVTierConnector:
    """``connector`` itself, or kvtier's among a ``MultiConnector``'s."""
    if isinstance(connector, KVTierConnector):
        return connector
    return next(c for c in connector.sub_connectors if isinstance(c, KVTierConnector))


def sample(tokens: Sequence[int]) -> int:
    """The stand-in model's next token: a function of the whole prefix (never EOS)."""
    return int(prefix_hashes(tokens)[-1] % 997)


def verify(tokens: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a step samples after ``tokens`` with ``drafts`` proposed: the drafts the stand-in
    model agrees with, up to the first it does not, then its own next token."""
    seq = list(tokens)
    for draft in drafts:
        if sample(seq) != draft:
            break
        seq.append(draft)
    seq.append(sample(seq))
    return seq[len(tokens) :]


def prompt(seed: int, length: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, 990, size=length)]
