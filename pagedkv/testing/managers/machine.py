"""One state machine for every cache manager, judged by the content oracle (:mod:`.oracle`).

Rules are a scheduler's calls on :class:`~.protocol.CacheManager`: admit a request (a shared system
prompt, its own suffix, a namespace, maybe an extra key) and prefill a first chunk; prefill more or
decode; write and commit a pending reservation (managers that defer commits); free; preempt and resume
(recompute); fork, evict, reset where the manager has them. Each reservation's K/V is written with
pagedkv's indexed ``write_kv`` into real pools at the slots the manager handed out. Request ids flow
through bundles, so a shrunk failure prints as a program; :mod:`.programs` records the same program as
data and replays it (``python -m pagedkv replay FILE``).

After every step (:meth:`ManagerMachine.check`): every live request's K/V, read through its block table
in every layer, equals the oracle's bit for bit (positions the window may release excepted); and the
invariants the protocol shows: a reserved slot lies in the request's own block at its position and in no
block another live request holds; free + used = total, and used = 0 with no live request; a hit is a
prefix some request committed (same namespace and extra keys) and leaves the tokens the manager promises
to compute; a freed request is not held; the manager's own ``self_check``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

import torch
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple,
                                 precondition, rule)

from pagedkv import get_backend
from pagedkv.testing.managers.oracle import expected_kv, stable_hash, token_identity
from pagedkv.testing.managers.protocol import ManagerConfig

VOCAB = st.integers(0, 3)  # small: equal blocks, hits and near-misses are common
NAMESPACES = (None, "salt-a", ("lora", 1))
EXTRA_KEYS = (None, "image-0", "image-1")
NUM_KV_HEADS, HEAD_DIM = 1, 2


@dataclasses.dataclass
class Request:
    """The machine's view of one live request."""

    namespace: Hashable
    tokens: list[int]
    extras: dict[int, Hashable]  # position -> extra key
    identities: list[int]  # token_identity of each token
    num_prompt: int
    reserved: int = 0  # tokens with slots
    written: int = 0  # tokens whose K/V is written
    committed: int = 0

    def extend(self, token_ids) -> None:
        for t in token_ids:
            prev = self.identities[-1] if self.identities else stable_hash(self.namespace)
            self.identities.append(token_identity(prev, t, self.extras.get(len(self.tokens))))
            self.tokens.append(t)


