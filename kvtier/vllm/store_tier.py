"""kvtier pages in a shared block store below the disk tier (``store_url``). Imports no vLLM.

A block's pages are kept under ``BlockKeyspace`` keys (model identity, block size, tensor-parallel
shard, reuse scope, the block's chained key, layer group), so engines on other processes or
machines that run the same model find them, and nobody else does. The store frames and
checksums every value (``kvtier.connector.store``): a missing, damaged or foreign value is a
miss, and a store that is down, slow or full answers misses within its timeout, never raises.

- ``present``: how many consecutive blocks the store holds whole: a batched existence check of
  the first ``FIRST_PROBE`` blocks, then, if the store holds them all, one of the rest. Checks and
  fetches are timed (``StoreSpeed``): ``faster_to_recompute`` tells when asking the store for a
  prefix is expected to take longer than recomputing it; a check of ``SLOW_CALL_S`` or more (on
  vLLM's scheduler thread, which waits for it) is a rate-limited WARNING. A prompt
  the store has never seen (most of them) costs one small check, not one per block: on a shared
  directory each check is a file's metadata round trip (a network one over NFS).
- ``fetch``: the verified payloads of blocks, read on a background thread; the run stops at the
  first miss. ``place`` then writes them into host pages, on another background thread: the
  caller keeps the pages locked and reads nothing of them until the returned future is done.
- ``put``: pages written on a background thread, skipping keys the store has; the caller keeps
  the pages unchanged (locked) until the returned future is done. The puts queued while a write
  is in flight go together in the next (``kvtier.connector.save_batches``): one existence check
  and one write for all of them, so a distant store's round trips do not pile up per save.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlparse

import numpy as np
import torch

from kvtier.config import ReuseScope
from kvtier.connector.fs_store import FileSystemStore
from kvtier.connector.keys import BlockKeyspace
from kvtier.connector.redis_store import RedisStore
from kvtier.connector.redis_urls import redact_url
from kvtier.connector.save_batches import Save, SaveBatches
from kvtier.connector.store import BlockStore
from kvtier.connector.store_connector import SLOW_CALL_S
from kvtier.connector.store_speed import StoreSpeed
from kvtier.reuse.block_keys import chain_from, scope_key
from kvtier.storage.log_limit import RateLimitedWarning

log = logging.getLogger(__name__)

REDIS_SCHEMES = ("redis", "rediss", "redis-cluster", "redis-sentinel")
FIRST_PROBE = 8  # blocks checked before the rest of a request's blocks are
EXIT_WAIT_S = 30.0  # at the exit of a process that did not close: the writes queued, waited for this long


def check_store_url(url: str) -> None:
    """``ValueError`` unless ``url`` is a Redis/Valkey URL or ``file:///path`` (checked before
    anything is built: the URL's form only, not whether the store answers)."""
    parsed = urlparse(url)
    if parsed.scheme in REDIS_SCHEMES:
        return
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):  # file://dir/x: "dir" is a host, the path /x
            raise ValueError(
                f"kvtier.vllm: store_url {url!r} names the host {parsed.netloc!r}; a shared directory is "
                "file:///absolute/path"
            )
        if not parsed.path:
            raise ValueError(f"kvtier.vllm: store_url {url!r} names no directory (file:///path)")
        return
    schemes = [*REDIS_SCHEMES, "file"]
    raise ValueError(f"kvtier.vllm: store_url must start with one of {schemes}://, got {redact_url(url)!r}")


def open_store(url: str) -> BlockStore:
    """The store a ``store_url`` names: a Redis/Valkey URL, or ``file:///path`` (a shared directory)."""
    check_store_url(url)
    parsed = urlparse(url)
    return RedisStore(url) if parsed.scheme in REDIS_SCHEMES else FileSystemStore(os.fspath(parsed.path))


class BlockChain:
    """The chained keys of one request's blocks, extended as the request grows (its tokens never change)."""

    __slots__ = ("keys", "scope")

    def __init__(self, scope: ReuseScope) -> None:
        self.scope = scope
        self.keys: list[bytes] = []

    def upto(self, tokens: Sequence[int], tokens_per_block: int, count: int) -> list[bytes]:
        """The keys of the first ``count`` full blocks of ``tokens``."""
        start = len(self.keys)
        if count > start:
            parent = self.keys[-1] if self.keys else scope_key(self.scope)
            self.keys += chain_from(
                parent, tokens[start * tokens_per_block : count * tokens_per_block], tokens_per_block
            )
        return self.keys[:count]


