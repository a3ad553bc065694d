"""How a cache is configured: its tiers, its block size, reuse switches, and reuse scopes."""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class PrimaryTier:
    """Pages that compute reads: GPU memory for ``device="cuda"``, plain memory for "cpu".

    ``free_reserve``: the share of each layer group's slots (0 to 0.5) that background work
    (``KVCacheManager.maintain``) keeps free by demoting the coldest pages, so that a returning
    request rarely waits for eviction. 0 (the default) keeps none.
    """

    bytes: int
    free_reserve: float = 0.0

    name = "primary"

    def __post_init__(self) -> None:
        _check_quota(self)
        r = self.free_reserve
        if isinstance(r, bool | np.bool_) or not isinstance(r, numbers.Real):
            raise TypeError(f"PrimaryTier.free_reserve must be a number, got {r!r}")
        if not 0.0 <= r <= 0.5:
            raise ValueError(f"PrimaryTier.free_reserve must be in 0..0.5, got {r}")
        object.__setattr__(self, "free_reserve", float(r))  # (a numpy float of any width too)


MAX_WRITE_THROUGH_HITS = 1 << 20
"""The largest ``HostTier.write_through_min_hits``: far past any reuse count that means something."""


@dataclass(frozen=True, slots=True)
class HostTier:
    """Host memory below the primary tier; pinned (page-locked) when the device is CUDA.

    ``write_through``: copy published primary pages to host memory in the background
    (``KVCacheManager.maintain``), once no running request uses them, so that evicting them
    later frees their slots without a copy. None (the default) turns it on for CUDA devices.
    Only pages of priority >= ``write_through_min_priority`` are copied, and with
    ``write_through_min_hits`` > 0 only pages that at least that many caches have reused (each
    cache counts once, at its first resume, for the prefix it kept; counted while the page lives,
    not across restarts): a block computed once and never asked again is then never copied. A page
    left uncopied is still demoted when evicted, with its copy made then on the caller's stream: a
    selective policy saves the link the copies of pages dropped from the primary tier without ever
    being demoted, at the price of a copy on the critical path for each page demoted uncopied.
    Copies only take free host slots or other copies' slots, never push a page out.
    """

    bytes: int
    write_through: bool | None = None
    write_through_min_priority: int = 0
    write_through_min_hits: int = 0

    name = "host"

    def __post_init__(self) -> None:
        _check_quota(self)
        if self.write_through is not None and not isinstance(self.write_through, bool):
            raise TypeError(f"HostTier.write_through must be True, False or None, got {self.write_through!r}")
        for name, most in (("write_through_min_priority", 100), ("write_through_min_hits", MAX_WRITE_THROUGH_HITS)):
            value = getattr(self, name)
            if not is_int(value) or not 0 <= value <= most:
                raise ValueError(f"HostTier.{name} must be an int in 0..{most}, got {value!r}")
            object.__setattr__(self, name, int(value))  # (a numpy integer too)


