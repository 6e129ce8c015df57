"""The cache-manager protocol: what the state machine asks of any engine's block manager.

A manager owns block ids, not K/V: it says which blocks a request's tokens live in and which slots its
next tokens go to; the machine writes the K/V there and reads it back. One request's life::

    block_ids, num_cached = m.admit(rid, prompt, namespace, extra_keys)   # prefix-cache lookup
    slots = m.reserve(rid, prompt[num_cached:num_cached + chunk])        # prefill chunk or decode token
    ... write K/V at ``slots`` in every layer ...
    m.commit(rid, num_tokens)                                            # those tokens' K/V is written
    m.free(rid)                                                          # finish, abort

Each engine's adapter maps these calls onto its own manager (vLLM's ``KVCacheManager``, SGLang's
``RadixCache`` + token-to-KV allocator, pagedkv's ``PagedKVCache``); :class:`ManagerCapabilities` says
what it has. A manager is handed to the machine by a factory ``make(config: ManagerConfig) -> CacheManager``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

#: An extra key at a token position: ``(position, key)``, e.g. a multimodal input's hash at its offset.
ExtraKey = tuple[int, Hashable]


@dataclasses.dataclass(frozen=True)
class ManagerCapabilities:
    """What a manager has and promises.

    Attributes:
        block_size: tokens per block (1 for a token-granular manager such as SGLang's page size 1).
        fork: ``fork(parent, child)`` shares the parent's blocks (copy-on-write on the partial block).
        window: ``window_left`` tokens a query attends back (sliding-window release of leading blocks);
            ``None``: full attention.
        namespaces: a namespace (cache salt, LoRA adapter) separates prefix-cache entries.
        extra_keys: extra keys at token positions (multimodal hashes) are part of a token's identity.
        preempt: ``preempt(rid)`` frees a request that is later re-admitted (recompute).
        evict: ``evict(num_blocks)`` drops unreferenced cached blocks on request.
        reset: ``reset()`` empties the prefix cache (no live request may read a dropped entry).
        eviction_order: the eviction order the manager promises (``"lru"``), or ``None`` (not promised,
            not judged).
        min_computed_on_full_hit: tokens a hit on the whole prompt still leaves to compute (1 in vLLM and
            SGLang: the last token's logits are needed).
        defers_commit: a reservation may stay unwritten (the request aborted between reserve and write)
            and only ``commit`` makes tokens hittable. ``False``: the manager caches at reserve time and
            relies on the engine writing every reserved slot in the same step (vLLM v1), so the machine
            writes each reservation at once.
        owns_pools: the manager holds the K/V pools itself (``kv_pools(layer)``), because it copies K/V
            (copy-on-write); otherwise the machine allocates pools of ``total`` blocks.
    """

    block_size: int
    fork: bool = False
    window: int | None = None
    namespaces: bool = True
    extra_keys: bool = False
    preempt: bool = True
    evict: bool = False
    reset: bool = False
    eviction_order: str | None = None
    min_computed_on_full_hit: int = 1
    defers_commit: bool = False
    owns_pools: bool = False

    def summary(self) -> str:
        """One line: the capabilities the machine judges."""
        have = [n for n in ("fork", "namespaces", "extra_keys", "preempt", "evict", "reset", "defers_commit")
                if getattr(self, n)]
        return (f"block_size {self.block_size}, window {self.window}, {' '.join(have) or 'no options'}, "
                f"eviction order {self.eviction_order or 'not promised'}, a full hit computes "
                f">= {self.min_computed_on_full_hit} token(s)")


@dataclasses.dataclass(frozen=True)
class ManagerConfig:
    """What the machine asks a factory for: ``num_blocks`` blocks of ``block_size`` tokens (a hint: a
    token-granular manager may use block size 1), ``window_left`` (or ``None``), prefix caching on, and
    the pools' geometry when the manager owns them (``num_layers`` x ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` float32)."""

    num_blocks: int
    block_size: int
    window_left: int | None = None
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 2


@runtime_checkable
class CacheManager(Protocol):
    """The calls every manager answers; optional ones are listed in :class:`ManagerCapabilities`.

    Request ids are ints, token ids ints, namespaces ``None``/str/int/tuple. Slots are
    ``block_id * block_size + offset``. Refusal (out of blocks) is ``None`` and changes nothing.
    """

    capabilities: ManagerCapabilities

    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = ()) -> tuple[list[int], int] | None:
        """Start a request with its prompt: ``(block_ids, num_cached_tokens)`` of the cached prefix it
        reuses (``num_cached_tokens`` leading tokens need no compute), or ``None`` when refused."""

    def reserve(self, request_id: int, token_ids: Sequence[int]) -> list[int] | None:
        """Slots (``int`` list, one per token) for the request's next ``len(token_ids)`` tokens; tokens
        past those admitted extend the request (decode). ``None``: out of blocks, nothing changed."""

    def commit(self, request_id: int, num_tokens: int) -> None:
        """The K/V of the request's first ``num_tokens`` tokens is written in every layer."""

    def free(self, request_id: int) -> None:
        """Release the request (finish or abort): it holds nothing afterwards."""

    def block_table(self, request_id: int) -> list[int]:
        """The request's block ids in order; ``-1`` where the window released a block."""

    def holds(self, request_id: int) -> bool:
        """Whether the manager still keeps any state of the request."""

    def counts(self) -> tuple[int, int, int] | None:
        """``(free, used, total)`` blocks, or ``None`` when not exposed. Cached blocks nobody references
        count as free (they are evictable)."""

    def self_check(self) -> None:
        """Check the manager's own exposed state (reference counts, free queue, hash index) against what
        it reports; raise ``AssertionError`` naming the inconsistency. A no-op where nothing is exposed."""


def manager_factory(candidate) -> object | None:
    """The manager factory a candidate provides (its ``cache_manager`` attribute), or ``None``."""
    factory = getattr(candidate, "cache_manager", None)
    return factory if callable(factory) else None
