"""The allocator and the cache as a Hypothesis state machine, driven like a scheduler drives them and
checked against a shadow model (:class:`pagedkv.testing.properties.cache_model.CacheModel`).
shadow model (:class:`pagedkv.testing.properties.cache_model.CacheModel`).

Histories: adds under cache namespaces (with prefix lookup), reservations (``append``) written and
committed at once, later, in part (a partial write of a chunk) or never (the write raised; the
request aborted or preempted between reserve and write), forks before or after the parent's write,
copy-on-write, finishes, preemptions with recompute, refused allocations and their retries, double
frees and bad arguments, over 1-3 layers.

After every step (the model's checks):

- free + used == total; free, evictable and used are disjoint; a block's reference count equals the
  number of live block tables holding it (``cache.check_invariants``);
- every live sequence reads, bit for bit and in every layer, the K/V written for its committed tokens
  (values depend on the whole prefix, the layer and the namespace: :func:`.cache_model.expected_kv`);
- no cached block was never written: each one's prefix (under its namespace) is one the model wrote,
  and it stores exactly that K/V, so every prefix-cache hit returns the K/V written for those tokens,
  even with a hash function that collides on every block (C4);
- hits are found: a lookup of a live sequence's tokens returns at least the leading run of its cached
  blocks, and a lookup of any cached prefix reaches its block;
- sharing is kept (an append changes no entry before its last, never copies a full last block, copies
  a shared partial one exactly once) and eviction follows the model's queue (least recently released
  first, deepest first among blocks released together);
- a call that raised changed nothing: the allocator's lists (in order), reference counts, prefix-cache
  entries, every table, every committed count and the pools are as before.

At the end every live sequence is freed and every block must be free (no leak). ``CacheMachine.cache_class``
is the cache under test (the cache mutants' test drives faulty ones through the same rules).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from pagedkv import get_backend
from pagedkv.cache import PagedKVCache
from pagedkv.errors import ArgumentTypeError, DoubleFreeError, OutOfBlocksError, ShapeError, UnknownBlockError
from pagedkv.testing.properties.cache_model import CacheModel
from pagedkv.testing.cases.case import Geometry
from pagedkv.testing.compare import bits

#: Rules per run of the machine.
STEPS = 50  # under the ci profile 40 steps let cow_first_layer_only live; 50 kill all nine cache mutants

VOCAB = st.integers(0, 5)  # a small vocabulary: equal blocks, hash hits and near-misses are common
KEYS = (None, "tenant-a", ("lora", 7))


def _tokens(n: int):
    return st.lists(VOCAB, min_size=n, max_size=n)


class CacheMachine(RuleBasedStateMachine):
    """A :class:`PagedKVCache` over a small pool, driven like a scheduler drives it."""

    cache_class = PagedKVCache
    backend = None  # write_kv and gather come from here; None: pagedkv's indexed backend
    device = "cpu"
    # the geometry, inside the backend's declared space (machine_for)
    block_sizes: tuple[int, ...] = (1, 2, 3, 4)
    num_kv_heads, head_dim, group, dtype = 1, 2, 1, "float32"

    @initialize(num_blocks=st.integers(3, 10), block_size=st.integers(0, 3), num_layers=st.integers(1, 3),
                constant_hash=st.booleans(), seed=st.integers(0, 100),
                systems=st.lists(st.integers(0, 9).flatmap(_tokens), min_size=1, max_size=3))
    def start(self, num_blocks, block_size, num_layers, constant_hash, seed, systems):
        bs = self.block_sizes[block_size % len(self.block_sizes)]  # an index: the sizes come from the declared space
        self.geometry = Geometry(num_blocks, bs, self.num_kv_heads, self.head_dim, self.group, self.dtype)
        self.cache = self.cache_class(self.geometry.cache_config(self.device, num_layers),
                                      **({"hash_fn": lambda parent, tokens: 0} if constant_hash else {}))
        self.alloc = self.cache.allocator
        backend = self.backend or get_backend("indexed")
        gather = getattr(backend, "gather", None)
        self.model = CacheModel(self.cache, self.geometry, seed, num_layers, backend.write_kv, gather,
                                attention=None if gather else getattr(backend, "paged_attention", None))
        self.systems = systems  # shared system prompts: later requests hit the prefix cache
        self.freed: list[int] = []
        self.next_id = 0

    # -- helpers ---------------------------------------------------------------------------------------
    def snapshot(self):
        a, c = self.alloc.snapshot(), self.cache
        return (a["ref_counts"], a["free"], a["evictable"], a["entries"], a["generations"], a["hash_index"],
                {s: (list(q.block_table), list(q.token_ids), q.num_written, q.cache_key)
                 for s, q in c.sequences.items()},
                bits(c.kv.cpu()).clone())

    def assert_unchanged(self, before, what):
        after = self.snapshot()
        names = ("reference counts", "free list", "evictable list", "cached hashes", "cached prefixes",
                 "hash index", "sequences", "pools")
        for name, x, y in zip(names, before, after):
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            assert same, f"{what} changed the {name}"

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def release(self, seq_id):
        self.model.free(seq_id)
        self.freed.append(seq_id)

    def prompt(self, data, min_suffix=0):
        system = data.draw(st.sampled_from(self.systems))
        return system + data.draw(st.integers(min_suffix if system else 1,
                                              2 * self.geometry.block_size).flatmap(_tokens))

    def admit(self, seq_id, prompt, key) -> bool:
        """add_sequence + reserve the uncached tokens; a refused reservation changes nothing, and the
        request is dropped (as a scheduler defers it)."""
        cached = self.model.add(seq_id, prompt, key)
        before = self.snapshot()
        try:
            self.model.reserve(seq_id, prompt[cached:])
        except OutOfBlocksError:
            self.assert_unchanged(before, f"a refused prefill of sequence {seq_id}")
            self.release(seq_id)
            return False
        return True

    live = property(lambda self: sorted(self.model.seqs))
    pending = property(lambda self: sorted(s for s, m in self.model.seqs.items() if m.written < len(m.tokens)))

    # -- rules -------------------------------------------------------------------------------------
    @rule(data=st.data())
    def add(self, data):
        """A request arrives under a namespace: prefix lookup, then its prefill is reserved and usually
        written and committed at once (sometimes left pending for a later rule)."""
        prompt, key = self.prompt(data), data.draw(st.sampled_from(KEYS))
        seq_id = self.new_id()
        if self.admit(seq_id, prompt, key) and data.draw(st.sampled_from((True, True, False))):
            self.model.write(seq_id)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), write=st.booleans())
    def append(self, data, write):
        """Decode or a prefill chunk (copy-on-write when the last block is shared and partial), written
        and committed at once or left reserved."""
        seq_id = data.draw(st.sampled_from(self.live))
        tokens = data.draw(st.integers(1, self.geometry.block_size + 1).flatmap(_tokens))
        fits = self.cache.can_append(seq_id, len(tokens))
        before = self.snapshot()
        try:
            self.model.reserve(seq_id, tokens)
        except OutOfBlocksError:
            assert not fits, "can_append said yes, append refused"
            self.assert_unchanged(before, f"a refused append to sequence {seq_id}")
            return
        assert fits, "can_append said no, append succeeded"
        if write:
            self.model.write(seq_id)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def write_part_of_a_chunk(self, data):
        """Only part of what was reserved is written and committed (a chunk cut short)."""
        seq_id = data.draw(st.sampled_from(self.pending))
        m = self.model.seqs[seq_id]
        self.model.write(seq_id, data.draw(st.integers(1, len(m.tokens) - m.written)))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def failed_write(self, data):
        """A write that raises (K/V of the wrong dtype) writes nothing and commits nothing."""
        seq_id = data.draw(st.sampled_from(self.pending))
        before = self.snapshot()
        self.model.failed_write(seq_id)
        self.assert_unchanged(before, f"a failed write to sequence {seq_id}")

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def abort_before_write(self, data):
        """A request aborted between reserve and write (C11): the blocks only it held, past what it
        committed, go back free and cache nothing."""
        seq_id = data.draw(st.sampled_from(self.pending))
        table = self.cache.block_table(seq_id).tolist()
        bs, m = self.geometry.block_size, self.model.seqs[seq_id]
        own_unwritten = [b for i, b in enumerate(table) if (i + 1) * bs > m.written and self.alloc.ref_count(b) == 1]
        self.release(seq_id)
        for b in own_unwritten:
            assert self.alloc.is_free(b) and b not in self.alloc.cached_entries(), \
                f"block {b}, reserved by aborted sequence {seq_id} but never written, is in the prefix cache"

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def preempt_before_write(self, data):
        """A request preempted between reserve and write, then recomputed from all its tokens: its
        prefix hit covers only K/V written before (the model checks it), then it is written in full."""
        seq_id = data.draw(st.sampled_from(self.pending))
        m = self.model.seqs[seq_id]
        tokens, key = list(m.tokens), m.cache_key
        self.release(seq_id)
        new = self.new_id()
        if self.admit(new, tokens, key):
            self.model.write(new)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def fork(self, data):
        """Parallel sampling: possibly before the parent's reserved tokens are written (then both must
        write them: a copy-on-write may separate their blocks)."""
        parent = data.draw(st.sampled_from(self.live))
        child = self.new_id()
        self.model.fork(parent, child)
        if data.draw(st.booleans()):  # the samples diverge at once: both append into a block they share
            for seq_id in (parent, child):
                tokens = data.draw(st.integers(1, self.geometry.block_size).flatmap(_tokens))
                try:
                    self.model.reserve(seq_id, tokens)
                except OutOfBlocksError:
                    break
                self.model.write(seq_id)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def finish(self, data):
        self.release(data.draw(st.sampled_from(self.live)))

    @precondition(lambda self: any(self.alloc.ref_count(b) > 1 for s in self.model.seqs
                                   for b in self.cache.sequences[s].block_table))
    @rule(data=st.data())
    def preempt_sharer(self, data):
        """Preempt a sequence whose blocks others still hold: theirs stay allocated and intact."""
        sharers = [s for s in self.live
                   if any(self.alloc.ref_count(b) > 1 for b in self.cache.sequences[s].block_table)]
        victim = data.draw(st.sampled_from(sharers))
        shared = [b for b in self.cache.sequences[victim].block_table if self.alloc.ref_count(b) > 1]
        self.release(victim)
        assert all(not self.alloc.is_free(b) for b in shared), "a block still referenced became free"

    @precondition(lambda self: self.model.seqs)
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
            self.model.reserve(seq_id, tokens)
        self.assert_unchanged(before, f"a refused oversized append to sequence {seq_id}")
        others = [s for s in self.live if s != seq_id]
        if others:
            self.release(data.draw(st.sampled_from(others)))
        retry = tokens[:self.geometry.block_size]
        if self.cache.can_append(seq_id, len(retry)):
            self.model.reserve(seq_id, retry)
            self.model.write(seq_id)

    @precondition(lambda self: any(m.written >= self.geometry.block_size for m in self.model.seqs.values()))
    @rule(data=st.data())
    def same_prompt_under_two_keys(self, data):
        """A committed prompt added again under its own namespace hits its cached blocks (hits are found);
        under another namespace it shares none of them."""
        bs = self.geometry.block_size
        seq_id = data.draw(st.sampled_from([s for s, m in self.model.seqs.items() if m.written >= bs]))
        m = self.model.seqs[seq_id]
        prompt, own = m.tokens[:m.written] + [0], self.cache.block_table(seq_id).tolist()
        other_key = data.draw(st.sampled_from([k for k in KEYS if k != m.cache_key]))
        other = self.new_id()
        self.model.add(other, prompt, other_key)
        shared = set(self.cache.block_table(other).tolist()) & set(own)
        assert not shared, f"the same tokens under cache_key {other_key!r} share blocks {shared} of {m.cache_key!r}"
        self.release(other)
        again = self.new_id()
        cached = self.model.add(again, prompt, m.cache_key)
        committed_blocks = [b for b in own[:m.written // bs] if b in self.alloc.cached_entries()]
        assert cached >= len(committed_blocks) * bs, \
            f"sequence {seq_id}'s {len(committed_blocks)} committed blocks are cached, a re-add hits {cached} tokens"
        self.release(again)

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
        """A lookup takes no reference; each block it finds caches exactly that token prefix, under
        that namespace, and was written."""
        prompt, key = self.prompt(data), data.draw(st.sampled_from(KEYS))
        before = self.snapshot()
        found = self.alloc.find_cached_prefix(prompt, key)
        self.assert_unchanged(before, "a prefix lookup (which takes no reference)")
        bs = self.geometry.block_size
        for i, b in enumerate(found):
            prefix = tuple(prompt[:(i + 1) * bs])
            assert self.alloc.cached_prefix(b) == prefix, f"block {b}: a hit on unequal tokens"
            assert self.alloc.cached_entries()[b].cache_key == key, f"block {b}: a hit across namespaces"
            assert (key, prefix) in self.model.written_prefixes, f"block {b}: a hit on K/V never written"

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def prefix_reinsert(self, data):
        """Registering a full block that already caches its prefix is a no-op, and so is a commit of
        no more tokens than are committed."""
        seq_id = data.draw(st.sampled_from(self.live))
        seq, bs = self.cache.sequences[seq_id], self.geometry.block_size
        before = self.snapshot()
        assert self.cache.mark_written(seq_id, data.draw(st.integers(0, seq.num_written))) == 0
        self.assert_unchanged(before, "a commit of tokens already committed")
        full = seq.num_written // bs
        if not full:
            return
        i = data.draw(st.integers(0, full - 1))
        block = seq.block_table[i]
        if block not in self.alloc.cached_entries():
            return  # its prefix is cached by another block (an equal block registered first)
        self.alloc.cache_full_block(block, seq.token_ids[i * bs:(i + 1) * bs], seq.block_table[i - 1] if i else None,
                                    cache_key=seq.cache_key)
        self.assert_unchanged(before, "re-registering a cached block")

    @rule(data=st.data())
    def bad_arguments(self, data):
        """Bad arguments raise the documented type and change nothing."""
        before = self.snapshot()
        kind = data.draw(st.sampled_from(("float_token", "unknown_seq", "negative_n", "bad_block", "commit_past_end",
                                          "slots_past_end", "unhashable_key")))
        live = self.live
        if kind == "float_token" and live:
            with pytest.raises(ArgumentTypeError):
                self.cache.append(data.draw(st.sampled_from(live)), [1, 2.5])
        elif kind == "unknown_seq":
            with pytest.raises(UnknownBlockError):
                self.cache.append(self.next_id + 1000, [1])
        elif kind == "negative_n":
            with pytest.raises(ValueError):
                self.alloc.allocate(-1)
        elif kind == "bad_block":
            with pytest.raises(UnknownBlockError):
                self.alloc.free(self.alloc.num_blocks)
        elif kind == "commit_past_end" and live:
            seq_id = data.draw(st.sampled_from(live))
            with pytest.raises(ShapeError, match="num_tokens"):
                self.cache.mark_written(seq_id, self.cache.seq_len(seq_id) + 1)
            with pytest.raises(ShapeError, match="num_tokens"):
                self.cache.mark_written(seq_id, -1)
        elif kind == "slots_past_end" and live:
            seq_id = data.draw(st.sampled_from(live))
            with pytest.raises(ShapeError, match="end"):
                self.cache.slot_mapping(seq_id, 0, self.cache.seq_len(seq_id) + 1)
        elif kind == "unhashable_key":
            with pytest.raises(ArgumentTypeError, match="cache_key"):
                self.cache.add_sequence(self.next_id + 1000, [1, 2], cache_key=["not", "hashable"])
        self.assert_unchanged(before, f"a call with a bad argument ({kind})")

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def the_model_holds(self):
        if not hasattr(self, "model"):
            return
        self.model.observe_evictions("after a step")
        self.model.check("after a step")
        assert self.alloc.num_free + self.alloc.num_used == self.alloc.num_blocks

    def teardown(self):
        if not hasattr(self, "model"):
            return
        for seq_id in self.live:
            self.release(seq_id)
        self.cache.check_invariants()
        assert self.alloc.num_used == 0 and self.alloc.num_free == self.alloc.num_blocks, "a block leaked"
        assert all(self.alloc.is_free(b) for b in range(self.alloc.num_blocks))


def machine_for(backend: Any = None, device: str = "cpu", cache_class: type | None = None, caps: Any = None) -> type:
    """The machine over ``backend`` (its ``write_kv`` and ``gather``, else its ``paged_attention``, and
    its ``cache_class`` when it ships its own cache manager) on ``device``, with pools inside the
    declared space ``caps`` (block sizes 1-4, head_dim 2, one kv head in float32 where it allows them)."""
    cls = cache_class or getattr(backend, "cache_class", None) or PagedKVCache
    space = {}
    if caps is not None:
        space = dict(block_sizes=caps.block_sizes.choose((1, 2, 3, 4))[:4],
                     head_dim=caps.head_dims.choose((2, 4, 8))[0],
                     num_kv_heads=caps.num_kv_heads.choose((1, 2))[0], group=caps.gqa_groups.choose((1, 2))[0],
                     dtype=next(d for d in ("float32", "float16", "bfloat16") if d in caps.dtypes))
    return type(f"CacheMachine_{cls.__name__}", (CacheMachine,),
                {"cache_class": cls, "backend": backend, "device": device, **space})


def cache_state_machine(backend: Any, device: str = "cpu", chosen: settings | None = None, caps: Any = None) -> None:
    """Run the state machine over ``backend`` inside ``caps`` (a registered property of kind ``"machine"``).

    Raises:
        AssertionError: a rule or invariant failed (Hypothesis prints the shrunk steps).
    """
    run_state_machine_as_test(machine_for(backend, device, caps=caps), settings=settings(chosen or settings(),
                                                                                stateful_step_count=STEPS))
