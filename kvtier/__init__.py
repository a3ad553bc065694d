"""kvtier: a tiered, paged KV-cache manager for LLM inference.

Public names (see docs/ARCHITECTURE.md for the layers behind them)::

    spec      AttentionLayer, RecurrentLayer, ModelSpec, LayerGroup, GroupKind
    config    CacheConfig, PrimaryTier, HostTier, DiskTier, ReuseScope
    caches    KVCacheManager, KVCache, CacheState, BAD_PAGE_INDEX
    layout    KvCacheLayout, GroupLayout, Region
    stats     CacheStats, TierStats
    errors    OutOfPagesError, CacheStateError, DiskTierBusyError, InvariantError
    weights   weights_fingerprint (a ModelSpec.model_id from the weights)
    modules   kvtier.copy, kvtier.connector, kvtier.engine, kvtier.models, kvtier.metrics, kvtier.hf,
              kvtier.vllm: each imported on first use (``import kvtier`` then ``kvtier.hf.PrefixCache``
              works; transformers or vLLM are imported only then)
"""

import importlib

from kvtier import copy
from kvtier.cache import CacheState, KVCache
from kvtier.config import DEFAULT_SCOPE, CacheConfig, DiskTier, HostTier, PrimaryTier, ReuseScope
from kvtier.errors import CacheStateError, DiskTierBusyError, InvariantError, OutOfPagesError
from kvtier.layout import GroupLayout, KvCacheLayout, Region
from kvtier.manager import KVCacheManager
from kvtier.pages import BAD_PAGE_INDEX
from kvtier.spec import AttentionLayer, GroupKind, LayerGroup, ModelSpec, RecurrentLayer
from kvtier.stats import CacheStats, TierStats
from kvtier.weights import weights_fingerprint

__version__ = "0.1.0"

_LAZY_MODULES = frozenset({"connector", "engine", "hf", "metrics", "models", "vllm"})


def __getattr__(name: str) -> object:
    """A submodule of ``_LAZY_MODULES``, imported on first use."""
    if name in _LAZY_MODULES:
        return importlib.import_module(f"kvtier.{name}")
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")


__all__ = [
    "BAD_PAGE_INDEX",
    "DEFAULT_SCOPE",
    "AttentionLayer",
    "CacheConfig",
    "CacheState",
    "CacheStateError",
    "CacheStats",
    "DiskTier",
    "DiskTierBusyError",
    "GroupKind",
    "GroupLayout",
    "HostTier",
    "InvariantError",
    "KVCache",
    "KVCacheManager",
    "KvCacheLayout",
    "LayerGroup",
    "ModelSpec",
    "OutOfPagesError",
    "PrimaryTier",
    "RecurrentLayer",
    "Region",
    "ReuseScope",
    "TierStats",
    "copy",
    "weights_fingerprint",
]
