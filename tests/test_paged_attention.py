"""The paged forward against the dense one and the cache-free oracle, in float64 on the CPU.

Pages live in a minimal test-only pool built from kvtier's own page geometry: one flat uint8
buffer per layer group, viewed with ``part_views`` exactly as ``KVCacheManager.kv_views`` does.
Slots are handed out from a shuffled permutation (slot order != block order) and every page that
is not in use holds random non-zero bytes (NaN and inf patterns included), so reading a page
that was never written, or was released, shows up in the results.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.layout import page_geometries, part_views
from kvtier.models import BAD_PAGE_INDEX, PagedSequence, build_model
from kvtier.models.llama import DecoderModel
from kvtier.spec import GroupKind

DTYPE = torch.float64
MODELS = ("tiny-llama", "tiny-swa", "tiny-hybrid")


class PagePool:
    """Pages for every layer group of ``model``'s spec, ``num_slots`` per group."""

    def __init__(self, model: DecoderModel, tokens_per_block: int, num_slots: int = 96, seed: int = 0) -> None:
        self.spec = model.spec
        self.device = model.device
        self.tokens_per_block = tokens_per_block
        self.geometries = page_geometries(self.spec, tokens_per_block)
        self.generator = torch.Generator().manual_seed(seed)
        self.buffers = [self._garbage(num_slots * g.page_bytes) for g in self.geometries]
        self.free = [torch.randperm(num_slots, generator=self.generator).tolist() for _ in self.geometries]

    def _garbage(self, nbytes: int) -> torch.Tensor:
        garbage = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, generator=self.generator)
        return garbage.to(self.device)

    def kv_views(self, layer_id: int) -> dict[str, torch.Tensor]:
        gid = self.spec.group_of(layer_id).group_id
        return part_views(self.geometries[gid], self.buffers[gid], layer_id)

    def page(self, gid: int, slot: int) -> torch.Tensor:
        size = self.geometries[gid].page_bytes
        return self.buffers[gid][slot * size : (slot + 1) * size]

    def allocate(self, gid: int) -> int:
        return self.free[gid].pop()

    def release(self, gid: int, slot: int) -> None:
        self.page(gid, slot).copy_(self._garbage(self.geometries[gid].page_bytes))
        self.free[gid].append(slot)


