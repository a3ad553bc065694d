"""Names of pages in an external store: one key per (reuse scope, block, layer group).

A key is ``<prefix>/<scope>/<block>/g<group>`` with the prefix
``kvtier/v<format>/<model fingerprint>/tpb<tokens per block>/tp<rank>of<world size>``:

- ``<format>`` is the stored page format's version (``block_codec.FORMAT_VERSION``): releases
  whose values differ never share a key (during a rolling upgrade each reads its own values; on
  shared keys each took the other's intact values for damaged ones and deleted them);

- the model fingerprint (``ModelSpec.fingerprint``) and tokens per block decide a page's bytes,
  and a tensor-parallel rank holds its own shard of the heads, so two models, two block sizes or
  two ranks never share a key;
- ``<scope>`` is 32 hex digits of blake2b over ``ReuseScope.encode()``: two tenants never share
  a key (and a tenant's keys share a prefix);
- ``<block>`` is the 16-byte chained block key (``kvtier.reuse.block_keys.block_key``) in hex, which names
  the block's whole token prefix;
- ``<group>`` is the layer group id.

Every part is derived from bytes with a fixed encoding, so keys are the same in every process
and on every machine. Keys use only ``[0-9a-z/]``: no ``{hash tag}``, so a Redis Cluster hashes
each whole key to its slot and one model's blocks spread over every node.
"""

from __future__ import annotations

import hashlib
import string
from dataclasses import dataclass
from functools import lru_cache

from kvtier.config import ReuseScope
from kvtier.connector.block_codec import FORMAT_VERSION
from kvtier.spec import ModelSpec

KEY_VERSION = f"v{FORMAT_VERSION}"
BLOCK_KEY_BYTES = 16
SCOPE_DIGEST_BYTES = 16
_HEX = frozenset(string.hexdigits.lower())


@dataclass(frozen=True, slots=True)
class BlockKeyspace:
    """The keys of one model shard: ``key(scope, block_key, group_id)`` names one page."""

    fingerprint: str
    tokens_per_block: int
    tp_rank: int = 0
    tp_world_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, str) or not self.fingerprint or not set(self.fingerprint) <= _HEX:
            raise ValueError(f"fingerprint must be lowercase hex (ModelSpec.fingerprint()), got {self.fingerprint!r}")
        for name in ("tokens_per_block", "tp_rank", "tp_world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.tokens_per_block <= 0 or self.tp_world_size <= 0:
            raise ValueError(
                f"tokens_per_block and tp_world_size must be > 0, got {self.tokens_per_block}, {self.tp_world_size}"
            )
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise ValueError(f"tp_rank must be in 0..{self.tp_world_size - 1}, got {self.tp_rank}")

    @classmethod
    def for_model(
        cls, spec: ModelSpec, tokens_per_block: int, tp_rank: int = 0, tp_world_size: int = 1
    ) -> BlockKeyspace:
        """The keyspace of ``spec``'s pages at ``tokens_per_block``, for one tensor-parallel rank."""
        return cls(spec.fingerprint(), tokens_per_block, tp_rank, tp_world_size)

    @property
    def prefix(self) -> str:
        """The part every key of this keyspace starts with."""
        return (
            f"kvtier/{KEY_VERSION}/{self.fingerprint}/tpb{self.tokens_per_block}/tp{self.tp_rank}of{self.tp_world_size}"
        )

    def key(self, scope: ReuseScope, block_key: bytes, group_id: int) -> str:
        """The key of layer group ``group_id``'s page of the block ``block_key`` in ``scope``."""
        if not isinstance(scope, ReuseScope):
            raise TypeError(f"scope must be a ReuseScope, got {scope!r}")
        if not isinstance(block_key, bytes | bytearray) or len(block_key) != BLOCK_KEY_BYTES:
            raise ValueError(
                f"block_key must be {BLOCK_KEY_BYTES} bytes (kvtier.reuse.block_keys.block_key), got {block_key!r}"
            )
        if isinstance(group_id, bool) or not isinstance(group_id, int) or group_id < 0:
            raise ValueError(f"group_id must be an int >= 0, got {group_id!r}")
        return f"{self.prefix}/{scope_tag(scope)}/{bytes(block_key).hex()}/g{group_id}"


@lru_cache(maxsize=4096)
def scope_tag(scope: ReuseScope) -> str:
    """The hex digest that stands for ``scope`` in keys."""
    return hashlib.blake2b(scope.encode(), digest_size=SCOPE_DIGEST_BYTES).hexdigest()
