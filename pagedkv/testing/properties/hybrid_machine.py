"""The hybrid cache (:class:`~pagedkv.cache.hybrid.HybridKVCache`: KV-cache groups on one block pool) as a
Hypothesis state machine, driven like a scheduler drives it and checked per group after every rule.

Histories: adds under namespaces (the agreed prefix hit), appends written at once, in part or never,
forks, finishes and aborts, refused oversized appends, double frees and bad arguments, over pools of
3-24 blocks, block sizes 1-4, 1-4 layers of drawn kinds (``full_attention`` / ``sliding_attention``,
at least one group) and windows 0-6, with a hash that may collide always.

After every rule, computed here from the tables and the shadow model (not from the cache's own counts):

- no physical block is held by two groups; each block's reference count equals the tables holding
  it, over every group; free + used = total with ``used`` counted from the tables;
- every group's hit is the agreed length (bursts of other traffic evict what the windows released, so
  the groups hold unequal runs of a prefix): right after an add, every group's table covers exactly the
  cached tokens, full groups with real blocks throughout, sliding groups with ``-1`` only before the
  window of the hit's end; a re-add of a committed prompt hits at least what the live tables still
  cache (full groups: every block; sliding groups: the window) (hits are found);
- every layer reads, through its group's table, the K/V written for the sequence's committed tokens:
  a full layer from position 0, a sliding layer from its group's first held position, which is never
  inside the window of the next query (``num_written - window_left``; checked right after each append
  too, before the step's write, when the step's own queries read from there);
- every cached block (walked through the prefix trie, even when its parent block was evicted) holds,
  in every layer of its group, the K/V of a prefix that was written under its namespace;
- a call that raised changed nothing; at the end, every block is free.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule

from pagedkv import get_backend
from pagedkv.cache.hybrid import HybridKVCache
from pagedkv.cache.window import NULL_BLOCK, releasable_blocks
from pagedkv.errors import ArgumentTypeError, DoubleFreeError, OutOfBlocksError, ShapeError
from pagedkv.testing.cases.case import Geometry
from pagedkv.testing.compare import bits
from pagedkv.testing.properties.cache_model import expected_kv

#: Rules per run.
STEPS = 40

VOCAB = st.integers(0, 4)
KEYS = (None, "tenant-a")
KINDS = st.sampled_from(("full_attention", "sliding_attention"))


class HybridCacheMachine(RuleBasedStateMachine):
    """A :class:`HybridKVCache` over a small pool; ``cache_class`` is the cache under test."""

    cache_class = HybridKVCache
    seqs = Bundle("seqs")
    freed = Bundle("freed")

    @initialize(num_blocks=st.integers(3, 24), block_size=st.integers(1, 4), layer_types=st.lists(KINDS, min_size=1,
                max_size=4), window_left=st.integers(0, 6), constant_hash=st.booleans(), seed=st.integers(0, 50))
    def start(self, num_blocks, block_size, layer_types, window_left, constant_hash, seed):
        self.geometry = Geometry(num_blocks, block_size, 1, 2, 1, "float32")
        config = dataclasses.replace(self.geometry.cache_config("cpu", len(layer_types)), window_left=window_left,
                                     layer_types=tuple(layer_types), debug_poison="nan")
        self.cache = self.cache_class(config, **({"hash_fn": lambda parent, tokens: 0} if constant_hash else {}))
        self.alloc, self.bs, self.seed = self.cache.allocator, block_size, seed
        self.write_kv = get_backend("indexed").write_kv
        self.windows = config.layer_windows
        self.model: dict[int, dict] = {}  # seq -> {"tokens", "written", "key"}
        self.written_prefixes: set = set()
        self.next_id = 0

    # -- helpers ------------------------------------------------------------------------------------
    def snapshot(self):
        a = self.alloc.snapshot()
        tables = [{s: (list(q.block_table), list(q.token_ids), q.num_written) for s, q in g.sequences.items()}
                  for g in self.cache.groups]
        return a["ref_counts"], a["free"], a["evictable"], a["entries"], tables, bits(self.cache.kv).clone()

    def assert_unchanged(self, before, what):
        after = self.snapshot()
        for x, y in zip(before, after):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f"{what} changed the cache"

    def group_window(self, g):
        return self.cache.specs[g].window_left

    def write(self, seq, n=None):
        """Write the next ``n`` reserved tokens (all) in every layer through its group's slots, then commit."""
        m = self.model[seq]
        start = m["written"]
        end = len(m["tokens"]) if n is None else min(len(m["tokens"]), start + n)
        if end > start:
            for layer in range(self.cache.config.num_layers):
                k, v = expected_kv(self.geometry, m["tokens"][:end], start, self.seed, layer=layer,
                                   cache_key=m["key"])
                slots = self.cache.slot_mapping(seq, start, end, group=self.cache.group_of(layer))
                self.write_kv(self.cache.k_cache(layer), self.cache.v_cache(layer), k, v, slots)
        self.cache.mark_written(seq, end)
        m["written"] = end
        for i in range(end // self.bs):
            self.written_prefixes.add((m["key"], tuple(m["tokens"][:(i + 1) * self.bs])))

    def add_request(self, prompt, key):
        seq = self.next_id
        self.next_id += 1
        cached = self.cache.add_sequence(seq, prompt, cache_key=key)
        bs = self.bs
        assert cached % bs == 0 and cached <= max(len(prompt) - 1, 0), f"add of {seq}: {cached} cached tokens"
        for g in range(len(self.cache.groups)):  # every group truncated to the agreed length
            table = self.cache.block_table(seq, group=g).tolist()
            skip = sum(b == NULL_BLOCK for b in table)
            assert len(table) == cached // bs, \
                f"add of {seq}: group {g} holds {len(table)} blocks for a hit of {cached} tokens"
            assert table[skip:] == [b for b in table if b != NULL_BLOCK] and \
                skip <= releasable_blocks(cached, self.group_window(g), bs, keep_last_full=True), \
                f"add of {seq}: group {g}'s table {table} after a hit of {cached} (window {self.group_window(g)})"
        for i in range(cached // bs):
            assert (key, tuple(prompt[:(i + 1) * bs])) in self.written_prefixes, \
                f"add of {seq}: a hit on block {i} whose K/V was never written"
        self.model[seq] = {"tokens": list(prompt[:cached]), "written": cached, "key": key}
        before = self.snapshot()
        try:
            self.cache.append(seq, prompt[cached:])
        except OutOfBlocksError:
            self.assert_unchanged(before, f"a refused prefill of {seq}")
            self.release(seq)
            return None
        self.model[seq]["tokens"] = list(prompt)
        self.check_windows(seq, f"the prefill of {seq}")
        return seq

    def check_windows(self, seq, what):
        """Right after an append, before its write: the step's queries (from ``num_written`` on) read keys
        from ``num_written - window_left``: no group released a block holding one of them."""
        written = self.model[seq]["written"]
        for g, spec in enumerate(self.cache.specs):
            first = self.cache.first_held_position(seq, group=g)
            limit = 0 if spec.window_left is None else max(0, written - spec.window_left)
            assert first <= limit, (f"{what}: group {g} (window {spec.window_left}) of sequence {seq} released the "
                                    f"blocks before position {first}; this step's first query reads from {limit}")

    def release(self, seq):
        self.cache.free(seq)
        del self.model[seq]

    def promised_hit(self, seq, num_tokens=None) -> int:
        """Blocks a prompt starting with ``seq``'s first ``num_tokens`` committed tokens (all) must hit at
        least: the longest run its own tables still cache (a full group's every block with its prefix, a
        sliding group's window), at most ``num_tokens - 1`` tokens (the last one is computed)."""
        m, bs = self.model[seq], self.bs
        tokens = m["tokens"][:m["written"]]
        entries = self.alloc.cached_entries()
        length = len(tokens) // bs if num_tokens is None else min(len(tokens), max(num_tokens - 1, 0)) // bs
        for g in range(len(self.cache.groups)):
            if self.group_window(g) is None:
                table, run = self.cache.block_table(seq, group=g).tolist(), 0
                while run < length and table[run] in entries and \
                        self.alloc.cached_prefix(table[run]) == tuple(tokens[:(run + 1) * bs]):
                    run += 1
                length = min(length, run)
        while length:
            ok = True
            for g in range(len(self.cache.groups)):
                table = self.cache.block_table(seq, group=g).tolist()
                first = releasable_blocks(length * bs, self.group_window(g), bs, keep_last_full=True)
                ok &= all(table[d] != NULL_BLOCK and table[d] in entries for d in range(first, length))
            if ok:
                return length
            length -= 1
        return 0

    # -- rules --------------------------------------------------------------------------------------
    @rule(target=seqs, prompt=st.lists(VOCAB, max_size=12), key=st.sampled_from(KEYS), write=st.booleans())
    def add(self, prompt, key, write):
        seq = self.add_request(prompt, key)
        if seq is None:
            return multiple()
        if write:
            self.write(seq)
        return seq

    @rule(target=seqs, seq=seqs, cut=st.integers(0, 16), suffix=st.lists(VOCAB, max_size=4), write=st.booleans())
    def add_sharing_a_prefix(self, seq, cut, suffix, write):
        """A request whose prompt starts with the first ``cut`` tokens of a live sequence (a shared system
        prompt, a conversation continued): the hits a live sequence's windows moved past are drawn here."""
        return self.add(self.model[seq]["tokens"][:cut] + suffix, self.model[seq]["key"], write)

    @rule(seq=seqs, tokens=st.lists(VOCAB, min_size=1, max_size=5), write=st.booleans())
    def append(self, seq, tokens, write):
        fits = self.cache.can_append(seq, len(tokens))
        before = self.snapshot()
        try:
            self.cache.append(seq, tokens)
        except OutOfBlocksError:
            assert not fits, "can_append said yes, append refused"
            self.assert_unchanged(before, f"a refused append to {seq}")
            return
        assert fits, "can_append said no, append succeeded"
        self.model[seq]["tokens"] += tokens
        self.check_windows(seq, f"an append to {seq}")
        if write:
            self.write(seq)

    @rule(seq=seqs, n=st.integers(1, 6))
    def write_part(self, seq, n):
        self.write(seq, n)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        child = self.next_id
        self.next_id += 1
        self.cache.fork(parent, child)
        self.model[child] = {**self.model[parent], "tokens": list(self.model[parent]["tokens"])}
        return child

    @rule(target=freed, seq=consumes(seqs))
    def finish(self, seq):
        self.release(seq)
        return seq

    @rule(n=st.integers(0, 6))
    def other_traffic(self, n):
        """Another request fills the free list and takes about ``n`` blocks more (evicting the least
        recently released cached blocks), then is aborted before its write."""
        seq = self.next_id
        self.next_id += 1
        self.cache.add_sequence(seq, [], cache_key="other")
        self.model[seq] = {"tokens": [], "written": 0, "key": "other"}
        empty = self.alloc.num_free - len(self.alloc.evictable_blocks())
        cap = (empty // len(self.cache.groups) + n) * self.bs  # tokens: each takes a slot in every group
        n = next((k for k in range(cap, 0, -1) if self.cache.can_append(seq, k)), 0)
        before = self.snapshot()
        try:
            self.cache.append(seq, [5] * n)  # token 5 is outside VOCAB: never a hit
        except OutOfBlocksError:
            self.assert_unchanged(before, f"a refused append to {seq}")
            raise AssertionError(f"can_append({seq}, {n}) said yes, append refused") from None
        finally:
            self.release(seq)

    @rule(target=seqs, seq=seqs, n=st.integers(0, 6), cut=st.integers(1, 16))
    def prefix_after_a_burst(self, seq, n, cut):
        """A burst of other traffic (evicting what the live sequences' windows released, least recently
        released first), then a request starting with a live sequence's first ``cut`` tokens: the groups
        then hold unequal runs of that prefix (vllm#44409 and #50457 live here)."""
        self.other_traffic(n)
        m = self.model[seq]
        prompt = m["tokens"][:cut]
        promised = self.promised_hit(seq, len(prompt))
        new = self.add_request(prompt, m["key"])
        if new is None:
            return multiple()
        cached = self.model[new]["written"]
        assert cached >= promised * self.bs, (f"sequence {seq}'s tables still cache {promised} blocks of the first "
                                              f"{cut} tokens, a request starting with them hits {cached} tokens")
        self.write(new)
        return new

    @rule(seq=seqs)
    def same_prompt_hits_again(self, seq):
        """A committed prompt added again hits at least what the live tables still cache, in every group."""
        m = self.model[seq]
        promised = self.promised_hit(seq)
        again = self.add_request(m["tokens"][:m["written"]] + [0], m["key"])
        if again is None:
            return
        cached = self.model[again]["written"]
        assert cached >= promised * self.bs, \
            f"sequence {seq}'s tables cache {promised} blocks of its committed prompt, a re-add hits {cached} tokens"
        self.release(again)

    @rule(seq=seqs, tokens=st.lists(VOCAB, min_size=1, max_size=2))
    def refused_oversized(self, seq, tokens):
        too_many = (self.alloc.num_blocks + 1) * self.bs
        before = self.snapshot()
        assert not self.cache.can_append(seq, too_many)
        with pytest.raises(OutOfBlocksError):
            self.cache.append(seq, (tokens * too_many)[:too_many])
        self.assert_unchanged(before, f"a refused oversized append to {seq}")

    @rule(seq=freed)
    def double_free(self, seq):
        before = self.snapshot()
        with pytest.raises(DoubleFreeError):
            self.cache.free(seq)
        self.assert_unchanged(before, f"a second free of {seq}")

    @rule(seq=seqs, kind=st.sampled_from(("float_token", "commit_past_end", "bad_group", "bad_layer")))
    def bad_arguments(self, seq, kind):
        before = self.snapshot()
        if kind == "float_token":
            with pytest.raises(ArgumentTypeError, match="token_ids"):
                self.cache.append(seq, [1, 2.5])
        elif kind == "commit_past_end":
            with pytest.raises(ShapeError, match="num_tokens"):
                self.cache.mark_written(seq, self.cache.seq_len(seq) + 1)
        elif kind == "bad_group":
            with pytest.raises(IndexError, match="group"):
                self.cache.block_table(seq, group=len(self.cache.groups))
        else:
            with pytest.raises(IndexError, match="layer"):
                self.cache.k_cache(self.cache.config.num_layers)
        self.assert_unchanged(before, f"a call with a bad argument ({kind})")

    # -- invariants ---------------------------------------------------------------------------------
    @invariant()
    def groups_hold(self):
        cache, bs = self.cache, self.bs
        cache.check_invariants()
        owner, refs = {}, {}
        for g in range(len(cache.groups)):
            for seq in self.model:
                for b in cache.block_table(seq, group=g).tolist():
                    if b == NULL_BLOCK:
                        continue
                    assert owner.setdefault(b, g) == g, f"block {b} is held by groups {owner[b]} and {g}"
                    refs[b] = refs.get(b, 0) + 1
        for b in range(self.alloc.num_blocks):
            assert self.alloc.ref_count(b) == refs.get(b, 0), \
                f"block {b}: reference count {self.alloc.ref_count(b)}, held by {refs.get(b, 0)} tables"
        assert len(refs) + self.alloc.num_free == self.alloc.num_blocks, \
            f"{len(refs)} blocks held by tables + {self.alloc.num_free} free != {self.alloc.num_blocks}"
        for seq, m in self.model.items():
            assert cache.seq_len(seq) == len(m["tokens"]) and cache.num_written(seq) == m["written"]
            for layer in range(cache.config.num_layers):
                g = cache.group_of(layer)
                window = self.windows[layer]
                assert cache.specs[g].window_left == window, f"layer {layer} sits in group {g} of another window"
                first = cache.first_held_position(seq, group=g)
                limit = 0 if window is None else max(0, m["written"] - window)
                assert first <= limit, (f"sequence {seq}, layer {layer} (window {window}): blocks before position "
                                        f"{first} released, the next query reads from {limit}")
                if m["written"] <= first:
                    continue
                table = cache.block_table(seq, group=g)[first // bs:]
                k, v = expected_kv(self.geometry, m["tokens"][:m["written"]], first, self.seed, layer=layer,
                                   cache_key=m["key"])
                for pool, exp, name in ((cache.k_cache(layer), k, "K"), (cache.v_cache(layer), v, "V")):
                    got = pool[table.long()].flatten(0, 1)[:m["written"] - first]
                    assert torch.equal(bits(got), bits(exp)), \
                        f"sequence {seq} reads a wrong {name} in layer {layer} (group {g}) from position {first}"
        for block, entry in self.alloc.cached_entries().items():
            parts, node = [], entry.node
            while node is not None:
                parts.append(node.key[2])
                root_key, node = node.key[1], node.parent
            prefix = tuple(t for part in reversed(parts) for t in part)
            g, key = entry.cache_key[1], (entry.cache_key[2] if len(entry.cache_key) == 3 else None)
            assert entry.cache_key == root_key and (key, prefix) in self.written_prefixes, \
                f"block {block} caches a prefix of {len(prefix)} tokens never written under {key!r}"
            for i, layer in enumerate(cache.specs[g].layers):
                k, v = expected_kv(self.geometry, prefix, len(prefix) - bs, self.seed, layer=layer, cache_key=key)
                assert torch.equal(bits(cache.kv[i, 0, block]), bits(k)) and \
                    torch.equal(bits(cache.kv[i, 1, block]), bits(v)), \
                    f"cached block {block} (group {g}) does not hold its prefix's K/V in layer {layer}"

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for seq in list(self.model):
            self.release(seq)
        self.cache.check_invariants()
        assert self.alloc.num_free == self.alloc.num_blocks, "a block leaked"


def hybrid_machine_for(cache_class: type) -> type:
    """The machine over another cache class with :class:`HybridKVCache`'s API (a planted fault)."""
    return type(f"HybridCacheMachine_{cache_class.__name__}", (HybridCacheMachine,), {"cache_class": cache_class})



# -- programs: a failing history as plain lines, replayed without Hypothesis ---------------------------------
def _call(line: str) -> tuple[list[str], str, dict]:
    """``"x = state.rule(a=1, seq=seqs_0)"`` -> ``(["x"], "rule", {"a": 1, "seq": Name("seqs_0")})`` (literals
    and bundle names only: nothing is evaluated)."""
    import ast

    node = ast.parse(line.strip()).body[0]
    targets: list[str] = []
    if isinstance(node, ast.Assign):
        target = node.targets[0]
        targets = [e.id for e in target.elts] if isinstance(target, ast.Tuple) else [target.id]
    call = node.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and not call.args):
        raise ValueError(f"not a step of a program: {line!r}")
    kwargs = {kw.arg: (_Name(kw.value.id) if isinstance(kw.value, ast.Name) else ast.literal_eval(kw.value))
              for kw in call.keywords}
    return targets, call.func.attr, kwargs


class _Name(str):
    """A bundle variable in a program (``seqs_0``)."""


def replay_program(lines: list[str], cache_class: type = HybridKVCache) -> None:
    """Run a program (the lines Hypothesis prints for a failing run of :class:`HybridCacheMachine`: ``state.start(
    ...)``, ``seqs_0 = state.add(...)``, ``state.groups_hold()``, ...) on ``cache_class``; the first line (the
    machine's constructor) is replaced by the machine over ``cache_class``. The invariant runs after every step
    and the teardown (no leak) at the end, as Hypothesis runs them; the program's own ``groups_hold`` and
    ``teardown`` lines are skipped. A step naming a variable an earlier step did not bind (a request the cache
    refused) is skipped.

    Raises:
        AssertionError: the machine's verdict, as in the run that printed the program.
    """
    machine = hybrid_machine_for(cache_class)()
    names: dict[str, object] = {}
    for line in lines:
        if line.startswith("state = ") or not line.strip():
            continue
        targets, method, kwargs = _call(line)
        if method in ("groups_hold", "teardown") or \
                any(isinstance(v, _Name) and v not in names for v in kwargs.values()):
            continue
        result = getattr(machine, method)(**{k: names[v] if isinstance(v, _Name) else v for k, v in kwargs.items()})
        values = list(getattr(result, "values", (result,)))
        names.update(zip(targets, values))
        machine.groups_hold()
    machine.teardown()


def record_program(cache_class: type, max_examples: int = 400) -> list[str]:
    """The first failing program the machine finds over ``cache_class`` (derandomized), cut down by removing
    steps while the replay still fails. ``[]`` when no run fails."""
    from hypothesis.stateful import run_state_machine_as_test

    from pagedkv.testing.settings import program_search_settings

    try:
        run_state_machine_as_test(hybrid_machine_for(cache_class),
                                  settings=program_search_settings(max_examples, STEPS))
        return []
    except AssertionError as exc:
        notes = "\n".join(getattr(exc, "__notes__", []))
    lines = notes.split("Falsifying example:\n", 1)[1]
    steps, current = [], ""
    for line in lines.splitlines():  # a call may span lines (a long list printed over several)
        current = f"{current} {line.strip()}" if current else line
        try:
            _call(current) if not current.startswith("state = ") else None
        except SyntaxError:
            continue
        steps.append(current)
        current = ""

    def fails(program):
        try:
            replay_program(program, cache_class)
        except AssertionError:
            return True
        return False

    assert fails(steps), "the printed program does not fail when replayed"
    i = len(steps) - 1
    while i > 0:  # drop each step (and its invariant check) whose absence keeps the failure
        trial = steps[:i] + steps[i + 1:]
        if ".start(" not in steps[i] and (".groups_hold(" in steps[i] or ".teardown(" in steps[i] or fails(trial)):
            steps = trial
        i -= 1
    return steps
