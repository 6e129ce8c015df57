"""A shadow model of the paged KV cache: drive a real cache through it and check it after every op.

:class:`CacheModel` wraps a :class:`~pagedkv.cache.paged_cache.PagedKVCache` (or a class with its methods) and
replays an engine's calls on it (add with a prefix lookup, reserve, write + commit, a partial or
failed write, fork, free) while keeping its own account of what must be true:

- every live sequence holds its tokens and, in every layer, reads bit for bit the K/V written for
  the tokens it has committed (:func:`expected_kv`: values depend on the whole prefix, the layer and
  the namespace, as a model's K/V do);
- no block the prefix cache holds was never written: its token prefix (under its ``cache_key``) is one
  the model wrote, and the block stores exactly that prefix's K/V in every layer; a prefix hit
  serves only such blocks, so it returns the K/V written for those tokens;
- hits are *found*: a lookup of a live sequence's tokens returns at least the leading run of its
  table that is cached, and a lookup of a cached block's prefix reaches it;
- sharing is *kept*: an append never changes the table entries before its last one, never copies a
  full last block, copies a partial last block only when it is shared (and then exactly once), and
  hands out slots only in blocks no other live sequence holds;
- eviction order: released cached blocks queue least recently released first and, among blocks
  released together, deepest first; allocation evicts from the head of that queue only;
- with a sliding window (``config.window_left``): an append releases only leading entries no later
  query reads (``-1`` in the table, no more than :func:`pagedkv.cache.window.releasable_blocks` of the
  committed count), changes no other entry, and queues the released blocks it held alone that cache
  a prefix (last first, as a ``free`` does); a prefix hit takes no reference on the blocks before its
  window (they keep their place in the queue); reads start at the first held position.

The kit's scenario runner (:func:`.scenarios.run_scenario`), the state machine and the
cache-mutant tests all use it. Every failed check raises :class:`ModelMismatch` (an ``AssertionError``).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from collections.abc import Hashable
from typing import Any

import torch

from pagedkv.testing.cases.case import Geometry, token_kv
from pagedkv.testing.compare import bits
from pagedkv.cache.window import NULL_BLOCK, releasable_blocks


class ModelMismatch(AssertionError):
    """The cache disagrees with the shadow model; the message names the sequence, block and check.
    ``where`` locates it when it can: ``{"seq", "position", "block", "slot"}`` (a subset)."""

    def __init__(self, message: str, where: dict | None = None):
        super().__init__(message)
        self.where = where or {}


def salt_of(cache_key: Hashable) -> int:
    """A stable int for a namespace (0 for ``None``), mixed into the test values of its sequences."""
    return 0 if cache_key is None else zlib.crc32(repr(cache_key).encode()) % 1_000_003 + 1


def expected_kv(geometry: Geometry, tokens, start: int, seed: int, *, layer: int = 0,
                cache_key: Hashable = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of ``tokens[start:]`` in ``layer`` under ``cache_key``: ``([n, H, D], [n, H, D])`` on the CPU."""
    tokens = list(tokens)
    return token_kv(geometry, tokens[start:], start, seed, prefix=tokens[:start], layer=layer,
                    salt=salt_of(cache_key))


@dataclass
class SeqModel:
    """What the model knows of one live sequence."""

    tokens: list[int]
    written: int  # leading tokens whose K/V is written (and committed)
    cache_key: Hashable = None
    pending_slots: Any = field(default=None, repr=False)


