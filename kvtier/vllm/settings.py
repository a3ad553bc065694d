"""The connector's settings (``kv_connector_extra_config``) and the identity its pages carry.

Keys of ``kv_connector_extra_config``:

- ``host_bytes`` (int, default 4 GiB): host memory for kvtier's pages (page-locked on CUDA).
- ``disk_bytes`` and ``disk_path`` (both or neither): a disk tier whose index survives a restart.
  Engines of one model that name the same ``disk_path`` (replicas on one machine) take a
  directory each under it, each with its own ``disk_bytes`` (``kvtier.storage.disk_replicas``).
- ``store_url`` (str or None): a store below the disk tier shared by processes and machines:
  ``redis://...``, ``rediss://...``, ``redis-cluster://...``, ``redis-sentinel://...`` (a Redis
  or Valkey server) or ``file:///path`` (a shared directory).
- ``model_id`` (str or None): what names the weights in every key. By default vLLM's model name
  and revision, and which weights those are (a stamp of a local directory's weight files: names,
  sizes, modification times; the commit of a hub model's snapshot in the local Hugging Face
  cache). Set it when processes on other machines share a store and load a local directory
  copied without its files' times: by default they share nothing. It replaces the weights' name
  and stamp only: the rest of the identity (``model_identity``: the configuration as vLLM runs
  it, the dtypes, quantization, KV layout, shard and vLLM's version) is in every key whatever it
  is, so engines that write their pages otherwise never share them.
- ``disk_read_wait_s`` (float >= 0, default 1.0): how long a request whose cached prefix is on disk
  may wait, from its first scheduling (or from the last at which vLLM's own cache held all of it),
  for reads it cannot start itself (host memory has no room for its pages, requests before it in
  vLLM's queue wait for room first, or another request's read has them), or go on reading when a
  read brought none of its pages to stay (it failed); what is still on disk then is recomputed (a
  DEBUG line of ``kvtier.vllm.scheduler`` says why).
  A read of its own pages, once started, is always waited for, and followed by the next while
  each brings more; the pages read stay in host memory for it until it is scheduled. The wait is
  wall-clock time: a stall of the scheduler's process counts.
- ``recompute_when_faster`` (bool, default False): a request reads from disk only the blocks whose
  read (at the disk's speed, measured on the connector's own reads and kept in the disk directory
  across restarts) beats recomputing them, and recomputes the rest without waiting for the disk;
  with a store (``store_url``), a prompt whose existence check and fetch (timed on the store's
  own calls) are expected to take longer than recomputing what the store could give is not asked
  for (a DEBUG line; one ask is still made 10 s after the store's last timed call).
  Off, every cached block is read: a wait costs only the request, a recompute costs every request
  the GPU's time.
- ``prefill_tokens_per_s`` (float > 0 or None, default None): the prefill rate to weigh with. None:
  the rate the worker measures on steps that compute prompt tokens (a forward timed by CUDA
  events from bind to ``wait_for_save``; until then, the rate kept in the disk directory). Only
  with ``recompute_when_faster``.
- ``queued_reads_share`` (float, > 0 and at most 1, default 0.5): of host memory, the share that
  pages held for requests that have not run yet may take: pages read from disk for requests vLLM
  has not scheduled yet, and the prefixes of requests whose loads vLLM started, which wait for a
  slot; the rest stays for the running requests' saves. A request that waits for reads with none
  before it in vLLM's queue waiting (for reads, or loaded for a slot) may always read. Higher lets
  more queued requests find their prefix in host memory when their slot frees; lower leaves more
  room to save the running requests' blocks.

Anything else is a ``ValueError`` naming the known keys; a value of the wrong type a
``TypeError``.
"""

from __future__ import annotations

import math
import os
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config import MAX_DISK_BYTES
from kvtier.vllm.file_stamp import model_weights_stamp
from kvtier.weights import config_fingerprint

