"""Reuse: naming blocks of tokens and finding the longest reusable prefix of a prompt.

Modules, bottom up:

    tokens       token arrays (``array('Q')``) and their little-endian bytes
    block_keys   chained block keys: a scope's root key, a block's key, a prompt's chain of keys
    tree         the radix tree of published blocks, one root per reuse scope (dormant roots for
                 restored blocks whose scope was not used yet)
    matching     the longest prefix every layer group can reuse (``find_reuse``), and the pages a
                 match uses
    reuse_points the reuse points a match offers below its own, and the bytes each loads per tier

The token and key helpers are public: the connectors and the adapters name blocks with them,
exactly as the tree does.
"""

from kvtier.reuse.block_keys import block_chain, block_key, scope_key
from kvtier.reuse.tokens import TOKEN_BYTES, as_token_array, encode_tokens

__all__ = ["TOKEN_BYTES", "as_token_array", "block_chain", "block_key", "encode_tokens", "scope_key"]