def is_int(value: object) -> bool:
    """An int or a numpy integer (an id or a count read from an array), not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


MAX_DISK_BYTES = 1 << 60
"""The largest ``DiskTier.bytes``: 1 EiB, within the int64 offsets of its page files, and far past
any file system they would be on (a larger quota is a typo, refused before anything is created)."""


@dataclass(frozen=True, slots=True)
class DiskTier:
    """Preallocated page files and a persistent index under ``path`` (a leading ``~`` is the user's home).

    ``bytes``: 1 to ``MAX_DISK_BYTES``.

    Each model (its ``model_id``: by default a fingerprint of the weights, so each checkpoint),
    block size and page layout gets a directory of its own under ``path``, each up to ``bytes``;
    kvtier never removes one. Opening a tier warns when the others there use more than ``bytes``.

    ``write_behind``: while host memory is nearly full, write copies of its coldest pages to disk
    on a background thread (``KVCacheManager.maintain``), so that demoting them later writes
    nothing on the caller's thread. Host memory is the host tier, or the primary tier of a manager
    on the CPU without one. None (the default) turns it on for CUDA devices with a host tier; True
    on a CUDA device without one is a ``ValueError`` (there is no host memory to write from).

    ``blocking_writes``: a page pushed out of host memory that has no disk copy yet is written on
    the caller's thread (True, the default). False: if only the reuse tree holds it, it is dropped
    instead, a later miss, so the caller never waits for the disk (pages a cache holds are still
    written); with ``write_behind``, which writes copies ahead, only what it has not reached is lost.
    """

    bytes: int
    path: str | os.PathLike[str]
    write_behind: bool | None = None
    blocking_writes: bool = True

    name = "disk"

    def __post_init__(self) -> None:
        _check_quota(self)
        if self.bytes > MAX_DISK_BYTES:
            raise ValueError(
                f"DiskTier.bytes must be at most 2**60 (1 EiB, more than any file system holds), got {self.bytes}"
            )
        if not isinstance(self.path, str | os.PathLike) or not os.fspath(self.path):
            raise TypeError(f"DiskTier.path must be a non-empty path, got {self.path!r}")
        if "\0" in os.fsdecode(self.path):
            raise ValueError(f"DiskTier.path holds a NUL byte, which no file name may: {self.path!r}")
        if self.write_behind is not None and not isinstance(self.write_behind, bool):
            raise TypeError(f"DiskTier.write_behind must be True, False or None, got {self.write_behind!r}")
        if not isinstance(self.blocking_writes, bool):
            raise TypeError(f"DiskTier.blocking_writes must be True or False, got {self.blocking_writes!r}")


TierConfig = PrimaryTier | HostTier | DiskTier
TIER_NAMES = (PrimaryTier.name, HostTier.name, DiskTier.name)
"""Every tier's name, hottest first: the keys of reuse counts by tier (0 for a tier not configured)."""


@dataclass(frozen=True, slots=True)
class ReuseScope:
    """Pages are reused only between requests of the same scope (same LoRA, same salt)."""

    lora_id: int | str | None = None
    salt: str | bytes | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora_id, bool) or not isinstance(self.lora_id, int | str | None):
            raise TypeError(f"ReuseScope.lora_id must be an int, a str or None, got {self.lora_id!r}")
        if not isinstance(self.salt, str | bytes | None):
            raise TypeError(f"ReuseScope.salt must be a str, bytes or None, got {self.salt!r}")

    def encode(self) -> bytes:
        """A stable byte encoding, part of every block key of this scope (``decode`` inverts it)."""
        return b"scope:" + _encode_part(self.lora_id) + b"|" + _encode_part(self.salt)

    @classmethod
    def decode(cls, data: bytes) -> ReuseScope:
        """The scope ``encode`` wrote; ``ValueError`` for anything else (only exact encodings decode)."""
        if not isinstance(data, bytes | bytearray):
            raise TypeError(f"decode takes bytes, got {type(data).__name__}")
        try:
            head, lora, salt = data.split(b":", 1)[0], *data.split(b":", 1)[1].split(b"|")
            if head != b"scope":
                raise ValueError
            scope = cls(_decode_part(lora), _decode_part(salt))
        except (ValueError, IndexError, UnicodeDecodeError, TypeError):
            raise ValueError(f"not an encoded ReuseScope: {bytes(data[:40])!r}") from None
        if scope.encode() != data:
            raise ValueError(f"not an encoded ReuseScope: {bytes(data[:40])!r}")
        return scope


def _encode_part(x: object) -> bytes:
    if x is None:
        return b"-"
    if isinstance(x, bytes):
        return b"b" + x.hex().encode()
    if isinstance(x, int):
        return b"i" + str(x).encode()
    return b"s" + str(x).encode().hex().encode()


def _decode_part(data: bytes) -> int | str | bytes | None:
    tag, body = data[:1], data[1:]
    if tag == b"-" and not body:
        return None
    if tag == b"i":
        return int(body)
    if tag == b"b":
        return bytes.fromhex(body.decode())
    if tag == b"s":
        return bytes.fromhex(body.decode()).decode()
    raise ValueError(data)


DEFAULT_SCOPE = ReuseScope()


