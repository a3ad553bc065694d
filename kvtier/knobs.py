"""Reading knobs from the environment: one rule per kind for every ``KVTIER_*`` variable.

- Integers: a value that is not a base-10 integer (the empty string included) or does not fit a
  signed 64-bit integer logs a WARNING that names the variable and what happens instead, and is
  ignored.
- Switches: exactly ``1`` turns one on and ``0`` (or unset) leaves it off; anything else
  (``true``, ``yes``, the empty string) logs a WARNING, once per value, and leaves it off.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Final

logger = logging.getLogger("kvtier.knobs")

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
DEBUG_ENV: Final = "KVTIER_DEBUG"
_DECIMAL: Final = re.compile(r"[+-]?[0-9]+")


def parse_int64(name: str, raw: str | None, instead: str) -> int | None:
    """The integer value of knob ``name``, or None when unset or invalid (invalid: WARNING, saying ``instead``)."""
    if raw is None:
        return None
    text = raw.strip()
    if not _DECIMAL.fullmatch(text):  # (``int`` would take "1_000" and other scripts' digits too)
        logger.warning("%s=%r is not an integer; %s", name, raw[:40], instead)
        return None
    if len(text.lstrip("+-").lstrip("0")) > 19 or not INT64_MIN <= (value := int(text)) <= INT64_MAX:
        logger.warning("%s=%r is out of range for a 64-bit integer; %s", name, raw[:40], instead)
        return None
    return value


@functools.cache
def parse_switch(name: str, raw: str | None) -> bool:
    """Whether switch ``name`` is on: ``"1"`` on, ``"0"`` or None off, anything else off with a WARNING.

    Cached per (name, value), so a bad value is reported once, not at every read.
    """
    if raw is None or raw == "0":
        return False
    if raw == "1":
        return True
    logger.warning("%s=%r is not 0 or 1; it stays off (set %s=1 to turn it on)", name, raw, name)
    return False


def debug_enabled() -> bool:
    """``KVTIER_DEBUG=1``: check every manager invariant after each operation (read at each call)."""
    return parse_switch(DEBUG_ENV, os.environ.get(DEBUG_ENV))
