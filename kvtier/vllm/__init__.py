"""``kvtier.vllm``: an out-of-tree KV connector that gives vLLM kvtier's host and disk tiers.

One line of vLLM configuration::

    KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"host_bytes": 64 << 30, "disk_bytes": 1 << 40,
                                                "disk_path": "/nvme/kv", "store_url": None})

Modules: ``connector`` (the vLLM class), ``scheduler`` and ``lease`` (the index: offers, leases,
jobs), ``worker`` (runs jobs on vLLM's caches), ``kv_groups`` (vLLM's KV cache groups as a kvtier
model), ``meta`` (what the halves exchange), ``settings`` (extra config, model identity), ``file_stamp``
(whether the weights at a path are still the ones seen before), and the
parts that import no vLLM: ``transfer`` (the data path: which block goes to which page, the
copies), ``host_pool`` (the host pages both halves share), ``store_tier`` (the shared store below the
disk tier) and ``paged_views`` (vLLM's cache layouts, for tests and ``kvtier bench vllm``).

Importing this package imports vLLM (0.33 or 0.34; the connector warns of another release). Where
vLLM is not installed the package still imports, so that ``kvtier.vllm.transfer`` runs on its own,
and ``KVTierConnector`` raises an ``ImportError`` that says what to install.
"""

from __future__ import annotations

try:
    from kvtier.vllm.connector import KVTierConnector
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.split(".")[0] != "vllm":
        raise
    _MISSING = exc

    def __getattr__(name: str) -> object:
        if name == "KVTierConnector":
            raise ImportError(
                "kvtier.vllm.KVTierConnector needs vLLM 0.33 or 0.34: pip install 'kvtier[vllm]'"
            ) from _MISSING
        raise AttributeError(f"module 'kvtier.vllm' has no attribute {name!r}")


__all__ = ["KVTierConnector"]
