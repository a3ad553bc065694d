"""Block keys: the chained names of blocks of tokens, the same in every process and machine.

A scope's root has a key (``scope_key``) derived from the scope and a namespace (the model);
a block's key is its tokens' bytes hashed under its parent's key (``block_key``), so a key names
the whole prefix up to its block. The reuse tree, the disk index and the connectors' stores all
name blocks this way; ``block_chain`` gives the keys of a prompt's full blocks at once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvtier.config import ReuseScope
from kvtier.reuse.tokens import TOKEN_BYTES, as_token_array, encode_tokens


def scope_key(scope: ReuseScope, namespace: bytes = b"") -> bytes:
    """The key of a scope's root: every block key of the scope chains from it.

    ``namespace`` names the model (its ``ModelSpec.fingerprint()``, weights included), so the
    same tokens under two models never share a key.
    """
    return hashlib.blake2b(namespace + b"|" + scope.encode(), digest_size=16, person=b"kvtier-root-v2").digest()


def block_key(parent_key: bytes, block_tokens: bytes) -> bytes:
    """The chained key of a block: its tokens hashed under its parent's key."""
    return hashlib.blake2b(block_tokens, digest_size=16, key=parent_key).digest()


def block_chain(
    tokens: Sequence[int], scope: ReuseScope, tokens_per_block: int, count: int, namespace: bytes = b""
) -> list[bytes]:
    """The chained keys of the first ``count`` full blocks of ``tokens`` under ``scope``'s root."""
    return chain_from(scope_key(scope, namespace), tokens[: count * tokens_per_block], tokens_per_block)


def chain_from(parent_key: bytes, tokens: Sequence[int], tokens_per_block: int) -> list[bytes]:
    """The chained keys of the full blocks of ``tokens``, the first block's parent ``parent_key``
    (the tokens converted once, not per block)."""
    data = encode_tokens(as_token_array(tokens))
    step = tokens_per_block * TOKEN_BYTES
    keys, parent = [], parent_key
    for b in range(len(data) // step):
        parent = block_key(parent, data[b * step : (b + 1) * step])
        keys.append(parent)
    return keys