class ManagerMachine(RuleBasedStateMachine):
    """The machine over ``make_manager(ManagerConfig)``; subclass with :func:`machine_for`."""

    make_manager: Callable = None
    block_sizes: tuple[int, ...] = (1, 2, 4)
    windows: tuple = (None,)  # window_left values the manager takes
    record: list | None = None  # when a list: each step appended as (rule name, kwargs)
    checks_run = 0  # steps judged, over every run of this class (for steps per second)
    tokens_read = 0  # written tokens whose K/V the checks compared with the oracle, over every run of this class
    prefix_hits = 0  # admissions served partly from the prefix cache, over every run of this class

    reqs = Bundle("reqs")
    systems = Bundle("systems")

    @initialize(num_blocks=st.integers(4, 12), block_size=st.integers(0, 2), num_layers=st.integers(1, 2),
                window=st.integers(0, 3))
    def start(self, num_blocks, block_size, num_layers, window):
        """The pool: ``block_size`` and ``window`` index the sizes the manager takes."""
        self.log("start", num_blocks=num_blocks, block_size=block_size, num_layers=num_layers, window=window)
        config = ManagerConfig(num_blocks, self.block_sizes[block_size % len(self.block_sizes)],
                               self.windows[window % len(self.windows)], num_layers, NUM_KV_HEADS, HEAD_DIM)
        self.m = type(self).make_manager(config)
        self.caps = self.m.capabilities
        self.bs, self.layers, self.window = self.caps.block_size, num_layers, self.caps.window
        if self.caps.owns_pools:
            self.pools = [self.m.kv_pools(layer) for layer in range(num_layers)]
        else:
            total = self.m.counts()[2] + getattr(self.m, "reserved_blocks", 0)
            shape = (total, self.bs, NUM_KV_HEADS, HEAD_DIM)
            self.pools = [(torch.full(shape, float("nan")), torch.full(shape, float("nan"))) for _ in range(num_layers)]
        self.write_kv = get_backend("indexed").write_kv
        self.live: dict[int, Request] = {}
        self.committed_prefixes: set[int] = set()  # identities of the last token of committed full blocks
        self.next_id = 0

    @initialize(target=systems, prompts=st.lists(st.lists(VOCAB, min_size=1, max_size=9), min_size=1, max_size=2))
    def system_prompts(self, prompts):
        """Shared system prompts: requests starting with one hit the prefix cache."""
        self.log("system_prompts", prompts=prompts)
        return multiple(*prompts)

    # -- recording and helpers -----------------------------------------------------------------------
    def log(self, name: str, **kwargs) -> None:
        if self.record is not None:
            self.record.append((name, kwargs))

    def write(self, rid: int, req: Request, slots: list[int], start: int) -> None:
        """Write the oracle's K/V of tokens ``start..start+len(slots)`` at ``slots`` in every layer."""
        if not slots:
            return
        mapping = torch.tensor(slots, dtype=torch.int64)
        for layer, (k_pool, v_pool) in enumerate(self.pools):
            k, v = expected_kv(req.identities[start:start + len(slots)], layer, NUM_KV_HEADS, HEAD_DIM)
            self.write_kv(k_pool, v_pool, k, v, mapping)
        req.written = start + len(slots)

    def commit(self, rid: int, req: Request) -> None:
        self.m.commit(rid, req.written)
        req.committed = req.written
        for end in range(self.bs, req.committed + 1, self.bs):
            self.committed_prefixes.add(req.identities[end - 1])

    def reserve(self, rid: int, req: Request, token_ids: list[int], write_now: bool) -> bool:
        """Reserve slots for ``token_ids`` (decode tokens past the prompt extend the request), check them,
        write them (now when the manager caches at reserve time). False: refused."""
        start = req.reserved
        slots = self.m.reserve(rid, token_ids)
        if slots is None:
            return False
        if start + len(token_ids) > len(req.tokens):
            req.extend(token_ids[len(req.tokens) - start:])
        assert len(slots) == len(token_ids), f"request {rid}: {len(slots)} slots for {len(token_ids)} tokens"
        table = self.m.block_table(rid)
        others = {b for r in self.live if r != rid for b in self.m.block_table(r) if b >= 0}
        for i, slot in enumerate(slots):
            p = start + i
            block, offset = divmod(slot, self.bs)
            assert offset == p % self.bs and p // self.bs < len(table) and table[p // self.bs] == block, \
                f"request {rid}: token {p} got slot {slot}, but its block table {table} puts it elsewhere"
            assert block not in others, \
                f"request {rid}: token {p} is to be written into block {block}, which another live request holds"
        req.reserved = start + len(token_ids)
        if write_now or not self.caps.defers_commit:
            self.write(rid, req, slots, start)
            self.commit(rid, req)
        return True

    def admit(self, rid: int, tokens: list[int], namespace, extras: dict, chunk: int, write_now: bool) -> bool:
        req = Request(namespace, [], dict(extras), [], len(tokens))
        req.extend(tokens)
        got = self.m.admit(rid, tokens, namespace, sorted(extras.items()))
        if got is None:
            return False
        block_ids, cached = got
        assert 0 <= cached <= len(tokens) - self.caps.min_computed_on_full_hit, \
            f"request {rid}: {cached} of {len(tokens)} prompt tokens served from the cache; at least " \
            f"{self.caps.min_computed_on_full_hit} must be computed"
        assert cached % self.bs == 0 or self.bs == 1, f"request {rid}: a hit of {cached} tokens is not whole blocks"
        if cached:
            type(self).prefix_hits += 1
            assert req.identities[cached - 1] in self.committed_prefixes, \
                f"request {rid}: a hit on its first {cached} tokens, which no request committed under namespace " \
                f"{namespace!r} with these extra keys"
        table = self.m.block_table(rid)
        assert list(block_ids) == table[:len(block_ids)], \
            f"request {rid}: admit returned blocks {block_ids}, its block table is {table}"
        req.reserved = req.written = req.committed = cached
        self.live[rid] = req
        if chunk and not self.reserve(rid, req, tokens[cached:cached + chunk], write_now):
            self.m.free(rid)  # refused: the scheduler drops the request
            del self.live[rid]
            return False
        return True

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    # -- rules ---------------------------------------------------------------------------------------
    @rule(target=reqs, system=systems, suffix=st.lists(VOCAB, max_size=6), namespace=st.sampled_from(NAMESPACES),
          extra=st.sampled_from(EXTRA_KEYS), chunk=st.integers(1, 12), write_now=st.booleans())
    def add(self, system, suffix, namespace, extra, chunk, write_now):
        """A request: a system prompt and its own suffix, under a namespace, with an extra key on its
        first suffix token (a multimodal input); the first prefill chunk reserved (written now or later)."""
        self.log("add", system=system, suffix=suffix, namespace=namespace, extra=extra, chunk=chunk,
                 write_now=write_now)
        namespace = namespace if self.caps.namespaces else None
        extras = {len(system): extra} if extra is not None and suffix and self.caps.extra_keys else {}
        rid = self.new_id()
        return rid if self.admit(rid, list(system) + list(suffix), namespace, extras, chunk, write_now) else multiple()

    @rule(rid=reqs, n=st.integers(1, 6), token=VOCAB, write_now=st.booleans())
    def step(self, rid, n, token, write_now):
        """The next chunk: up to ``n`` prompt tokens, or one decode token once the prompt is reserved."""
        self.log("step", rid=rid, n=n, token=token, write_now=write_now)
        req = self.live[rid]
        if req.written < req.reserved:  # a pending reservation is written first (one step at a time)
            return
        if req.reserved < req.num_prompt:
            tokens = req.tokens[req.reserved:min(req.reserved + n, req.num_prompt)]
        else:
            tokens = [token]
        self.reserve(rid, req, tokens, write_now)

    @precondition(lambda self: any(r.written < r.reserved for r in self.live.values()))
    @rule(data=st.data())
    def write_pending(self, data):
        """Write and commit a reservation left pending."""
        pending = sorted(r for r, q in self.live.items() if q.written < q.reserved)
        rid = data.draw(st.sampled_from(pending), label="rid")
        self.log("write_pending_rid", rid=rid)
        self.write_pending_rid(rid)

    def write_pending_rid(self, rid):
        req = self.live[rid]
        table = self.m.block_table(rid)
        slots = [table[p // self.bs] * self.bs + p % self.bs for p in range(req.written, req.reserved)]
        self.write(rid, req, slots, req.written)
        self.commit(rid, req)

    @rule(rid=consumes(reqs))
    def free(self, rid):
        """Finish or abort (a pending reservation is dropped unwritten)."""
        self.log("free", rid=rid)
        self.m.free(rid)
        del self.live[rid]
        assert not self.m.holds(rid), f"request {rid} is still held after free"

    @precondition(lambda self: self.caps.preempt)
    @rule(target=reqs, rid=consumes(reqs))
    def preempt(self, rid):
        """Preempt (free) and resume by recompute: re-admit every token so far under a new id."""
        self.log("preempt", rid=rid)
        req = self.live.pop(rid)
        self.m.free(rid)
        assert not self.m.holds(rid), f"request {rid} is still held after preemption"
        new = self.new_id()
        extras = req.extras
        ok = self.admit(new, req.tokens[:max(req.written, 1)] if req.tokens else [0], req.namespace, extras,
                        len(req.tokens), True)
        return new if ok else multiple()

    @precondition(lambda self: self.caps.fork)
    @rule(target=reqs, rid=reqs)
    def fork(self, rid):
        """Fork (beam search, parallel sampling): the child shares the parent's blocks."""
        self.log("fork", rid=rid)
        parent = self.live[rid]
        if parent.written < parent.reserved:
            return multiple()
        child = self.new_id()
        self.m.fork(rid, child)
        self.live[child] = dataclasses.replace(parent, tokens=list(parent.tokens), identities=list(parent.identities),
                                               extras=dict(parent.extras))
        return child

    @precondition(lambda self: self.caps.evict)
    @rule(n=st.integers(1, 4))
    def evict(self, n):
        """Evict up to ``n`` unreferenced cached blocks."""
        self.log("evict", n=n)
        self.m.evict(n)

    @precondition(lambda self: self.caps.reset)
    @rule()
    def reset(self):
        """Reset the prefix cache: a success forgets every committed prefix not held by a live request."""
        self.log("reset")
        if self.m.reset():
            self.committed_prefixes = {r.identities[e - 1] for r in self.live.values()
                                       for e in range(self.bs, r.committed + 1, self.bs)}

    # -- checks --------------------------------------------------------------------------------------
    @invariant()
    def check(self):
        """Every live request reads the oracle's K/V; counts add up; the manager's own state is consistent."""
        if not hasattr(self, "m"):
            return
        type(self).checks_run += 1
        for rid, req in self.live.items():
            table = self.m.block_table(rid)
            first = 0 if self.window is None else max(0, req.written - self.window)
            positions = range(first, req.written)
            slots = []
            for p in positions:
                assert p // self.bs < len(table) and table[p // self.bs] >= 0, \
                    f"request {rid}: token {p} (written) has no block in its table {table}"
                slots.append(table[p // self.bs] * self.bs + p % self.bs)
            if not slots:
                continue
            type(self).tokens_read += len(slots)
            index = torch.tensor(slots, dtype=torch.int64)
            for layer, (k_pool, v_pool) in enumerate(self.pools):
                k, v = expected_kv(req.identities[first:req.written], layer, NUM_KV_HEADS, HEAD_DIM)
                got_k = k_pool.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[index]
                got_v = v_pool.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[index]
                for name, want, got in (("K", k, got_k), ("V", v, got_v)):
                    bad = (want.view(torch.int32) != got.view(torch.int32)).flatten(1).any(1)
                    if bool(bad.any()):
                        i = int(bad.nonzero()[0])
                        raise AssertionError(
                            f"request {rid} (namespace {req.namespace!r}) reads wrong {name} at token {first + i} "
                            f"(layer {layer}, slot {slots[i]}, block table {table}): expected "
                            f"{want[i].flatten().tolist()}, got {got[i].flatten().tolist()}")
        counts = self.m.counts()
        if counts is not None:
            free, used, total = counts
            assert free + used == total, f"free {free} + used {used} != total {total}"
            assert self.live or used == 0, f"{used} blocks used with no live request"
        self.m.self_check()

    def teardown(self):
        if hasattr(self, "m"):
            for rid in list(self.live):
                self.m.free(rid)
            counts = self.m.counts()
            if counts is not None:
                assert counts[1] == 0, f"{counts[1]} blocks still used after every request was freed"


def machine_for(make_manager: Callable, *, block_sizes=(1, 2, 4), windows=(None,), name: str = "Machine"):
    """A :class:`ManagerMachine` subclass over ``make_manager`` (a factory taking :class:`ManagerConfig`)."""
    return type(name, (ManagerMachine,), {"make_manager": staticmethod(make_manager), "block_sizes": tuple(block_sizes),
                                          "windows": tuple(windows)})
