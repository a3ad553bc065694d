"""Counters the manager keeps, and the ``CacheStats`` snapshot it reports."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TierStats:
    """Occupancy of one tier, summed over layer groups."""

    pages_total: int
    pages_used: int
    bytes_total: int
    bytes_used: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the manager's counters (cumulative since it was created).

    ``checksum_failures`` counts pages that did not come back intact from disk: a checksum that
    does not match, a short read, or a read that failed (each is a miss, never a wrong byte).
    ``disk_resets`` counts disk tier directories whose index or files could not be read when the
    manager started: each was reported (an ERROR log line) and started empty.
    ``recomputed_tokens`` counts cached tokens a request recomputes though they were found: loading
    them from their tier was estimated slower than recomputing them (``set_prefill_rate``), or the
    reuse was given up (shortened for a batch or for a caller that must not wait for the disk, or
    lost to a checksum failure on the way in).
    ``hit_tokens`` (and ``hit_rate``) count reuse from the manager's own tiers, once it is settled:
    at its cache's first commit of a token, or at its close (``kvtier.hit_count``); tokens an engine's
    connector loads after them are counted by the connector (``ConnectorStats``) and in each
    ``RequestOutput.reused_tokens_by_tier["connector"]``. Every count only grows.
    """

    tiers: dict[str, TierStats]
    hit_tokens: dict[str, int]
    lookup_tokens: int
    evictions: int
    demotions: int
    promotions: int
    drops: int
    checksum_failures: int
    bytes_copied: dict[str, int]
    disk_resets: int = 0
    recomputed_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Reused tokens over looked-up tokens (0 when nothing was looked up)."""
        return sum(self.hit_tokens.values()) / self.lookup_tokens if self.lookup_tokens else 0.0


@dataclass(slots=True)
class Counters:
    """The mutable counters behind ``CacheStats``.

    ``evictions`` counts pages forced out of a tier to make room (each is also a demotion or a
    drop); ``promotions`` counts pages moved to a warmer tier; ``drops`` pages discarded from the
    cache entirely; ``bytes_copied`` is keyed "<src>-><dst>:<path>".
    """

    hit_tokens: Counter[str] = field(default_factory=Counter)
    lookup_tokens: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    drops: int = 0
    checksum_failures: int = 0
    disk_resets: int = 0
    recomputed_tokens: int = 0
    bytes_copied: Counter[str] = field(default_factory=Counter)

    def add_copy(self, src: str, dst: str, path: str, nbytes: int) -> None:
        self.bytes_copied[f"{src}->{dst}:{path}"] += nbytes
