"""Rules of the cache-manager machine about a manager's API beyond a scheduler's happy path, for managers
that declare them (:attr:`~.protocol.ManagerCapabilities.misuse`, pagedkv's own cache) and for the kernel
backend the machine writes with:

- each misuse the manager declares (a double free, a block released once too often, a bad argument)
  raises its declared type and changes nothing (the manager's ``snapshot()``, pools included);
- a reservation larger than the whole pool is refused (``None``) and changes nothing;
- a write that raises (the kernel backend's ``write_kv`` given K/V of the wrong dtype) writes nothing;
- part of a pending reservation written and committed (a chunk cut short), the rest later;
- requests with one system prompt admitted before any writes (its blocks computed twice);
- a fork whose parent and child each append at once: copy-on-write copies the shared partial block
  only (every full block stays shared);
- where the manager itemizes its evictable blocks, their order (least recently released first, a
  request's blocks tail first) and that an eviction takes their front (without a window).

:class:`ApiRules` is mixed into the machine :func:`~.machine.machine_for` builds when asked
(``rule_sets``); program files replay with it mixed in, so a program of either machine replays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, invariant, multiple, precondition, rule

VOCAB = st.integers(0, 3)


def same(a, b) -> bool:
    """``a == b`` where tensors (nested in tuples, lists and dicts) compare bit for bit (NaN included)."""
    from pagedkv.testing.compare import bits

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            a.dtype == b.dtype and torch.equal(bits(a.cpu()), bits(b.cpu()))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


class ApiRules:
    """Mixed into :class:`~.machine.ManagerMachine` (it uses the machine's ``m``, ``caps``, ``live``,
    ``io``, ``pools`` and helpers)."""

    reqs = Bundle("reqs")

    @contextmanager
    def _quiet(self) -> Iterator[None]:
        """Rules this one calls are not logged (the program replays this rule, which calls them again)."""
        record, self.record = self.record, None
        try:
            yield
        finally:
            self.record = record

    def _unchanged(self, before, what: str) -> None:
        assert same(before, self.m.snapshot()), f"{what} changed the manager's state"

    @precondition(lambda self: self.caps.misuse)
    @rule(rid=reqs, pick=st.integers(0, 15))
    def misuse(self, rid, pick):
        """One of the misuses the manager declares, about live request ``rid`` (and the last freed one):
        it raises the declared type and changes nothing."""
        self.log("misuse", rid=rid, pick=pick)
        freed = [r for r in range(self.next_id) if r not in self.live and r not in self.zombies]
        misuses = self.m.misuses(rid, freed[-1] if freed else None)
        name = sorted(misuses)[pick % len(misuses)]
        call, error = misuses[name]
        before = self.m.snapshot()
        try:
            call()
        except error:
            pass
        else:
            raise AssertionError(f"{name} (request {rid}) raised nothing; {error} expected")
        self._unchanged(before, name)

    @precondition(lambda self: self.caps.misuse)
    @rule(rid=reqs, token=VOCAB)
    def oversized_reserve(self, rid, token):
        """A reservation of more tokens than the whole pool holds is refused and changes nothing."""
        self.log("oversized_reserve", rid=rid, token=token)
        too_many = (self.m.counts()[2] + 1) * max(self.gbs)
        before = self.m.snapshot()
        assert self.m.reserve(rid, [token] * too_many) is None, \
            f"request {rid}: a reservation of {too_many} tokens, more than the pool holds, was not refused"
        self._unchanged(before, f"a refused reservation of {too_many} tokens for request {rid}")

    def _pending(self):
        return sorted(r for r, q in self.live.items() if q.in_flight and q.loading is None)

    @precondition(lambda self: self.caps.defers_commit and not self.caps.async_steps and self._pending())
    @rule(data=st.data())
    def failed_write(self, data):
        """The kernel backend's ``write_kv`` given K/V of the wrong dtype (float64) for a pending
        reservation raises ``TypeError`` or ``ValueError`` and writes nothing (nothing is committed)."""
        rid = data.draw(st.sampled_from(self._pending()), label="rid")
        self.log("failed_write_rid", rid=rid)
        self.failed_write_rid(rid)

    def failed_write_rid(self, rid):
        req = self.live[rid]
        step = req.in_flight[0]
        slots = [self.flat(0, s) for s in step.slots[0] if s >= 0]
        if not slots:
            return
        k_pool, v_pool = self.pools[0]
        before = [p.clone() for pools in self.pools for p in pools]
        k, v = self.io.expected(req.identities[step.start:step.start + len(slots)], 0, k_pool.device)
        mapping = torch.tensor(slots, dtype=torch.int64, device=k_pool.device)
        try:
            self.io.write_kv(k_pool, v_pool, k.double(), v.double(), mapping)
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"write_kv accepted float64 K/V for {k_pool.dtype} pools (request {rid})")
        after = [p for pools in self.pools for p in pools]
        assert all(same(x, y) for x, y in zip(before, after)), \
            f"write_kv raised for float64 K/V but wrote into the pools (request {rid})"

    @precondition(lambda self: self.caps.defers_commit and not self.caps.async_steps and self._pending())
    @rule(data=st.data(), n=st.integers(1, 8))
    def write_part(self, data, n):
        """The first ``n`` tokens of a pending reservation (at most all but one) are written and
        committed (a chunk cut short); the rest stays pending."""
        rid = data.draw(st.sampled_from(self._pending()), label="rid")
        self.log("write_part_rid", rid=rid, n=n)
        self.write_part_rid(rid, n)

    def write_part_rid(self, rid, n):
        req = self.live[rid]
        step = req.in_flight[0]
        n = min(n, step.end - step.start - 1)
        if n <= 0:
            return
        self.write(rid, req, tuple(s[:n] for s in step.slots), step.start)
        req.in_flight[0] = dataclasses.replace(step, start=step.start + n, slots=tuple(s[n:] for s in step.slots))
        self.commit(rid, req)

    @precondition(lambda self: self.caps.fork)
    @rule(target=reqs, rid=reqs, parent_tokens=st.lists(VOCAB, min_size=1, max_size=3),
          child_tokens=st.lists(VOCAB, min_size=1, max_size=3))
    def fork_and_diverge(self, rid, parent_tokens, child_tokens):
        """Parallel sampling: a fork, then parent and child each decode their own tokens at once, into
        the block they share (copy-on-write where it is partial)."""
        self.log("fork_and_diverge", rid=rid, parent_tokens=parent_tokens, child_tokens=child_tokens)
        with self._quiet():
            child = self.fork(rid)
            if not isinstance(child, int):
                return multiple()
            shared = self.m.block_table(rid)
            full = [self.live[rid].written // bs for bs in self.gbs]  # blocks no append writes into
            for who, tokens in ((rid, parent_tokens), (child, child_tokens)):
                for token in tokens:
                    self.step(who, 1, token, True)
        for who in (rid, child):
            tables = self.m.block_table(who)
            for g, n in enumerate(full):  # a block the window released since reads -1
                assert all(b in (a, -1) for a, b in zip(shared[g][:n], tables[g][:n])), \
                    f"request {who} (a fork of {rid} into {child}) no longer shares its full blocks {shared[g][:n]}: " \
                    f"{tables[g][:n]} (copy-on-write copies a shared partial block only)"
        return child

    systems = Bundle("systems")

    @rule(target=reqs, system=systems, suffixes=st.lists(st.lists(VOCAB, max_size=6), min_size=2, max_size=2))
    def burst(self, system, suffixes):
        """Requests with one system prompt arriving in the same step: each prompt reserved whole before
        any is written, so each computes its own copy of the system prompt's blocks (later prompts must
        find the longest chain under either copy)."""
        self.log("burst", system=system, suffixes=suffixes)
        with self._quiet():
            rids = [self.add(system, suffix, None, None, 15, False) for suffix in suffixes]
        return multiple(*(r for r in rids if isinstance(r, int)))

    @invariant()
    def declared_eviction_order(self):
        """Where the manager itemizes its evictable blocks (``evictable_blocks()``, next evicted first):
        blocks that one request's table held enter it tail first (the deepest is evicted first: a shared
        head stays cached longest), and a block handed out from it is its front (hits excepted)."""
        listed = getattr(getattr(self, "m", None), "evictable_blocks", None)
        if listed is None or not (self.caps.misuse and self.model_known and self.window is None):
            return  # a window releases a live request's leading blocks as it goes (pagedkv: head first)
        got, last = listed(), getattr(self, "_evictable", [])
        place = getattr(self, "_place", {})
        evicted = [b for b in last if b not in got and b not in self.cached]
        front = [b for b in last if b in got or b in evicted][:len(evicted)]  # hits leave it anywhere
        assert evicted == front, f"blocks {evicted} evicted while {front} were first in the eviction order {last}"
        entered = [place[b] for b in got if b not in last and b in place]  # released since, from a table
        for (rid, i), (other, j) in zip(entered, entered[1:]):
            assert rid != other or i > j, \
                f"evictable blocks {got} (next evicted first): request {rid}'s block at position {i} enters " \
                f"before its block at position {j} (a request's blocks are released tail first)"
        self._evictable = got
        self._place = {b: (rid, i) for rid, tables in self.tables() for i, b in enumerate(tables[0]) if b >= 0}
