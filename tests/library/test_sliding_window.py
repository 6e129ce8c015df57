"""Sliding-window block release (``CacheConfig.window_left``): what is released, what stays, what the
backends read, and a state machine over sharing, prefix hits and namespaces."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import CacheConfig, PagedKVCache, get_backend
from pagedkv.attention.dense import paged_attention_sync_free, reference_attention
from pagedkv.backends import available_backends
from pagedkv.errors import ArgumentValueError, BlockIndexError, OutOfBlocksError, ShapeError
from pagedkv.testing.properties.cache_model import expected_kv
from pagedkv.testing.cases import Geometry
from pagedkv.testing.properties.window_rules import check_cached_blocks, check_windowed_sequence
from pagedkv.cache.window import releasable_blocks

INDEXED = get_backend("indexed")


def _cache(num_blocks=16, block_size=4, window_left=5, enable_prefix_caching=True) -> PagedKVCache:
    return PagedKVCache(CacheConfig(num_blocks=num_blocks, block_size=block_size, num_kv_heads=1, head_dim=4,
                                    window_left=window_left, debug_poison="nan"),
                        enable_prefix_caching=enable_prefix_caching)


def _decode(cache, seq_id, tokens, kv):
    """Append, write and commit ``tokens`` one at a time; ``kv[p]`` is position p's K (V = -K)."""
    for t in tokens:
        p = cache.seq_len(seq_id)
        slots = cache.append(seq_id, [t])
        INDEXED.write_kv(cache.k_cache(), cache.v_cache(), kv[p:p + 1], -kv[p:p + 1], slots)
        cache.mark_written(seq_id)


def test_releasable_blocks_is_the_block_before_the_first_visible_key():
    # window_left 5, block_size 4: after 13 committed tokens the next query (position 13) reads from 8
    assert releasable_blocks(13, 5, 4) == 2
    assert releasable_blocks(12, 5, 4) == 1 and releasable_blocks(5, 5, 4) == 0
    assert releasable_blocks(13, None, 4) == releasable_blocks(13, -1, 4) == 0
    assert releasable_blocks(13, 0, 4) == 3 and releasable_blocks(13, 0, 4, keep_last_full=True) == 2


def test_an_append_releases_what_no_later_query_reads_and_returns_it_to_the_pool():
    cache = _cache(window_left=5)
    kv = torch.randn(40, 1, 4)
    cache.add_sequence(0, [])
    _decode(cache, 0, range(21), kv)
    # the last append ran with 20 committed: position 20 reads from 15, so blocks 0..2 went back
    assert cache.block_table(0).tolist()[:3] == [-1, -1, -1] and min(cache.block_table(0).tolist()[3:]) >= 0
    assert cache.first_held_position(0) == 12
    assert cache.stats()["window_released"] == 3 == cache.stats()["window_released_live"]
    assert cache.allocator.num_used == 3  # blocks 3, 4, 5 of the table
    cache.check_invariants()
    # mark_written alone releases nothing (the step's attention may still read): the next append does
    cache.mark_written(0)
    assert cache.first_held_position(0) == 12
    cache.free(0)
    assert cache.allocator.num_used == 0


def test_released_uncached_blocks_are_poisoned_and_cached_ones_keep_their_kv():
    cache = _cache(window_left=1, enable_prefix_caching=False)
    kv = torch.randn(12, 1, 4)
    cache.add_sequence(0, [])
    first = None
    for t in range(10):
        _decode(cache, 0, [t], kv)
        first = cache.block_table(0).tolist()[0] if first is None else first
    assert cache.block_table(0).tolist()[0] == -1
    assert torch.isnan(cache.k_cache()[first]).all() and torch.isnan(cache.v_cache()[first]).all()
    cached = _cache(window_left=1)
    cached.add_sequence(0, [])
    _decode(cached, 0, range(10), kv)
    block = cached.allocator.find_cached_prefix(list(range(4)))[0]
    assert cached.block_table(0).tolist()[0] == -1 and cached.allocator.ref_count(block) == 0
    torch.testing.assert_close(cached.k_cache()[block], kv[:4])  # evictable: a later prompt may hit it


def test_a_shared_block_released_by_one_sequence_stays_with_the_other():
    cache = _cache(window_left=3, enable_prefix_caching=False)
    kv = torch.randn(40, 1, 4)
    cache.add_sequence(0, [])
    _decode(cache, 0, range(6), kv)
    cache.fork(0, 1)
    shared = cache.block_table(0).tolist()[0]
    _decode(cache, 0, range(6, 14), kv)  # the parent's window moves on: it drops its reference
    assert cache.block_table(0).tolist()[0] == -1
    assert cache.block_table(1).tolist()[0] == shared and cache.allocator.ref_count(shared) == 1
    cache.check_invariants()
    check = lambda sid, n: check_windowed_sequence(  # noqa: E731
        cache, sid, list(range(n)), n, None, lambda t, s, e, layer, key: (kv[s:e], -kv[s:e]), INDEXED.gather)
    check(0, 14)
    check(1, 6)


