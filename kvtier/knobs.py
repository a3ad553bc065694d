"""Reading integer knobs from the environment: one rule for every ``KVTIER_*`` variable.

A value that is not a base-10 integer (the empty string included) or does not fit a signed
64-bit integer logs a WARNING that names the variable and what happens instead, and is ignored.
"""

from __future__ import annotations

import logging
from typing import Final

logger = logging.getLogger("kvtier.knobs")

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1


def parse_int64(name: str, raw: str | None, instead: str) -> int | None:
    """The integer value of knob ``name``, or None when unset or invalid (invalid: WARNING, saying ``instead``)."""
    if raw is None:
        return None
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        logger.warning("%s=%r is not an integer; %s", name, raw, instead)
        return None
    if not INT64_MIN <= value <= INT64_MAX:
        logger.warning("%s=%r is out of range for a 64-bit integer; %s", name, raw, instead)
        return None
    return value