DEFAULT_HOST_BYTES = 4 << 30
DEFAULT_DISK_READ_WAIT_S = 1.0
DEFAULT_QUEUED_READS_SHARE = 0.5
KNOWN_KEYS = (
    "host_bytes",
    "disk_bytes",
    "disk_path",
    "store_url",
    "model_id",
    "disk_read_wait_s",
    "recompute_when_faster",
    "prefill_tokens_per_s",
    "queued_reads_share",
)


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    host_bytes: int = DEFAULT_HOST_BYTES
    disk_bytes: int | None = None
    disk_path: str | None = None
    store_url: str | None = None
    model_id: str | None = None
    disk_read_wait_s: float = DEFAULT_DISK_READ_WAIT_S
    recompute_when_faster: bool = False
    prefill_tokens_per_s: float | None = None
    queued_reads_share: float = DEFAULT_QUEUED_READS_SHARE

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Settings from ``kv_connector_extra_config`` (a mapping or None); ``ValueError``/``TypeError``
        for bad input."""
        if extra is not None and not isinstance(extra, Mapping):
            raise TypeError(f"kvtier.vllm: kv_connector_extra_config must be a dict, got {type(extra).__name__}")
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KNOWN_KEYS))
        if unknown:
            raise ValueError(
                f"kvtier.vllm: unknown kv_connector_extra_config keys {unknown}; known: {list(KNOWN_KEYS)}"
            )
        host_bytes = _positive_int("host_bytes", extra.get("host_bytes", DEFAULT_HOST_BYTES))
        disk_bytes = extra.get("disk_bytes")
        disk_path = extra.get("disk_path")
        if (disk_bytes is None) != (disk_path is None):
            raise ValueError("kvtier.vllm: give both disk_bytes and disk_path for a disk tier, or neither")
        if disk_bytes is not None:
            disk_bytes = _positive_int("disk_bytes", disk_bytes)
            if disk_bytes > MAX_DISK_BYTES:
                raise ValueError(f"kvtier.vllm: disk_bytes must be at most 2**60 (1 EiB), got {disk_bytes}")
            if not isinstance(disk_path, str | os.PathLike) or not os.fspath(disk_path):
                raise TypeError(f"kvtier.vllm: disk_path must be a non-empty path, got {disk_path!r}")
            disk_path = os.fspath(disk_path)
        store_url = _optional_text("store_url", extra.get("store_url"))
        model_id = _optional_text("model_id", extra.get("model_id"))
        wait = _finite("disk_read_wait_s", extra.get("disk_read_wait_s", DEFAULT_DISK_READ_WAIT_S))
        if wait < 0:
            raise ValueError(f"kvtier.vllm: disk_read_wait_s must be >= 0 and finite, got {wait}")
        weigh = extra.get("recompute_when_faster", False)
        if not isinstance(weigh, bool):
            raise TypeError(f"kvtier.vllm: recompute_when_faster must be a bool, got {weigh!r}")
        rate = extra.get("prefill_tokens_per_s")
        if rate is not None:
            rate = _finite("prefill_tokens_per_s", rate)
            if rate <= 0:
                raise ValueError(f"kvtier.vllm: prefill_tokens_per_s must be > 0 and finite, got {rate}")
            if not weigh:
                raise ValueError("kvtier.vllm: prefill_tokens_per_s is used only with recompute_when_faster=True")
        share = _finite("queued_reads_share", extra.get("queued_reads_share", DEFAULT_QUEUED_READS_SHARE))
        if not 0 < share <= 1:
            raise ValueError(f"kvtier.vllm: queued_reads_share must be > 0 and at most 1, got {share}")
        return cls(host_bytes, disk_bytes, disk_path, store_url, model_id, wait, weigh, rate, share)


def model_identity(vllm_config: Any, kv_cache_layout: str | None, model_id: str | None = None) -> str:
    """What decides the bytes of a page besides its tokens: the weights (``model_id`` when the user
    names them; else model and revision, and a stamp of the weight files where they are on local
    disk: weights saved again at the same path are another model), the model's configuration as
    vLLM runs it (``hf_overrides`` applied: the rotary embedding's base and scaling decide every
    key), the KV cache dtype, quantization and physical layout, the tensor-parallel shard, and
    vLLM's version (its model code computes the keys and values: a release may compute them
    otherwise, so an upgrade starts from nothing)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    if model_id is not None:
        weights = [f"user:{model_id}"]
    else:
        weights = [
            f"vllm:{model.model}@{model.revision or 'default'}",
            f"files={model_weights_stamp(model.model, model.revision)}",
        ]
    parts = [
        *weights,
        f"config={config_fingerprint(model.hf_config)}",
        f"dtype={model.dtype}",
        f"kv={cache.cache_dtype}",
        f"quant={model.quantization}",
        f"layout={kv_cache_layout}",
        f"tp={getattr(parallel, 'rank', 0)}/{parallel.tensor_parallel_size}",
        f"code=vllm-{vllm_version()}",
    ]
    return "|".join(parts)


def vllm_version() -> str:
    """The version of the vLLM whose model code computes the keys and values."""
    import vllm

    return vllm.__version__


TESTED_VLLM = ("0.33", "0.34")  # the releases whose scheduler tests/vllm drives (.ci/run, each)


def untested_vllm(version: str) -> bool:
    """Whether ``version`` is of none of the releases kvtier's connector is tested with."""
    return version.split(".")[:2] not in [release.split(".") for release in TESTED_VLLM]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"kvtier.vllm: {name} must be an int (bytes), got {value!r}")
    if value <= 0:
        raise ValueError(f"kvtier.vllm: {name} must be > 0, got {value}")
    return value


def _finite(name: str, value: object) -> float:
    """``value`` as a finite float: ``TypeError`` for a non-number, ``ValueError`` for nan, an
    infinity or an int too large for a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"kvtier.vllm: {name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = float("inf")
    if not math.isfinite(number):
        raise ValueError(f"kvtier.vllm: {name} must be finite, got {reprlib.repr(value)}")
    return number


def _optional_text(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(f"kvtier.vllm: {name} must be a non-empty str or None, got {value!r}")
    return value
