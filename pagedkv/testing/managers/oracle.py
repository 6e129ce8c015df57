"""The content oracle: the K/V every token must read back, whatever the manager did with its blocks.

A token's identity is its namespace, its whole prefix (token ids and the extra keys at their positions)
and its position; :func:`token_identity` chains it position by position (a 64-bit integer). K and V of a
token in a layer are a deterministic function of that identity and the layer, small integers exact in
float32, so a wrong prefix hit, a stale hash, a block reused while still read, a lost write or a bad
eviction reads other bits than :func:`expected_kv` gives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable

import torch

_MASK = (1 << 64) - 1


def stable_hash(value: Hashable) -> int:
    """A process-independent 64-bit hash of a namespace or extra key (``hash`` of a str is salted)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little")


def token_identity(previous: int, token_id: int, extra_key: Hashable = None) -> int:
    """The identity of the next token after a prefix whose last identity is ``previous`` (for the
    first token: ``stable_hash(namespace)``). Tuples of ints hash the same in every process."""
    extra = 0 if extra_key is None else stable_hash(extra_key)
    return hash((previous, token_id, extra)) & _MASK


def expected_kv(identities: list[int], layer: int, num_kv_heads: int,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, ``float32 [len(identities), num_kv_heads, head_dim]`` each, of tokens with these
    identities in ``layer``: 16-bit fields of a per-layer hash (exact in float32)."""
    n, width = len(identities), num_kv_heads * head_dim
    rows = []
    for ident in identities:
        h = hash((ident, layer)) & _MASK
        h2 = hash((h, 1)) & _MASK
        bits = [(h >> (16 * i)) & 0xFFFF for i in range(4)] + [(h2 >> (16 * i)) & 0xFFFF for i in range(4)]
        rows.append([bits[i % 8] + 65536 * (i // 8) for i in range(2 * width)])
    kv = torch.tensor(rows, dtype=torch.float32).reshape(n, 2, num_kv_heads, head_dim)
    return kv[:, 0], kv[:, 1]
