"""Which path moves a call's pages: the copy engines or the Triton kernel.

The choice is a pure function of the page size, the call's number of runs (``kvtier.copy.runs``)
and the link between host and GPU, fixed by two knobs read once per process:

- ``KVTIER_COPY_ENGINE_MIN_BYTES``: the smallest page that goes to the copy engines. ``0`` sends
  every size there, a negative value none. Unset, it is ``DEFAULT_COPY_ENGINE_MIN_BYTES`` = 64 KiB,
  measured on an H200 over PCIe Gen5 (docs/benchmarks.md): from 64 KiB on the copy engines
  match the kernel on an idle GPU (within 5%) and beat it by 15-90% while matmuls run; at 32 KiB
  and below their cost per copy lets the kernel win, idle and under load.
- ``KVTIER_COHERENT_COPY_KERNEL``: on a coherent CPU-GPU link (NVLink-C2C) the copy engines take
  every size unless this is exactly ``"1"``, which opts that link into the kernel.

A call of at most ``SEPARATE_COPY_RUNS`` runs goes to the copy engines whatever its page size,
unless the knobs send every size to the kernel: one ``cuMemcpyAsync`` per run costs less to submit
than a kernel launch with its table of pairs (15 us against 31-45 us for one page on the H200's
host), and a run is one contiguous copy, which the copy engines move at the link's speed at any
length (their cost per copy is what makes many small pages the kernel's).

A value that is not an integer (empty included) or does not fit 64 bits logs a WARNING that names
the variable and is ignored. ``parse`` applies the same rules to any mapping, so tests drive the
semantics without touching the process-wide cache that ``from_env`` keeps.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from kvtier.knobs import parse_int64

logger = logging.getLogger(__name__)

DevicePath = Literal["copy_engine", "kernel"]
CopyPath = Literal["copy_engine", "kernel", "cpu", "none"]

COPY_ENGINE_MIN_BYTES_ENV: Final = "KVTIER_COPY_ENGINE_MIN_BYTES"
COHERENT_COPY_KERNEL_ENV: Final = "KVTIER_COHERENT_COPY_KERNEL"
DEFAULT_COPY_ENGINE_MIN_BYTES: Final = 64 * 1024
SEPARATE_COPY_RUNS: Final = 4  # calls of at most this many runs: one cuMemcpyAsync per run


def parse_min_bytes(raw: str | None) -> int | None:
    """``KVTIER_COPY_ENGINE_MIN_BYTES`` from its raw value: a byte threshold, or None for "never".

    Unset -> the default; ``"0"`` -> 0 (every size); negative -> None; a bad value -> WARNING and
    the default.
    """
    instead = f"keeping the default of {DEFAULT_COPY_ENGINE_MIN_BYTES} bytes"
    value = parse_int64(COPY_ENGINE_MIN_BYTES_ENV, raw, instead)
    if value is None:
        return DEFAULT_COPY_ENGINE_MIN_BYTES
    return None if value < 0 else value


def parse_coherent_copy_kernel(raw: str | None) -> bool:
    """``KVTIER_COHERENT_COPY_KERNEL`` from its raw value: True only for exactly ``"1"``.

    Unset and ``"0"`` keep the copy engines on coherent links; any other value logs a WARNING and
    keeps them too.
    """
    if raw is None or raw == "0":
        return False
    if raw == "1":
        return True
    logger.warning(
        "%s=%r is neither 0 nor 1; coherent links keep the copy engines (set it to exactly 1 for the kernel)",
        COHERENT_COPY_KERNEL_ENV,
        raw,
    )
    return False


@dataclass(frozen=True, slots=True)
class CopyPolicy:
    """The resolved knobs. ``choose`` depends on nothing else.

    ``copy_engine_min_bytes``: pages of at least this many bytes use the copy engines on a
    non-coherent link (PCIe); None = never. ``coherent_copy_kernel``: a coherent link uses the
    kernel (True) or the copy engines (False) for every size.
    """

    copy_engine_min_bytes: int | None = DEFAULT_COPY_ENGINE_MIN_BYTES
    coherent_copy_kernel: bool = False

    def __post_init__(self) -> None:
        threshold = self.copy_engine_min_bytes
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0):
            raise ValueError(f"copy_engine_min_bytes must be an int >= 0 or None (never), got {threshold!r}")

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> CopyPolicy:
        """The policy that the knobs in ``env`` describe (bad values warn and are ignored)."""
        return cls(
            copy_engine_min_bytes=parse_min_bytes(env.get(COPY_ENGINE_MIN_BYTES_ENV)),
            coherent_copy_kernel=parse_coherent_copy_kernel(env.get(COHERENT_COPY_KERNEL_ENV)),
        )

    @classmethod
    def from_env(cls) -> CopyPolicy:
        """The process's policy: the environment as it was at the first call (read once)."""
        return _process_policy()

    def choose(self, page_bytes: int, *, coherent_link: bool = False, runs: int | None = None) -> DevicePath:
        """The path for pages of ``page_bytes`` bytes between host and GPU (or GPU and GPU), for a
        call of ``runs`` runs (None: a call of many). ``TypeError`` unless ``page_bytes`` is an int."""
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int):
            raise TypeError(f"page_bytes must be an int, got {page_bytes!r}")
        if page_bytes < 0:
            raise ValueError(f"page_bytes must be >= 0, got {page_bytes}")
        if coherent_link:
            return "kernel" if self.coherent_copy_kernel else "copy_engine"
        threshold = self.copy_engine_min_bytes
        if threshold is not None and (page_bytes >= threshold or (runs is not None and runs <= SEPARATE_COPY_RUNS)):
            return "copy_engine"
        return "kernel"


@functools.cache
def _process_policy() -> CopyPolicy:
    return CopyPolicy.parse(os.environ)