def test_a_prefix_hit_takes_no_reference_on_blocks_before_its_window():
    cache = _cache(num_blocks=20, window_left=2)
    kv = torch.randn(40, 1, 4)
    prompt = list(range(17))
    cache.add_sequence(0, [])
    _decode(cache, 0, prompt, kv)
    cache.free(0)
    evictable = cache.allocator.evictable_blocks()
    cached = cache.add_sequence(1, prompt)
    assert cached == 16
    table = cache.block_table(1).tolist()
    # the first query (position 16) reads from 14: blocks 0..2 are not taken, block 3 is (it is the parent
    # of the next block to cache, and holds positions 12..15)
    assert table[:3] == [-1, -1, -1] and table[3] >= 0
    assert [b for b in evictable if b not in table] == cache.allocator.evictable_blocks()  # queue order kept
    _decode(cache, 1, [16, 17, 18, 19, 20], kv)  # the prompt's last token, then decode
    # block 4 (positions 16..19) entered the prefix cache under its held parent: the whole chain is found
    assert len(cache.allocator.find_cached_prefix(list(range(20)))) == 5
    cache.check_invariants()


def test_append_is_all_or_nothing_and_can_append_counts_the_blocks_a_release_frees():
    cache = _cache(num_blocks=3, window_left=0, enable_prefix_caching=False)
    kv = torch.randn(40, 1, 4)
    cache.add_sequence(0, [])
    _decode(cache, 0, range(8), kv)  # 2 blocks; the next append releases both
    cache.add_sequence(1, [])
    cache.append(1, [0])  # the third block
    assert cache.can_append(0, 8)  # 2 blocks, freed by its own release
    assert not cache.can_append(0, 9)
    before = cache.block_table(0).tolist()
    with pytest.raises(OutOfBlocksError):
        cache.append(0, list(range(9)))
    assert cache.block_table(0).tolist() == before  # nothing released by the refused append
    cache.append(0, list(range(8)))
    assert cache.block_table(0).tolist()[:2] == [-1, -1]


def test_slot_mapping_refuses_released_positions():
    cache = _cache(window_left=1)
    cache.add_sequence(0, [])
    _decode(cache, 0, range(10), torch.randn(12, 1, 4))
    with pytest.raises(ShapeError, match="released"):
        cache.slot_mapping(0, 0, 4)
    assert cache.slot_mapping(0, 8, 10).tolist() == cache.slot_mapping(0, 8).tolist()


def test_config_checks_window_left():
    assert CacheConfig(4, 4, 1, 4, window_left=-1).window_left is None
    with pytest.raises(ArgumentValueError, match="window_left"):
        CacheConfig(4, 4, 1, 4, window_left=-2)
    with pytest.raises(TypeError, match="window_left"):
        CacheConfig(4, 4, 1, 4, window_left=2.0)


