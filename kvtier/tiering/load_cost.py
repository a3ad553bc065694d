"""The load-or-recompute decision: never make time to first token worse than recomputing.

Loading a cached block costs its bytes over the measured bandwidth of the tier it is on (0 on
the primary tier); recomputing a token costs one over the engine's measured prefill rate. For a
prompt of ``L`` tokens whose cached prefix has blocks ``0..n-1``, reusing the first ``c`` blocks
costs ``load(0..c-1) + (L - c * tokens_per_block) / rate``; the cut ``c`` with the least cost is
kept (the longest among equals), the rest is recomputed. Blocks are loaded in prefix order, so
the cost is evaluated for every cut in one pass.

Bandwidths are measured online, per source tier, from the mover's own copies: a measurement
slower than the estimate replaces it at once, a faster one moves it by a weighted mean (a disk
read from the OS page cache is fast, the same read cold is not: loads err toward recomputing,
which costs at most the gain of a load). A tier never measured yet is assumed to win (its first
load measures it); a disk tier holding pages is sampled when its manager opens it, if nothing
measured it before (``disk_speed``). With no prefill rate (nothing told the pool one) every
cached block is loaded.

A disk tier remembers the measures in its index (``DiskIndex.measured``): a manager started
later on the same directory, and device kind, starts from the disk bandwidth the last one
measured, so its first disk load after a restart is weighed too; the last prefill rate is offered
to the caller (``remembered_prefill_rate``), which decides whether to use it.

An estimate is refreshed only by reads from its tier, and an estimate that says "recompute" stops
the loads that would read: it would never be revisited (a cold page cache measured once, a
remembered value from another day). So when a cut leaves blocks on a tier whose last sample is
older than ``PROBE_INTERVAL_S`` (a remembered value counts as sampled when the manager opened), the
cut is moved past ``PROBE_BYTES`` more of that tier's bytes (``with_probe``): at most one request
a minute loads a few MiB more than it would, and the tier is measured again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from kvtier.storage.disk_index import DiskIndex

SMOOTHING = 0.3  # weight of the newest measurement
PROBE_INTERVAL_S = 60.0  # a tier's estimate older than this is measured again by the next cut it makes
PROBE_BYTES = 4 << 20  # what such a probe loads past the cut: enough that latency does not dominate


class LoadCost:
    """Measured bandwidths per tier (bytes/s into the primary tier) and the prefill rate (tokens/s).

    With ``disk`` (the disk tier's number and index), the disk's bandwidth starts from the value
    remembered there for primary tiers on ``device_kind`` ("cuda", "cpu"), and new measures of
    both rates are remembered.
    """

    def __init__(self, num_tiers: int, disk: tuple[int, DiskIndex] | None = None, device_kind: str = "cpu") -> None:
        self.bandwidth: list[float | None] = [math.inf] + [None] * (num_tiers - 1)
        self.prefill_rate: float | None = None
        self.remembered_prefill_rate: float | None = None
        self._disk = disk
        self._sampled_at = [-math.inf] * num_tiers  # monotonic time of each tier's last sample or probe
        self._bandwidth_name = f"disk_to_{device_kind}_bytes_per_s"
        self._prefill_name = f"prefill_{device_kind}_tokens_per_s"
        if disk is not None:
            tier, index = disk
            self.bandwidth[tier] = index.measured.get(self._bandwidth_name)
            if self.bandwidth[tier] is not None:
                self._sampled_at[tier] = time.monotonic()
            self.remembered_prefill_rate = index.measured.get(self._prefill_name)

    def observe(self, tier: int, nbytes: int, seconds: float) -> None:
        """A copy of ``nbytes`` from ``tier`` into the primary tier took ``seconds``."""
        if tier == 0 or nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        self._sampled_at[tier] = time.monotonic()
        old = self.bandwidth[tier]
        if old is None or rate < old:
            self.bandwidth[tier] = rate  # a slower read counts at once (the OS page cache went cold)
        else:
            self.bandwidth[tier] = (1 - SMOOTHING) * old + SMOOTHING * rate
        if self._disk is not None and tier == self._disk[0]:
            self._disk[1].remember(self._bandwidth_name, self.bandwidth[tier])

    def set_prefill_rate(self, tokens_per_second: float) -> None:
        if isinstance(tokens_per_second, bool) or not isinstance(tokens_per_second, int | float):
            raise TypeError(f"a prefill rate is a number of tokens per second, got {tokens_per_second!r}")
        if not tokens_per_second > 0 or not math.isfinite(tokens_per_second):
            raise ValueError(f"a prefill rate is a finite number of tokens per second > 0, got {tokens_per_second!r}")
        self.prefill_rate = float(tokens_per_second)
        if self._disk is not None:
            self._disk[1].remember(self._prefill_name, self.prefill_rate)

    def block_seconds(self, tier_bytes: Sequence[tuple[int, int]]) -> float:
        """Estimated seconds to load one block whose pages are ``(tier, bytes)``; 0 where unknown."""
        total = 0.0
        for tier, nbytes in tier_bytes:
            bandwidth = self.bandwidth[tier]
            if bandwidth is not None:
                total += nbytes / bandwidth
        return total

    def with_probe(self, cut: int, block_pages: Sequence[Sequence[tuple[int, int]]]) -> int:
        """``cut`` moved past ``PROBE_BYTES`` of a tier that the first block after it has pages on,
        if that tier has an estimate last sampled ``PROBE_INTERVAL_S`` ago or more (the probe counts
        as its sample until a read lands); else ``cut``. ``block_pages``: (tier, bytes) per block."""
        if cut >= len(block_pages):
            return cut
        now = time.monotonic()
        stale = [
            t
            for t, _ in block_pages[cut]
            if self.bandwidth[t] is not None and now - self._sampled_at[t] >= PROBE_INTERVAL_S
        ]
        if not stale:
            return cut
        tier = stale[0]
        self._sampled_at[tier] = now
        probed = 0
        while cut < len(block_pages) and probed < PROBE_BYTES:
            probed += sum(nbytes for t, nbytes in block_pages[cut] if t == tier)
            cut += 1
        return cut

    def best_cut(self, block_seconds: Sequence[float], prompt_tokens: int, tokens_per_block: int) -> int:
        """The number of leading cached blocks worth loading for a prompt of ``prompt_tokens``."""
        rate = self.prefill_rate
        n = len(block_seconds)
        if rate is None or n == 0:
            return n
        best, best_cost = 0, prompt_tokens / rate
        load = 0.0
        for c in range(1, n + 1):
            load += block_seconds[c - 1]
            cost = load + max(prompt_tokens - c * tokens_per_block, 0) / rate
            if cost <= best_cost:
                best, best_cost = c, cost
        return best
