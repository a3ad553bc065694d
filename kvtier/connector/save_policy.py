"""Selective saving: which finished requests' blocks a connector writes to its store.

``SavePolicy(min_priority=0, min_seen=1)`` (the default: save everything) saves a finished
request's full blocks when its priority is at least ``min_priority`` and, block by block, when
the block's prefix has been seen in at least ``min_seen`` finished requests of this connector
(the block itself included). A chained block key names the whole token prefix up to that
block, so counting keys counts prefixes. Both conditions hold together when both are set.

The counts live in the connector's process, for the ``max_tracked`` most recently seen prefixes
(least recently seen forgotten first), so they take bounded memory.

``SavePolicy.parse`` reads the knob's text form: ``"all"``, ``"priority>=P"``, ``"seen>=N"``, or
both joined by a comma (``"priority>=50,seen>=2"``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.tiering.eviction import MAX_PRIORITY, MIN_PRIORITY

DEFAULT_MAX_TRACKED = 1 << 18


@dataclass(frozen=True, slots=True)
class SavePolicy:
    """Save requests of priority >= ``min_priority``, blocks of prefixes seen >= ``min_seen`` times."""

    min_priority: int = MIN_PRIORITY
    min_seen: int = 1
    max_tracked: int = DEFAULT_MAX_TRACKED

    def __post_init__(self) -> None:
        for name in ("min_priority", "min_seen", "max_tracked"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SavePolicy.{name} must be an int, got {value!r}")
        if not MIN_PRIORITY <= self.min_priority <= MAX_PRIORITY:
            raise ValueError(f"min_priority must be in {MIN_PRIORITY}..{MAX_PRIORITY}, got {self.min_priority}")
        if self.min_seen < 1 or self.max_tracked < 1:
            raise ValueError(f"min_seen and max_tracked must be >= 1, got {self.min_seen}, {self.max_tracked}")

    @classmethod
    def parse(cls, text: str | SavePolicy) -> SavePolicy:
        """The policy ``text`` names (a ``SavePolicy`` passes through); ``ValueError`` naming the forms."""
        if isinstance(text, SavePolicy):
            return text
        if not isinstance(text, str):
            raise TypeError(f"a save policy is a SavePolicy or a str, got {text!r}")
        if text.strip() == "all":
            return cls()
        fields: dict[str, int] = {}
        for part in text.split(","):
            name, sep, value = part.strip().partition(">=")
            key = {"priority": "min_priority", "seen": "min_seen"}.get(name.strip())
            value = value.strip()
            if not sep or key is None or key in fields or not (value.isascii() and value.isdigit()):
                raise ValueError(
                    f"bad save policy {text!r}: expected 'all', 'priority>=P', 'seen>=N' or 'priority>=P,seen>=N'"
                )
            fields[key] = int(value)
        return cls(**fields)


class PrefixSightings:
    """How many finished requests carried each prefix (chained block key), for the most recent ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def see(self, block_keys: Sequence[bytes]) -> list[int]:
        """Count one more sighting of each key; each key's count, this one included."""
        out = []
        for key in block_keys:
            count = self._counts.pop(key, 0) + 1
            self._counts[key] = count
            out.append(count)
        while len(self._counts) > self._capacity:
            self._counts.popitem(last=False)
        return out

    def __len__(self) -> int:
        return len(self._counts)
