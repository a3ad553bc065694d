"""``kvtier.hf``: prefix reuse across ``generate()`` calls for Hugging Face transformers models.

``PrefixCache(model, cache_config, scope=...)`` wraps a decoder-only model whose cache layers are
full attention, sliding-window attention, linear attention (hybrid models) or full attention and
a state space model in one layer (Falcon-H1, Zamba2), keys and values of one shape or two
(multi-head latent attention: DeepSeek-V3), and serves its ``generate()`` calls from
kvtier's tiers: the longest cached prefix of each row is loaded instead of recomputed, and every
computed block is saved for the next call (or the next process, through a disk tier). Importing
``kvtier`` does not import transformers; using ``kvtier.hf.PrefixCache`` does. The data path
(``batch_rows``, ``page_io``) does not, and is tested without it.

    model layers   kvtier/hf/model_layers.py  the model's cache layers as a ModelSpec; refusals
    batch rows     kvtier/hf/batch_rows.py    left padding; how many columns each row reuses
    page copies    kvtier/hf/page_io.py       batched gather/scatter between pages and dense tensors
    hf cache       kvtier/hf/hf_cache.py      the DynamicCache handed to generate, what it records
    load / save    kvtier/hf/prefix_load.py, prefix_save.py
    prefill rate   kvtier/hf/prefill_rate.py  each call's prompt forward timed: load or recompute
    token bound    kvtier/hf/token_bound.py   where images, token types or own positions reach a row's KV
    window check   kvtier/hf/window_check.py  a cache window the attention does not apply (long calls plain)
    padding probe  kvtier/hf/padding.py       whether a model computes a left-padded row as kvtier serves it
    call state     kvtier/hf/call_state.py    state a model keeps between calls, which a reusing call must not inherit
    numerics       kvtier/hf/numerics.py      autocast, matmul precision and the like: part of a call's scope
    training noise kvtier/hf/training_noise.py whether the forward is random now (dropout in training mode)
    adapters       kvtier/hf/adapters.py      the PEFT adapters active in a call: part of its scope
    forward hooks  kvtier/hf/forward_hooks.py a user's hook on the model (calls plain while one is)
    rotary tables  kvtier/hf/rotary_tables.py tables built otherwise than the configuration now says
    the adapter    kvtier/hf/prefix_cache.py  PrefixCache (weights changed in place after construction
                                              are refused: kvtier.weights.WeightWatch)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.hf.prefix_cache import PrefixCache

__all__ = ["PrefixCache"]


def __getattr__(name: str):
    if name == "PrefixCache":
        from kvtier.hf.prefix_cache import PrefixCache

        return PrefixCache
    raise AttributeError(f"module 'kvtier.hf' has no attribute {name!r}")
