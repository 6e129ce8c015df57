"""The allocator and the cache as a state machine: every history of adds (with prefix lookup),
appends (with copy-on-write), forks, frees, preemptions, refused allocations and their retries,
double frees and bad arguments keeps the books straight.

After every step:

- free + used == total; free, evictable and used are disjoint; a block's reference count equals the
  number of live block tables holding it (``cache.check_invariants``);
- every live sequence reads, bit for bit, the K/V of its own tokens (K/V is a deterministic
  function of token, position and seed: :func:`pagedkv.testing.cases.token_kv`);
- every block the prefix cache holds (used or evictable) stores exactly the K/V a recomputation of
  its token prefix gives, so a prefix hit can never serve stale or foreign K/V, even with a hash
  function that collides on every block (C4);
- a call that raised (out of blocks, double free, a bad argument) changed nothing: the allocator's
  lists (in order), reference counts, prefix-cache entries, every table and both pools are as before.

At the end every live sequence is freed and every block must be free (no leak).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import get_backend
from pagedkv.cache import PagedKVCache
from pagedkv.testing.cases import Geometry, token_kv
from pagedkv.config import CacheConfig
from pagedkv.errors import ArgumentTypeError, DoubleFreeError, OutOfBlocksError, UnknownBlockError
from pagedkv.testing.tolerance import bits

indexed = get_backend("indexed")
VOCAB = st.integers(0, 5)  # a small vocabulary: equal blocks, hash hits and near-misses are common


def _tokens(n: int):
    return st.lists(VOCAB, min_size=n, max_size=n)


class CacheMachine(RuleBasedStateMachine):
    """A :class:`PagedKVCache` over a small pool, driven like a scheduler drives it."""

    @initialize(num_blocks=st.integers(3, 10), block_size=st.sampled_from((1, 2, 3, 4)),
                constant_hash=st.booleans(), seed=st.integers(0, 100),
                systems=st.lists(st.integers(0, 9).flatmap(_tokens), min_size=1, max_size=3))
    def start(self, num_blocks, block_size, constant_hash, seed, systems):
        self.geometry = Geometry(num_blocks, block_size, num_kv_heads=1, head_dim=2, dtype="float32")
        self.cache = PagedKVCache(CacheConfig(num_blocks, block_size, 1, 2, torch.float32),
                                  **({"hash_fn": lambda parent, tokens: 0} if constant_hash else {}))
        self.alloc = self.cache.allocator
        self.seed = seed
        self.systems = systems  # shared system prompts: later requests hit the prefix cache
        self.shadow: dict[int, list[int]] = {}  # live sequence -> its tokens
        self.freed: list[int] = []
        self.next_id = 0

    # -- helpers ---------------------------------------------------------------------------------------
    def snapshot(self):
        a, c = self.alloc, self.cache
        return (list(a._ref), list(a._free), list(a._evictable), dict(a._entries), list(a._generation),
                {h: list(bs) for h, bs in a._by_hash.items()},
                {s: (list(q.block_table), list(q.token_ids)) for s, q in c.sequences.items()},
                bits(c.kv).clone())

    def assert_unchanged(self, before, what):
        after = self.snapshot()
        names = ("reference counts", "free list", "evictable list", "cached hashes", "cached prefixes",
                 "hash index", "sequences", "pools")
        for name, x, y in zip(names, before, after):
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            assert same, f"{what} changed the {name}"

    def write(self, seq_id, tokens, start):
        slots = self.cache.append(seq_id, tokens)
        k, v = token_kv(self.geometry, tokens, start, self.seed)
        indexed.write_kv(self.cache.k_cache(), self.cache.v_cache(), k, v, slots)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def check_blocks_hold(self, blocks, tokens, what):
        """``blocks`` (a table prefix) store exactly the K/V of ``tokens`` (whole blocks)."""
        if not blocks:
            return
        n = len(blocks) * self.geometry.block_size
        got_k = indexed.gather(self.cache.k_cache(), blocks, n)
        got_v = indexed.gather(self.cache.v_cache(), blocks, n)
        k, v = token_kv(self.geometry, tokens[:n], 0, self.seed)
        assert torch.equal(bits(got_k), bits(k)) and torch.equal(bits(got_v), bits(v)), \
            f"{what}: blocks {blocks} do not hold the K/V of tokens {tokens[:n]}"

    live = property(lambda self: sorted(self.shadow))

    # -- rules -------------------------------------------------------------------------------------
    @rule(data=st.data())
    def add(self, data):
        """A request arrives: prefix lookup, then prefill of the uncached tokens (refused when the pool
        is too full: the request is dropped, as a scheduler would defer it)."""
        system = data.draw(st.sampled_from(self.systems))
        prompt = system + data.draw(st.integers(0 if system else 1, 2 * self.geometry.block_size).flatmap(_tokens))
        seq_id = self.new_id()
        cached = self.cache.add_sequence(seq_id, prompt)
        assert cached % self.geometry.block_size == 0 and cached <= max(len(prompt) - 1, 0)
        hit = self.cache.sequences[seq_id].block_table
        assert len(hit) * self.geometry.block_size == cached
        self.check_blocks_hold(hit, prompt, f"prefix hit of sequence {seq_id}")  # equal tokens, equal K/V
        before = self.snapshot()
        try:
            self.write(seq_id, prompt[cached:], cached)
        except OutOfBlocksError:
            self.assert_unchanged(before, f"a refused prefill of sequence {seq_id}")
            self.cache.free(seq_id)
            self.freed.append(seq_id)
            return
        self.shadow[seq_id] = list(prompt)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def append(self, data):
        """Decode or a prefill chunk: copy-on-write when the last block is shared and partial."""
        seq_id = data.draw(st.sampled_from(self.live))
        tokens = data.draw(st.integers(1, self.geometry.block_size + 1).flatmap(_tokens))
        fits = self.cache.can_append(seq_id, len(tokens))
        before = self.snapshot()
        try:
            self.write(seq_id, tokens, len(self.shadow[seq_id]))
        except OutOfBlocksError:
            assert not fits, "can_append said yes, append refused"
            self.assert_unchanged(before, f"a refused append to sequence {seq_id}")
            return
        assert fits, "can_append said no, append succeeded"
        self.shadow[seq_id] += tokens

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = self.new_id()
        self.cache.fork(parent, child)
        self.shadow[child] = list(self.shadow[parent])

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def finish(self, data):
        seq_id = data.draw(st.sampled_from(self.live))
        self.cache.free(seq_id)
        del self.shadow[seq_id]
        self.freed.append(seq_id)

    @precondition(lambda self: any(self.alloc.ref_count(b) > 1 for s in self.shadow
                                   for b in self.cache.sequences[s].block_table))
    @rule(data=st.data())
    def preempt_sharer(self, data):
        """Preempt a sequence whose blocks others still hold: theirs stay allocated and intact."""
        sharers = [s for s in self.live if any(self.alloc.ref_count(b) > 1 for b in self.cache.sequences[s].block_table)]
        victim = data.draw(st.sampled_from(sharers))
        shared = [b for b in self.cache.sequences[victim].block_table if self.alloc.ref_count(b) > 1]
        self.cache.free(victim)
        del self.shadow[victim]
        self.freed.append(victim)
        assert all(not self.alloc.is_free(b) for b in shared), "a block still referenced became free"

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def refused_then_retried(self, data):
        """An append larger than the free pool is refused and changes nothing; after another sequence
        finishes (if any), a retry of a fitting size succeeds."""
        seq_id = data.draw(st.sampled_from(self.live))
        too_many = (self.alloc.num_free + 1) * self.geometry.block_size + 1
        tokens = data.draw(_tokens(too_many))
        assert not self.cache.can_append(seq_id, too_many)
        before = self.snapshot()
        with pytest.raises(OutOfBlocksError):
            self.write(seq_id, tokens, len(self.shadow[seq_id]))
        self.assert_unchanged(before, f"a refused oversized append to sequence {seq_id}")
        others = [s for s in self.live if s != seq_id]
        if others:
            victim = data.draw(st.sampled_from(others))
            self.cache.free(victim)
            del self.shadow[victim]
            self.freed.append(victim)
        retry = tokens[:self.geometry.block_size]
        if self.cache.can_append(seq_id, len(retry)):
            self.write(seq_id, retry, len(self.shadow[seq_id]))
            self.shadow[seq_id] += retry

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def double_free(self, data):
        """C3: freeing a freed sequence again raises DoubleFreeError and changes nothing."""
        seq_id = data.draw(st.sampled_from(self.freed))
        before = self.snapshot()
        with pytest.raises(DoubleFreeError):
            self.cache.free(seq_id)
        self.assert_unchanged(before, f"a second free of sequence {seq_id}")

    @rule(data=st.data())
    def double_free_block(self, data):
        """Dropping a reference a free (or evictable) block does not hold raises and changes nothing;
        so does releasing a used block more times than it is referenced."""
        idle = [b for b in range(self.alloc.num_blocks) if self.alloc.is_free(b)]
        used = [b for b in range(self.alloc.num_blocks) if not self.alloc.is_free(b)]
        before = self.snapshot()
        if idle:
            with pytest.raises(DoubleFreeError):
                self.alloc.free(data.draw(st.sampled_from(idle)))
        if used:
            b = data.draw(st.sampled_from(used))
            with pytest.raises(DoubleFreeError):
                self.alloc.free_all([b] * (self.alloc.ref_count(b) + 1))
        self.assert_unchanged(before, "a double free of a block")

    @rule(data=st.data())
    def prefix_lookup(self, data):
        """A lookup takes no reference; each block it finds caches exactly that token prefix."""
        system = data.draw(st.sampled_from(self.systems))
        prompt = system + data.draw(st.integers(0, 2 * self.geometry.block_size).flatmap(_tokens))
        before = self.snapshot()
        found = self.alloc.find_cached_prefix(prompt)
        self.assert_unchanged(before, "a prefix lookup (which takes no reference)")
        bs = self.geometry.block_size
        for i, b in enumerate(found):
            assert self.alloc.cached_prefix(b) == tuple(prompt[:(i + 1) * bs]), f"block {b}: a hit on unequal tokens"
        self.check_blocks_hold(found, prompt, "prefix lookup")

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def prefix_reinsert(self, data):
        """Registering a full block that already caches its prefix is a no-op."""
        seq_id = data.draw(st.sampled_from(self.live))
        seq, bs = self.cache.sequences[seq_id], self.geometry.block_size
        full = seq.num_tokens // bs
        if not full:
            return
        i = data.draw(st.integers(0, full - 1))
        block = seq.block_table[i]
        if block not in self.alloc.cached_entries():
            return  # its prefix is cached by another block (an equal block registered first)
        before = self.snapshot()
        self.alloc.cache_full_block(block, seq.token_ids[i * bs:(i + 1) * bs], seq.block_table[i - 1] if i else None)
        self.assert_unchanged(before, "re-registering a cached block")

    @rule(data=st.data())
    def bad_arguments(self, data):
        """Bad arguments raise the documented type and change nothing."""
        before = self.snapshot()
        kind = data.draw(st.sampled_from(("float_token", "unknown_seq", "negative_n", "bad_block")))
        if kind == "float_token" and self.shadow:
            with pytest.raises(ArgumentTypeError):
                self.cache.append(data.draw(st.sampled_from(self.live)), [1, 2.5])
        elif kind == "unknown_seq":
            with pytest.raises(UnknownBlockError):
                self.cache.append(self.next_id + 1000, [1])
        elif kind == "negative_n":
            with pytest.raises(ValueError):
                self.alloc.allocate(-1)
        elif kind == "bad_block":
            with pytest.raises(UnknownBlockError):
                self.alloc.free(self.alloc.num_blocks)
        self.assert_unchanged(before, f"a call with a bad argument ({kind})")

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def books_balance(self):
        self.cache.check_invariants()
        assert self.alloc.num_free + self.alloc.num_used == self.alloc.num_blocks

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id, tokens in self.shadow.items():
            assert self.cache.sequences[seq_id].token_ids == tokens
            self.check_blocks_hold(self.cache.sequences[seq_id].block_table[:len(tokens) // self.geometry.block_size],
                                   tokens, f"sequence {seq_id}")
            n = len(tokens)
            got = indexed.gather(self.cache.k_cache(), self.cache.block_table(seq_id), n)
            assert torch.equal(bits(got), bits(token_kv(self.geometry, tokens, 0, self.seed)[0])), \
                f"sequence {seq_id} reads K/V that is not its own"

    @invariant()
    def cached_blocks_hold_their_prefix(self):
        bs = self.geometry.block_size
        for block, entry in self.alloc.cached_entries().items():
            prefix = entry.tokens
            k, v = token_kv(self.geometry, entry.tokens, entry.depth * bs, self.seed)
            assert torch.equal(bits(self.cache.k_cache()[block]), bits(k)) and \
                torch.equal(bits(self.cache.v_cache()[block]), bits(v)), \
                f"cached block {block} does not hold the K/V of its prefix {prefix}"

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for seq_id in self.live:
            self.cache.free(seq_id)
        self.cache.check_invariants()
        assert self.alloc.num_used == 0 and self.alloc.num_free == self.alloc.num_blocks, "a block leaked"
        assert all(self.alloc.is_free(b) for b in range(self.alloc.num_blocks))


CacheMachine.TestCase.settings = settings(settings(), stateful_step_count=25)
TestCacheMachine = CacheMachine.TestCase
