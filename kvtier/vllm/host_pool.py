"""The host pages both halves of the connector share, found by the engine's id.

The scheduler half owns a ``KVCacheManager`` whose primary tier is host memory: its buffers (one
per layer group) are the pages the worker half copies vLLM's blocks into and out of. The two
halves are separate objects in one process (vLLM's single-process executor), so the scheduler
half publishes the buffers here under the engine id and the worker half looks them up on its
first job. Nothing here imports vLLM.

For a CUDA device the worker registers the buffers with ``cudaHostRegister`` (page-locked, so
the copy engines reach them directly); if that fails it keeps going on pageable memory, through
the copy engines only (the copy kernel cannot reach pageable memory).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1
_POOLS: dict[str, HostPool] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class HostPool:
    """Flat uint8 host buffers, one per kvtier layer group; slot s of group g is ``page_bytes[g]`` bytes at
    ``s * page_bytes[g]``."""

    buffers: tuple[torch.Tensor, ...]
    page_bytes: tuple[int, ...]


def publish(engine_id: str, pool: HostPool) -> None:
    """Make ``pool`` the host pages of engine ``engine_id``; ``ValueError`` if it already has some."""
    with _LOCK:
        if engine_id in _POOLS:
            raise ValueError(f"engine {engine_id!r} already has kvtier host pages in this process")
        _POOLS[engine_id] = pool


def withdraw(engine_id: str) -> None:
    """Forget engine ``engine_id``'s host pages (idempotent)."""
    with _LOCK:
        _POOLS.pop(engine_id, None)


def lookup(engine_id: str) -> HostPool | None:
    """The host pages of engine ``engine_id``, or None when its scheduler half is not in this process."""
    with _LOCK:
        return _POOLS.get(engine_id)


class Registration:
    """Host buffers page-locked for one CUDA device; ``release()`` unregisters them (idempotent)."""

    def __init__(self, buffers: tuple[torch.Tensor, ...]) -> None:
        self._addresses: list[int] = []
        cudart = torch.cuda.cudart()
        for buffer in buffers:
            code = int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), _CUDA_HOST_REGISTER_PORTABLE))
            if code:
                self.release()
                raise RuntimeError(f"cudaHostRegister of {buffer.numel()} bytes failed with cudaError {code}")
            self._addresses.append(buffer.data_ptr())

    def release(self) -> None:
        addresses, self._addresses = self._addresses, []
        if addresses:
            cudart = torch.cuda.cudart()
            for address in addresses:
                cudart.cudaHostUnregister(address)


def register_for_device(pool: HostPool, device: torch.device) -> Registration | None:
    """Page-lock ``pool`` for ``device`` (CUDA); None on the CPU or when registration fails (logged)."""
    if device.type != "cuda":
        return None
    try:
        return Registration(pool.buffers)
    except RuntimeError as exc:
        log.warning("kvtier.vllm: host pages stay pageable (%s); copies use the copy engines only", exc)
        return None