@dataclass(frozen=True)
class CacheConfig:
    """The cache's geometry and tiers. Tiers are ordered warm to cold; the first is primary.

    ``device``: "cpu", "cuda:N", or "cuda": the CUDA device current when a manager is built on the
    config (the manager keeps it as "cuda:N": making another device current later moves nothing).
    """

    tokens_per_block: int = 16
    tiers: list[TierConfig] = field(default_factory=list)
    device: str | torch.device = "cpu"
    enable_reuse: bool = True
    enable_partial_reuse: bool = True
    snapshot_interval_blocks: int = 4

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "snapshot_interval_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in ("enable_reuse", "enable_partial_reuse"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # "no" and 0 would otherwise pass as truthy or falsy
                raise TypeError(f"{name} must be True or False, got {value!r}")
        tiers = list(self.tiers)
        if not tiers or not isinstance(tiers[0], PrimaryTier):
            raise ValueError("tiers must start with a PrimaryTier, e.g. tiers=[kvtier.PrimaryTier(1 << 30)]")
        order = {PrimaryTier: 0, HostTier: 1, DiskTier: 2}
        ranks = []
        for t in tiers:
            if type(t) not in order:
                raise TypeError(f"unknown tier {t!r}: use PrimaryTier, HostTier or DiskTier")
            ranks.append(order[type(t)])
        if ranks != sorted(set(ranks)):
            raise ValueError("tiers must be ordered warm to cold, each kind at most once: primary, host, disk")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        disk = next((t for t in tiers if isinstance(t, DiskTier)), None)
        if device.type == "cuda" and disk is not None and disk.write_behind and HostTier not in map(type, tiers):
            raise ValueError(
                "DiskTier(write_behind=True) on a CUDA device needs a HostTier: it writes host memory's coldest "
                "pages to disk, and this manager has no host memory tier (add kvtier.HostTier(...), or leave "
                "write_behind None)"
            )
        object.__setattr__(self, "tiers", tiers)
        object.__setattr__(self, "device", device)


def write_through_enabled(config: CacheConfig) -> bool:
    """Whether the host tier (if any) keeps write-through copies of primary pages."""
    host = next((t for t in config.tiers if isinstance(t, HostTier)), None)
    if host is None:
        return False
    if host.write_through is None:
        return torch.device(config.device).type == "cuda"
    return host.write_through


def write_behind_enabled(config: CacheConfig) -> bool:
    """Whether the disk tier (if any) is written behind host memory: the host tier, or the primary
    tier of a manager on the CPU without one (``DiskTier.write_behind``)."""
    disk = next((t for t in config.tiers if isinstance(t, DiskTier)), None)
    on_cuda = torch.device(config.device).type == "cuda"
    if disk is None or (on_cuda and not any(isinstance(t, HostTier) for t in config.tiers)):
        return False  # no disk, or no host memory above it
    if disk.write_behind is None:
        return on_cuda
    return disk.write_behind


def _check_quota(tier: TierConfig) -> None:
    b = tier.bytes
    if isinstance(b, bool) or not isinstance(b, int):
        raise TypeError(f"{type(tier).__name__}.bytes must be an int, got {b!r}")
    if b <= 0:
        raise ValueError(f"{type(tier).__name__}.bytes must be > 0, got {b}")


def check_device_usable(device: torch.device) -> None:
    """A clear error, before any allocation, for a CUDA device this process cannot use."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device={str(device)!r} but CUDA is not available here (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda or 'none'}, sees no GPU): use device='cpu' or a CUDA machine"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device={str(device)!r} but this process sees {torch.cuda.device_count()} GPU(s)")


def concrete_device(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` is the CUDA device current now (so that what is built
    on it stays there after another device is made current); any other device as it is."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` name one device (a bare ``cuda`` names the current one)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a.type != "cuda" or concrete_device(a) == concrete_device(b)


def check_fits_in_memory(what: str, nbytes: int, device: torch.device, remedy: str) -> None:
    """``ValueError`` when ``nbytes`` (of ``what``, such as a tier or a model's weights) are more than
    all the memory ``device`` has: GPU memory for a CUDA device, else the machine's physical
    memory; the message ends with ``remedy``. Such an allocation can never be had: refusing it
    names the problem before the allocator fails (or the system's out-of-memory killer ends the
    process)."""
    if device.type == "cuda":
        where, have = str(device), torch.cuda.get_device_properties(device).total_memory
    else:
        where, have = "host memory", _host_memory_bytes()
    if have is not None and nbytes > have:
        raise ValueError(
            f"{what} cannot be allocated: it is more than all of {where} ({have / 2**30:.1f} GiB); {remedy}"
        )


def _host_memory_bytes() -> int | None:
    """Physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