class CacheModel:
    """Drives ``cache`` like an engine and checks it against a shadow model (see the module docstring).

    Args:
        cache: a fresh cache (no sequences yet).
        geometry: the pool geometry the values are made for.
        seed: value seed.
        num_layers: layers written and checked (the cache's ``config.num_layers``).
        write_kv: ``write_kv(k_cache, v_cache, key, value, slot_mapping)`` (a backend's).
        gather: ``gather(cache, block_table, seq_len)`` used to read sequences back (a backend's).
        attention: the backend's ``paged_attention`` (read through where it has no ``gather``).
        latent: the backend reads V from K's storage (``shared_kv_storage``): its ``v_cache`` is K's first
            columns, and so is the V its output is judged against.
    """

    def __init__(self, cache, geometry: Geometry, seed: int, num_layers: int, write_kv, gather,
                 attention=None, latent: bool = False) -> None:
        self.latent = latent
        self.cache, self.alloc = cache, cache.allocator
        self.geometry, self.seed, self.num_layers = geometry, seed, num_layers
        self.bs = geometry.block_size
        self.write_kv, self.gather = write_kv, gather or _pool_read
        self.attention = attention  # a backend without gather is read through its paged_attention
        self.seqs: dict[int, SeqModel] = {}
        self.written_prefixes: set[tuple[Hashable, tuple[int, ...]]] = set()
        self.lru: list[int] = []  # released cached blocks, next evicted first
        self.device = cache.config.device
        self.window = getattr(cache, "window_left", None)  # None: nothing is released early

    # -- values --------------------------------------------------------------------------------
    def kv(self, seq: SeqModel | tuple, start: int, end: int, layer: int):
        tokens, key = (seq.tokens, seq.cache_key) if isinstance(seq, SeqModel) else seq
        return expected_kv(self.geometry, list(tokens)[:end], start, self.seed, layer=layer, cache_key=key)

    def first_held(self, seq_id: int) -> int:
        """The first position whose block ``seq_id`` still holds (``0`` without a window)."""
        return self.cache.first_held_position(seq_id) if self.window is not None else 0

    def held(self, seq_id: int) -> list[int]:
        """The blocks ``seq_id``'s table holds (its entries that the window did not release)."""
        return [b for b in self.cache.block_table(seq_id).tolist() if b != NULL_BLOCK]

    # -- operations -----------------------------------------------------------------------------
    def add(self, seq_id: int, tokens, cache_key: Hashable = None) -> int:
        """``add_sequence``: the hit must be whole written blocks holding the written K/V."""
        tokens = list(tokens)
        cached = self.cache.add_sequence(seq_id, tokens, cache_key=cache_key)
        hit = self.cache.block_table(seq_id).tolist()
        if cached % self.bs or len(hit) * self.bs != cached or cached > max(len(tokens) - 1, 0):
            raise ModelMismatch(f"add of sequence {seq_id}: {cached} cached tokens over {len(hit)} blocks "
                                f"(block_size {self.bs}, prompt of {len(tokens)})")
        skip = self.first_held(seq_id) // self.bs
        if skip > releasable_blocks(cached, self.window, self.bs, keep_last_full=True) or \
                any(b != NULL_BLOCK for b in hit[:skip]) or any(b < 0 for b in hit[skip:]):
            raise ModelMismatch(f"add of sequence {seq_id}: table {hit} after a hit of {cached} tokens (window_left "
                                f"{self.window}): -1 must stand exactly before the first query's window")
        self.lru = [b for b in self.lru if b not in hit]  # revived (blocks before the window stay queued)
        seq = SeqModel(tokens[:cached], cached, cache_key)
        for i in range(len(hit)):
            prefix = tuple(tokens[:(i + 1) * self.bs])
            if (cache_key, prefix) not in self.written_prefixes:
                raise ModelMismatch(f"add of sequence {seq_id}: a prefix-cache hit on block {hit[i]} (block {i} of "
                                    f"the prompt, cache_key {cache_key!r}) whose K/V was never written")
        self.seqs[seq_id] = seq
        self._check_reads(seq_id, 0, cached, "a prefix-cache hit")
        return cached

    def reserve(self, seq_id: int, tokens) -> torch.Tensor:
        """``append`` without a write: checks that sharing is kept and the slots are the sequence's own."""
        tokens = list(tokens)
        seq, bs = self.seqs[seq_id], self.bs
        before = self.cache.block_table(seq_id).tolist()
        n0, r0 = len(seq.tokens), self.first_held(seq_id) // bs
        last_shared = bool(before) and before[-1] != NULL_BLOCK and self.alloc.ref_count(before[-1]) > 1
        alone = {b for b in before if b != NULL_BLOCK and self.alloc.ref_count(b) == 1}
        entries = set(self.alloc.cached_entries())
        copies = self.cache.num_cow_copies
        slots = self.cache.append(seq_id, tokens)  # OutOfBlocksError: the caller checks nothing changed
        r1 = self.first_held(seq_id) // bs
        if r1 > releasable_blocks(seq.written, self.window, bs):
            raise ModelMismatch(f"an append to sequence {seq_id} released its first {r1} blocks; with {seq.written} "
                                f"tokens committed and window_left {self.window} a later query may read block "
                                f"{releasable_blocks(seq.written, self.window, bs)}", {"seq": seq_id})
        self.lru += [b for b in reversed(before[r0:r1]) if b in alone and b in entries]  # a release queues them
        others = {b: s for s in self.seqs if s != seq_id for b in self.held(s)}
        for j, slot in enumerate(slots.tolist()):
            if slot // bs in others:
                raise ModelMismatch(f"append to sequence {seq_id} hands out slot {slot} (position {n0 + j}) in block "
                                    f"{slot // bs}, which live sequence {others[slot // bs]} also holds: a shared "
                                    f"block written without copy-on-write",
                                    {"seq": seq_id, "position": n0 + j, "block": slot // bs, "slot": slot})
        after = self.cache.block_table(seq_id).tolist()
        partial = n0 % bs != 0
        cow = bool(tokens) and partial and last_shared
        keep = len(before) - 1 if cow else len(before)
        if after[:keep] != [NULL_BLOCK if r0 <= i < r1 else b for i, b in enumerate(before[:keep])]:
            raise ModelMismatch(f"an append of {len(tokens)} tokens to sequence {seq_id} changed table entries it "
                                f"did not need to: {before} -> {after}")
        if cow and after[keep] == before[keep]:
            raise ModelMismatch(f"an append to sequence {seq_id} wrote into its shared partial last block "
                                f"{before[keep]} without copying it")
        if self.cache.num_cow_copies != copies + cow:
            raise ModelMismatch(f"an append to sequence {seq_id} (starting at {n0}, last block "
                                f"{'shared' if last_shared else 'own'}, {'partial' if partial else 'full'}) made "
                                f"{self.cache.num_cow_copies - copies} copies, expected {int(cow)}")
        seq.tokens += tokens
        return slots

    def write(self, seq_id: int, n: int | None = None) -> None:
        """Write the next ``n`` reserved tokens (all when ``None``) in every layer, then commit them."""
        seq = self.seqs[seq_id]
        start = seq.written
        end = len(seq.tokens) if n is None else min(len(seq.tokens), start + n)
        if end > start:
            slots = self.cache.slot_mapping(seq_id, start, end)
            for layer in range(self.num_layers):
                k, v = self.kv(seq, start, end, layer)
                self.write_kv(self.cache.k_cache(layer), self.cache.v_cache(layer), k.to(self.device),
                              v.to(self.device), slots)
        self.cache.mark_written(seq_id, end)
        seq.written = end
        for i in range(end // self.bs):
            self.written_prefixes.add((seq.cache_key, tuple(seq.tokens[:(i + 1) * self.bs])))

    def failed_write(self, seq_id: int) -> None:
        """A write that raises (K/V of a wrong dtype): nothing is written or committed."""
        seq = self.seqs[seq_id]
        if seq.written == len(seq.tokens):
            return
        slots = self.cache.slot_mapping(seq_id, seq.written, len(seq.tokens))
        k, v = self.kv(seq, seq.written, len(seq.tokens), 0)
        try:
            self.write_kv(self.cache.k_cache(0), self.cache.v_cache(0), k.to(torch.float64).to(self.device),
                          v.to(torch.float64).to(self.device), slots)
        except (TypeError, ValueError):
            return
        if self.geometry.torch_dtype != torch.float64:
            raise ModelMismatch(f"write_kv accepted float64 K/V for a {self.geometry.dtype} pool")

    def fork(self, parent: int, child: int) -> None:
        self.cache.fork(parent, child)
        p = self.seqs[parent]
        self.seqs[child] = SeqModel(list(p.tokens), p.written, p.cache_key)

    def free(self, seq_id: int) -> None:
        """Release (finish, preempt, abort): cached blocks whose last reference goes queue deepest first."""
        table = self.held(seq_id)
        entries = self.alloc.cached_entries()
        released = [b for b in reversed(table) if self.alloc.ref_count(b) == 1 and b in entries]
        self.cache.free(seq_id)
        del self.seqs[seq_id]
        self.lru += released

    # -- checks ---------------------------------------------------------------------------------
    def observe_evictions(self, what: str) -> None:
        """After any op: the blocks evicted are the head of the model's queue, and the evictable blocks
        are exactly the rest of it."""
        entries = self.alloc.cached_entries()
        evictable = {b for b in entries if self.alloc.ref_count(b) == 0}
        gone = [b for b in self.lru if b not in evictable]
        if self.lru[:len(gone)] != gone:
            raise ModelMismatch(f"{what}: evicted {gone} out of order: the least recently released (deepest first) "
                                f"were {self.lru[:len(gone)]} (queue {self.lru})")
        lost = [b for b in gone if self.alloc.ref_count(b) == 0]
        if lost:
            raise ModelMismatch(f"{what}: released cached blocks {lost} left the prefix cache without being "
                                f"evicted for an allocation")
        self.lru = self.lru[len(gone):]
        if set(self.lru) != evictable:
            raise ModelMismatch(f"{what}: evictable blocks {sorted(evictable)}, the model expects {sorted(self.lru)}")

    def _check_reads(self, seq_id: int, start: int, end: int, what: str) -> None:
        """Positions ``start .. end - 1`` (from the first held one) read the K/V written for them."""
        first = self.first_held(seq_id)
        start = max(start, first)
        if end <= start:
            return
        seq = self.seqs[seq_id]
        table = self.cache.block_table(seq_id)[first // self.bs:]
        for layer in range(self.num_layers):
            k_exp, v_exp = self.kv(seq, first, end, layer)
            for pool, exp, name in ((self.cache.k_cache(layer), k_exp, "K"), (self.cache.v_cache(layer), v_exp, "V")):
                got = self.gather(pool, table, end - first).cpu()
                a, e = bits(got[start - first:]), bits(exp[start - first:])
                if got.shape != exp.shape or not torch.equal(a, e):
                    p = start + int((a != e).flatten(1).any(1).nonzero()[0]) if got.shape == exp.shape else -1
                    block = int(table[(p - first) // self.bs]) if p >= 0 else -1
                    raise ModelMismatch(f"{what}: sequence {seq_id} reads a wrong {name} in layer {layer} at position "
                                        f"{p} (block {block}) of {end} written tokens",
                                        {"seq": seq_id, "position": p, "block": block} if p >= 0 else {"seq": seq_id})

    def _check_attention(self, live: list, what: str) -> None:
        """The backend's ``paged_attention`` over the sequences ``live`` (``[(seq_id, SeqModel)]``), each a
        decode row after its last written token (it reads every key and value the sequence holds), equals
        the fp64 reference over the K/V the model expects, in every layer. One batch a layer, one row a
        sequence: an interpreted kernel pays per launch and per row (a decode kernel runs a prefill's
        tokens as rows), and a wrong key or value anywhere moves the row's output."""
        from pagedkv.attention.dense import reference_attention
        from pagedkv.testing.compare import assert_attention_close

        g, ids = self.geometry, [seq_id for seq_id, _ in live]
        ends = [seq.written for _, seq in live]
        queries = torch.randn(len(live), g.num_q_heads, g.head_dim, generator=torch.Generator().manual_seed(
            self.seed * 7919 + sum(ids) * 31 + sum(ends))).to(g.torch_dtype)
        tables = self.cache.block_tables(ids).to(self.device)
        lens = torch.tensor(ends, dtype=torch.int32, device=self.device)
        qsl = torch.arange(len(live) + 1, dtype=torch.int32, device=self.device)
        for layer in range(self.num_layers):
            k_cache, v_cache = latent_pools(self.cache.k_cache(layer), self.cache.v_cache(layer), self.latent)
            out = self.attention(queries.to(self.device), k_cache, v_cache, tables, lens, qsl).cpu()
            for i, ((seq_id, seq), end) in enumerate(zip(live, ends)):
                k_exp, v_exp = self.kv(seq, 0, end, layer)
                if self.latent:
                    v_exp = k_exp[..., :v_cache.shape[-1]]
                try:
                    expected = reference_attention(queries[i:i + 1], [k_exp], [v_exp], [0, 1])
                    assert_attention_close(out[i:i + 1], expected)
                except AssertionError as exc:
                    table = self.cache.block_table(seq_id).tolist()
                    raise ModelMismatch(f"{what}: paged_attention over sequence {seq_id}'s blocks {table} (layer "
                                        f"{layer}, {end} written tokens) differs from attention over its own "
                                        f"tokens' K/V: {str(exc).splitlines()[0]}", {"seq": seq_id}) from None

    def check(self, what: str = "after an op") -> None:
        """Every property of the module docstring, now."""
        self.cache.check_invariants()
        bs = self.bs
        for seq_id, seq in self.seqs.items():
            if self.cache.seq_len(seq_id) != len(seq.tokens) or self.cache.num_written(seq_id) != seq.written:
                raise ModelMismatch(f"{what}: sequence {seq_id} holds {self.cache.seq_len(seq_id)} tokens, "
                                    f"{self.cache.num_written(seq_id)} committed; the model: {len(seq.tokens)}, "
                                    f"{seq.written}")
            self._check_reads(seq_id, 0, seq.written, what)
        live = [(seq_id, seq) for seq_id, seq in self.seqs.items() if seq.written]
        if self.attention is not None and live:
            self._check_attention(live, what)
        entries = self.alloc.cached_entries()
        for block, entry in entries.items():
            prefix = self.alloc.cached_prefix(block)
            if prefix is None:
                continue  # a parent was evicted: no lookup reaches this block
            if (entry.cache_key, prefix) not in self.written_prefixes:
                raise ModelMismatch(f"{what}: block {block} caches a prefix of {len(prefix)} tokens (cache_key "
                                    f"{entry.cache_key!r}) whose K/V was never written")
            for layer in range(self.num_layers):
                k, v = self.kv((prefix, entry.cache_key), len(prefix) - bs, len(prefix), layer)
                if not (torch.equal(bits(self.cache.k_cache(layer)[block].cpu()), bits(k))
                        and torch.equal(bits(self.cache.v_cache(layer)[block].cpu()), bits(v))):
                    raise ModelMismatch(f"{what}: cached block {block} (depth {entry.depth}) does not hold, in layer "
                                        f"{layer}, the K/V written for its prefix")
            found = self.alloc.find_cached_prefix(prefix, entry.cache_key, record_stats=False)
            if len(found) <= entry.depth:
                raise ModelMismatch(f"{what}: a lookup of the prefix cached by block {block} (depth {entry.depth}) "
                                    f"finds only {len(found)} blocks")
        for seq_id, seq in self.seqs.items():
            table = self.cache.block_table(seq_id).tolist()
            run = 0
            while run < len(table) and (run + 1) * bs <= len(seq.tokens) and table[run] in entries:
                run += 1
            found = self.alloc.find_cached_prefix(seq.tokens[:run * bs], seq.cache_key, record_stats=False)
            if len(found) < run:
                raise ModelMismatch(f"{what}: the first {run} blocks of sequence {seq_id} are cached, a lookup of its "
                                    f"tokens finds {len(found)}")


def _pool_read(pool: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """``pool[table[p // bs], p % bs]`` for ``p < n``, by plain indexing (the definition of a gather)."""
    from pagedkv.testing.cases.case import reference_gather

    return reference_gather(pool, table, n)


def latent_pools(k_cache: torch.Tensor, v_cache: torch.Tensor, latent: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_cache, v_cache)`` as a backend's ``paged_attention`` takes them: where it reads V from K's storage
    (``latent``, ``shared_kv_storage``: MLA's latent cache) ``v_cache`` is ``k_cache[..., :head_dim_v]``."""
    return (k_cache, k_cache[..., :v_cache.shape[-1]]) if latent else (k_cache, v_cache)
