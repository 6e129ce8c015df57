"""The allocator and the cache as a Hypothesis state machine, driven like a scheduler drives them and
checked against a shadow model (:class:`pagedkv.testing.properties.cache_model.CacheModel`).

Written in Hypothesis' stateful idiom: live sequence ids, freed ids and system prompts flow between
rules through bundles (a rule that ends a sequence consumes it), and every choice is a rule argument,
so a shrunk failure prints as a program of calls (``seqs_0 = state.add(cache_key=None, suffix=[1],
system=systems_0, write=False)``, ``seqs_1 = state.fork(diverge=None, parent=seqs_0)``, ...). The
messages name sequences by the cache's ids, which count every ``add_sequence`` (dropped requests too).

Histories: adds under cache namespaces (with prefix lookup), reservations (``append``) written and
committed at once, later, in part (a partial write of a chunk) or never (the write raised; the
request aborted or preempted between reserve and write), forks before or after the parent's write,
copy-on-write, finishes and preemptions (a freed sequence's shared blocks stay allocated), preemptions
with recompute, refused allocations and their retries, double frees and bad arguments, over 1-3 layers,
with or without a sliding window (``window_left``: appends and prefix hits release the leading blocks
no later query reads, under sharing and namespaces; :mod:`.window_rules`).

After every step, the model's checks (:mod:`.cache_model` lists them): the allocator's counts and
reference counts, every live sequence's K/V bit for bit in every layer, no cached block that was never
written (C4 included), hits found, sharing kept, the eviction order, the window's releases, and that a
call that raised changed nothing.

At the end every live sequence is freed and every block must be free (no leak). ``CacheMachine.cache_class``
is the cache under test (the cache mutants' test drives faulty ones through the same rules).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple,
                                 precondition, rule, run_state_machine_as_test)

from pagedkv import get_backend
from pagedkv.backends.capabilities import capabilities_of
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.errors import ArgumentTypeError, DoubleFreeError, OutOfBlocksError, ShapeError, UnknownBlockError
from pagedkv.testing.properties.cache_model import CacheModel
from pagedkv.testing.cases.case import Geometry
from pagedkv.testing.compare import bits
from pagedkv.testing.properties.window_rules import check_windowed_sequence
from pagedkv.cache.window import NULL_BLOCK, releasable_blocks

#: Rules per run of the machine.
STEPS = 50  # under the ci profile 40 steps let cow_first_layer_only live; 50 kill all nine cache mutants

VOCAB = st.integers(0, 5)  # a small vocabulary: equal blocks, hash hits and near-misses are common
KEYS = (None, "tenant-a", ("lora", 7))
SUFFIX = st.lists(VOCAB, max_size=8)  # a request's own tokens after its system prompt
POOL = dict(num_blocks=st.integers(3, 10), block_size=st.integers(0, 3), num_layers=st.integers(1, 3),
            constant_hash=st.booleans(), seed=st.integers(0, 100))


#: How many runs of a cache machine have started in this process (read before and after a run).
RUNS_STARTED = [0]


class CacheMachine(RuleBasedStateMachine):
    """A :class:`PagedKVCache` over a small pool, driven like a scheduler drives it.

    ``seqs`` holds the live sequence ids (a rule that ends one consumes it), ``freed`` the ids of those
    finished or aborted (for double frees), ``systems`` the shared system prompts requests start with.
    """

    cache_class = PagedKVCache
    backend = None  # write_kv and gather come from here; None: pagedkv's indexed backend
    device = "cpu"
    # the geometry, inside the backend's declared space (machine_for)
    block_sizes: tuple[int, ...] = (1, 2, 3, 4)
    num_kv_heads, head_dim, group, dtype = 1, 2, 1, "float32"

    seqs = Bundle("seqs")
    freed = Bundle("freed")
    systems = Bundle("systems")

    def __init__(self) -> None:
        super().__init__()
        RUNS_STARTED[0] += 1  # Hypothesis builds one machine per run: execute.run reports the runs that ran

    @initialize(**POOL, window_left=st.none() | st.integers(0, 9))
    def start(self, num_blocks, block_size, num_layers, constant_hash, seed, window_left):
        """The pool: ``block_size`` indexes the declared block sizes; ``constant_hash``: every block hashes
        to 0 (each hit must then compare tokens and namespace); ``window_left``: every layer attends
        through that window, so appends and prefix hits release the blocks no later query reads."""
        bs = self.block_sizes[block_size % len(self.block_sizes)]  # an index: the sizes come from the declared space
        self.geometry = Geometry(num_blocks, bs, self.num_kv_heads, self.head_dim, self.group, self.dtype)
        backend = self.backend or get_backend("indexed")
        # a freed or released block shows no old K/V: NaN, or the largest finite value for a backend that
        # declares it loads unused slots and needs them finite
        poison = "max" if "finite_unused_slots" in capabilities_of(backend).preconditions else "nan"
        config = dataclasses.replace(self.geometry.cache_config(self.device, num_layers), window_left=window_left,
                                     debug_poison=poison)
        self.cache = self.cache_class(config, **({"hash_fn": lambda parent, tokens: 0} if constant_hash else {}))
        self.alloc = self.cache.allocator
        gather = getattr(backend, "gather", None)
        self.model = CacheModel(self.cache, self.geometry, seed, num_layers, backend.write_kv, gather,
                                attention=None if gather else getattr(backend, "paged_attention", None))
        self.next_id = 0

    @initialize(target=systems, prompts=st.lists(st.lists(VOCAB, max_size=9), min_size=1, max_size=3))
    def system_prompts(self, prompts):
        """Shared system prompts: later requests starting with one hit the prefix cache."""
        return multiple(*prompts)

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
        """Free ``seq_id`` (finish, abort, preempt): the blocks other live tables still hold stay allocated."""
        shared = [b for b in self.model.held(seq_id) if self.alloc.ref_count(b) > 1]
        self.model.free(seq_id)
        assert all(not self.alloc.is_free(b) for b in shared), \
            f"freeing sequence {seq_id} freed blocks {shared} that other sequences still hold"

    def admit(self, prompt, key):
        """add_sequence + reserve the uncached tokens: the new id, or ``multiple()`` when the reservation is
        refused (it changes nothing, and the request is dropped, as a scheduler defers it)."""
        seq_id = self.new_id()
        cached = self.model.add(seq_id, prompt, key)
        before = self.snapshot()
        try:
            self.model.reserve(seq_id, prompt[cached:])
        except OutOfBlocksError:
            self.assert_unchanged(before, f"a refused prefill of sequence {seq_id}")
            self.release(seq_id)
            return None
        return seq_id

    live = property(lambda self: sorted(self.model.seqs))
    pending = property(lambda self: sorted(s for s, m in self.model.seqs.items() if m.written < len(m.tokens)))

    # -- rules -------------------------------------------------------------------------------------
    @rule(target=seqs, system=systems, suffix=SUFFIX, cache_key=st.sampled_from(KEYS),
          write=st.sampled_from((True, True, False)))
    def add(self, system, suffix, cache_key, write):
        """A request (``system + suffix``, possibly empty) arrives under a namespace: prefix lookup,
        then its prefill is reserved and written and committed at once, or left pending for later rules.
        A refused prefill adds no sequence."""
        seq_id = self.admit(system + suffix, cache_key)
        if seq_id is None:
            return multiple()
        if write:
            self.model.write(seq_id)
        return seq_id

    @rule(seq=seqs, tokens=st.lists(VOCAB, min_size=1, max_size=5), write=st.booleans())
    def append(self, seq, tokens, write):
        """Decode or a prefill chunk (copy-on-write when the last block is shared and partial), written
        and committed at once or left reserved; a refusal agrees with ``can_append`` and changes nothing."""
        fits = self.cache.can_append(seq, len(tokens))
        before = self.snapshot()
        try:
            self.model.reserve(seq, tokens)
        except OutOfBlocksError:
            assert not fits, "can_append said yes, append refused"
            self.assert_unchanged(before, f"a refused append to sequence {seq}")
            return
        assert fits, "can_append said no, append succeeded"
        if write:
            self.model.write(seq)

    @precondition(lambda self: self.pending)
    @rule(seq=seqs, n=st.integers(1, 8))
    def write_part_of_a_chunk(self, seq, n):
        """Only the next ``n`` reserved tokens (at most what is pending) are written and committed (a chunk
        cut short); with nothing pending it is a commit of nothing new."""
        self.model.write(seq, n)

    @precondition(lambda self: self.pending)
    @rule(seq=seqs)
    def failed_write(self, seq):
        """A write that raises (K/V of the wrong dtype) writes nothing and commits nothing."""
        before = self.snapshot()
        self.model.failed_write(seq)
        self.assert_unchanged(before, f"a failed write to sequence {seq}")

    @rule(target=freed, seq=consumes(seqs))
    def abort_before_write(self, seq):
        """A request aborted, possibly between reserve and write (C11): the blocks only it held, past what
        it committed, go back free and cache nothing."""
        table = self.cache.block_table(seq).tolist()
        bs, m = self.geometry.block_size, self.model.seqs[seq]
        own_unwritten = [b for i, b in enumerate(table)
                         if (i + 1) * bs > m.written and b != NULL_BLOCK and self.alloc.ref_count(b) == 1]
        self.release(seq)
        for b in own_unwritten:
            assert self.alloc.is_free(b) and b not in self.alloc.cached_entries(), \
                f"block {b}, reserved by aborted sequence {seq} but never written, is in the prefix cache"
        return seq

    @rule(target=seqs, seq=consumes(seqs))
    def preempt_before_write(self, seq):
        """A request preempted (possibly between reserve and write), then recomputed from all its tokens
        under a new id: its prefix hit covers only K/V written before (the model checks it), then it is
        written in full. A refused recompute adds no sequence."""
        m = self.model.seqs[seq]
        tokens, key = list(m.tokens), m.cache_key
        self.release(seq)
        new = self.admit(tokens, key)
        if new is None:
            return multiple()
        self.model.write(new)
        return new

    @rule(target=seqs, parent=seqs, diverge=st.none() | st.tuples(*[st.lists(VOCAB, min_size=1, max_size=4)] * 2))
    def fork(self, parent, diverge):
        """Parallel sampling: possibly before the parent's reserved tokens are written (then both must
        write them: a copy-on-write may separate their blocks). ``diverge``: the samples diverge at once,
        parent then child appending (and writing) these tokens into a block they share."""
        child = self.new_id()
        self.model.fork(parent, child)
        for seq_id, tokens in zip((parent, child), diverge or ()):
            before = self.snapshot()
            try:
                self.model.reserve(seq_id, tokens)
            except OutOfBlocksError:
                self.assert_unchanged(before, f"a refused append to forked sequence {seq_id}")
                break
            self.model.write(seq_id)
        return child

    @rule(target=freed, seq=consumes(seqs))
    def finish(self, seq):
        """A request finishes or is preempted: blocks it shares with others stay allocated and intact."""
        self.release(seq)
        return seq

    def refuse_oversized(self, seq, tokens):
        """An append larger than the free pool (``tokens`` repeated) is refused and changes nothing;
        returns the retry (its first block's worth)."""
        bs, m = self.geometry.block_size, self.model.seqs[seq]
        releasable = self.cache.block_table(seq).tolist()[:releasable_blocks(m.written, self.cache.window_left, bs)]
        freeable = self.alloc.num_free + sum(b != NULL_BLOCK and self.alloc.ref_count(b) == 1 for b in releasable)
        too_many = (freeable + 1) * bs + 1  # the free pool and what the window may release first
        oversized = (tokens * too_many)[:too_many]
        assert not self.cache.can_append(seq, too_many)
        before = self.snapshot()
        with pytest.raises(OutOfBlocksError):
            self.model.reserve(seq, oversized)
        self.assert_unchanged(before, f"a refused oversized append to sequence {seq}")
        return oversized[:bs]

    def retry(self, seq, tokens):
        if self.cache.can_append(seq, len(tokens)):
            self.model.reserve(seq, tokens)
            self.model.write(seq)

    @rule(seq=seqs, tokens=st.lists(VOCAB, min_size=1, max_size=3))
    def refused_then_retried(self, seq, tokens):
        """An append of ``tokens`` repeated past the free pool is refused and changes nothing; a retry of
        a fitting size succeeds when ``can_append`` says it fits."""
        self.retry(seq, self.refuse_oversized(seq, tokens))

    @precondition(lambda self: len(self.model.seqs) >= 2)
    @rule(target=freed, finished=consumes(seqs), seq=seqs, tokens=st.lists(VOCAB, min_size=1, max_size=3))
    def refused_then_retried_after_a_finish(self, finished, seq, tokens):
        """As :meth:`refused_then_retried`, with another sequence (``finished``, drawn first: never ``seq``)
        finishing between the refusal and the retry."""
        retry = self.refuse_oversized(seq, tokens)
        self.release(finished)
        self.retry(seq, retry)
        return finished

    @precondition(lambda self: any(m.written >= self.geometry.block_size for m in self.model.seqs.values()))
    @rule(seq=seqs, other_key=st.sampled_from(KEYS))
    def same_prompt_under_two_keys(self, seq, other_key):
        """A committed prompt added again under its own namespace hits its cached blocks (hits are found);
        under another namespace (``other_key``, when it is another) it shares none of them."""
        bs, m = self.geometry.block_size, self.model.seqs[seq]
        prompt, own = m.tokens[:m.written] + [0], self.cache.block_table(seq).tolist()
        if other_key != m.cache_key:
            other = self.new_id()
            self.model.add(other, prompt, other_key)
            shared = set(self.model.held(other)) & set(self.model.held(seq))
            assert not shared, \
                f"the same tokens under cache_key {other_key!r} share blocks {shared} of {m.cache_key!r}"
            self.release(other)
        again = self.new_id()
        cached = self.model.add(again, prompt, m.cache_key)
        committed = own[:m.written // bs] if NULL_BLOCK not in own else []  # a released block may be evicted
        committed_blocks = [b for b in committed if b in self.alloc.cached_entries()]
        assert cached >= len(committed_blocks) * bs, \
            f"sequence {seq}'s {len(committed_blocks)} committed blocks are cached, a re-add hits {cached} tokens"
        self.release(again)

    @rule(seq=freed)
    def double_free(self, seq):
        """C3: freeing a freed sequence again raises DoubleFreeError and changes nothing."""
        before = self.snapshot()
        with pytest.raises(DoubleFreeError):
            self.cache.free(seq)
        self.assert_unchanged(before, f"a second free of sequence {seq}")

    @rule(block=st.integers(0, 10))
    def double_free_block(self, block):
        """Dropping a reference a free (or evictable) block does not hold raises and changes nothing; so
        does releasing a used block more times than it is referenced, and freeing a block id past the pool."""
        before = self.snapshot()
        if block >= self.alloc.num_blocks:
            with pytest.raises(UnknownBlockError):
                self.alloc.free(block)
        elif self.alloc.is_free(block):
            with pytest.raises(DoubleFreeError):
                self.alloc.free(block)
        else:
            with pytest.raises(DoubleFreeError):
                self.alloc.free_all([block] * (self.alloc.ref_count(block) + 1))
        self.assert_unchanged(before, f"a double free of block {block}")

    @rule(system=systems, suffix=SUFFIX, cache_key=st.sampled_from(KEYS))
    def prefix_lookup(self, system, suffix, cache_key):
        """A lookup takes no reference; each block it finds caches exactly that token prefix, under
        that namespace, and was written."""
        prompt = system + suffix
        before = self.snapshot()
        found = self.alloc.find_cached_prefix(prompt, cache_key)
        self.assert_unchanged(before, "a prefix lookup (which takes no reference)")
        bs = self.geometry.block_size
        for i, b in enumerate(found):
            prefix = tuple(prompt[:(i + 1) * bs])
            assert self.alloc.cached_prefix(b) == prefix, f"block {b}: a hit on unequal tokens"
            assert self.alloc.cached_entries()[b].cache_key == cache_key, f"block {b}: a hit across namespaces"
            assert (cache_key, prefix) in self.model.written_prefixes, f"block {b}: a hit on K/V never written"

    @rule(seq=seqs, commit_less_by=st.integers(0, 8), depth=st.integers(0, 4))
    def prefix_reinsert(self, seq, commit_less_by, depth):
        """A commit of no more tokens than are committed (``commit_less_by`` fewer) is a no-op, and so is
        registering again the full block at ``depth`` of the table when it caches its prefix."""
        s, bs = self.cache.sequences[seq], self.geometry.block_size
        before = self.snapshot()
        assert self.cache.mark_written(seq, max(s.num_written - commit_less_by, 0)) == 0
        self.assert_unchanged(before, "a commit of tokens already committed")
        table = s.block_table
        if depth >= s.num_written // bs or table[depth] not in self.alloc.cached_entries() or \
                (depth and table[depth - 1] == NULL_BLOCK):
            return  # no full block there, its prefix is cached by another block (registered first), or its
            # parent was released by the window
        self.alloc.cache_full_block(s.block_table[depth], s.token_ids[depth * bs:(depth + 1) * bs],
                                    s.block_table[depth - 1] if depth else None, cache_key=s.cache_key)
        self.assert_unchanged(before, "re-registering a cached block")

    @rule(kind=st.sampled_from(("unknown_seq", "negative_n", "bad_block", "unhashable_key")))
    def bad_arguments(self, kind):
        """Bad arguments raise the documented type and change nothing."""
        before = self.snapshot()
        if kind == "unknown_seq":
            with pytest.raises(UnknownBlockError):
                self.cache.append(self.next_id + 1000, [1])
        elif kind == "negative_n":
            with pytest.raises(ValueError):
                self.alloc.allocate(-1)
        elif kind == "bad_block":
            with pytest.raises(UnknownBlockError):
                self.alloc.free(self.alloc.num_blocks)
        else:
            with pytest.raises(ArgumentTypeError, match="cache_key"):
                self.cache.add_sequence(self.next_id + 1000, [1, 2], cache_key=["not", "hashable"])
        self.assert_unchanged(before, f"a call with a bad argument ({kind})")

    @rule(seq=seqs, kind=st.sampled_from(("float_token", "commit_past_end", "slots_past_end")))
    def bad_sequence_arguments(self, seq, kind):
        """Bad arguments about a live sequence raise the documented type and change nothing."""
        before = self.snapshot()
        if kind == "float_token":
            with pytest.raises(ArgumentTypeError):
                self.cache.append(seq, [1, 2.5])
        elif kind == "commit_past_end":
            with pytest.raises(ShapeError, match="num_tokens"):
                self.cache.mark_written(seq, self.cache.seq_len(seq) + 1)
            with pytest.raises(ShapeError, match="num_tokens"):
                self.cache.mark_written(seq, -1)
        else:
            with pytest.raises(ShapeError, match="end"):
                self.cache.slot_mapping(seq, 0, self.cache.seq_len(seq) + 1)
        self.assert_unchanged(before, f"a call with a bad argument ({kind}) about sequence {seq}")

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def the_model_holds(self):
        self.model.observe_evictions("after a step")
        self.model.check("after a step")
        assert self.alloc.num_free + self.alloc.num_used == self.alloc.num_blocks
        if self.cache.window_left is not None:  # the model's check covers window_rules.check_cached_blocks
            for seq_id, m in self.model.seqs.items():
                check_windowed_sequence(self.cache, seq_id, m.tokens, m.written, m.cache_key, self.kv_of,
                                        self.model.gather)

    def kv_of(self, tokens, start, end, layer, cache_key):
        return self.model.kv((tokens, cache_key), start, end, layer)

    def teardown(self):
        if not hasattr(self, "model"):
            return
        for seq_id in self.live:
            self.release(seq_id)
        self.cache.check_invariants()
        assert self.alloc.num_used == 0 and self.alloc.num_free == self.alloc.num_blocks, "a block leaked"
        assert all(self.alloc.is_free(b) for b in range(self.alloc.num_blocks))


class FullAttentionCacheMachine(CacheMachine):
    """The machine without a sliding window: a backend read through its ``paged_attention`` only (no
    ``gather``) is judged by a causal prefill over every committed token, which a released block breaks."""

    @initialize(**POOL)
    def start(self, num_blocks, block_size, num_layers, constant_hash, seed):
        CacheMachine.start(self, num_blocks, block_size, num_layers, constant_hash, seed, window_left=None)


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
    base = CacheMachine if backend is None or getattr(backend, "gather", None) else FullAttentionCacheMachine
    return type(f"CacheMachine_{cls.__name__}", (base,), {"cache_class": cls, "backend": backend, "device": device,
                                                          **space})


def cache_state_machine(backend: Any, device: str = "cpu", chosen: settings | None = None, caps: Any = None) -> None:
    """Run the state machine over ``backend`` inside ``caps`` (a registered property of kind ``"machine"``).

    Raises:
        AssertionError: a rule or invariant failed (Hypothesis prints the shrunk steps).
    """
    from pagedkv.testing.settings import machine_settings

    run_state_machine_as_test(machine_for(backend, device, caps=caps), settings=machine_settings(chosen, STEPS))
