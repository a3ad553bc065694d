"""Property test: random cache operations over several caches and scopes on small tiers.

After every step the manager's invariants hold, and every ACTIVE cache's pages hold exactly the
bytes its own tokens imply (``tests.kvdata``), whether they were written by it, reused from the
tree, copied for a partial block, or migrated through lower tiers and back.
"""

from __future__ import annotations

import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

import kvtier
from kvtier.tiering import mover
from tests.kvdata import PageOracle, small_spec

TPB = 4
PREFIXES = [[7000 + i for i in range(40)], [8000 + (i % 5) for i in range(40)]]
SCOPES = [kvtier.ReuseScope(), kvtier.ReuseScope(lora_id=3)]


class Request:
    def __init__(self, cache: kvtier.KVCache, tokens: list[int], prompt_len: int) -> None:
        self.cache = cache
        self.tokens = tokens  # the prompt followed by the tokens it will commit later
        self.prompt = tokens[:prompt_len]  # the input the cache was made for


def by_coldest_tier(cache: kvtier.KVCache) -> dict[str, int]:
    """The reused tokens per tier, block by block: a block's tokens go to the coldest tier any of its
    pages (or, for the last block, the page it copies a partly reused block from) came from."""
    names = cache._pool.tier_names
    reused = cache.num_reused_tokens
    out = {"primary": 0, "host": 0, "disk": 0}  # every tier, configured or not
    num_blocks = -(-reused // TPB)
    for b in range(num_blocks):
        tiers = [blocks[b].tier for blocks in cache._table.blocks if b < len(blocks) and blocks[b] is not None]
        if b == num_blocks - 1:
            tiers += [source.tier for source in cache._pending]
        out[names[max(tiers, default=0)]] += min(TPB, reused - b * TPB)
    return out


def tier_configs(kind: str, pages: dict[str, int], spec: kvtier.ModelSpec, tmp: str) -> list:
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block=TPB, tiers=[kvtier.PrimaryTier(1 << 22)]))
    demand = sum(
        probe.page_bytes(g.group_id) / (2 if g.kind is kvtier.GroupKind.RECURRENT else 1) for g in probe.layer_groups
    )
    probe.close()
    out = []
    for name, n in pages.items():
        quota = int(demand * n) + 1
        if name == "primary":
            out.append(kvtier.PrimaryTier(quota))
        elif name == "host":
            out.append(kvtier.HostTier(quota))
        else:
            out.append(kvtier.DiskTier(quota, tmp))
    return out


