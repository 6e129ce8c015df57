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
        eviction_order: the eviction order the manager promises, or ``None`` (not promised). ``"lru"`` is
            judged: a block handed out afresh is the front of a free queue where released blocks with no
            cached content are reused first and cached ones last, in release order, a request's blocks
            released tail first (vLLM's ``FreeKVCacheBlockQueue``). Other values are printed, not judged.
        hit_promise: what was committed and not evicted hits: a cached full block stays cached until its
            block is handed out again (or ``evict`` names it, or ``reset`` drops everything), so an admit
            must hit at least every such leading block, up to ``len(prompt) - min_computed_on_full_hit``.
        async_steps: the next step may be reserved before the previous one's writes complete (vLLM's
            async scheduling): ``commit(rid, n)`` says the step writing tokens below ``n`` completed, and
            blocks those in-flight steps read or write (the attention window behind each in-flight
            token) must not be handed to anyone meanwhile, not even after ``free(rid)``: a free with steps
            in flight is deferred until their ``commit`` (which the machine still calls after ``free``).
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
    hit_promise: bool = False
    async_steps: bool = False
    min_computed_on_full_hit: int = 1
    defers_commit: bool = False
    owns_pools: bool = False

    def summary(self) -> str:
        """One line: the capabilities the machine judges."""
        have = [n for n in ("fork", "namespaces", "extra_keys", "preempt", "evict", "reset", "defers_commit",
                            "hit_promise", "async_steps")
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

    Request ids are ints, token ids ints, namespaces ``None``, a str (a cache salt) or tagged parts
    (:func:`namespace_parts`); an extra key ``(position, ("mm", identifier, index))`` is token ``index`` of
    a multimodal input (its placeholder run starts where ``index`` is 0). Slots are
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


def namespace_parts(namespace: Hashable) -> tuple[str | None, tuple[str, str] | None]:
    """``(cache_salt, lora)`` of a namespace, ``lora`` as ``(name, path)``: ``None``; a str (a cache salt);
    ``("lora", n)`` (adapter ``lora{n}`` at ``/lora``); or a tuple of tagged parts ``(("salt", s),)``,
    ``(("lora", name, path),)`` or both. Two namespaces are one only when equal: a salt spelled like a
    LoRA name, or one LoRA name at two paths, are different namespaces.

    Raises:
        ValueError: a namespace of another shape.
    """
    if namespace is None:
        return None, None
    if isinstance(namespace, str):
        return namespace, None
    if (isinstance(namespace, tuple) and len(namespace) == 2 and namespace[0] == "lora"
            and isinstance(namespace[1], int)):
        return None, (f"lora{namespace[1]}", "/lora")
    salt = lora = None
    for part in namespace if isinstance(namespace, tuple) else ():
        if isinstance(part, tuple) and len(part) == 2 and part[0] == "salt":
            salt = str(part[1])
        elif isinstance(part, tuple) and len(part) == 3 and part[0] == "lora":
            lora = (str(part[1]), str(part[2]))
        else:
            raise ValueError(f"namespace {namespace!r}: parts must be ('salt', s) or ('lora', name, path)")
    if salt is None and lora is None:
        raise ValueError(f"namespace {namespace!r}: no salt and no LoRA adapter")
    return salt, lora


def multimodal_spans(extra_keys: Sequence[ExtraKey]) -> list[tuple[str, int, int]]:
    """``(identifier, offset, length)`` of each multimodal input in ``extra_keys`` (``(position, ("mm",
    identifier, index))`` entries, index 0 at its offset); other keys are one-token inputs at their
    position (``str(key)`` their identifier)."""
    spans: list[list] = []
    for pos, key in sorted(extra_keys, key=lambda e: e[0]):
        if isinstance(key, tuple) and len(key) == 3 and key[0] == "mm":
            if key[2] > 0 and spans and spans[-1][0] == str(key[1]) and spans[-1][1] + spans[-1][2] == pos:
                spans[-1][2] += 1
                continue
            spans.append([str(key[1]), pos, 1])
        else:
            spans.append([str(key), pos, 1])
    return [tuple(s) for s in spans]


def manager_factory(candidate) -> object | None:
    """The manager factory a candidate provides (its ``cache_manager`` attribute), or ``None``."""
    factory = getattr(candidate, "cache_manager", None)
    return factory if callable(factory) else None