class StoreTier:
    """One engine's pages in a block store; see the module docstring."""

    def __init__(
        self,
        store: BlockStore,
        keyspace: BlockKeyspace,
        host_buffers: Sequence[torch.Tensor],
        page_bytes: Sequence[int],
    ) -> None:
        self.store = store
        self.keyspace = keyspace
        self._hosts = [buffer.numpy() for buffer in host_buffers]
        self._page_bytes = list(page_bytes)
        self._writer = SaveBatches(1, "kvtier-vllm-store", self._write_batch)
        # a process that exits without closing still writes what it queued (its thread is a daemon)
        self._flush_at_exit = weakref.finalize(self, self._writer.shutdown, EXIT_WAIT_S)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-vllm-store-read")
        self._placer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-vllm-store-place")
        self.speed = StoreSpeed()
        self._slow_checks = RateLimitedWarning(log, "kvtier.vllm: slow store checks")

    def keys(self, chain: BlockChain, blocks: Sequence[bytes]) -> list[str]:
        """Per block, per group, the store key (block-major)."""
        groups = range(len(self._page_bytes))
        return [self.keyspace.key(chain.scope, key, g) for key in blocks for g in groups]

    def faster_to_recompute(self, blocks: int, tokens_per_block: int, prefill_tokens_per_s: float | None) -> bool:
        """Whether recomputing ``blocks`` blocks at ``prefill_tokens_per_s`` is expected to beat checking
        and fetching them (``StoreSpeed.faster_to_recompute``; False until a check was timed, or without a rate)."""
        nbytes = blocks * sum(self._page_bytes)
        return self.speed.faster_to_recompute(blocks * tokens_per_block, nbytes, prefill_tokens_per_s)

    def present(self, chain: BlockChain, blocks: Sequence[bytes]) -> int:
        """How many of ``blocks``, from the first, the store holds for every group (the first
        ``FIRST_PROBE`` checked first, the rest only if the store holds all of those)."""
        head = self._run(chain, blocks[:FIRST_PROBE])
        if head < FIRST_PROBE or len(blocks) <= FIRST_PROBE:
            return head
        return head + self._run(chain, blocks[FIRST_PROBE:])

    def _run(self, chain: BlockChain, blocks: Sequence[bytes]) -> int:
        """How many of ``blocks``, from the first, the store holds for every group: one batched check."""
        if not blocks:
            return 0
        start = time.perf_counter()
        found = self.store.contains_many(self.keys(chain, blocks))
        took = time.perf_counter() - start
        self.speed.checked(took)
        if took >= SLOW_CALL_S:
            self._slow_checks(
                f"an existence check of {len(blocks)} blocks took {took:.2f} s on vLLM's scheduler thread, which "
                "waits for it; recompute_when_faster=True stops asking a store slower than recomputing"
            )
        per_block = np.array(found, dtype=bool).reshape(len(blocks), -1).all(axis=1)
        return len(blocks) if per_block.all() else int(np.argmin(per_block))

    def fetch(self, chain: BlockChain, blocks: Sequence[bytes]) -> Future[list[list[bytes]]]:
        """Read the stored pages of ``blocks`` on a background thread. The future's result holds,
        per block from the first, its verified pages (one per group), up to the first block the
        store does not have whole."""
        groups = len(self._page_bytes)
        sizes = [self._page_bytes[g] for _ in blocks for g in range(groups)]
        return self._reader.submit(self._read, self.keys(chain, blocks), sizes, groups)

    def _read(self, keys: list[str], sizes: list[int], groups: int) -> list[list[bytes]]:
        start = time.perf_counter()
        payloads = self.store.get_many(keys, sizes)
        self.speed.fetched(time.perf_counter() - start, sum(sizes))
        run: list[list[bytes]] = []
        for i in range(0, len(payloads), groups):
            row = payloads[i : i + groups]
            if any(p is None for p in row):
                break
            run.append(row)  # type: ignore[arg-type]  (no None left)
        return run

    def place(self, pages: Sequence[Sequence[bytes]], slots: Sequence[np.ndarray]) -> Future[None]:
        """Write fetched pages (``pages[i][g]``, a ``fetch`` result) into host slots ``slots[g][i]``, in
        the background (a copy of the whole hit: hundreds of milliseconds for a long prefix)."""
        return self._placer.submit(self._place, pages, slots)

    def _place(self, pages: Sequence[Sequence[bytes]], slots: Sequence[np.ndarray]) -> None:
        for i, row in enumerate(pages):
            for g, payload in enumerate(row):
                page, slot = self._page_bytes[g], int(slots[g][i])
                self._hosts[g][slot * page : (slot + 1) * page] = np.frombuffer(payload, dtype=np.uint8)

    def put(self, chain: BlockChain, blocks: Sequence[bytes], slots: Sequence[np.ndarray]) -> Future:
        """Write host pages ``slots[g][i]`` under ``blocks``' keys, in the background (keys present are skipped)."""
        keys = iter(self.keys(chain, blocks))
        groups = range(len(self._page_bytes))
        pages = [(next(keys), g, int(slots[g][i]), False) for i in range(len(blocks)) for g in groups]
        return self._writer.submit(pages, None, len(blocks) * sum(self._page_bytes))

    def _write_batch(self, saves: list[Save]) -> None:
        """The pages of the puts in ``saves`` (a key several hold, once) that the store lacks, in one write."""
        pages = {key: (g, slot) for save in saves for key, g, slot, _ in save.pages}
        items = []
        for (key, (g, slot)), present in zip(pages.items(), self.store.contains_many(list(pages)), strict=True):
            if not present:
                page = self._page_bytes[g]
                items.append((key, self._hosts[g][slot * page : (slot + 1) * page]))
        if items:
            self.store.put_many(items)

    def close(self) -> None:
        """Finish the reads, placements and writes in flight, then close the store."""
        self._reader.shutdown(wait=True)
        self._placer.shutdown(wait=True)
        self._flush_at_exit.detach()
        self._writer.shutdown()
        self.store.close()