class Request:
    """One sequence's pages, kept the way the engine keeps them: one slot per block for attention
    groups (``BAD_PAGE_INDEX`` once a sliding-window block is stale), one state slot for recurrent."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.pages: list[list[int]] = [[] for _ in pool.spec.groups]
        for group in pool.spec.groups:
            if group.kind is GroupKind.RECURRENT:
                self.pages[group.group_id].append(pool.allocate(group.group_id))

    def ensure(self, length: int) -> None:
        """Pages for every block of positions ``0..length-1``."""
        blocks = -(-length // self.pool.tokens_per_block)
        for group in self.pool.spec.groups:
            if group.kind is not GroupKind.RECURRENT:
                pages = self.pages[group.group_id]
                while len(pages) < blocks:
                    pages.append(self.pool.allocate(group.group_id))

    def release_stale(self, history: int) -> None:
        """Release sliding-window blocks ``[s, max(s, (history + 1 - W) // tpb))`` (API.md §3)."""
        tpb = self.pool.tokens_per_block
        for group in self.pool.spec.groups:
            if group.kind is not GroupKind.SLIDING_WINDOW:
                continue
            sink_blocks = -(-group.sink_tokens // tpb)
            pages = self.pages[group.group_id]
            for block in range(sink_blocks, max(sink_blocks, (history + 1 - group.window) // tpb)):
                if pages[block] != BAD_PAGE_INDEX:
                    self.pool.release(group.group_id, pages[block])
                    pages[block] = BAD_PAGE_INDEX

    def sequence(self, token_ids: list[int], start: int) -> PagedSequence:
        self.ensure(start + len(token_ids))
        self.release_stale(start)
        device = self.pool.device
        pages = tuple(torch.tensor(p, dtype=torch.int64, device=device) for p in self.pages)
        return PagedSequence(torch.tensor(token_ids, device=device), start, pages)


def paged_prefill(model: DecoderModel, request: Request, prompt: list[int], chunks: list[int]) -> torch.Tensor:
    """Run ``prompt`` through ``forward_paged`` in chunks of the given sizes (the last size repeats
    as needed); returns the logits of every prompt token."""
    start, logits, sizes = 0, [], list(chunks)
    while start < len(prompt):
        size = sizes.pop(0) if len(sizes) > 1 else sizes[0]
        ids = prompt[start : start + size]
        logits.append(model.forward_paged([request.sequence(ids, start)], request.pool.kv_views, logits_for="all"))
        start += len(ids)
    return torch.cat(logits)


def paged_decode(model: DecoderModel, request: Request, first: int, start: int, max_tokens: int) -> list[int]:
    """Greedy decoding one token per step, from ``first`` (the token after ``start`` cached ones)."""
    out = [first]
    while len(out) < max_tokens:
        logits = model.forward_paged([request.sequence(out[-1:], start)], request.pool.kv_views)
        start += 1
        out.append(int(logits[0].argmax()))
    return out


def paged_generate(
    model: DecoderModel, request: Request, prompt: list[int], max_tokens: int, chunks: list[int]
) -> tuple[list[int], torch.Tensor]:
    """Chunked prefill then greedy decoding; returns the tokens and the prefill logits."""
    logits = paged_prefill(model, request, prompt, chunks)
    return paged_decode(model, request, int(logits[-1].argmax()), len(prompt), max_tokens), logits


def prompt_of(length: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@functools.cache
def tiny(name: str) -> DecoderModel:
    return build_model(name, "cpu", DTYPE, seed=1)


@pytest.fixture(params=MODELS)
def model(request: pytest.FixtureRequest) -> DecoderModel:
    return tiny(request.param)


@pytest.mark.parametrize(
    ("tpb", "chunks"),
    [(16, [1000]), (16, [7, 13, 50, 5]), (8, [1]), (32, [40, 33]), (16, [16, 17, 15])],
)
def test_paged_generation_matches_reference(model: DecoderModel, tpb: int, chunks: list[int]) -> None:
    prompt = prompt_of(131, seed=tpb + len(chunks), vocab=model.vocab_size)
    expected = model.reference_generate(prompt, 12)
    tokens, prefill_logits = paged_generate(model, Request(PagePool(model, tpb)), prompt, 12, chunks)
    assert tokens == expected
    dense = model.forward_dense(torch.tensor(prompt))
    torch.testing.assert_close(prefill_logits, dense, rtol=0, atol=1e-10)


@settings(max_examples=12, deadline=None)
@given(cuts=st.lists(st.integers(1, 59), min_size=1, max_size=6), tpb=st.sampled_from([4, 16, 64]))
def test_any_chunking_gives_dense_logits(cuts: list[int], tpb: int) -> None:
    for name in MODELS:
        model = tiny(name)
        prompt = prompt_of(90, seed=sum(cuts), vocab=model.vocab_size)
        logits = paged_prefill(model, Request(PagePool(model, tpb)), prompt, cuts)
        torch.testing.assert_close(logits, model.forward_dense(torch.tensor(prompt)), rtol=0, atol=1e-10)


def test_batch_of_sequences_matches_dense(model: DecoderModel) -> None:
    """Several sequences at different stages in one call: prefill from 0, a chunk after a cached
    prefix, and a one-token decode step."""
    pool = PagePool(model, 16)
    prompts = [prompt_of(length, seed, model.vocab_size) for length, seed in ((70, 1), (100, 2), (61, 3))]
    requests = [Request(pool) for _ in prompts]
    # Cache a prefix of the second and third prompts first.
    for request, prompt, cached in zip(requests[1:], prompts[1:], (52, 60), strict=True):
        model.forward_paged([request.sequence(prompt[:cached], 0)], pool.kv_views)
    seqs = [
        requests[0].sequence(prompts[0], 0),
        requests[1].sequence(prompts[1][52:], 52),
        requests[2].sequence(prompts[2][60:], 60),
    ]
    all_logits = model.forward_paged(seqs, pool.kv_views, logits_for="all")
    dense = [model.forward_dense(torch.tensor(p)) for p in prompts]
    expected = torch.cat((dense[0], dense[1][52:], dense[2][60:]))
    torch.testing.assert_close(all_logits, expected, rtol=0, atol=1e-10)
    # The same step again ("last"): the pages were rewritten with the same values.
    last = model.forward_paged(seqs[:1], pool.kv_views)
    torch.testing.assert_close(last, dense[0][-1:], rtol=0, atol=1e-10)


def test_released_window_pages_are_never_read() -> None:
    """Stale sliding-window blocks are released (garbage-filled, BAD_PAGE_INDEX) as generation
    goes on; the output still equals the oracle's."""
    model = tiny("tiny-swa")
    request = Request(PagePool(model, 8))
    prompt = prompt_of(150, seed=5, vocab=model.vocab_size)
    tokens, _ = paged_generate(model, request, prompt, 30, [20])
    assert tokens == model.reference_generate(prompt, 30)
    swa = next(g.group_id for g in model.spec.groups if g.kind is GroupKind.SLIDING_WINDOW)
    pages = request.pages[swa]
    history = 150 + 30 - 2  # the last step's start
    released = range(1, (history + 1 - 48) // 8)  # block 0 holds the sink tokens
    assert [pages[b] for b in released] == [BAD_PAGE_INDEX] * len(released)
    assert BAD_PAGE_INDEX not in pages[: released.start] + pages[released.stop :]


def test_bad_page_inside_window_is_rejected() -> None:
    model = tiny("tiny-swa")
    pool = PagePool(model, 8)
    request = Request(pool)
    prompt = prompt_of(100, seed=6, vocab=model.vocab_size)
    model.forward_paged([request.sequence(prompt[:90], 0)], pool.kv_views)
    seq = request.sequence(prompt[90:], 90)
    swa = next(g.group_id for g in model.spec.groups if g.kind is GroupKind.SLIDING_WINDOW)
    oldest_visible = (90 - 48 + 1) // 8  # holds position 43, the oldest key query 90 sees
    assert seq.page_indices[swa][oldest_visible - 1] == BAD_PAGE_INDEX
    seq.page_indices[swa][oldest_visible] = BAD_PAGE_INDEX
    with pytest.raises(ValueError, match="inside the attention window"):
        model.forward_paged([seq], pool.kv_views)


def test_recurrent_state_restored_from_snapshot_continues_identically() -> None:
    model = tiny("tiny-hybrid")
    pool = PagePool(model, 16)
    prompt = prompt_of(80, seed=7, vocab=model.vocab_size)
    rec = next(g.group_id for g in model.spec.groups if g.kind is GroupKind.RECURRENT)
    attn = next(g.group_id for g in model.spec.groups if g.kind is GroupKind.ATTENTION)

    first = Request(pool)
    model.forward_paged([first.sequence(prompt[:32], 0)], pool.kv_views)
    snapshot = pool.allocate(rec)
    pool.page(rec, snapshot).copy_(pool.page(rec, first.pages[rec][0]))
    expected = continue_generation(model, first, prompt, 32, 10)
    assert expected == model.reference_generate(prompt, 10)

    # A second request reuses the two full attention blocks and starts from the snapshot.
    second = Request(pool)
    pool.release(rec, second.pages[rec][0])
    second.pages[rec] = [snapshot]
    second.pages[attn] = first.pages[attn][:2]
    assert continue_generation(model, second, prompt, 32, 10) == expected


def continue_generation(model: DecoderModel, request: Request, prompt: list[int], start: int, n: int) -> list[int]:
    """The rest of the prompt after ``start`` cached tokens in one chunk, then ``n`` greedy tokens."""
    logits = model.forward_paged([request.sequence(prompt[start:], start)], request.pool.kv_views)
    return paged_decode(model, request, int(logits[0].argmax()), len(prompt), n)


def test_malformed_sequences_are_rejected() -> None:
    model = tiny("tiny-llama")
    pool = PagePool(model, 16)
    request = Request(pool)
    seq = request.sequence(list(range(20)), 0)
    short = PagedSequence(seq.token_ids, 0, (seq.page_indices[0][:1],))
    with pytest.raises(ValueError, match="cover fewer than"):
        model.forward_paged([short], pool.kv_views)
    with pytest.raises(ValueError, match="layer groups"):
        model.forward_paged([PagedSequence(seq.token_ids, 0, ())], pool.kv_views)
    with pytest.raises(ValueError, match="token ids"):
        model.forward_paged([PagedSequence(seq.token_ids + model.vocab_size, 0, seq.page_indices)], pool.kv_views)
    with pytest.raises(ValueError, match="past the end"):
        model.forward_paged([PagedSequence(seq.token_ids, 0, (seq.page_indices[0] + 1000,))], pool.kv_views)
    with pytest.raises(ValueError, match="logits_for"):
        model.forward_paged([seq], pool.kv_views, logits_for="first")
    with pytest.raises(ValueError, match="at least one"):
        model.forward_paged([], pool.kv_views)


def test_views_that_do_not_match_the_model_are_rejected() -> None:
    """Pages built for another dtype (so other K/V element types and state sizes) are refused."""
    for name, message in (
        ("tiny-llama", "pages are torch.float32"),
        ("tiny-hybrid", "'state' as uint8 \\[slots, 8192\\]"),
    ):
        model = tiny(name)
        seq = Request(PagePool(model, 16)).sequence(list(range(10)), 0)
        f32_pool = PagePool(build_model(name, "cpu", torch.float32), 16)
        with pytest.raises(ValueError, match=message):
            model.forward_paged([seq], f32_pool.kv_views)


@pytest.mark.parametrize("name", MODELS)
def test_bf16_paged_forward_follows_the_dense_one(name: str) -> None:
    model = build_model(name, "cpu", torch.bfloat16, seed=1)
    prompt = prompt_of(100, seed=8, vocab=model.vocab_size)
    paged = paged_prefill(model, Request(PagePool(model, 16)), prompt, [37, 1, 30])
    dense = model.forward_dense(torch.tensor(prompt))
    assert torch.isfinite(paged).all()
    assert (paged.float() - dense.float()).abs().max() < 0.1 * dense.float().abs().max()
    assert (paged.argmax(-1) == dense.argmax(-1)).float().mean() > 0.9
