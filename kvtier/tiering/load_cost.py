"""The load-or-recompute decision: never make time to first token worse than recomputing.

Loading a page costs its bytes over the measured bandwidth of the tier it is on (0 on the
primary tier); recomputing a token costs one over the engine's measured prefill rate. A cached
prefix may be reused up to any of its reuse points (``kvtier.reuse.reuse_points``: the block
boundaries where every layer group has a hit, and the match's own end); reusing ``p`` tokens of a
prompt of ``L`` costs ``load(p) + (L - p) / rate``, where ``load(p)`` prices the pages a cache
reusing ``p`` tokens would use: every earlier block of a full-attention group, only the window's
blocks of a sliding-window group, the one snapshot of a recurrent group. The point with the least
cost is kept (the longest among equals), the rest is recomputed.

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
import numbers
import time
from collections.abc import Sequence

import numpy as np

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
        if isinstance(tokens_per_second, bool | np.bool_) or not isinstance(tokens_per_second, numbers.Real):
            raise TypeError(f"a prefill rate is a number of tokens per second, got {tokens_per_second!r}")
        try:
            rate = float(tokens_per_second)
        except OverflowError:  # an int past a float's range
            rate = math.inf if tokens_per_second > 0 else -math.inf
        if not rate > 0 or not math.isfinite(rate):
            shown = repr(tokens_per_second)
            raise ValueError(
                "a prefill rate is a finite number of tokens per second > 0, got "
                + (shown if len(shown) <= 40 else f"{rate:g}")  # (10**400: inf, not 401 digits)
            )
        self.prefill_rate = rate
        if self._disk is not None:
            self._disk[1].remember(self._prefill_name, self.prefill_rate)

    def point_seconds(self, tier_bytes: np.ndarray) -> np.ndarray:
        """Estimated seconds to load what each reuse point uses: row ``k`` of ``tier_bytes`` holds its
        bytes per tier; the primary tier and tiers never measured cost 0."""
        known = np.array([0.0 if b is None else 1.0 / b for b in self.bandwidth])
        return tier_bytes @ known

    def _estimated(self, tier: int) -> bool:
        """Whether the tier's bandwidth is a measured estimate (the primary tier's is known: free)."""
        bandwidth = self.bandwidth[tier]
        return bandwidth is not None and math.isfinite(bandwidth)

    def best_point(self, point_tokens: Sequence[int], seconds: Sequence[float], prompt_tokens: int) -> int:
        """The index of the reuse point (``point_tokens`` ascending, ``seconds`` to load each) that makes
        a prompt of ``prompt_tokens`` cheapest: the longest among equals, the last with no prefill rate."""
        rate = self.prefill_rate
        if rate is None:
            return len(point_tokens) - 1
        best, best_cost = 0, math.inf
        for k, (tokens, load) in enumerate(zip(point_tokens, seconds, strict=True)):
            cost = load + max(prompt_tokens - tokens, 0) / rate
            if cost <= best_cost:
                best, best_cost = k, cost
        return best

    def with_probe(self, point: int, tier_bytes: np.ndarray) -> int:
        """``point`` moved on until ``PROBE_BYTES`` more of a tier's bytes are loaded (or to the last
        point), if the next point loads more from a tier whose estimate was last sampled
        ``PROBE_INTERVAL_S`` ago or more (the probe counts as its sample until a read lands); else
        ``point``. ``tier_bytes[k, t]``: what point ``k`` loads from tier ``t``."""
        if point + 1 >= len(tier_bytes):
            return point
        now = time.monotonic()
        grows = np.flatnonzero(tier_bytes[point + 1] > tier_bytes[point])
        stale = [int(t) for t in grows if self._estimated(int(t)) and now - self._sampled_at[t] >= PROBE_INTERVAL_S]
        if not stale:
            return point
        tier = stale[0]
        self._sampled_at[tier] = now
        probed = np.flatnonzero(tier_bytes[point + 1 :, tier] - tier_bytes[point, tier] >= PROBE_BYTES)
        return point + 1 + int(probed[0]) if len(probed) else len(tier_bytes) - 1