def _windowed_batch(window_left=5, block_size=4, lens=(23, 9, 17), q_lens=(1, 3, 5)):
    """Tables with -1 before every sequence's window, a NaN pool, and the fp64 reference."""
    torch.manual_seed(0)
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    k_cache = torch.full((num_blocks, block_size, 2, 8), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    width = max(-(-n // block_size) for n in lens)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    keys, values, qsl, nxt = [], [], [0], 1  # block 0 stays NaN: the sync-free path clamps -1 onto it
    for b, (n, q) in enumerate(zip(lens, q_lens)):
        k, v = torch.randn(n, 2, 8), torch.randn(n, 2, 8)
        keys.append(k)
        values.append(v)
        first = max(0, n - q - window_left) // block_size
        for i in range(-(-n // block_size)):
            if i >= first:
                tables[b, i] = nxt
                m = min(block_size, n - i * block_size)
                lo = i * block_size
                k_cache[nxt, :m], v_cache[nxt, :m] = k[lo:lo + m], v[lo:lo + m]
                nxt += 1
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], 4, 8)
    expected = reference_attention(query, keys, values, qsl, window_left=window_left)
    lens_t, qsl_t = torch.tensor(lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32)
    return query, k_cache, v_cache, tables, lens_t, qsl_t, expected


@pytest.mark.parametrize("name", available_backends())
@pytest.mark.parametrize("validate", ["full", "metadata"])
def test_backends_skip_released_entries_and_refuse_them_inside_the_window(name, validate):
    query, k, v, tables, lens, qsl, expected = _windowed_batch()
    assert (tables == -1).any()
    backend = get_backend(name)
    out = backend.paged_attention(query, k, v, tables, lens, qsl, window_left=5, validate=validate)
    assert not torch.isnan(out).any()  # no released (NaN) slot was read
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    with pytest.raises(BlockIndexError, match=r"block_tables\[0\] has block id -1 at entry"):
        backend.paged_attention(query, k, v, tables, lens, qsl, window_left=9)  # a wider window reads them
    with pytest.raises(BlockIndexError, match="-1 at entry 0"):
        backend.gather(k, tables[0], int(lens[0]))  # gather reads from position 0: never over a -1


def test_sync_free_attention_masks_released_entries():
    query, k, v, tables, lens, qsl, expected = _windowed_batch()
    out = paged_attention_sync_free(query, k, v, tables, lens, qsl, 8 ** -0.5, window_left=5)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_a_windowed_cache_serves_the_same_attention_as_a_full_one():
    """Same workload, window_left 6 on every read: the released run's outputs equal the full run's bit for bit."""
    outs = []
    for release in (False, True):
        cache = _cache(num_blocks=24, window_left=6 if release else None)
        torch.manual_seed(1)
        kv = torch.randn(60, 1, 4)
        for sid in (0, 1):
            cache.add_sequence(sid, [])
        got = []
        for step in range(25):
            for sid in (0, 1):
                _decode(cache, sid, [step * 2 + sid], kv if sid == 0 else kv.flip(0))
            q = torch.randn(2, 2, 4)
            qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
            got.append(INDEXED.paged_attention(q, cache.k_cache(), cache.v_cache(), cache.block_tables([0, 1]),
                                               cache.seq_lens([0, 1]), qsl, window_left=6))
        outs.append(torch.stack(got))
        assert (cache.stats()["window_released"] > 0) == release
    assert torch.equal(outs[0], outs[1])


# -- the state machine ---------------------------------------------------------------------------------
VOCAB = st.integers(0, 3)
KEYS = (None, "tenant-a", 7, ("lora", 7))


class WindowMachine(RuleBasedStateMachine):
    """A windowed cache driven like a scheduler: adds with prefix hits under namespaces, appends written
    whole, in part or not at all, forks and frees; after every rule every live sequence reads its own
    tokens' K/V inside its window, and every cached block its prefix's
    (:mod:`pagedkv.testing.properties.window_rules`)."""

    @initialize(num_blocks=st.integers(4, 12), block_size=st.sampled_from((1, 2, 3, 4)), window_left=st.integers(0, 9),
                num_layers=st.integers(1, 2), seed=st.integers(0, 50), prefix_caching=st.booleans(),
                systems=st.lists(st.lists(VOCAB, min_size=0, max_size=8), min_size=1, max_size=3))
    def start(self, num_blocks, block_size, window_left, num_layers, seed, prefix_caching, systems):
        self.geometry = Geometry(num_blocks, block_size, num_kv_heads=1, head_dim=2, dtype="float32")
        config = dataclasses.replace(self.geometry.cache_config("cpu", num_layers), window_left=window_left,
                                     debug_poison="nan")
        self.cache = PagedKVCache(config, enable_prefix_caching=prefix_caching)
        self.seed, self.systems = seed, systems
        self.seqs: dict[int, tuple[list[int], int, object]] = {}  # tokens, written, cache_key
        self.written_prefixes: set = set()
        self.next_id = 0

    def kv_of(self, tokens, start, end, layer, key):
        return expected_kv(self.geometry, list(tokens)[:end], start, self.seed, layer=layer, cache_key=key)

    def write(self, seq_id, n=None):
        tokens, written, key = self.seqs[seq_id]
        end = len(tokens) if n is None else min(len(tokens), written + n)
        if end > written:
            slots = self.cache.slot_mapping(seq_id, written, end)
            for layer in range(self.cache.config.num_layers):
                k, v = self.kv_of(tokens, written, end, layer, key)
                INDEXED.write_kv(self.cache.k_cache(layer), self.cache.v_cache(layer), k, v, slots)
        self.cache.mark_written(seq_id, end)
        self.seqs[seq_id] = (tokens, end, key)
        bs = self.cache.block_size
        self.written_prefixes.update((key, tuple(tokens[:e])) for e in range(bs, end + 1, bs))

    def reserve(self, seq_id, new) -> bool:
        tokens, written, key = self.seqs[seq_id]
        if not self.cache.can_append(seq_id, len(new)):
            with pytest.raises(OutOfBlocksError):
                self.cache.append(seq_id, new)
            return False
        self.cache.append(seq_id, new)
        self.seqs[seq_id] = (tokens + list(new), written, key)
        return True

    @rule(data=st.data())
    def add(self, data):
        prompt = data.draw(st.sampled_from(self.systems)) + data.draw(st.lists(VOCAB, min_size=1, max_size=6))
        key = data.draw(st.sampled_from(KEYS))
        seq_id, self.next_id = self.next_id, self.next_id + 1
        cached = self.cache.add_sequence(seq_id, prompt, cache_key=key)
        self.seqs[seq_id] = (prompt[:cached], cached, key)
        if not self.reserve(seq_id, prompt[cached:]):
            self.free_seq(seq_id)
        elif data.draw(st.booleans()):
            self.write(seq_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), how=st.sampled_from(("all", "all", "part", "none")))
    def step(self, data, how):
        """Write what is pending (whole, in part, or not: a write that raised), then decode or chunk."""
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        if how != "none":
            self.write(seq_id, None if how == "all" else data.draw(st.integers(0, 3)))
        self.reserve(seq_id, data.draw(st.lists(VOCAB, min_size=1, max_size=4)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.cache.fork(parent, child)
        tokens, written, key = self.seqs[parent]
        self.seqs[child] = (list(tokens), written, key)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        self.free_seq(data.draw(st.sampled_from(sorted(self.seqs))))

    def free_seq(self, seq_id):
        self.cache.free(seq_id)
        del self.seqs[seq_id]

    @invariant()
    def every_live_sequence_reads_its_own_tokens_inside_its_window(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        for seq_id, (tokens, written, key) in self.seqs.items():
            check_windowed_sequence(self.cache, seq_id, tokens, written, key, self.kv_of, INDEXED.gather)
        check_cached_blocks(self.cache, self.written_prefixes, self.kv_of)

    def teardown(self):
        if hasattr(self, "cache"):
            for seq_id in list(self.seqs):
                self.free_seq(seq_id)
            assert self.cache.allocator.num_used == 0, "blocks leaked after every sequence was freed"


WindowMachine.TestCase.settings = settings(settings(), stateful_step_count=40)
TestWindowMachine = WindowMachine.TestCase


# -- the shadow model's window checks (the cache state machine draws window_left) ------------------------
class _WindowCountsReservedTokens(PagedKVCache):
    """Moves the window with the tokens reserved, not those committed: it releases blocks the queries
    of the tokens still to be written read."""

    def _releasable(self, seq):
        return seq.block_table[seq.num_released:releasable_blocks(seq.num_tokens, self.window_left, self.block_size)]


def _model(cache_class, window_left, num_blocks=12, block_size=2):
    from pagedkv.testing.properties.cache_model import CacheModel

    geometry = Geometry(num_blocks, block_size, num_kv_heads=1, head_dim=2, dtype="float32")
    config = dataclasses.replace(geometry.cache_config("cpu", 2), window_left=window_left, debug_poison="nan")
    cache = cache_class(config)
    return CacheModel(cache, geometry, 3, 2, INDEXED.write_kv, INDEXED.gather)


def test_the_model_follows_releases_under_sharing_and_prefix_hits():
    model = _model(PagedKVCache, window_left=1)
    model.add(0, list(range(7)))
    model.reserve(0, list(range(7)))
    model.write(0)
    model.fork(0, 1)
    for t in range(4):  # the parent's window moves on: it releases blocks its child still holds
        model.reserve(0, [t])
        model.write(0)
    assert model.cache.first_held_position(0) > 0 and model.cache.first_held_position(1) == 0
    model.free(0)
    model.observe_evictions("after the parent finished")
    assert model.add(2, list(range(7)) + [0]) == 6  # a hit on the child's blocks and the released ones
    model.reserve(2, [0])
    model.check("after a hit under a window")
    model.free(1)
    model.free(2)
    model.observe_evictions("after every sequence finished")
    model.check("at the end")
    assert model.alloc.num_used == 0


def test_the_model_catches_a_release_of_a_block_the_next_query_reads():
    from pagedkv.testing.properties.cache_model import ModelMismatch

    model = _model(_WindowCountsReservedTokens, window_left=2)
    model.add(0, [])
    model.reserve(0, list(range(8)))  # a chunk reserved, not yet written
    with pytest.raises(ModelMismatch, match="released its first 3 blocks"):
        model.reserve(0, [8])
