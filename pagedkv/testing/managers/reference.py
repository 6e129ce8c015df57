"""A reference hybrid cache manager: every layout of :data:`~.protocol.HYBRID_LAYOUTS`, a KV connector
and speculative drafts, in plain Python, written from the protocol alone.

It is the worked example of the grouped protocol for an engine's adapter, and the correct base the
planted faults of :mod:`pagedkv.tools.mutants.hybrid_managers` change one rule of (each fault must be
caught by the machine, :mod:`.machine`). It follows vLLM v1's hybrid design
(``kv_cache_coordinator.py``, ``single_type_kv_cache_manager.py``, ``block_pool.py``):

- one pool of block ids for every group, a reference count per block, a free queue whose released
  blocks keep their cached content (evictable, reused from the front, a request's blocks tail first);
- per group a block table and prefix-cache entries keyed by ``(group, chained hash of the tokens, their
  extra keys and the namespace)``: a block is cached when its tokens are committed (a Mamba block only
  where a step wrote the state at its last token);
- one hit length: the longest whole-block prefix (of every group's block size) that every group serves
  (full attention: every block; sliding window and chunked local: the blocks the first computed token
  reads and the last cached token's block; Mamba: the block holding the state at the hit's end); hit
  blocks are adopted (referenced) by the first ``reserve`` or ``load``;
- a group releases the blocks no later query of the request reads (:meth:`GroupSpec.first_read`);
- a connector: external tokens past the local hit (whole blocks, or any prefix from a P/D prefiller's store) load
  into blocks allocated by ``load``, cached only when ``load_done(ok=True)``; a free waits for a pending load and
  for ``store_done``;
- drafts get slots but are cached only once accepted (``drop`` truncates the request);
- beside a Mamba group, the blocks a step's reservation hands out afresh are named for the worker's zeroing
  (``take_zeroed``, as vLLM names them beside Mamba layers); a load's are not: its data lands there first.

Spec: ``pagedkv.testing.managers.reference`` (``cache_manager_layouts``: every hybrid layout).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence

from pagedkv.testing.managers.protocol import (HYBRID_LAYOUTS, LAYOUT_RETENTION, ExtraKey, ManagerCapabilities,
                                              ManagerConfig)


@dataclasses.dataclass
class _Request:
    keys: dict  # (group, block index) -> prefix-cache key of that block's tokens
    tokens: list
    extras: dict
    namespace: Hashable
    tables: list  # per group: block ids, -1 where released or not needed
    computed: int = 0  # tokens whose K/V is committed (or loaded)
    reserved: int = 0  # tokens with slots
    hit: int = 0
    pending_hits: list = dataclasses.field(default_factory=list)  # (group, block) to adopt
    states: set = dataclasses.field(default_factory=set)  # Mamba: token counts a step wrote the state after
    external: int = 0
    loading: bool = False
    freed: bool = False
    storing: bool = False


class ReferenceManager:
    """The reference grouped manager (see the module docstring).

    Raises:
        ValueError: ``config.groups`` empty (this manager serves hybrid layouts only).
    """

    def __init__(self, config: ManagerConfig) -> None:
        if not config.groups:
            raise ValueError("groups: the reference manager serves hybrid layouts (ManagerConfig.groups) only")
        self.groups = tuple(config.groups)
        self.align = math.lcm(*(g.block_size for g in self.groups))
        self.num_blocks = config.num_blocks
        self.refs = [0] * config.num_blocks
        self.free_queue: list[int] = list(range(config.num_blocks))  # front: handed out first
        self.block_key: dict[int, Hashable] = {}  # cached block -> its key
        self.index: dict[Hashable, dict[int, None]] = {}  # key -> its cached blocks (duplicates kept, as vLLM)
        self.requests: dict[int, _Request] = {}
        self.to_zero: list[int] = []  # blocks handed out afresh since the last take_zeroed()
        self.capabilities = ManagerCapabilities(
            block_size=min(g.block_size for g in self.groups), extra_keys=True, prompt_embeds=True, defers_commit=True,
            hit_promise=True, groups=self.groups, connector=config.connector,
            speculative=config.num_speculative_tokens > 0, admission="whole-hit", window_release=True,
            cached_prompt=True, zeroes_new_blocks=any(g.kind == "mamba" for g in self.groups),
            token_loads=config.connector and config.token_loads)

    # -- the pool -----------------------------------------------------------------------------------
    def _take(self) -> int:
        block = self.free_queue.pop(0)
        key = self.block_key.pop(block, None)
        if key is not None:  # evicted: handed out afresh
            del self.index[key][block]
            if not self.index[key]:
                del self.index[key]
        self.refs[block] = 1
        return block

    def _adopt(self, block: int) -> None:
        if self.refs[block] == 0:
            self.free_queue.remove(block)
        self.refs[block] += 1

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free_queue.append(block)

    def _cache(self, key: Hashable, block: int) -> None:
        if block not in self.block_key:
            self.index.setdefault(key, {})[block] = None
            self.block_key[block] = key

    # -- keys and hits ------------------------------------------------------------------------------
    def _key(self, req: _Request, g: int, i: int) -> Hashable:
        """Block ``i`` of group ``g``: the chained key of its tokens (and their extra keys)."""
        bs = self.groups[g].block_size
        if (g, i) not in req.keys:
            parent = self._key(req, g, i - 1) if i else ("ns", g, req.namespace)
            span = range(i * bs, (i + 1) * bs)
            req.keys[(g, i)] = hash((parent, tuple(req.tokens[p] for p in span),
                                     tuple(req.extras.get(p) for p in span)))
        return req.keys[(g, i)]

    def _needed(self, g: int, length: int) -> range:
        """Block indices group ``g`` must hold for a hit of ``length`` tokens."""
        group, bs = self.groups[g], self.groups[g].block_size
        first = 0 if group.kind == "full" else min(group.first_read(length), length - 1)
        return range(first // bs, length // bs)

    def _hit_blocks(self, req: _Request, length: int) -> list[list[int]] | None:
        out = []
        for g in range(len(self.groups)):
            blocks = [next(iter(self.index.get(self._key(req, g, i), {None: None}))) for i in self._needed(g, length)]
            if None in blocks:
                return None
            out.append(blocks)
        return out

    # -- the protocol -------------------------------------------------------------------------------
    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = (), *, num_stored: int = 0):
        req = _Request({}, list(token_ids), dict(extra_keys), namespace, [[] for _ in self.groups])
        cap = (len(token_ids) - 1) // self.align * self.align
        hit = next((n for n in range(cap, 0, -self.align) if self._hit_blocks(req, n) is not None), 0)
        for g, blocks in enumerate(self._hit_blocks(req, hit) if hit else [[] for _ in self.groups]):
            needed = self._needed(g, hit)
            req.tables[g] = [-1] * needed.start + blocks
            req.pending_hits += [(g, b) for b in blocks]
        req.hit = req.computed = req.reserved = hit
        # the connector offers the store's tokens past the hit up to the prompt less one token: whole blocks from an
        # offloading store, any prefix from a P/D prefiller's (token_loads)
        limit = len(token_ids) - 1 if self.capabilities.token_loads else cap
        req.external = max(0, min(num_stored, limit) - hit) if self.capabilities.connector else 0
        self.requests[request_id] = req
        return tuple(list(t) for t in req.tables), hit

    def _grow(self, req: _Request, start: int, end: int, keep_from, zero: bool = True) -> tuple | None:
        """Blocks for tokens ``start..end`` in every group (from ``keep_from(g)`` on; earlier ones ``-1``),
        the hit adopted first (so no allocation evicts it), then what no query reads released; slots per
        group, or ``None`` (nothing changed). ``zero``: name the new blocks for the worker's zeroing."""
        wanted = []
        for g, group in enumerate(self.groups):
            bs, table = group.block_size, req.tables[g]
            first = max(start, keep_from(g)) // bs
            wanted.append([i for i in range(first, (end - 1) // bs + 1) if i >= len(table) or table[i] < 0])
        free = len(self.free_queue) - sum(self.refs[b] == 0 for _, b in req.pending_hits)
        if sum(map(len, wanted)) > free:
            return None
        self._adopt_hits(req)
        self._allocate(req, wanted, zero)
        for g, group in enumerate(self.groups):
            if group.kind != "full":  # what no later query reads
                table = req.tables[g]
                for i in range(min(self._first_read(g, start), keep_from(g)) // group.block_size):
                    if table[i] >= 0:
                        self._release(table[i])
                        table[i] = -1
        return tuple([req.tables[g][p // g_.block_size] * g_.block_size + p % g_.block_size
                      if p // g_.block_size < len(req.tables[g]) and req.tables[g][p // g_.block_size] >= 0 else -1
                      for p in range(start, end)] for g, g_ in enumerate(self.groups))

    def _adopt_hits(self, req: _Request) -> None:
        for _, block in req.pending_hits:
            self._adopt(block)
        req.pending_hits = []

    def _allocate(self, req: _Request, wanted: list[list[int]], zero: bool) -> None:
        for g, table in enumerate(req.tables):
            for i in wanted[g]:
                table.extend([-1] * (i + 1 - len(table)))
                table[i] = self._take()
                if zero and self.capabilities.zeroes_new_blocks:
                    self.to_zero.append(table[i])

    def take_zeroed(self) -> list[int]:
        """The blocks handed out afresh for steps since the last call (``capabilities.zeroes_new_blocks``)."""
        taken, self.to_zero = self.to_zero, []
        return taken

    def _first_read(self, g: int, position: int) -> int:
        """The first token group ``g``'s query at ``position`` reads (what is before it is released)."""
        return self.groups[g].first_read(position)

    def reserve(self, request_id: int, token_ids: Sequence[int], num_draft: int = 0):
        req = self.requests[request_id]
        start, end = req.reserved, req.reserved + len(token_ids)
        slots = self._grow(req, start, end, lambda g: start)
        if slots is None:
            return None
        req.tokens[start:end] = list(token_ids)  # decode tokens and drafts extend the request
        req.reserved = end
        req.states |= set(range(end - num_draft, end + 1))  # the state after the last verified and each draft
        for g in range(len(self.groups)):
            for i in [i for (h, i) in req.keys if h == g and (i + 1) * self.groups[g].block_size > start]:
                del req.keys[(g, i)]  # tokens changed from ``start`` on
        return slots

    def commit(self, request_id: int, num_tokens: int) -> None:
        req = self.requests[request_id]
        req.computed = num_tokens
        for g, group in enumerate(self.groups):
            bs, table = group.block_size, req.tables[g]
            for i in range(num_tokens // bs):
                if i < len(table) and table[i] >= 0 and (group.kind != "mamba" or (i + 1) * bs in req.states):
                    self._cache(self._key(req, g, i), table[i])

    def drop(self, request_id: int, num_rejected: int) -> None:
        req = self.requests[request_id]
        end = req.reserved - num_rejected
        del req.tokens[end:]
        req.reserved = min(req.reserved, end)
        req.states = {s for s in req.states if s <= end}
        for key in [k for k in req.keys if (k[1] + 1) * self.groups[k[0]].block_size > end]:
            del req.keys[key]

    def num_external(self, request_id: int) -> int:
        return self.requests[request_id].external

    def load(self, request_id: int):
        req = self.requests[request_id]
        start, end = req.hit, req.hit + req.external
        slots = self._grow(req, start, end, lambda g: min(self.groups[g].first_read(end), end - 1)
                           if self.groups[g].kind != "full" else 0, zero=False)  # the load's data lands there
        if slots is not None:
            req.loading, req.reserved = True, end
        return slots

    def load_done(self, request_id: int, ok: bool) -> None:
        req = self.requests[request_id]
        req.loading = False
        end = req.hit + req.external
        if ok:
            req.states.add(end)
            self.commit(request_id, end)
        req.reserved = req.computed = end if ok else req.hit
        self._settle(request_id)

    def store_done(self, request_id: int) -> None:
        self.requests[request_id].storing = False
        self._settle(request_id)

    def free(self, request_id: int) -> None:
        req = self.requests[request_id]
        req.freed, req.storing = True, self.capabilities.connector
        self._settle(request_id)

    def _settle(self, request_id: int) -> None:
        req = self.requests[request_id]
        if req.freed and not (req.loading or req.storing):
            for table in req.tables if not req.pending_hits else ():  # a hit never adopted holds nothing
                for block in reversed(table):  # tail first
                    if block >= 0:
                        self._release(block)
            del self.requests[request_id]

    def block_table(self, request_id: int) -> tuple[list[int], ...]:
        return tuple(list(t) for t in self.requests[request_id].tables)

    def cached_prompt_tokens(self, request_id: int) -> int:
        """The least over the groups of the furthest end of a block of the request's table cached under the
        request's own key at that position (``protocol.CachedPromptCalls``; vLLM's ``estimate_cached_tokens``)."""
        req, counts = self.requests[request_id], []
        for g, group in enumerate(self.groups):
            bs, table = group.block_size, req.tables[g]
            counts.append(max([(i + 1) * bs for i, block in enumerate(table) if block >= 0
                               and (i + 1) * bs <= len(req.tokens)
                               and self.block_key.get(block) == self._key(req, g, i)] or [0]))
        return min(counts)

    def holds(self, request_id: int) -> bool:
        return request_id in self.requests

    def counts(self) -> tuple[int, int, int]:
        return len(self.free_queue), self.num_blocks - len(self.free_queue), self.num_blocks

    def reference_counts(self) -> dict[int, int]:
        return {b: n for b, n in enumerate(self.refs) if n}

    def self_check(self) -> None:
        assert len(set(self.free_queue)) == len(self.free_queue), "a block twice in the free queue"
        assert all(self.refs[b] == 0 for b in self.free_queue), "a referenced block in the free queue"
        assert sum(map(len, self.index.values())) == len(self.block_key), \
            "the prefix index and the cached blocks disagree"


def cache_manager(config: ManagerConfig) -> ReferenceManager:
    """The manager factory (``--pagedkv-impl pagedkv.testing.managers.reference``)."""
    return ReferenceManager(config)


#: Every hybrid layout (caching densely: the sparse-retention ones are the same groups under vLLM's policy).
cache_manager_layouts = tuple(name for name in HYBRID_LAYOUTS if name not in LAYOUT_RETENTION)