class CacheMachine(RuleBasedStateMachine):
    """Drives one manager; subclasses choose the model kind and tiers."""

    kind = "llama"
    pages = {"primary": 14}  # noqa: RUF012 - per subclass constant
    device = "cpu"

    requests = Bundle("requests")

    @initialize()
    def setup(self) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        spec = small_spec(self.kind)
        tiers = tier_configs(self.kind, self.pages, spec, self.tmp.name)
        config = kvtier.CacheConfig(tokens_per_block=TPB, tiers=tiers, snapshot_interval_blocks=2, device=self.device)
        self.mgr = kvtier.KVCacheManager(spec, config)
        self.oracle = PageOracle(self.mgr)
        self.live: list[Request] = []

    def teardown(self) -> None:
        if hasattr(self, "mgr"):
            self.mgr.close()
            self.tmp.cleanup()

    @rule(
        target=requests,
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.sampled_from([0, 3, 8, 13, 16, 21, 24, 30]),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=10),
        future=st.lists(st.integers(0, 3), min_size=0, max_size=12),
        scope=st.integers(0, len(SCOPES) - 1),
        priority=st.integers(0, 100),
    )
    def create(self, prefix, prefix_len, suffix, future, scope, priority):
        prompt = PREFIXES[prefix][:prefix_len] + suffix
        cache = self.mgr.create_cache(prompt, scope=SCOPES[scope], priority=priority)
        assert 0 <= cache.num_reused_tokens < len(prompt)
        assert cache.reused_by_tier == by_coldest_tier(cache)
        request = Request(cache, prompt + future, len(prompt))
        self.live.append(request)
        return request

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.sampled_from([8, 13, 16, 24, 30]),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=6),
        keep=st.booleans(),
    )
    def serve(self, prefix, prefix_len, suffix, keep):
        """A whole request at once: create, resume, prefill, then suspend (keep) or close it."""
        prompt = PREFIXES[prefix][:prefix_len] + suffix
        cache = self.mgr.create_cache(prompt)
        if not cache.resume():
            cache.close()
            return
        self.oracle.check(cache, prompt)
        start = cache.num_committed_tokens
        if cache.resize(len(prompt)):
            self.oracle.write(cache, prompt, start, len(prompt))
            cache.commit(prompt[start:])
        if keep:
            cache.suspend()
            self.live.append(Request(cache, prompt, len(prompt)))
        else:
            cache.close()

    @rule(request=requests)
    def resume(self, request):
        if request.cache.state is kvtier.CacheState.CLOSED:
            return
        if request.cache.resume():
            self.oracle.check(request.cache, request.tokens)

    @rule(request=requests, n=st.integers(1, 9))
    def step(self, request, n):
        cache = request.cache
        if cache.state is not kvtier.CacheState.ACTIVE:
            return
        start = cache.num_committed_tokens
        end = min(len(request.tokens), start + n)
        if end == start:
            return
        if cache.resize(max(end, cache.capacity)):
            self.oracle.write(cache, request.tokens, start, end)
            cache.commit(request.tokens[start:end])
            assert cache.num_committed_tokens == end

    @rule(request=requests)
    def finish(self, request):
        """Resume and commit every remaining token at once, as a whole prefill would."""
        cache = request.cache
        if cache.state is kvtier.CacheState.CLOSED or not cache.resume():
            return
        start, end = cache.num_committed_tokens, len(request.tokens)
        if end > start and cache.resize(max(end, cache.capacity)):
            self.oracle.write(cache, request.tokens, start, end)
            cache.commit(request.tokens[start:end])

    @rule(request=requests, ahead=st.integers(0, 6))
    def reserve(self, request, ahead):
        """Grow capacity and history together past what is committed, as a connector's reserve does."""
        cache = request.cache
        if cache.state is not kvtier.CacheState.ACTIVE:
            return
        history = cache.history_length + ahead
        before = (cache.capacity, cache.history_length)
        if not cache.resize(max(history, cache.capacity), history=history):
            assert (cache.capacity, cache.history_length) == before

    @rule(request=requests)
    def match_again(self, request):
        """A request still waiting (made, never resumed, nothing committed) reuses what was served
        since: never less than before, each block counted for its coldest tier now."""
        cache = request.cache
        if cache.state is not kvtier.CacheState.SUSPENDED or cache.num_committed_tokens != cache.num_reused_tokens:
            return
        before = cache.num_reused_tokens
        gained = cache.match_again(request.prompt)
        assert cache.num_reused_tokens == before + gained < len(request.prompt)
        if gained:  # (else the counts stay as they were found, where the pages were then)
            assert cache.reused_by_tier == by_coldest_tier(cache)

    @rule(request=requests)
    def suspend(self, request):
        if request.cache.state is kvtier.CacheState.ACTIVE:
            request.cache.suspend()

    @rule(request=consumes(requests))
    def close(self, request):
        request.cache.close()
        if request in self.live:
            self.live.remove(request)

    @rule(pick=st.integers(0, 1 << 16), offset=st.integers(0, 1 << 20))
    def corrupt_disk(self, pick, offset):
        """Flip a byte of a page on disk: whoever reads it must see a miss, never wrong bytes."""
        disk = next((t for t in self.mgr._pool.tiers if t.is_disk), None)
        if disk is None:
            return
        used = [(g, s) for g, owners in enumerate(disk.owners) for s, p in enumerate(owners) if p is not None]
        if not used:
            return
        group, slot = used[pick % len(used)]
        page_bytes = self.mgr.page_bytes(group)
        path = disk.storage.directory / f"group{group}.pages"
        with open(path, "r+b") as f:
            f.seek(slot * page_bytes + offset % page_bytes)
            byte = f.read(1)
            f.seek(slot * page_bytes + offset % page_bytes)
            f.write(bytes([byte[0] ^ 0x5A]))

    @rule()
    def restart(self):
        """Close everything and start a new manager on the same disk directory."""
        if "disk" not in self.pages:
            return
        for request in self.live:
            request.cache.close()
        self.live.clear()
        config = self.mgr.config
        self.mgr.close()
        self.mgr = kvtier.KVCacheManager(self.mgr.spec, config)
        self.oracle = PageOracle(self.mgr)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), prefix_len=st.integers(1, 30), scope=st.integers(0, 1))
    def prefetch(self, prefix, prefix_len, scope):
        self.mgr.prefetch(PREFIXES[prefix][:prefix_len], scope=SCOPES[scope])

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), prefix_len=st.integers(2, 30), scope=st.integers(0, 1))
    def shorten_to_memory(self, prefix, prefix_len, scope):
        """A new cache given up past its first page on disk, as vLLM's scheduler half does: its
        resume reads nothing from disk and holds the bytes of its tokens."""
        tokens = PREFIXES[prefix][:prefix_len]
        cache = self.mgr.create_cache(tokens, scope=SCOPES[scope])
        kept = cache.reused_in_memory
        cache.shorten_to_memory()
        assert cache.num_reused_tokens == cache.reused_in_memory <= kept
        read = self.disk_bytes_read()
        if cache.resume():
            assert self.disk_bytes_read() == read
            self.oracle.check(cache, tokens)
        cache.close()

    def disk_bytes_read(self) -> int:
        return sum(n for edge, n in self.mgr.stats().bytes_copied.items() if edge.startswith("disk->"))

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants()
        stats = self.mgr.stats()  # every token looked up is a hit, recomputed or a miss, once
        assert min(stats.hit_tokens.values()) >= 0
        assert sum(stats.hit_tokens.values()) + stats.recomputed_tokens <= stats.lookup_tokens
        for request in self.live:
            if request.cache.state is kvtier.CacheState.ACTIVE:
                self.oracle.check(request.cache, request.tokens)

    @rule(index=st.integers(0, 50))
    def resume_kept(self, index):
        """Resume a request kept by ``serve`` (its pages may be on any tier by now)."""
        if self.live:
            request = self.live[index % len(self.live)]
            if request.cache.state is not kvtier.CacheState.CLOSED and request.cache.resume():
                self.oracle.check(request.cache, request.tokens)
                request.cache.suspend()


SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def machine(kind: str, pages: dict[str, int], device: str = "cpu") -> type[CacheMachine]:
    return type(f"{kind}_{'_'.join(pages)}", (CacheMachine,), {"kind": kind, "pages": pages, "device": device})


@pytest.mark.parametrize("kind", ["llama", "swa", "hybrid"])
def test_primary_only(kind):
    m = machine(kind, {"primary": 14})
    m.TestCase.settings = SETTINGS
    m.TestCase().runTest()


@pytest.mark.parametrize("scratch", [True, False], ids=["swap scratch", "head start"])
@pytest.mark.parametrize("kind", ["llama", "swa", "hybrid"])
def test_primary_and_host(kind, scratch, monkeypatch):
    if not scratch:
        monkeypatch.setattr(mover, "SWAP_SCRATCH_BYTES", 0)
    m = machine(kind, {"primary": 10, "host": 12})
    m.TestCase.settings = SETTINGS
    m.TestCase().runTest()


@pytest.mark.parametrize("scratch", [True, False], ids=["swap scratch", "head start"])
@pytest.mark.parametrize("kind", ["llama", "swa", "hybrid"])
def test_three_tiers(kind, scratch, monkeypatch):
    if not scratch:
        monkeypatch.setattr(mover, "SWAP_SCRATCH_BYTES", 0)
    m = machine(kind, {"primary": 8, "host": 6, "disk": 20})
    m.TestCase.settings = SETTINGS
    m.TestCase().runTest()
