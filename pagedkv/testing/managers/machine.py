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

What a manager declares is judged too (:class:`~.protocol.ManagerCapabilities`): the ``"lru"`` eviction order (every
block handed out afresh is the front of the machine's model of the free queue), the hit promise (an admit hits every
committed leading block not evicted since; under sparse retention only the window blocks a hit at a kept boundary needs,
and beside a Mamba group no hit on a state retention drops;
with groups of full attention and sliding windows the hit vLLM's coordinator agrees on where the manager declares it,
:mod:`.lookup`, and no more where every cached block is known), and asynchronous steps (a next step reserved while the
previous one's writes are in flight; no block an in-flight step reads or writes handed to anyone, a free deferred until
its steps complete), the admission promise (a reservation or load refused only when the pool is short of its need) and
the window release promise (no block wholly before what the next query reads kept past a reservation), and, where hits
land inside blocks (``hit_alignment``: vLLM's fine-grained partial hash hits) or every Mamba group exports prefill
checkpoints, the replay promise (a live request stopped at its replay boundary holds every block of that hit, so a
prompt sharing it hits at least there), and the cached-prompt promise (``cached_prompt``: at a prefill's first output
the count of prompt tokens cached that the manager reports, vLLM's ``num_cache_creation_tokens``, reaches what the
request's own tables hold cached). Namespaces are drawn so that their encodings collide (a cache salt spelled like a
LoRA name, one LoRA name at two paths) and multimodal inputs as placeholder runs, so one image at two offsets in one
block differs only in its offset.

KV-cache groups (:class:`~.protocol.GroupSpec`, a layout of :data:`~.protocol.HYBRID_LAYOUTS` the manager
lists): every group's blocks come from one pool, and block ``b`` is one page of every layer slot (layer
``i`` of each group shares it, as in vLLM), so the machine's pools are ``[total, max block_size, ...]``
per layer slot and group ``g`` writes its layer ``i`` there. The oracle per group: a full-attention group
reads every written token, a sliding-window group the tokens inside the window of the next query, a
chunked-local group its current chunk, a Mamba group the state after the last written token (a step
writes the state after its last token only, and after its last verified and each draft token), which a
hit must serve as the digest of exactly that prefix. Invariants: no block held by two groups, every
group's admitted blocks truncated to the one agreed hit, the manager's reference counts (where exposed)
equal to the tables holding each block, the ``"lru"`` order per group (:class:`Chains`), no recurrent-state
hit on a state a reservation of the same scheduler step writes (reservations between two commits are one
step), and, with ``capabilities.lookahead``, the proposer's drafts written past each step in the request's
own blocks. A one-group manager runs as today behind
:class:`~.protocol.GroupedView`.

A KV connector (the machine is the external store: it holds any prefix, so it offers whole blocks of the
prompt): external tokens past the local hit are loaded into blocks reserved first, the request waits
until the load completes (or fails, and is recomputed from the local hit; what a failed load wrote must
never be read), and a freed request's blocks stay held until its store completes. Speculative decoding:
a decode step with draft tokens whose rejected tail is dropped; no rejected token's K/V or state may be
served to anyone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Hashable

import torch
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple,
                                 precondition, rule)

from pagedkv.testing.managers.kv_events import EventIndex
from pagedkv.testing.managers import lookup
from pagedkv.testing.managers.kv_io import KVIO
from pagedkv.testing.managers.oracle import stable_hash, token_identity
from pagedkv.testing.managers.branch_points import BranchPoints
from pagedkv.testing.managers.calls import ManagerCalls, call_manager, check_served
from pagedkv.testing.managers.protocol import (MULTI_MODULE_MTP_LAYOUTS, ONE_GROUP, ManagerConfig, as_grouped,
                                               is_embedding, layout_groups, layout_prefix_match_unit, layout_retention,
                                               layout_window, prompt_embedding_rows)

VOCAB = st.integers(0, 3)  # small: equal blocks, hits and near-misses are common
#: Namespaces whose encodings collide where an engine flattens them (protocol.namespace_parts).
NAMESPACES = (None, (("salt", "a"),), (("salt", "lora-a"),), (("lora", "lora-a", "/adapters/1"),),
              (("lora", "lora-a", "/adapters/2"),), (("salt", "a"), ("lora", "lora-a", "/adapters/1")))
EXTRA_KEYS = (None, "image-0", "image-1")
#: A namespace and one whose encoding is near it (a salt spelled like a LoRA name, the LoRA name at another path).
SIBLINGS = {NAMESPACES[0]: NAMESPACES[2], NAMESPACES[1]: NAMESPACES[5], NAMESPACES[2]: NAMESPACES[3],
            NAMESPACES[3]: NAMESPACES[4], NAMESPACES[4]: NAMESPACES[2], NAMESPACES[5]: NAMESPACES[1]}
IMAGE_LENGTHS = {"image-0": 2, "image-1": 3, "image-2": 1}  # one input, one length (its placeholder run)
#: The further inputs a request may carry after its first (``add``'s ``more``): a one-token input too, so that
#: two inputs fit in one small block beside other tokens.
MORE_ITEMS = ("image-0", "image-1", "image-2")
#: The text tokens between two of ``add``'s further inputs (or after the last): none most often (attachments sent
#: one after another), so that two inputs share a block.
GAPS = (0, 0, 0, 1, 2)
ROOMY_ONE_GROUP = 3  # a one-group roomy pool (``start``'s ``pool_per_group``): this many times ``num_blocks``
PLACEHOLDER = 0  # the token id of a multimodal input's placeholder run (what an engine's processor writes)
#: Prompt-embedding payloads (``add``'s ``embeds``): two, so that two requests share placeholder ids but not
#: embeddings; ``variant`` swaps one for another (``"content"``) or moves it (``"image"``: same rows elsewhere).
EMBEDS = ("embeds-0", "embeds-1")
NUM_KV_HEADS, HEAD_DIM = 1, 2
MAX_DRAFTS = 3  # num_speculative_tokens the machine asks for


def layer_key(group: int, layer: int) -> int:
    """The oracle's layer of a group's layer (group 0's layers as a one-group manager's)."""
    return layer + 1000 * group


@dataclasses.dataclass
class Step:
    """A reservation whose K/V is not written yet: tokens ``start..end`` at ``slots``; ``reads``: the
    blocks it reads or writes (its tokens and the attention window behind them) in the table it was
    reserved with."""

    start: int
    end: int
    slots: tuple  # one slot list per group
    reads: frozenset
    epoch: int = 0  # the scheduler step it was reserved in (ManagerMachine.epoch)


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
    in_flight: list = dataclasses.field(default_factory=list)  # Steps, oldest first
    table: tuple = ()  # its block tables (one per group) when last reserved or freed
    adopted: bool = False  # its first reservation succeeded (until then an admitted hit is only shown)
    loading: tuple | None = None  # a connector load in flight: (first token, its slots per group)
    correction: int | None = None  # the token verification put where a draft was rejected (decoded next)
    storing: bool = False  # freed, its connector store pending
    junction: int | None = 0  # the shared-prefix junction its sparse groups keep (None: not known)
    hit: int = 0  # the hit it was admitted with (or looked up again after a failed load)
    # under EAGLE: ManagerMachine.pool_entries when the reservation reaching its replay boundary began (None: none
    # yet, or its boundary state is not its own: a hit past it, an eviction, a reset)
    replay_open: int | None = None
    # group -> (block, tokens): a partial entry of its prompt's tail the machine knows it registered on its own block
    # (ManagerMachine.note_partial_tail); reported: its cached-prompt count was judged (capabilities.cached_prompt)
    partial: dict = dataclasses.field(default_factory=dict)
    reported: bool = False
    state_marks: list = dataclasses.field(default_factory=list)  # (boundary, pool_entries): written, not yet completed
    # looked up again after a preemption with its output (capabilities.resume): the engine keys its prompt-tail
    # entries by the prompt it was admitted with, not by ``num_prompt`` here (every token it recomputes)
    resumed: bool = False
    zero_after_load: set = dataclasses.field(default_factory=set)  # blocks the worker zeroes once its load landed

    def pending(self) -> bool:
        return bool(self.in_flight) or self.loading is not None or self.storing

    def embedded(self) -> bool:
        """Its prompt carries embedding rows (an engine keys every block of it by its embeddings then)."""
        return bool(prompt_embedding_rows(self.extras.items(), self.num_prompt))

    def cache_key(self, end: int):
        """What the model files its block ending at token ``end`` under (:attr:`ManagerMachine.cached`): the last
        token's identity, marked ``"embedded"`` for a prompt with embeddings (vLLM keys each of its blocks by the
        embeddings' bytes there: zero rows at tokens, a slice cut at the prompt's end, so only its own kind may be
        promised it)."""
        return ("embedded", self.identities[end - 1]) if self.embedded() else self.identities[end - 1]

    def truncate(self, n: int) -> None:
        """Drop tokens from ``n`` on (rejected drafts)."""
        del self.tokens[n:], self.identities[n:]
        self.reserved, self.written, self.committed = (min(x, n) for x in (self.reserved, self.written,
                                                                           self.committed))

    def extend(self, token_ids) -> None:
        for t in token_ids:
            prev = self.identities[-1] if self.identities else stable_hash(self.namespace)
            self.identities.append(token_identity(prev, t, self.extras.get(len(self.tokens))))
            self.tokens.append(t)


class Chains:
    """Cached blocks one call released in several KV-cache groups: each group's in its release order (tail
    first), the groups' order among themselves not promised (vLLM frees group by group, a deferred free in
    reverse group order). Taking a block from the free queue here takes the head of one group's chain."""

    def __init__(self, chains) -> None:
        self.chains = [list(c) for c in chains if c]

    def blocks(self) -> set[int]:
        return {b for c in self.chains for b in c}

    def discard(self, block: int) -> None:
        self.chains = [[b for b in c if b != block] for c in self.chains]
        self.chains = [c for c in self.chains if c]

    def __bool__(self) -> bool:
        return bool(self.chains)


def whole_inputs(extras: dict, num_tokens: int) -> dict:
    """``extras`` of the first ``num_tokens`` tokens less each multimodal input cut there (a branch inside its
    placeholder run): an engine's processor expands one input to one run length, and vLLM's block key names
    the input and its offset, not its length; the cut run's placeholder tokens stay, as text."""
    def whole(p, key):
        start = p - key[2]
        return all(start + i < num_tokens and extras.get(start + i) == ("mm", key[1], i)
                   for i in range(IMAGE_LENGTHS[key[1]]))
    return {p: key for p, key in extras.items() if p < num_tokens and (
            not (isinstance(key, tuple) and len(key) == 3 and key[0] == "mm" and key[1] in IMAGE_LENGTHS)
            or whole(p, key))}


@functools.cache
def invariant_names(machine_class: type) -> tuple[str, ...]:
    """The names of ``machine_class``'s invariants (its ``check`` and any rule set's), in ``dir`` order."""
    return tuple(name for name in dir(machine_class)
                 if getattr(getattr(machine_class, name, None), "hypothesis_stateful_invariant", None))


class ManagerMachine(RuleBasedStateMachine):
    """The machine over ``make_manager(ManagerConfig)``; subclass with :func:`machine_for`."""

    make_manager: Callable = None
    block_sizes: tuple[int, ...] = (1, 2, 4)
    windows: tuple = (None,)  # window_left values the manager takes
    layouts: tuple = (ONE_GROUP,)  # the layouts (protocol.HYBRID_LAYOUTS names) the manager takes
    record: list | None = None  # when a list: each step appended as (rule name, kwargs)
    checks_run = 0  # steps judged, over every run of this class (for steps per second)
    tokens_read = 0  # written tokens whose K/V the checks compared with the oracle, over every run of this class
    prefix_hits = 0  # admissions served partly from the prefix cache, over every run of this class
    hits_due = 0  # admissions, served or refused, the hit promise gave a hit, over every run of this class
    # when a dict: repr of each distinct declared ManagerCapabilities -> [it, programs] (the verdict's waivers)
    capabilities_seen: dict | None = None
    pools_seen: set | None = None  # when a set: the pools (blocks) the programs were built with
    # when a bool: capabilities.misuse of the manager the suite built before the search (it mixed the API rules
    # in by it), so a program's manager must declare the same
    probed_misuse: bool | None = None
    # K/V moves through a kernel backend's write_kv and gather (kv_io.KVIO; None: pagedkv's indexed)
    kv_backend = None
    num_kv_heads, head_dim, dtype = NUM_KV_HEADS, HEAD_DIM, torch.float32
    # the pool guard (calls.ManagerCalls.guard_pools) on a manager owning its pools; off only where the manager is
    # not what is judged (pagedkv's own cache under a kernel property, which its own searches judge with it on)
    guard_manager_pools = True

    reqs = Bundle("reqs")
    systems = Bundle("systems")

    @classmethod
    def make_served(cls, config: ManagerConfig) -> tuple:
        """``(manager, the config it serves)`` for ``config``. A manager refusing a connector or drafts with
        ``ValueError`` (what :class:`ManagerConfig` allows one that cannot serve them) is asked again without
        them, drafts dropped first, then the connector, then both, and judged on what it serves, as one that
        leaves the capability off. A ``ValueError`` with neither asked is the manager's failure."""
        asks = [config]
        if config.num_speculative_tokens:
            asks.append(dataclasses.replace(config, num_speculative_tokens=0))
        if config.connector:
            asks.append(dataclasses.replace(config, connector=False))
            if config.num_speculative_tokens:
                asks.append(dataclasses.replace(config, connector=False, num_speculative_tokens=0))
        for ask in asks:
            try:
                return ManagerCalls(call_manager("the manager factory", cls.make_manager, ask)), ask
            except ValueError:
                if ask is asks[-1]:
                    raise

    # two layers at least, as every model has: a fault in some layers only (a copy-on-write of the first
    # layer) needs a second; the map keeps the draw (and so every other program) as it was
    @initialize(num_blocks=st.integers(4, 12), block_size=st.integers(0, 2),
                num_layers=st.integers(1, 2).map(lambda n: n + 1),
                window=st.integers(0, 3), layout=st.integers(0, 11), features=st.integers(0, 7),
                pool_per_group=st.booleans())
    def start(self, num_blocks, block_size, num_layers, window, layout=0, features=0, pool_per_group=False):
        """The pool: ``block_size`` and ``window`` index the sizes the manager takes, ``layout`` its
        layouts (a hybrid one takes ``block_size`` as its hash block size and ``window`` as its window draw,
        :func:`~.protocol.layout_window`: 0-2 tokens, or several blocks); ``features`` asks for a connector (bit 0)
        and speculative decoding (bit 1), and makes the connector's store a P/D prefiller's (bit 2: any prefix of a
        prompt, where the manager declares ``token_loads``; else whole blocks);
        ``pool_per_group``: a hybrid layout's pool holds ``num_blocks`` per group (a roomy pool where three
        groups' prompts fit and hit) rather than in all (pressure on every allocation); a one-group pool holds
        three times ``num_blocks`` (several requests live at once, where a pool of 4-12 one-token blocks refuses
        half the admissions: a variant of a live prompt then meets its blocks)."""
        self.log("start", num_blocks=num_blocks, block_size=block_size, num_layers=num_layers, window=window,
                 layout=layout, features=features, **({"pool_per_group": True} if pool_per_group else {}))
        bs = self.block_sizes[block_size % len(self.block_sizes)]
        name = self.layouts[layout % len(self.layouts)]
        groups = layout_groups(name, bs, layout_window(window, bs))
        if groups:
            num_layers = max(g.num_layers for g in groups)
        num_blocks *= (len(groups) or ROOMY_ONE_GROUP) if pool_per_group else 1
        config = ManagerConfig(num_blocks, bs, self.windows[window % len(self.windows)], num_layers, self.num_kv_heads,
                               self.head_dim, groups=groups, connector=bool(features & 1),
                               token_loads=(features & 5) == 5,
                               num_speculative_tokens=MAX_DRAFTS if features & 2 else 0,
                               # whole-prompt admission on half the pools, read off a draw every program
                               # has (so that no other draw moves)
                               full_sequence_must_fit=bool(num_blocks % 2),
                               retention_interval=layout_retention(name, bs, window),
                               prefix_match_unit=layout_prefix_match_unit(name, bs),
                               multi_module_mtp=name in MULTI_MODULE_MTP_LAYOUTS)
        manager, served = self.make_served(config)
        check_served(manager.capabilities, config, served)
        config = served
        self.m = as_grouped(manager)
        self.caps = self.m.capabilities
        if self.capabilities_seen is not None:
            self.capabilities_seen.setdefault(repr(self.caps), [self.caps, 0])[1] += 1
        self.num_blocks = config.num_blocks
        if self.pools_seen is not None:
            self.pools_seen.add(config.num_blocks)
        assert self.probed_misuse is None or bool(self.caps.misuse) == self.probed_misuse, \
            f"capabilities.misuse: {bool(self.caps.misuse)} here, {self.probed_misuse} for the manager built for " \
            f"this layout before the search (the suite chose the rules it searches by it): a manager declares " \
            f"the same capabilities in every build"
        self.groups = self.caps.groups
        if not groups:  # one group serves every layer asked for (a GroupedView's group says one)
            self.groups = tuple(dataclasses.replace(g, num_layers=num_layers) for g in self.groups)
        self.grouped = bool(groups)
        # groups of full attention and sliding windows of a manager declaring vLLM's coordinated lookup: the
        # promised hit is the one it agrees on over the modelled cache (:mod:`.lookup`), a lower and an upper bound
        # where every cached block is known
        # (several groups: vLLM serves one group with its UnitaryKVCacheCoordinator, which the plain promise models)
        self.coordinated = self.grouped and len(self.groups) > 1 and self.caps.coordinated_lookup and all(
            g.kind in ("full", "sliding_window") for g in self.groups)
        self.connector = self.caps.connector and config.connector
        # the store a P/D prefiller fills (the prompt less a backoff: a load ending inside a block), or an offloading
        # store's whole blocks
        self.token_store = self.connector and self.caps.token_loads and config.token_loads
        self.speculative = self.caps.speculative and config.num_speculative_tokens > 0
        # the engine runs an EAGLE-family drafter (its lookup drops a hit's last block), drafts drawn or not: a
        # manager declaring eagle_drop without speculative (vLLM beside a Mamba group) serves EAGLE's replay
        # boundaries while the machine draws no drafts
        self.eagle_server = self.caps.eagle_drop and config.num_speculative_tokens > 0
        # the state promise (:meth:`state_hit`): a coordinated layout with a Mamba group, one hit granularity, with a
        # connector or without (it bounds the local hit, which a load only extends); under EAGLE (no drafts drawn
        # beside Mamba) one full-attention and one Mamba group, where vLLM's lookup runs once and the full-attention
        # block past a state must be cached too (:attr:`state_reach`)
        eagle_state = self.eagle_server and sorted(g.kind for g in self.groups) == ["full", "mamba"]
        self.state_window = (self.grouped and len(self.groups) > 1 and self.caps.coordinated_lookup
                             and self.caps.hit_promise and any(g.kind == "mamba" for g in self.groups)
                             and all(g.kind in ("full", "sliding_window", "mamba") for g in self.groups)
                             and not (self.caps.hit_alignment or self.speculative)
                             and (not self.eagle_server or eagle_state))
        # tokens past a Mamba state ``e`` a prompt shares and the writer committed for ``e`` to be promised: under
        # EAGLE the full-attention block EAGLE's lookup matches past the hit and drops
        self.state_reach = next(g.block_size for g in self.groups if g.kind == "full") if (
            self.state_window and self.eagle_server) else 0
        # the replay promise's window (:meth:`replay_hit`) is kept: with fine-grained hits, or where every Mamba
        # group exports prefill checkpoints under the state promise (under EAGLE too: the checkpoint moves with r)
        self.replay_window = bool(self.caps.hit_alignment) or self.state_window and all(
            g.prefill_checkpoints for g in self.groups if g.kind == "mamba")
        self.reprefill = self.caps.reprefill if self.speculative else 0  # tokens a reservation leaves uncached
        self.gbs = [g.block_size for g in self.groups]
        self.bs = math.lcm(*self.gbs)  # a hit is whole blocks of every group
        self.unit = self.caps.hit_alignment or self.bs  # ... or, fine-grained, whole prefix-match units
        self.page = max(self.gbs)  # tokens per page of the machine's pools
        self.layers, self.window = num_layers, self.caps.window
        if self.caps.owns_pools:
            self.pools = [self.m.kv_pools(layer) for layer in range(num_layers)]
            self.page = self.pools[0][0].shape[1]
            if self.guard_manager_pools:  # no write in a call that reads
                manager.guard_pools(pool for pair in self.pools for pool in pair)
        else:
            total = self.m.counts()[2] + getattr(self.m, "reserved_blocks", 0)
            shape = (total, self.page, self.num_kv_heads, self.head_dim)
            self.pools = [(torch.full(shape, float("nan")), torch.full(shape, float("nan"))) for _ in range(num_layers)]
        self.io = KVIO(type(self).kv_backend, self.num_kv_heads, self.head_dim, self.dtype)
        self.live: dict[int, Request] = {}
        self.zombies: dict[int, Request] = {}  # freed with steps, a load or a store pending (their free deferred)
        self.committed_prefixes: set[int] = set()  # identities of the last token of committed full blocks
        self.next_id = 0
        self.epoch = 0  # scheduler steps so far: a commit ends one (reservations between two commits share one)
        # finished conversations (namespace, tokens, extras, the request: its block tables), newest last
        self.history: list[tuple] = []
        # released requests whose prompt's EAGLE replay boundary may stay hittable (:meth:`replay_hit`), newest last
        self.replayable: list[Request] = []
        # under the state or the replay promise, each admitted prompt's text before its first input, by request,
        # oldest first: what :mod:`.branch_points` cuts (its only reader)
        self.branchable: dict[int, list[int]] = {}
        # ... and the boundaries inside it whose Mamba state its steps wrote and retention keeps (under sparse
        # retention: every one on a block boundary), oldest first
        self.branch_states: dict[int, list[int]] = {}
        # under EAGLE: an upper bound on the blocks that entered the manager's free queue so far (released by every
        # holder, or a moved copy-on-write entry: :meth:`account`), and the blocks held at the last count
        self.pool_entries, self.pool_held = 0, set()
        # (boundary, identity of its last token, pool_entries when its state was written) of every Mamba state a
        # completed step wrote on a block boundary (:meth:`state_hit`)
        self.state_marks: list[tuple[int, int, int]] = []
        # under sparse retention, the identities of the boundaries a writer's retention keeps past its segments'
        # (its prompt's replay boundaries and its shared-prefix junction): with a segment's boundary, the only
        # states a hit may read (:meth:`check_state_retained`)
        self.reachable_states: set[int] = set()
        self.rejected: list[tuple] = []  # timelines ending in rejected drafts (namespace, tokens, extras)
        # the model of what the manager declares: block -> identity its cached full block holds (hit
        # promise), the free queue as tiers, front first (eviction order), blocks ever handed out
        self.cached: dict[int, int] = {}
        self.queue: list[tuple[str, set]] = [("initial", set())]
        self.ever_used: set[int] = set()
        self.model_known = True  # False after an eviction the manager does not itemize
        counts = self.m.counts()
        self.total = counts[2] if counts is not None else None
        # blocks a manager keeps aside (a null block, padding pages: ``reserved_blocks``) come on top of the pool
        # asked for, never out of it: a watermark taken from it would refuse as if the pool were short
        assert self.total is None or self.total >= config.num_blocks, \
            f"counts(): a pool of {self.total} blocks where {config.num_blocks} were asked for " \
            f"(ManagerConfig.num_blocks); blocks the manager keeps aside come on top (reserved_blocks)"
        # a promise judged against the pool's free count needs the count
        for name, declared in (("admission", self.caps.admission is not None),
                               ("eviction_order", self.caps.eviction_order == "lru")):
            assert not declared or counts is not None, \
                f"capabilities.{name}: declared, but counts() is None: the promise is judged against the pool's " \
                f"free count, so a manager declaring it reports the count"
        # the router's index rebuilt from the manager's KV events (capabilities.kv_events)
        self.kv_events = (EventIndex([g.kind for g in self.groups], math.gcd(self.unit, *self.gbs))
                          if self.caps.kv_events else None)
        self.zeroed_under_load: dict[int, int] = {}  # block -> the request whose load it was zeroed after

    @initialize(target=systems, prompts=st.lists(st.lists(VOCAB, min_size=1, max_size=9), min_size=1, max_size=2))
    def system_prompts(self, prompts):
        """Shared system prompts: requests starting with one hit the prefix cache."""
        self.log("system_prompts", prompts=prompts)
        return multiple(*prompts)

    # -- recording and helpers -----------------------------------------------------------------------
    def log(self, name: str, **kwargs) -> None:
        if self.record is not None:
            self.record.append((name, kwargs))

    def write(self, rid: int, req: Request, slots: tuple, start: int, drafts: int = 0, identities=None) -> None:
        """Write the oracle's K/V of tokens ``start..start+n`` at ``slots`` (one list per group) in every
        layer; a Mamba group's state only after the last token (and the last verified and each draft
        token), or, exporting prefill checkpoints (``GroupSpec.prefill_checkpoints``), wherever the manager named
        a slot. ``identities``: what is written instead of the tokens' own (a failed load's garbage)."""
        n = len(slots[0]) if slots else 0
        if not n:
            return
        end = start + n
        identities = req.identities[start:end] if identities is None else identities
        for g, group in enumerate(self.groups):
            keep = [i for i in range(n) if slots[g][i] >= 0 and (
                group.kind != "mamba" or group.prefill_checkpoints or i >= n - 1 - drafts)]
            if not keep:
                continue
            self.write_layers(g, [identities[i] for i in keep], [self.flat(g, slots[g][i]) for i in keep])
        req.written = max(req.written, end)

    def write_layers(self, g: int, identities: list[int], pages: list[int]) -> None:
        """The oracle's K/V of ``identities`` at ``pages`` (indices into the machine's pages) in every layer of
        group ``g``; a manager's own pools are then copied afresh by the guard before its next read-only call."""
        for layer in range(self.groups[g].num_layers):
            k_pool, v_pool = self.pools[layer]
            self.io.write(k_pool, v_pool, identities, layer_key(g, layer), pages)
        if self.caps.owns_pools:
            self.m.pools_written()

    def propose(self, rid: int, req: Request) -> None:
        """The proposer's step (``capabilities.lookahead``): draft K/V written at the positions just past the
        request's reserved tokens, through its block tables (as vLLM's drafter computes its slots): each in a
        block of the request's own table that no other request or group holds. Later reservations write the
        real tokens there before anyone reads them."""
        k = self.caps.lookahead if self.speculative else 0
        if not k:
            return
        tables, others, end = self.m.block_table(rid), self.others(rid), req.reserved
        for g, group in enumerate(self.groups):
            if group.kind == "mamba":  # draft states live in the manager's scratch blocks
                continue
            bs, table = self.gbs[g], tables[g]
            mine = {b for h, t in enumerate(tables) if h != g for b in t if b >= 0}
            pages = []
            for p in range(end, end + k):
                block = table[p // bs] if p // bs < len(table) else -1
                assert block >= 0 and block not in others and block not in mine, \
                    f"request {rid}: the proposer's draft at position {p} (lookahead {k} past {end} reserved " \
                    f"tokens) has " + (f"block {block}, which another request or group holds" if block >= 0 else
                                       f"no block in group {g}'s table {table}")
                pages.append(block * self.page + p % bs)
            self.write_layers(g, [stable_hash(("draft", req.identities[end - 1] if end else 0, i)) for i in range(k)],
                              pages)

    def flat(self, group: int, slot: int) -> int:
        """A group's slot as an index into the machine's pages."""
        block, offset = divmod(slot, self.gbs[group])
        return block * self.page + offset

    def register(self, rid: int, req: Request, upto: int, promised: bool = True) -> None:
        """Tokens below ``upto`` are cached by the manager: their full blocks are hittable (a sliding-window
        or chunked-local group's where a hit of whole blocks of every group needs them; and, where
        ``promised``, must hit)."""
        tables = self.m.block_table(rid) if rid in self.live else req.table  # a deferred free: as it was freed
        if self.kv_events is not None:
            self.kv_events.commit(req.namespace, req.tokens, upto)
        for end in range(self.unit, upto + 1, self.unit):
            self.committed_prefixes.add(req.identities[end - 1])
        if not promised:
            return
        if self.coordinated:
            return self.register_coordinated(req, tables, upto)
        for g, (group, table) in enumerate(zip(self.groups, tables)):
            bs, aligned = self.gbs[g], upto // self.bs * self.bs
            reachable = {i for hit in range(self.bs, aligned + 1, self.bs)
                         for i in range(min(group.first_read(hit), hit - 1) // bs, hit // bs)}
            if group.kind == "sliding_window" and self.caps.retention_interval is not None:
                reachable = lookup.window_blocks_kept(
                    aligned // bs, bs, group.window, self.bs, False, self.caps.retention_interval,
                    [*lookup.replay_boundaries(req.num_prompt, self.bs, False), req.junction or 0])
            for end in range(bs, aligned + 1, bs):
                block = table[end // bs - 1] if end // bs - 1 < len(table) else -1
                if block >= 0 and group.kind != "mamba" and (end // bs - 1 in reachable or group.kind == "full"):
                    self.cached[block] = (g, req.cache_key(end))

    def register_coordinated(self, req: Request, tables: tuple, upto: int) -> None:
        """What vLLM caches of a request with ``upto`` tokens computed, by group: the full blocks below
        ``HybridKVCacheCoordinator.get_num_cacheable_tokens`` (:func:`.lookup.cacheable_tokens`: whole scheduler
        blocks, one block of the group more under EAGLE) that the table still holds, of a sliding window only those
        ``SlidingWindowManager.reachable_block_mask`` keeps (:func:`.lookup.window_blocks_kept`, at the replay
        boundaries of ``kv_cache_coordinator.replay_boundaries`` and the request's shared-prefix junction)."""
        eagle = self.eagle
        if req.junction is None:  # its junction depends on what was cached when the model did not know
            self.model_known = False
        boundaries = [*lookup.replay_boundaries(req.num_prompt, self.bs, eagle), *([req.junction] if req.junction
                                                                                   else [])]
        for g, (group, table) in enumerate(zip(self.groups, tables)):
            bs = self.gbs[g]
            num_blocks = lookup.cacheable_tokens(upto, bs, self.bs, eagle) // bs
            kept = (range(num_blocks) if group.kind == "full" else
                    lookup.window_blocks_kept(num_blocks, bs, group.window, self.bs, eagle,
                                              self.caps.retention_interval, boundaries))
            for i in kept:
                if i < len(table) and table[i] >= 0:
                    self.cached[table[i]] = (g, req.cache_key((i + 1) * bs))

    @property
    def eagle(self) -> bool:
        """vLLM's EAGLE last-block drop is on (``capabilities.eagle_drop`` with drafts)."""
        return self.speculative and self.caps.eagle_drop

    def coordinated_hit(self, req: Request) -> tuple[int, int]:
        """``(hit, longest)`` of :func:`.lookup.coordinated_hit` for ``req`` over the modelled cache: the agreed hit
        and the longest single group's (its shared-prefix junction where longer)."""
        still = [set() for _ in self.groups]
        for g, ident in self.cached.values():
            still[g].add(ident)
        hash_bs = self.caps.block_size
        return lookup.coordinated_hit(self.groups, lambda g, end: req.identities[end - 1] in still[g],
                                      len(req.tokens) - self.caps.min_computed_on_full_hit,
                                      len(req.tokens) // hash_bs * hash_bs, self.bs, self.eagle)

    def junction(self, req: Request, cached: int) -> int | None:
        """vLLM's shared-prefix junction of an admission with agreed hit ``cached``: the full-attention groups'
        own hit (whole scheduler blocks, the last token left to compute) where it runs past ``cached`` (a
        sparse group kept no boundary there), else 0; ``None`` where the model does not know what is cached, or
        the prompt has embeddings (vLLM keys its blocks by embedding bytes the model does not see, so which of
        another request's blocks it hits, and the junction, are not known)."""
        if not self.model_known or req.embedded():
            return None
        if self.coordinated:  # KVCacheManager.get_computed_blocks: the junction is the longest group hit
            hit, longest = self.coordinated_hit(req)
            return longest if longest > cached else 0
        full = [g for g, group in enumerate(self.groups) if group.kind == "full"]
        still = {g: {ident for h, ident in self.cached.values() if h == g} for g in full}
        cap, hit = len(req.tokens) - self.caps.min_computed_on_full_hit, 0
        while hit + self.bs <= cap and all(req.identities[end - 1] in still[g] for g in full
                                           for end in range(hit + self.gbs[g], hit + self.bs + 1, self.gbs[g])):
            hit += self.bs
        return hit if hit > cached else 0

    def commit(self, rid: int, req: Request) -> None:
        before = self.holdings()
        self.m.commit(rid, req.written)
        self.epoch += 1
        req.committed = req.written
        if req.state_marks:
            reach = self.state_reach  # under EAGLE the block past the state committed too
            done = [(e, req.identities[e + reach - 1], opened) for e, opened in req.state_marks
                    if e + reach <= req.committed]
            self.state_marks = [*self.state_marks[-31:], *done]
            req.state_marks = [(e, opened) for e, opened in req.state_marks if e + reach > req.committed]
        if self.caps.defers_commit:
            # a deferred free's last step may be cached as it completes (a finished request inserted then, as
            # SGLang's radix cache does): hittable, not promised
            self.register(rid, req, req.committed, promised=rid in self.live)
        self.settle(rid)
        self.account(before, "commit")
        if self.caps.cached_prompt and rid in self.live and not req.reported and req.committed >= req.num_prompt:
            req.reported = True
            self.judge_cached_prompt(rid, req)

    # -- the cached-prompt count (capabilities.cached_prompt) ----------------------------------------------
    def note_partial_tail(self, rid: int, req: Request, upto: int) -> None:
        """A reservation caching ``upto`` tokens of ``req``: where a full-attention group's block is wider than the
        hash block (``capabilities.block_size``, ``u``), the prompt's tail is kept at hash-block granularity: its
        last whole hash block boundary ``b`` (``floor((P - 1) / u) * u`` of a prompt of ``P`` tokens, the most a
        resend hits; ``floor(P / u) * u`` where the engine runs EAGLE, whose lookup reads the whole prompt) is a
        partial entry on the request's own block holding token ``b`` once the group caches ``b`` tokens (vLLM's
        ``FullAttentionManager._cache_partial_tail_block`` through ``BlockPool.cache_partial_block``; the group
        caches :func:`.lookup.cacheable_tokens` of ``upto``). Recorded as ``req.partial[g] = (block, b)`` for
        :meth:`cached_prompt_floor`, only where the count is judged (a coordinated layout), not for a prompt with
        embeddings (its keys hash embedding slices)."""
        if not (self.caps.cached_prompt and self.coordinated) or req.partial or req.embedded() or req.resumed:
            return
        u = self.caps.block_size
        boundary = (req.num_prompt if self.eagle_server else req.num_prompt - 1) // u * u
        tables = None
        for g, group in enumerate(self.groups):
            bs = self.gbs[g]
            if (group.kind != "full" or bs <= u or boundary <= 0 or not boundary % bs
                    or boundary > lookup.cacheable_tokens(upto, bs, self.bs, self.eagle)):
                continue
            tables = tables or self.m.block_table(rid)
            if boundary // bs < len(tables[g]) and tables[g][boundary // bs] >= 0:
                req.partial[g] = (tables[g][boundary // bs], boundary)

    def cached_prompt_floor(self, rid: int, req: Request) -> int | None:
        """The least cached-prompt count the request's tables allow (:meth:`judge_cached_prompt`): per group the
        furthest end of a block of its table the model knows is cached at that position (:attr:`cached`: a full
        block ending at token ``(i + 1) * block_size`` of this request's prefix) or of its partial entry
        (:attr:`Request.partial`, still in the table), the least over the groups; ``None`` where not judged (a
        group neither full attention nor a sliding window, the hit promise not declared, the model not knowing
        what is cached). A lower bound: what the model records is what the hit promise holds the manager to."""
        if not (self.caps.hit_promise and self.model_known) or any(
                g.kind not in ("full", "sliding_window") for g in self.groups):
            return None
        tables, floor = self.m.block_table(rid), None
        for g, table in enumerate(tables):
            bs, best = self.gbs[g], 0
            for i, block in enumerate(table):
                end = (i + 1) * bs
                if block < 0 or end > len(req.identities):
                    continue
                if self.cached.get(block) == (g, req.cache_key(end)):
                    best = end
            block, boundary = req.partial.get(g, (-1, 0))
            if boundary and boundary // bs < len(table) and table[boundary // bs] == block:
                best = max(best, boundary)
            floor = best if floor is None else min(floor, best)
        return floor

    def judge_cached_prompt(self, rid: int, req: Request) -> None:
        """The cached-prompt promise (``capabilities.cached_prompt``), judged right after the step computing the
        prompt's last token completes (when vLLM's scheduler reads ``estimate_cached_tokens`` for the request's
        ``num_cache_creation_tokens``): the count is at least :meth:`cached_prompt_floor` (what the request's own
        tables hold cached: a count below it under-reports the prompt tokens written to the cache), at most the
        tokens the request reserved (nothing past them is cached), and whole hash blocks (``capabilities.block_size``:
        a full block's end or a partial entry's last whole hash block), so a count reaching into a partial block is
        over-reported.

        Raises:
            AssertionError: the count is not an int, is below the floor, above the reserved tokens or not whole hash
                blocks.
        """
        got = self.m.cached_prompt_tokens(rid)
        floor = self.cached_prompt_floor(rid, req)
        assert isinstance(got, int) and 0 <= got <= req.reserved, \
            f"request {rid}: its prefill's first output reports {got!r} cached prompt tokens; it reserved " \
            f"{req.reserved} (the count is a token count no larger)"
        assert floor is None or got >= floor, \
            f"request {rid}: its prefill's first output reports {got} of its {req.num_prompt} prompt tokens cached, " \
            f"but its block tables hold {floor} cached (every group's own cached blocks and prompt-tail entries): " \
            f"the prompt tokens written to the cache are under-reported"
        u = self.caps.block_size
        assert got % u == 0, \
            f"request {rid}: its prefill's first output reports {got} of its {req.num_prompt} prompt tokens cached, " \
            f"not whole hash blocks of {u} tokens: the cache holds full blocks and a partial entry's whole hash " \
            f"blocks, so the count names tokens no block holds cached"

    # -- the model of the free queue, the hit promise and in-flight reads ------------------------------
    def settle(self, rid: int) -> None:
        """A deferred free whose last pending step, load or store completed happens now; one left waiting for its
        store alone holds what the store reads (:meth:`hold_for_store`)."""
        if rid in self.zombies and not self.zombies[rid].pending():
            del self.zombies[rid]
            assert not self.m.holds(rid), f"request {rid} is still held after its free completed"
        elif rid in self.zombies:
            self.hold_for_store(self.zombies[rid])

    def hold_for_store(self, req: Request) -> None:
        """A freed request waiting for its store alone (no load, no step in flight) holds only the blocks of the
        groups the store reads (``capabilities.stored_groups``; every group where ``None``)."""
        stored = self.caps.stored_groups
        if stored is not None and req.storing and req.loading is None and not req.in_flight:
            req.table = tuple(table if g in stored else [] for g, table in enumerate(req.table))

    def tables(self) -> list[tuple[int, tuple]]:
        """``(request, its block tables)`` of every adopted live request and every deferred free."""
        out = [(rid, self.m.block_table(rid)) for rid, q in self.live.items() if q.adopted]
        return out + [(rid, req.table) for rid, req in self.zombies.items()]

    def holdings(self) -> dict[int, tuple[int, int, frozenset]]:
        """Every block a live request (or a deferred free) holds -> ``(group, position in that table, holders)``: its
        lowest position where requests hold it at different ones (an exported Mamba checkpoint in its reserved block,
        hit through the block its boundary ends), and each holder's ``(request, position)``."""
        held: dict[int, tuple[int, int, frozenset]] = {}
        for rid, tables in self.tables():
            for g, table in enumerate(tables):
                for i, b in enumerate(table):
                    if b >= 0:
                        g0, i0, holders = held.get(b, (g, i, frozenset()))
                        held[b] = (*min((g0, i0), (g, i)), holders | {(rid, i)})
        return held

    def in_flight_reads(self) -> set[int]:
        return {b for req in (*self.live.values(), *self.zombies.values()) for step in req.in_flight
                for b in step.reads}

    def account(self, before: dict[int, int], call: str, hits=(), moves: int = 0, left=frozenset(),
                loading: Request | None = None) -> None:
        """Judge what ``call`` changed in the holdings: released blocks join the free-queue model (tail
        first; uncached ones to the front), blocks handed out afresh must be its front (eviction order
        ``"lru"``) and outside every in-flight step's reads, and lose what they cached. ``hits``: the admission's
        hit blocks the call adopts, less ``left``, those it left untouched in the free queue. ``moves``: blocks
        the call may hand out and free within it (:meth:`cow_moves`). The blocks the worker zeroes for the call
        (``capabilities.zeroes_new_blocks``) are zeroed now, or, for the connector load of ``loading``, once its
        data landed (:meth:`finish_load_rid`)."""
        after = self.holdings()
        # released and handed out again within the call: a holder let it go and one holds it where it did not (a
        # fork or an adopted hit only adds holders; one holder of a shared block leaving only takes one away)
        moved = {b for b in before if b in after and after[b][2] - before[b][2] and before[b][2] - after[b][2]}
        if self.replay_window or self.state_window:
            # blocks that entered the free queue (:meth:`replay_hit`): every block no longer held that was held at
            # the last count, before the call or as a hit it adopted (a partial hit's copy-on-write releases its
            # source in the same call), the moved entries' blocks, and blocks freed and handed out again within the
            # call (a Mamba group's released state block taken for its next state: popped from the queue's front)
            self.pool_entries += len((self.pool_held | set(before) | set(hits)) - set(after)) + moves + len(
                moved - set(hits))
            self.pool_held = set(after)
        released = sorted((b for b in before if b not in after or b in moved),
                          key=lambda b: (before[b][0], -before[b][1]))
        adopted = set(hits) - set(left)
        fresh = (set(after) - set(before) | moved) - adopted
        judged = self.caps.eviction_order == "lru" and self.model_known and self.total is not None
        if released:
            uncached = {b for b in released if b not in self.cached}
            if uncached:
                self.queue.insert(0, ("blocks", uncached))
            if self.grouped and len(self.groups) > 1:
                self.queue.append(("chains", Chains([b for b in released if b in self.cached and before[b][0] == g]
                                                    for g in range(len(self.groups)))))
            else:
                self.queue.extend(("blocks", {b}) for b in released if b in self.cached)
        for b in adopted:  # adopted hits leave the free queue wherever they are
            for _, tier in self.queue:
                tier.discard(b)
        reads = self.in_flight_reads() & fresh
        assert not reads, \
            f"{call}: blocks {sorted(reads)} handed out while an in-flight step still reads or writes them"
        if judged and fresh:
            self.judge_lru(call, set(fresh))
        for b in fresh:
            for _, tier in self.queue:
                tier.discard(b)
        self.queue = [(k, t) for k, t in self.queue if t or k == "initial"]
        self.ever_used |= set(after)
        for b in fresh:  # handed out again: what it cached is evicted, and a zero a load's block took is gone
            self.cached.pop(b, None)
            self.zeroed_under_load.pop(b, None)
        if self.caps.zeroes_new_blocks:
            zeroed = set(self.m.take_zeroed())
            read = sorted(zeroed & (set(after) - fresh))
            assert not read, \
                f"{call}: take_zeroed() names blocks {read}, which the call did not hand out afresh (held before it, " \
                f"or a prefix hit it adopted): the worker's zeroing wipes K/V that is read"
            if loading is not None:
                loading.zero_after_load |= zeroed
            else:
                self.zero_pages(zeroed)

    def zero_pages(self, blocks: set[int]) -> None:
        """The worker zeroes ``blocks``: their pages in every layer (every group's, one block id one page)."""
        outside = sorted(b for b in blocks if not 0 <= b < self.pools[0][0].shape[0])
        assert not outside, f"take_zeroed() names blocks {outside}, outside the pool of {self.pools[0][0].shape[0]}"
        if not blocks:
            return
        index = torch.tensor(sorted(blocks), dtype=torch.int64)
        for k_pool, v_pool in self.pools:
            k_pool[index.to(k_pool.device)] = 0
            v_pool[index.to(v_pool.device)] = 0
        if self.caps.owns_pools:
            self.m.pools_written()

    def judge_lru(self, call: str, need: set) -> None:
        """``need`` (blocks handed out afresh) must be the front of the free-queue model."""
        queue = self.queue
        while need:
            kind, tier = queue[0] if queue else ("empty", set())
            if kind == "empty":
                raise AssertionError(f"{call}: blocks {sorted(need)} handed out, which are not free")
            if kind == "initial":
                left = self.total - len(self.ever_used)
                never = {b for b in need if b not in self.ever_used}
                if len(never) < left:
                    assert need <= never, (
                        f"{call}: blocks {sorted(need - never)} (released before) handed out while "
                        f"{left - len(never)} never-used blocks are still free ahead of them (eviction order lru)")
                    self.ever_used |= never
                    return
                need -= never
                self.ever_used |= never
                queue.pop(0)
                continue
            if kind == "chains":
                if self.judge_chains(call, need, tier):
                    return
                queue.pop(0)
                continue
            front = sorted(tier)
            if tier <= need:
                need -= tier
                queue.pop(0)
            elif need <= tier:
                tier -= need
                return
            else:
                held_back = sorted(b for b in need if b not in tier)
                raise AssertionError(
                    f"{call}: blocks {held_back} handed out while {front} (released earlier, or uncached) are "
                    f"at the front of the free queue (eviction order lru: least recently released first, a "
                    f"request's blocks tail first, uncached blocks before cached ones)")

    def judge_chains(self, call: str, need: set, tier: Chains) -> bool:
        """Take ``need``'s blocks from a :class:`Chains` tier (each group's taken blocks the head of its
        chain); True when ``need`` is met inside it, False when the tier is used up (``need`` reduced)."""
        taken = need & tier.blocks()
        for chain in tier.chains:
            head = next((i for i, b in enumerate(chain) if b not in taken), len(chain))
            late = sorted(b for b in chain[head:] if b in taken)
            assert not late, (
                f"{call}: blocks {late} handed out while {[b for b in chain if b not in taken]} of "
                f"the same KV-cache group, released with them, are ahead of them in the free queue (eviction "
                f"order lru: a request's blocks are released tail first in each group)")
        for b in taken:
            tier.discard(b)
        need -= taken
        if not need:
            return True
        assert not tier, \
            f"{call}: blocks {sorted(need)} handed out while {sorted(tier.blocks())} (released earlier) are at the " \
            f"front of the free queue (eviction order lru: least recently released first)"
        return False

    def promised_hit(self, req: Request) -> int:
        """The hit the promise guarantees: the longest whole-block prefix, up to the computed minimum,
        every group can still serve from cached blocks: a full group every leading block, a sliding-window
        or chunked-local group the blocks the first computed token reads and the last cached token's
        block (a chained hash needs it; none promised with a Mamba group)."""
        if not (self.caps.hit_promise and self.model_known) or any(g.kind == "mamba" for g in self.groups):
            return 0
        if req.embedded():  # its keys hash embedding slices the identity does not see (their length): no promise
            return 0
        if self.coordinated:
            return self.coordinated_hit(req)[0]
        cap = len(req.tokens) - self.caps.min_computed_on_full_hit
        still = [set() for _ in self.groups]
        for g, ident in self.cached.values():
            still[g].add(ident)
        if not self.grouped and self.window is None:  # a window's hit needs only the blocks it reads (below)
            hit = 0
            while hit + self.bs <= cap and req.identities[hit + self.bs - 1] in still[0]:
                hit += self.bs
            return self.eagle_dropped(req, hit, still)
        for hit in range(cap // self.bs * self.bs, 0, -self.bs):
            if all(req.identities[(i + 1) * self.gbs[g] - 1] in still[g]
                   for g, group in enumerate(self.groups)
                   for i in range(min(group.first_read(hit), hit - 1) // self.gbs[g], hit // self.gbs[g])) and (
                    self.eagle_next_block(req, hit, still)):
                return hit
        return 0

    def replay_hit(self, req: Request) -> int:
        """The replay promise of fine-grained hits (``capabilities.hit_alignment``) and of layouts whose every Mamba
        group exports prefill checkpoints under the state promise (:attr:`replay_window`): a live request ``q`` whose
        steps stopped exactly at its replay boundary ``r`` (its prompt less one token, down to whole prefix-match
        units: where vLLM registers the partial entries of the prompt's tail, ``FullAttentionManager.
        _cache_partial_tail_block`` and ``MambaManager._cache_partial_tail_block``), all of them completed, holds
        every block a hit of ``r`` tokens needs (none evictable, its Mamba state there not yet moved by a next step),
        so a prompt whose first ``r`` tokens are ``q``'s hits at least ``r``.

        That state outlives the request's next step, as its blocks outlive the request: the request computed past
        ``r``, so a checkpoint inside a block is moved, at the next step, to a copy-on-write block freed once copied;
        one in its own block is released by ``remove_skipped_blocks`` (Mamba keeps only its running state); the
        full-attention entries up to ``r`` (the partial one registered once the request computed ``r``) are freed
        with the request. All of them sit in the free queue, hittable until evicted. So the promise also covers a
        request ``q``, live or released, that admitted a hit of at most ``r`` and computed its prompt of ``P`` tokens
        (decode steps since move only its running state), while no block that entered the free queue since that
        state could first enter it (after the step computing it, or at the step adopting it as a hit of ``r``) can
        have been evicted: vLLM's ``BlockPool`` appends a cached block at the queue's tail (``free_blocks``;
        uncached ones go to the front) and evicts only the block ``get_new_blocks`` pops from the front, so once one
        is evicted every block in the queue entered after it; while no more blocks entered since
        (:attr:`pool_entries`, counted from above) than the queue holds now, none was. An eviction or reset ends it
        (:meth:`end_replay_windows`). Without the manager's free count only the live request stopped at ``r`` is
        promised.

        Under EAGLE (``capabilities.eagle_drop`` with drafts asked for, :attr:`eagle_server`) the replay boundary is
        one prefix-match unit below the prompt's last whole unit, ``r = floor(P / u) * u - u`` (vLLM's
        ``get_mamba_prefill_checkpoint_position(P, u, drop_eagle_block=True)``: the Mamba checkpoint sits where
        EAGLE's lookup, matching the unit past a hit and dropping it, resumes), and the lookup needs the
        full-attention entries up to ``floor(P / u) * u`` (registered once the request computed its prompt): only
        the window above is promised.

        Without fine-grained hits (``GroupSpec.prefill_checkpoints`` in every Mamba group: vLLM's Mamba2 layers at
        one block size, ``r`` a block boundary) the state at ``r`` is written by a chunk ending there, or exported by
        the chunk crossing it: vLLM's "align" scheduler (``Scheduler._mamba_block_aligned_split``) ends every prefill
        chunk but the last on a block boundary, and the last one at ``r`` unless the manager exports the checkpoint
        ``floor((P - 1) / bs) * bs = r`` from inside it (``MambaManager._needs_internal_checkpoint``, for the chunk
        reaching the prefill's end under every retention; under EAGLE ``r = floor(P / bs) * bs - bs``, in a column
        that may hold one of the drafter's scratch blocks, ``MambaSpec.num_speculative_blocks``, kept there for the
        export).

        Not promised with a connector beside fine-grained hits (a load re-aligns the local hit to whole scheduler
        blocks; at block granularity ``r`` is one already), drafts or embeddings (their keys see what the identity
        does not), nor from a resumed request (its engine keys the prompt's tail by the prompt it was admitted
        with); multimodal inputs are let in (each token's identity names its input and offset, and an equal identity
        at the last unit the lookup matches makes every hash block up to it equal)."""
        if not self.replay_window or self.connector and self.caps.hit_alignment or self.speculative:
            return 0
        if req.embedded():
            return 0
        counts = self.m.counts()
        if self.eagle_server and counts is None:  # no free count to bound the evictions by: nothing promised
            return 0
        cap, best = len(req.tokens) - self.caps.min_computed_on_full_hit, 0
        for live, q in [*((True, q) for q in self.live.values()), *((False, q) for q in self.replayable)]:
            if not q.adopted or q.pending() or q.embedded() or q.resumed or q.reserved != q.committed:
                continue
            r = self.replay_boundary(q)
            # EAGLE's lookup matches the unit past r (and drops it)
            matched = q.num_prompt // self.unit * self.unit if self.eagle_server else r
            # its prompt computed, and no eviction since its state at r entered the free queue
            windowed = (counts is not None and q.replay_open is not None and q.committed >= q.num_prompt
                        and self.pool_entries - q.replay_open <= counts[0])
            # (without EAGLE) live and stopped at r: it holds that state
            stopped = live and not self.eagle_server and q.committed == r
            if ((windowed or stopped) and best < r <= cap and matched <= len(req.tokens)
                    and q.identities[matched - 1] == req.identities[matched - 1]):
                best = r
        return best

    def state_hit(self, req: Request) -> int:
        """The state promise of a coordinated layout with a Mamba group (:attr:`state_window`: no drafts or
        fine-grained hits; a connector's loads come past the local hit this bounds): the longest boundary ``e``
        within the hit's cap at which a completed step of a request sharing ``req``'s first ``e`` tokens wrote the
        Mamba state, while no block that entered the free queue since can have been evicted, is hit. ``e`` is a
        boundary whose state retention keeps (:meth:`state_kept`).

        vLLM's "align" mode caches a Mamba block once the request computed the boundary it ends on
        (``cache_blocks``): the state written there (a chunk's end, an exported prefill checkpoint, a decode step),
        and the attention groups' blocks below it, all of which the request held when the state was written. They
        enter the free queue as they are released (``remove_skipped_blocks`` keeps only the running state; the rest
        with the request), hittable until ``BlockPool`` evicts them from the front, the same bound as the replay
        promise's (:meth:`replay_hit`). A Mamba lookup takes the longest cached state below the attention hit, so a
        cached state at ``e`` is hit at least. Not judged for prompts with embeddings (their keys see bytes the
        identity does not).

        Under EAGLE (one full-attention group of block size ``b`` and one Mamba group, whose retention mask does not
        shift under EAGLE: draft models have no Mamba layers) vLLM's lookup (``HybridKVCacheCoordinator.
        find_longest_cache_hit``, one pass for a full group and one other) matches full attention up to ``b`` tokens
        past the cap, within the prompt's whole hash blocks, drops the last block, and takes the longest cached state
        below: ``e`` is promised once the writer committed ``e + b`` tokens (that block cached) and to a prompt
        sharing those ``e + b`` tokens (:attr:`state_reach`)."""
        if not self.state_window or req.embedded():
            return 0
        counts = self.m.counts()
        if counts is None:
            return 0
        cap, reach = len(req.tokens) - self.caps.min_computed_on_full_hit, self.state_reach
        # under EAGLE the block matched past the hit lies within the prompt's whole hash blocks
        limit = len(req.tokens) // self.bs * self.bs if reach else len(req.tokens)
        return max((e for e, identity, opened in self.state_marks if e <= cap and e + reach <= limit
                    and self.pool_entries - opened <= counts[0] and req.identities[e + reach - 1] == identity),
                   default=0)

    def state_kept(self, req: Request, e: int) -> bool:
        """Whether vLLM keeps the Mamba state at boundary ``e`` of ``req`` cached
        (``MambaManager.reachable_block_mask``): every block boundary under dense retention; under a retention
        interval its boundaries, the prompt's replay boundary (``floor((P - 1) / bs) * bs``; under EAGLE both of
        ``kv_cache_coordinator.replay_boundaries``, ``floor((P - 1) / bs) * bs - bs`` and ``floor(P / bs) * bs - bs``)
        and, without EAGLE, the request's shared-prefix junction (:meth:`junction`: the scheduler ends a chunk there
        and the mask pins it); under sparse retention (0) the replay boundaries and the junction only. A resumed
        request's boundaries are its admitted prompt's, not known here."""
        interval = self.caps.retention_interval
        if e % self.bs:
            return False
        if interval is None or interval and e % interval == 0:
            return True
        # vLLM's replay boundaries, rounded down to whole blocks (under EAGLE two: the resend's and a longer
        # sibling's, which differ where the prompt ends on a block boundary)
        kept = {b // self.bs * self.bs for b in lookup.replay_boundaries(req.num_prompt, self.bs, self.eagle_server)}
        if not self.eagle_server:  # the junction too, where vLLM's equals the model's (under EAGLE a block lower)
            kept.add(req.junction)  # None or 0 where there is none: no boundary e >= 1 matches it
        return not req.resumed and e in kept

    def check_state_retained(self, rid: int, req: Request, cached: int) -> None:
        """The retention promise beside a Mamba group (under the state promise, sparse retention, the cache
        known): a hit of ``cached`` tokens reads the Mamba state there, which vLLM keeps only on a segment's
        boundary (a retention interval's multiple; none under interval 0), at a replay boundary of a prompt
        sharing it, or at the shared-prefix junction of a request sharing it
        (``MambaManager.reachable_block_mask`` and ``_cache_partial_tail_block``). A state retention drops is
        transient: the next step overwrites it, so a hit there serves what a policy promised to free. Not judged
        where a connector loads past the hit (its load restores the state at its end, and the local hit may run
        past the Mamba group's: ``get_computed_blocks_for_connector``)."""
        interval = self.caps.retention_interval
        if not (cached and self.state_window and self.model_known) or req.embedded():
            return
        kept = interval and cached % interval == 0 or req.identities[cached - 1] in self.reachable_states
        assert kept, \
            f"request {rid}: a hit of {cached} tokens reads a Mamba state retention (interval {interval}) drops: " \
            f"{cached} is not a multiple of the interval, nor a replay boundary or shared-prefix junction of a " \
            f"request sharing those tokens (the retention promise)"

    def mark_reachable_states(self, req: Request) -> None:
        """Record ``req``'s boundaries sparse retention keeps (:meth:`check_state_retained`): its prompt's replay
        boundaries and its junction, each with and without EAGLE's shift (a block lower: vLLM's junction is its
        full-attention hit, which EAGLE's lookup ends a block lower), rounded down to whole blocks (a hit is whole
        blocks, so no other position is looked up)."""
        junction = req.junction or 0
        boundaries = {*lookup.replay_boundaries(req.num_prompt, self.bs, False),
                      *lookup.replay_boundaries(req.num_prompt, self.bs, True), junction,
                      *((junction - self.bs,) if self.eagle_server else ())}
        for b in boundaries:
            if 0 < b // self.bs * self.bs <= len(req.identities):
                self.reachable_states.add(req.identities[b // self.bs * self.bs - 1])

    def cow_moves(self, req: Request | None = None, start: int = 0) -> int:
        """Blocks an allocation may hand out and free within the call (:meth:`account`): vLLM's
        ``MambaManager.allocate_new_blocks`` moves a producer's partial tail entry to one copy-on-write block
        outside the table, freed once copied, in the allocation after the one that registered it
        (``_cache_partial_tail_block``: a step ending inside a block, at the prompt's checkpoint or a shared-prefix
        junction, both within the prompt): for a reservation of ``req`` from ``start``, one per Mamba group whose
        block ``start`` ends inside, within the prompt; for a load or resume, one per Mamba group."""
        mamba = [g for g, group in enumerate(self.groups) if group.kind == "mamba"]
        if req is None:
            return len(mamba)
        return sum(0 < start <= req.num_prompt and start % self.gbs[g] != 0 for g in mamba)

    def end_replay_windows(self) -> None:
        """An eviction or reset may have taken any request's replay boundary state (under EAGLE it sits in the
        free queue, :meth:`replay_hit`) and any Mamba state the state promise counts on (:meth:`state_hit`): none
        is promised any longer."""
        self.replayable, self.state_marks = [], []
        for q in (*self.live.values(), *self.zombies.values()):
            q.replay_open, q.state_marks = None, []

    def replay_boundary(self, q: Request) -> int:
        """``q``'s replay boundary (:meth:`replay_hit`): ``floor((P - 1) / u) * u``, under EAGLE
        ``floor(P / u) * u - u``."""
        if self.eagle_server:
            return max(q.num_prompt // self.unit * self.unit - self.unit, 0)
        return (q.num_prompt - 1) // self.unit * self.unit

    def eagle_next_block(self, req: Request, hit: int, still: list[set]) -> bool:
        """Whether a hit of ``hit`` tokens survives the EAGLE drop (``capabilities.eagle_drop``): every
        group's block after it is cached too, inside the prompt's whole hash blocks (vLLM's lookup
        matches one block past the hit, up to ``len(block_hashes) * hash_block_size``, and drops it)."""
        if not (self.speculative and self.caps.eagle_drop):
            return True
        limit = (len(req.tokens) // self.caps.block_size * self.caps.block_size if self.caps.eagle_margin else
                 len(req.tokens) - self.caps.min_computed_on_full_hit)  # a one-group lookup stops at the hit's cap
        return all(hit + bs <= limit and req.identities[hit + bs - 1] in still[g] for g, bs in enumerate(self.gbs))

    def eagle_dropped(self, req: Request, hit: int, still: list[set]) -> int:
        """One group's promised ``hit`` less the block EAGLE drops where the block after it is not cached."""
        while hit and not self.eagle_next_block(req, hit, still):
            hit -= self.bs
        return hit

    def read_blocks(self, tables: tuple, start: int, end: int) -> frozenset:
        """Blocks that tokens ``start..end`` write and whose attention window (or state) they read."""
        out = set()
        for g, group in enumerate(self.groups):
            bs, table = self.gbs[g], tables[g]
            first = group.first_read(start)
            if not self.grouped:
                first = 0 if self.window is None else max(0, start - self.window)
            out |= {table[p // bs] for p in range(first, end) if p // bs < len(table) and table[p // bs] >= 0}
        return frozenset(out)

    def check_slots(self, rid: int, slots: tuple, start: int, n: int, what: str, optional) -> None:
        """``slots`` (one list per group) of tokens ``start..start+n``: each in the request's own block at
        its position (an exported prefill checkpoint's state, before the step's last token, in any block of the
        request's table: the one its manager reserved for it), in no block another live request or another group
        holds; ``-1`` only where ``optional(group, i)`` says the group keeps nothing of token ``start + i``."""
        assert isinstance(slots, tuple) and len(slots) == len(self.groups), \
            f"request {rid}: {what} returned {slots!r}, not one slot list per KV-cache group ({len(self.groups)})"
        tables = self.m.block_table(rid)
        others = self.others(rid)
        for g in range(len(self.groups)):
            bs, table = self.gbs[g], tables[g]
            assert len(slots[g]) == n, f"request {rid}: {what}: {len(slots[g])} slots for {n} tokens (group {g})"
            mine = {b for h, t in enumerate(tables) if h != g for b in t if b >= 0}
            for i, slot in enumerate(slots[g]):
                p = start + i
                if slot < 0 and optional(g, i):
                    continue
                block, offset = divmod(slot, bs)
                # an exported Mamba checkpoint lands in the block its manager reserved for it, anywhere in the table
                exported = self.groups[g].prefill_checkpoints and i < n - 1 and block in table
                at_home = p // bs < len(table) and table[p // bs] == block
                assert slot >= 0 and offset == p % bs and (at_home or exported), \
                    f"request {rid}: token {p} got slot {slot}" + (f" in group {g}" if self.grouped else "") + \
                    f", but its block table {table} puts it elsewhere"
                assert block not in others, \
                    f"request {rid}: token {p} is to be written into block {block}, which another live request holds"
                assert block not in mine, \
                    f"request {rid}: token {p} is to be written into block {block} of group {g}, which another " \
                    f"KV-cache group of the request holds (one page, two groups' layers)"

    def reserve(self, rid: int, req: Request, token_ids: list[int], write_now: bool, hits=(), drafts: int = 0) -> bool:
        """Reserve slots for ``token_ids`` (decode tokens past the prompt extend the request; the last
        ``drafts`` are draft tokens), check them, write them (now when the manager caches at reserve time
        and steps are synchronous). False: refused. ``hits``: the blocks the admission hit (first
        reserve only): adopted now, not handed out afresh."""
        start = req.reserved
        before = self.holdings()
        if not req.adopted:  # its admitted hit (again, after a failed load) is adopted, not handed out afresh
            hits = [*hits, *(b for table in self.m.block_table(rid) for b in table if b >= 0)]
        need = self.admission_need(rid, req, start, start + len(token_ids), 0)
        entries = self.pool_entries
        slots = self.m.reserve(rid, token_ids, num_draft=drafts) if drafts else self.m.reserve(rid, token_ids)
        if slots is None:
            self.check_refusal(rid, need, f"reserve of tokens {start}..{start + len(token_ids) - 1}")
            self.account(before, f"reserve (refused) of request {rid}", moves=self.cow_moves(req, start))
            return False
        self.check_window_release(rid, req)
        req.adopted = True
        # a hit block the window already left behind (vLLM skips it, never touched) is not adopted: it stays in
        # the free queue, where this reservation may take it (what it cached evicted)
        left = set()
        if hits:
            tables, hit_blocks = self.m.block_table(rid), set(hits)
            left = {b for g, admitted in enumerate(req.table) if self.groups[g].kind in ("sliding_window",
                                                                                          "chunked_local")
                    for b in admitted if b in hit_blocks and b not in tables[g][:-(-start // self.gbs[g])]}
        self.account(before, f"reserve of request {rid}", hits=hits, moves=self.cow_moves(req, start), left=left)
        taken = len(slots[0]) if isinstance(slots, tuple) and slots else len(token_ids)
        if taken < len(token_ids):  # its scheduler clipped a prompt chunk: the rest is reserved later
            assert 0 < taken and not drafts and start + len(token_ids) <= req.num_prompt, \
                f"request {rid}: reserve returned slots for {taken} of {len(token_ids)} tokens (only a prompt " \
                f"chunk may be clipped, to at least one token)"
            token_ids = token_ids[:taken]
        if hits:
            self.check_same_step_state(rid, req, start)
        if start + len(token_ids) > len(req.tokens):
            req.extend(token_ids[len(req.tokens) - start:])
        n = len(token_ids)
        r = self.replay_boundary(req) if self.replay_window else 0
        if r and (start < r <= start + n or start == req.hit == r):
            # this step computes its replay boundary's state, which enters the free queue after it (or adopts it as
            # a hit of r, which may enter it from this step on): hittable while the count from here allows
            # (replay_hit); not again after an eviction or reset ended it
            req.replay_open = entries if start == r else self.pool_entries
        self.check_slots(rid, slots, start, n, "reserve",
                         lambda g, i: self.groups[g].kind == "mamba" and i < n - 1 - drafts)
        if self.caps.chunk_checkpoints and not drafts:
            self.check_checkpoint_export(rid, req, slots, start, n)
        if self.state_window and not req.embedded():
            # the step writes every Mamba group's state on a block boundary: it enters the free queue after this
            # step at the earliest (its block is the request's until then)
            written = set.intersection(*({i for i, slot in enumerate(slots[g]) if slot >= 0}
                                         for g, group in enumerate(self.groups) if group.kind == "mamba"))
            ends = [start + i + 1 for i in sorted(written)]
            marks = [(e, self.pool_entries) for e in ends if self.state_kept(req, e)]
            req.state_marks += marks
            if rid in self.branchable:
                # a branch point may cut just past one (:mod:`.branch_points`): a state retention keeps, which the
                # state promise asks for, or under sparse retention any on a block boundary, where one it drops
                # must not hit (:meth:`check_state_retained`)
                cuts = ([e for e in ends if e % self.bs == 0] if self.caps.retention_interval is not None else
                        [e for e, _ in marks])
                self.branch_states.setdefault(rid, []).extend(e for e in cuts if e < len(self.branchable[rid]))
        table = self.m.block_table(rid)
        pending = self.pending_slots()
        for g, group in enumerate(self.groups):  # what the step's first query reads (a hit's window, its state)
            self.check_reads(rid, req, g, group, table[g], pending, at=start)
        req.reserved = start + n
        if not self.caps.defers_commit:
            # cached at reserve time (K/V written in the same step), less the re-prefillable tail
            self.register(rid, req, req.reserved - drafts - self.reprefill)
            self.note_partial_tail(rid, req, req.reserved - drafts - self.reprefill)
        if drafts or write_now and not req.in_flight or not (self.caps.defers_commit or self.caps.async_steps):
            self.write(rid, req, slots, start, drafts)
            self.propose(rid, req)
            if not drafts:
                self.commit(rid, req)
        else:
            req.table = table
            req.in_flight.append(Step(start, req.reserved, tuple(list(s) for s in slots),
                                      self.read_blocks(table, start, req.reserved), self.epoch))
        return True

    def check_checkpoint_export(self, rid: int, req: Request, slots, start: int, n: int) -> None:
        """The checkpoint promise (``capabilities.chunk_checkpoints``): a reservation of tokens ``start..start + n - 1``
        names a slot for the state at the position its Mamba groups of Mamba2 layers export
        (:func:`.lookup.prefill_checkpoint`; vLLM's ``prefill_end``, the prompt's end under sparse retention, is
        ``max(P, tokens - 1)``), so that a manager reserving no block for a checkpoint it owes fails here and not
        only where a later prompt happens to ask for that state."""
        sparse = self.caps.retention_interval == 0
        prefill_end = max(req.num_prompt, len(req.tokens) - 1) if sparse else 0
        for g, group in enumerate(self.groups):
            if not group.prefill_checkpoints:
                continue
            c = lookup.prefill_checkpoint(start, start + n, self.caps.block_size, group.block_size,
                                          self.eagle_server, prefill_end)
            assert not c or slots[g][c - 1 - start] >= 0, \
                f"request {rid}: the reservation of tokens {start}..{start + n - 1} names no slot for the state at " \
                f"{c} tokens in group {g} ({group.kind}), which its chunk exports (the checkpoint promise: vLLM's " \
                f"prefill checkpoint rule{', under EAGLE' if self.eagle_server else ''})"

    def admission_need(self, rid: int, req: Request, start: int, end: int, computed: int) -> tuple | None:
        """``(free blocks, blocks needed)`` of a reservation or load of tokens ``start..end``
        (``capabilities.admission``), before the call; ``None`` where not promised or no counts are exposed.
        Per group: the blocks its tokens (and the lookahead) lie in that its table does not hold, and, on the first
        reservation or load, the hit blocks nobody holds (in the free queue: touching one takes it from
        there), less, for a load whose first token computed after it is ``computed``, a window's or chunk's
        hit blocks wholly before that token (the external tokens moved the window past them: never touched;
        counted with drafts on); ``"sequence"``: the whole prompt first."""
        counts = self.m.counts() if self.caps.admission else None
        if counts is None:
            return None
        first = not req.adopted
        end += self.caps.lookahead if self.speculative else 0
        if first and self.caps.admission == "sequence":
            end = max(end, req.num_prompt)
        held, need = self.holdings(), 0
        for g, (group, table) in enumerate(zip(self.groups, self.m.block_table(rid))):
            bs = self.gbs[g]
            need += sum(1 for i in range(start // bs, -(-end // bs)) if i >= len(table) or table[i] < 0)
            if first:
                skipped = (0 if group.kind == "full" or self.speculative or self.caps.admission == "whole-hit"
                           else group.first_read(computed) // bs)
                need += sum(1 for i, b in enumerate(table) if b >= 0 and b not in held and i >= skipped)
        return counts[0], need

    def check_refusal(self, rid: int, need: tuple | None, call: str) -> None:
        """A refused reservation or load (the admission promise): the pool was short of its need."""
        if need is not None:
            free, blocks = need
            assert blocks > free, \
                f"request {rid}: {call} refused with {free} blocks free, but it needs {blocks} (the admission " \
                f"promise {self.caps.admission!r}: refused only when the pool is short)"

    def check_window_release(self, rid: int, req: Request) -> None:
        """The window release promise (``capabilities.window_release``): right after a reservation, a
        sliding-window or chunked-local group holds no block wholly before what the request's first
        uncommitted token reads."""
        if not self.caps.window_release:
            return
        for g, (group, table) in enumerate(zip(self.groups, self.m.block_table(rid))):
            if group.kind not in ("sliding_window", "chunked_local"):
                continue
            first = group.first_read(req.committed)
            if not self.grouped:
                first = max(0, req.committed - self.window)
            kept = [i for i in range(min(first // self.gbs[g], len(table))) if table[i] >= 0]
            assert not kept, \
                f"request {rid}: group {g} ({group.kind}) still holds blocks {[table[i] for i in kept]} (table " \
                f"{table}) wholly before token {first}, the first its query at token {req.committed} reads (the " \
                f"window release promise: released by the next step)"

    def check_same_step_state(self, rid: int, req: Request, start: int) -> None:
        """A recurrent-state hit of ``start`` tokens, adopted now, must not be a state that a step reserved in
        this same scheduler step writes: that step's forward computes it while this one reads it (vLLM's
        ``cached_blocks_this_step``; SGLang #37836's class)."""
        tables = self.m.block_table(rid)
        for g, group in enumerate(self.groups):
            if group.kind != "mamba" or not start:
                continue
            bs, table = self.gbs[g], tables[g]
            if (start - 1) // bs >= len(table) or table[(start - 1) // bs] < 0:
                continue  # no state block: check_reads names it
            page = self.flat(g, table[(start - 1) // bs] * bs + (start - 1) % bs)
            for other, q in (*self.live.items(), *self.zombies.items()):
                for step in (step for step in q.in_flight if step.epoch == self.epoch):
                    assert page not in {self.flat(g, x) for x in step.slots[g] if x >= 0}, \
                        f"request {rid}: a hit of {start} tokens resumes group {g}'s state (block " \
                        f"{table[(start - 1) // bs]}) that request {other}'s step writes in this same scheduler " \
                        f"step (tokens {step.start}..{step.end - 1}): its forward has not computed it yet"

    def others(self, rid: int) -> set[int]:
        held = {b for r in self.live if r != rid for t in self.m.block_table(r) for b in t if b >= 0}
        return held | {b for z in self.zombies.values() for t in z.table for b in t if b >= 0}

    def admit(self, rid: int, tokens: list[int], namespace, extras: dict, chunk: int, write_now: bool,
              stored: int = 0, store_ahead: bool = False, resumed: dict | None = None) -> bool:
        # an embedding row past the prompt, or where a new message put a token (a truncated conversation's), is no
        # input: the token there is text (an engine gives a row only at a placeholder, and reads no id there)
        extras = {p: key for p, key in extras.items()
                  if not is_embedding(key) or p < len(tokens) and tokens[p] == PLACEHOLDER}
        req = Request(namespace, [], dict(extras), [], len(tokens), resumed=resumed is not None)
        req.extend(tokens)
        if resumed is None and (self.state_window or self.replay_window):
            self.branchable[rid] = list(tokens[:min(extras, default=len(tokens))])
        if not self.connector:
            stored = 0
        elif self.token_store:  # a prefiller computed the prompt less a backoff of ``stored - 1`` tokens
            stored = len(tokens) if store_ahead else max(0, len(tokens) - stored + 1) if stored else 0
        else:
            stored = min(len(tokens) // self.bs if store_ahead else stored, len(tokens) // self.bs) * self.bs
        if resumed is not None:  # the holdings before: the preemption frees what it held, then looks it up again
            got = self.m.resume(rid)
            self.account(resumed, f"resume of request {rid}", moves=self.cow_moves())
        elif stored:
            got = self.m.admit(rid, tokens, namespace, sorted(extras.items()), num_stored=stored)
        else:
            got = self.m.admit(rid, tokens, namespace, sorted(extras.items()))
        if got is None:
            # admit takes no block (the first reserve or load does): under the admission promise it is never
            # refused, or a request the hit promise covers escapes it
            assert self.caps.admission is None, \
                f"request {rid}: {'resume' if resumed is not None else 'admit'} refused, but it takes no block " \
                f"(the admission promise {self.caps.admission!r}: only a reservation or load is refused, and only " \
                f"when the pool is short)"
            if resumed is None and self.caps.hit_promise and self.promised_hit(req):
                type(self).hits_due += 1  # a refusal escapes the promise; a search of nothing but such passes none
            return False
        block_ids, cached = got
        # a prompt shorter than min_computed_on_full_hit is computed whole
        assert 0 <= cached <= max(0, len(tokens) - self.caps.min_computed_on_full_hit), \
            f"request {rid}: {cached} of {len(tokens)} prompt tokens served from the cache; at least " \
            f"{self.caps.min_computed_on_full_hit} must be computed"
        assert cached % self.unit == 0 or self.unit == 1, \
            f"request {rid}: a hit of {cached} tokens is not whole blocks" + (
                f" of {self.unit} tokens (the manager's hit alignment)" if self.caps.hit_alignment else "")
        if cached:
            type(self).prefix_hits += 1
            assert req.identities[cached - 1] in self.committed_prefixes, \
                f"request {rid}: a hit on its first {cached} tokens, which no request committed under namespace " \
                f"{namespace!r} with these extra keys"
        if self.kv_events is not None:
            self.drain_events(f"admit of request {rid}")
            self.kv_events.judge_hit(rid, namespace, tokens, cached, self.gbs)
        promised, replay = self.promised_hit(req), self.replay_hit(req)
        type(self).hits_due += promised > 0
        assert cached >= replay, \
            f"request {rid}: a hit of {cached} tokens, but a request sharing this prompt past its replay boundary of " \
            f"{replay} tokens computed its prompt, live or released, and no block that entered the free queue since " \
            f"can have been evicted, or stopped there and is live (the replay promise" + \
            (": under EAGLE)" if self.eagle_server else ")")
        state = self.state_hit(req)
        assert cached >= state, \
            f"request {rid}: a hit of {cached} tokens, but a request sharing its first {state} tokens completed a " \
            f"step writing every Mamba group's state there, on a block boundary, and no block that entered the free " \
            f"queue since can have been evicted (the state promise: a cached Mamba state hits)"
        external = self.m.num_external(rid) if stored else 0
        if self.caps.retention_interval is not None:
            if not external:  # else a load restores the state
                self.check_state_retained(rid, req, cached)
            req.junction = self.junction(req, cached)
            self.mark_reachable_states(req)
        # where the model knows every cached block of a coordinated layout, no hit is longer than the one vLLM's
        # coordinator agrees on over it: a longer one read a block sparse retention should have dropped, or kept a
        # block EAGLE drops. A ceiling needs no hit promise: where vLLM caches less than the model records (a
        # one-token window) its hit is only shorter (a prompt with embeddings is keyed by bytes the model does
        # not see: no ceiling)
        if self.coordinated and self.model_known and not req.embedded():
            # under the hit promise :meth:`promised_hit` is this same lookup
            ceiling = promised if self.caps.hit_promise else self.coordinated_hit(req)[0]
            assert cached <= ceiling, \
                f"request {rid}: a hit of {cached} tokens, but " + (
                    f"sparse retention (interval {self.caps.retention_interval}) kept window blocks for"
                    if self.caps.retention_interval is not None else "the groups' cached blocks agree on") + \
                f" a hit of at most {ceiling}" + (" (EAGLE drops a hit's last block)" if self.eagle else "")
        assert cached >= promised, \
            f"request {rid}: a hit of {cached} tokens, but its first {promised} were committed and not evicted " \
            f"since (the hit promise: what is cached hits)"
        tables = self.m.block_table(rid)
        for g, blocks in enumerate(block_ids):
            assert list(blocks) == tables[g][:len(blocks)], \
                f"request {rid}: admit returned blocks {list(blocks)}" + (f" in group {g}" if self.grouped else "") + \
                f", its block table is {tables[g]}"
            # a state group may hit less where the load restores its state (at the load's end): vLLM's divergent
            # local hybrid hit; without external tokens every group holds exactly the agreed hit
            short = external and self.groups[g].kind == "mamba"
            # (a hit ending inside a block, fine-grained: that block too)
            assert not self.grouped or len(blocks) == len(tables[g]) and (
                    len(blocks) == -(-cached // self.gbs[g]) or short and len(blocks) < cached // self.gbs[g]), \
                f"request {rid}: group {g} admitted blocks {list(blocks)} (table {tables[g]}) of {self.gbs[g]} " \
                f"tokens for the agreed hit of {cached} tokens (every group's hit truncated to the agreed length" + \
                (f"; {external} external tokens to load" if external else "") + ")"
        req.reserved = req.written = req.committed = req.hit = cached
        req.table = tables
        self.live[rid] = req
        hits = [b for blocks in block_ids for b in blocks if b >= 0]  # the first reserve adopts them
        if external:
            return self.start_load(rid, req, cached, external, stored, hits)
        if chunk and not self.reserve(rid, req, tokens[cached:cached + chunk], write_now, hits=hits):
            self.release(rid)  # refused: the scheduler drops the request
            return False
        return True

    def start_load(self, rid: int, req: Request, cached: int, external: int, stored: int, hits) -> bool:
        """The connector loads ``external`` tokens past the local hit: their blocks reserved and checked;
        the request waits for :meth:`finish_load`."""
        end = cached + external
        assert end <= min(stored, max(0, req.num_prompt - self.caps.min_computed_on_full_hit)) and (
                self.token_store or end % self.bs == 0), \
            f"request {rid}: the connector takes {external} tokens past a local hit of {cached}, beyond the " \
            f"{stored} the store holds (or the prompt's last token, or not whole blocks of a store that holds whole " \
            f"blocks)"
        before = self.holdings()
        need = self.admission_need(rid, req, cached, end, end)
        slots = self.m.load(rid)
        if slots is None:
            self.check_refusal(rid, need, f"load of tokens {cached}..{end - 1}")
            self.account(before, f"load (refused) of request {rid}", moves=self.cow_moves())
            self.release(rid)
            return False
        req.adopted = True
        # a hit block the load leaves (a window's block behind the loaded tokens' window, vLLM skipping it) is not
        # adopted: it stays in the free queue, where the load's own allocation may take it (what it cached evicted)
        tables = self.m.block_table(rid)
        hits = [b for b in hits if any(b in t[:-(-cached // self.gbs[g])] for g, t in enumerate(tables))]
        # (capabilities.loads_keep_held) a token the load leaves as its group's longer hit holds it: that block is a
        # hit the load adopts, not one handed out afresh, and the load writes nothing there
        kept = self.kept_by_load(slots, tables, cached)
        hits += sorted(kept - set(hits))
        self.account(before, f"load of request {rid}", hits=hits, moves=self.cow_moves(), loading=req)
        self.check_slots(rid, slots, cached, external, "load",
                         lambda g, i: self.groups[g].first_read(end) > cached + i or (
                             self.groups[g].kind == "mamba" and i < external - 1) or (
                             self.caps.loads_keep_held and self.held_at(tables[g], g, cached + i)))
        # a load takes the blocks its tokens lie in and no more (vLLM's allocate_external_computed_blocks: a block
        # taken past them is a block no token of the request needs yet); a Mamba group's state blocks are its own
        lookahead = self.caps.lookahead if self.speculative else 0
        for g, table in enumerate(tables):
            lie_in = -(-(end + lookahead) // self.gbs[g])
            assert self.groups[g].kind == "mamba" or len(table) <= lie_in, \
                f"request {rid}: after its load of tokens {cached}..{end - 1}, group {g}'s block table {table} " \
                f"holds {len(table)} blocks, past the {lie_in} its tokens lie in (a block no token needs)"
        req.loading = (cached, tuple(list(s) for s in slots))
        req.table = self.m.block_table(rid)
        return True

    def held_at(self, table: list[int], g: int, position: int) -> bool:
        """Group ``g``'s table holds a block for token ``position``."""
        i = position // self.gbs[g]
        return i < len(table) and table[i] >= 0

    def kept_by_load(self, slots: tuple, tables: tuple, start: int) -> set[int]:
        """The blocks a load starting at token ``start`` leaves unwritten under ``capabilities.loads_keep_held``:
        those its ``-1`` slots lie in where the group's table holds a block."""
        if not self.caps.loads_keep_held:
            return set()
        return {tables[g][(start + i) // self.gbs[g]] for g, group_slots in enumerate(slots)
                for i, slot in enumerate(group_slots) if slot < 0 and self.held_at(tables[g], g, start + i)}

    def judge_now(self) -> None:
        """Run every invariant now, as after a step of the program: a rule that runs several scheduler steps (a
        whole chat turn and the next one) is judged after each, so a check that compares two consecutive states
        (the eviction order: blocks handed out from the front of the list the last check saw) sees every state.

        Raises:
            AssertionError: an invariant fails.
        """
        step_open = getattr(self, "step_open", None)
        for name in invariant_names(type(self)):
            getattr(self, name)()
        if step_open is not None:  # still inside the rule that called it
            self.step_open = step_open

    def release(self, rid: int) -> None:
        """Free ``rid``: its steps in flight still complete (the free deferred) where steps are
        asynchronous; otherwise a pending reservation is dropped unwritten. A load in flight still
        completes, and a connector stores the request's blocks (both deferring the free)."""
        before = self.holdings()
        req = self.live.pop(rid)
        if req.written:
            self.history = [*self.history[-7:], (req.namespace, req.tokens[:req.written], dict(req.extras), req)]
        if (self.replay_window and req.replay_open is not None and req.adopted and not req.pending()
                and req.reserved == req.committed >= req.num_prompt):
            self.replayable = [*self.replayable[-7:], req]
        if not (req.in_flight and self.caps.async_steps):
            req.in_flight = []
        req.storing = self.connector
        if req.pending():
            req.table = self.m.block_table(rid) if req.adopted else tuple([] for _ in self.groups)
            self.zombies[rid] = req
            self.hold_for_store(req)
        self.m.free(rid)
        if not req.pending():
            assert not self.m.holds(rid), f"request {rid} is still held after free"
        self.account(before, f"free of request {rid}")

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    # -- rules ---------------------------------------------------------------------------------------
    @rule(target=reqs, system=systems, suffix=st.lists(VOCAB, max_size=6), namespace=st.sampled_from(NAMESPACES),
          extra=st.sampled_from(EXTRA_KEYS), chunk=st.integers(1, 12), write_now=st.booleans(),
          image_at=st.integers(0, 3), stored=st.integers(0, 3), n=st.integers(1, 3), store_ahead=st.booleans(),
          more=st.lists(st.tuples(st.sampled_from(MORE_ITEMS), st.sampled_from(GAPS)), max_size=2),
          embeds=st.none() | st.tuples(st.sampled_from(EMBEDS), st.integers(-4, 5), st.integers(1, 3)),
          tail=st.integers(0, 3))
    def add(self, system, suffix, namespace, extra, chunk, write_now, image_at=0, stored=0, n=1, store_ahead=False,
            more=(), embeds=None, tail=None):
        """A request: a system prompt and its own suffix, under a namespace, with a multimodal input
        ``extra`` (its placeholder run, as long as :data:`IMAGE_LENGTHS` says, ``image_at`` into the suffix);
        the first prefill chunk reserved (written now or later). With a connector, the store holds the
        prompt's first ``stored`` hit-sized blocks (its tokens past the local hit are loaded first), or, a P/D
        prefiller's store (``start``'s ``features`` bit 2), the prompt less a backoff of ``stored - 1`` tokens (none
        for ``stored`` 0); with ``store_ahead``, the whole prompt (a store shared with other instances, ahead of
        the device cache): every local hit short of the prompt then meets a load, whose blocks are allocated while
        the hit's may still sit in the free queue.
        ``n`` > 1: parallel sampling, ``n`` requests of the prompt admitted in one scheduler step, each's
        first chunk reserved before any is written (one prefill batch): a later one may hit what an earlier
        one cached in this step, whose K/V or recurrent state that step's forward has not written yet
        (vLLM's ``cached_blocks_this_step``; SGLang #37836's batch). ``more``: further multimodal inputs
        ``(input, gap)`` at the suffix's end (attachments after a message), the first ending ``gap`` tokens
        before the prompt's end, each next one ``gap`` tokens before the previous one, while they fit in the
        suffix beside ``extra``: several inputs in one block, the prompt's partial last block among them,
        whose key must name every input it overlaps (also where decode completes it). ``tail`` (programs drawn
        since attachments are inserted; ``None``: the older placement above): the inputs of ``more`` inserted at
        the suffix's end rather than written over it (each ``gap`` moves that many of the suffix's last tokens
        behind it; ``extra`` the first of them, ``GAPS[image_at]`` tokens before the next), and text tokens before
        them dropped or added so that the prompt's last block is partial, ``tail`` tokens fewer than one short of full
        (``tail`` 0: all but one token): the inputs then lie in the prompt's partial last block whatever the
        suffix's length, where the first decode step completes it (:meth:`attach`). ``embeds``: ``(payload,
        at, length)``: prompt embeddings (where the manager takes them, ``capabilities.prompt_embeds``): up to
        ``length`` rows of ``payload`` given instead of tokens from suffix position ``at`` on, or, ``at`` < 0,
        from the prompt's start (a soft prompt, shared as a system prompt is) (placeholder ids, positions no
        multimodal input holds), so that prompts share placeholder ids but not embeddings."""
        self.log("add", system=system, suffix=suffix, namespace=namespace, extra=extra, chunk=chunk,
                 write_now=write_now, image_at=image_at, stored=stored, **({"n": n} if n > 1 else {}),
                 **({"store_ahead": True} if store_ahead else {}),
                 **({"more": [list(m) for m in more]} if more else {}),
                 **({"embeds": list(embeds)} if embeds else {}), **({"tail": tail} if tail is not None else {}))
        namespace = namespace if self.caps.namespaces else None
        tokens, extras = self.prompt(system, suffix, extra, image_at, more, embeds, tail)
        admitted = []
        for _ in range(max(1, n)):
            rid = self.new_id()
            if self.admit(rid, tokens, namespace, extras, chunk, write_now and n <= 1, stored, store_ahead):
                admitted.append(rid)
        return multiple(*admitted)

    def prompt(self, system, suffix, extra, image_at, more, embeds, tail) -> tuple[list[int], dict]:
        """``add``'s prompt: its token ids and extra keys (position -> key)."""
        attached = {}  # the suffix's inserted inputs (``tail``)
        if tail is not None and more and suffix and self.caps.extra_keys:
            first = [] if extra is None else [(extra, GAPS[image_at % len(GAPS)])]
            suffix, attached = self.attach(len(system), list(suffix), [*more, *first], tail)
        tokens = list(system) + list(suffix)
        extras = {len(system) + p: key for p, key in attached.items()}
        if extra is not None and suffix and self.caps.extra_keys and not attached:
            length = IMAGE_LENGTHS[extra]
            first = len(system) + image_at % max(1, len(suffix) - length + 1)  # inside the suffix where it fits
            # whole even where the suffix is shorter: an engine's processor expands an input to the run its content
            # gives, and vLLM keys a block by the input's identifier and offset, not its length (a run cut here
            # would be one image at two lengths)
            tokens += [PLACEHOLDER] * max(0, first + length - len(tokens))
            for i in range(length):
                extras[first + i] = ("mm", extra, i)
                tokens[first + i] = PLACEHOLDER
        end = len(tokens)
        for item, gap in more if suffix and self.caps.extra_keys and not attached else ():
            end -= gap
            start = end - IMAGE_LENGTHS[item]
            if start < len(system) or any(p in extras for p in range(start, end)):
                break
            for i in range(IMAGE_LENGTHS[item]):
                extras[start + i] = ("mm", item, i)
                tokens[start + i] = PLACEHOLDER
            end = start
        if embeds and suffix and self.caps.prompt_embeds and self.caps.extra_keys:
            payload, at, length = embeds
            first = 0 if at < 0 else len(system) + at % len(suffix)
            for i, p in enumerate(range(first, min(first + length, len(tokens)))):
                if p in extras:
                    break
                extras[p] = ("embed", payload, i)
                tokens[p] = PLACEHOLDER
        return tokens, extras

    @rule(system=systems, suffix=st.lists(VOCAB, max_size=6), namespace=st.sampled_from(NAMESPACES),
          extra=st.sampled_from(EXTRA_KEYS), image_at=st.integers(0, 3),
          more=st.lists(st.tuples(st.sampled_from(MORE_ITEMS), st.sampled_from(GAPS)), max_size=2),
          tail=st.integers(0, 3), tokens=st.lists(VOCAB, min_size=1, max_size=4),
          reply=st.lists(VOCAB, min_size=1, max_size=3))
    def serve(self, system, suffix, namespace, extra, image_at=0, more=(), tail=None, tokens=(), reply=None):
        """A whole chat turn between two other steps: a prompt as :meth:`add` builds it admitted, prefilled in one
        chunk, ``tokens`` decoded one step each, finished (a short request that runs to completion while others
        wait): output completes the prompt's partial last block (where its inputs lie, ``tail``) and the
        conversation, output and all, is left in the cache. ``reply``: the user's next message, served the same
        way at once: its prompt is the whole conversation so far and the message, whose hit reaches through the
        blocks the first turn's output completed (a chat's next turn, vLLM's block hashes computed afresh;
        ``None``: no next turn, as no program drawn since has)."""
        self.log("serve", system=system, suffix=suffix, namespace=namespace, extra=extra, image_at=image_at,
                 **({"more": [list(m) for m in more]} if more else {}), **({"tail": tail} if tail is not None else {}),
                 tokens=tokens, **({"reply": reply} if reply is not None else {}))
        prompt, extras = self.prompt(system, suffix, extra, image_at, more, None, tail)
        namespace = namespace if self.caps.namespaces else None
        elsewhere, conversation = 0, None
        for _ in range(1 if reply is None else 2):
            if conversation is not None:
                # the reply comes after a pause (its length less one: the blocks the conversation went on elsewhere)
                elsewhere = self.pause(max(0, len(reply) - 1), conversation)
                if elsewhere:
                    self.judge_now()
                prompt = [*conversation.tokens[:conversation.written], *[0] * elsewhere, *reply] or [0]
                extras = whole_inputs(conversation.extras, conversation.written)
            rid = self.new_id()
            if not self.admit(rid, prompt, namespace, extras, len(prompt), True, store_ahead=bool(elsewhere)):
                return
            req = self.live[rid]
            if req.loading is not None:  # the store's blocks past the local hit loaded first
                self.judge_now()
                self.finish_load_rid(rid, True)
            self.judge_now()
            self.decode_tokens(rid, tokens)
            self.judge_now()
            self.release(rid)
            self.judge_now()
            conversation = req

    def attach(self, start: int, suffix: list, more, tail: int) -> tuple[list, dict]:
        """``add``'s attachments: the suffix with the inputs of ``more`` (``(input, gap)``, last first) inserted at
        its end, each followed by ``gap`` of the suffix's last tokens, and text tokens in front of them dropped (or,
        too few, tokens of id 1 added) so that the last block of a prompt of ``start`` tokens before the suffix
        holds ``bs - 1 - tail % (bs - 1)`` of its tokens (``bs`` the hit block size; a block of one token is never
        partial). Returns the new suffix and its inputs' positions in it (position -> ``("mm", input, offset)``)."""
        text, behind = list(suffix), []
        for item, gap in more:
            gap = min(gap, len(text))
            behind = [("mm", item, i) for i in range(IMAGE_LENGTHS[item])] + text[len(text) - gap:] + behind
            del text[len(text) - gap:]
        if self.bs > 1:
            ends = self.bs - 1 - tail % (self.bs - 1)  # prompt tokens in its last block
            short = (ends - start - len(text) - len(behind)) % self.bs  # text tokens to add, or bs less to drop
            text = text[:len(text) - (self.bs - short)] if short and len(text) >= self.bs - short else \
                text + [1] * short
        suffix = text + [PLACEHOLDER if isinstance(t, tuple) else t for t in behind]
        return suffix, {len(text) + i: t for i, t in enumerate(behind) if isinstance(t, tuple)}

    @precondition(lambda self: self.history)
    @rule(target=reqs, turn=st.integers(0, 7), suffix=st.lists(VOCAB, max_size=4), chunk=st.integers(1, 12),
          write_now=st.booleans(), stored=st.integers(0, 3), store_ahead=st.booleans())
    def next_turn(self, turn, suffix, chunk, write_now, stored=0, store_ahead=False):
        """The next turn of a finished conversation: its tokens so far (prompt and output) and a new
        message ``suffix``, under its namespace (a multi-turn chat: the hits reach past the system prompt);
        ``stored`` and ``store_ahead`` as :meth:`add`'s. On a layout of several KV-cache groups with a connector,
        ``store_ahead`` with ``stored`` > 0 (a draw ``store_ahead`` leaves unused) is a conversation that went on
        elsewhere: another instance served ``stored`` blocks of it (tokens 0) into the shared store, and the turn
        comes back here after a pause on a busy server (:meth:`pause`): the store holds the whole prompt, this
        instance's cache the conversation as it left it, the first to be evicted."""
        self.log("next_turn", turn=turn, suffix=suffix, chunk=chunk, write_now=write_now, stored=stored,
                 **({"store_ahead": True} if store_ahead else {}))
        namespace, tokens, extras, conversation = self.history[-1 - turn % len(self.history)]
        elsewhere = self.pause(stored, conversation) if store_ahead else 0
        rid = self.new_id()
        ok = self.admit(rid, [*tokens, *[0] * elsewhere, *suffix] or [0], namespace, extras, chunk, write_now, stored,
                        store_ahead)
        return rid if ok else multiple()

    @rule(target=reqs, rid=reqs, change=st.sampled_from(("image", "namespace", "content", "same")),
          chunk=st.integers(1, 12), write_now=st.booleans(), which=st.integers(0, 2),
          output=st.sampled_from(("none", "decoded", "in_prompt")), suffix=st.lists(VOCAB, max_size=4))
    def variant(self, rid, change, chunk, write_now, which=0, output="none", suffix=()):
        """A request whose prompt is a live one's with one identity part moved so that encodings may
        collide: an input (multimodal or embedding rows) one token later or earlier, every token id kept (so
        that the blocks differ from the live one's only in the input's offset; an embedding row's token is a
        placeholder, so rows keep every id only where they move over one: of the inputs and ways, first one that
        keeps it in its blocks, then one that keeps every token id, then the first input, the later way; where none
        of its inputs moves inside blocks it has committed, which a hit reaches, the latest live request's that
        does, so that the draw lands where two encodings can meet), or its namespace swapped for a sibling, or
        (``"content"``) its input number ``which`` (of those it has, in order) another one of the same size
        (same placeholder run, other content: only the key differs), or (``"same"``) nothing: the same prompt
        again (a client's retry, one prompt sent twice) while the live one may still be in prefill, so that both
        compute its blocks and a cache files two blocks under one hash. The live request's ``output`` so far:
        ``"decoded"`` by the variant after its prompt (a reply that comes out the same: blocks completed by
        decode carry the two prompts' tails alike), ``"in_prompt"`` (the conversation re-sent with its input
        edited: the edited blocks lie inside the prompt, full, where a hit reaches them), or ``"none"``; then a
        new message ``suffix`` (an earlier message edited, the chat going on: the edited blocks are no longer the
        prompt's last, which no hit reaches)."""
        self.log("variant", rid=rid, change=change, chunk=chunk, write_now=write_now,
                 **({"which": which} if change == "content" else {}),
                 **({"output": output} if output != "none" else {}), **({"suffix": suffix} if suffix else {}))

        def edited(owner):  # what a variant of ``owner`` edits: its prompt (output too, re-sent), inputs, namespace
            end = max(owner.num_prompt, owner.written) if output == "in_prompt" else owner.num_prompt
            return list(owner.tokens[:end]), dict(owner.extras), owner.namespace

        req = self.live[rid]
        tokens, extras, namespace = edited(req)
        if change == "same":
            pass
        elif change == "namespace":
            if not self.caps.namespaces:
                return multiple()
            namespace = SIBLINGS.get(namespace, None)
        elif change == "content":
            starts = sorted(p for p, key in extras.items() if key[2] == 0 and p < len(tokens))
            if not starts:
                return multiple()
            first = starts[which % len(starts)]
            kind, ident = extras[first][:2]
            other = ident[:-1] if ident.endswith("'") else ident + "'"
            for p in range(first, len(tokens)):
                if extras.get(p) != (kind, ident, p - first):
                    break
                extras[p] = (kind, other, p - first)
        else:
            def reached(owner, way):  # the input stays inside its blocks, which its request has committed
                return not way[0] and owner.committed >= (max(way[-2]) // self.bs + 1) * self.bs

            ways = self.input_moves(tokens, extras)
            if not any(reached(req, way) for way in ways):
                # none moves inside blocks a hit reaches: the latest live request with an input that does
                for other in reversed(self.live.values()):
                    prompt = edited(other)
                    moves = [way for way in self.input_moves(*prompt[:2]) if reached(other, way)]
                    if moves:
                        req, ways, (tokens, extras, namespace) = other, moves, prompt
                        break
            if not ways:  # no input, or none inside the prompt (a preempted request's truncated one) or movable
                return multiple()
            *_, kind, ident, run, moved = min(ways, key=lambda way: way[:3])
            extras = {p: key for p, key in extras.items() if p not in run}
            extras.update({p: (kind, ident, i) for i, p in enumerate(moved)})
            for p in moved if kind == "embed" else ():  # an engine reads no token id under an embedding row
                tokens[p] = PLACEHOLDER
        new = self.new_id()
        if not self.admit(new, [*tokens, *suffix], namespace, extras, chunk, write_now):
            return multiple()
        if output == "decoded" and new in self.live:
            self.decode_tokens(new, req.tokens[req.num_prompt:req.written])
        return new

    def input_moves(self, tokens: list[int], extras: dict) -> list[tuple]:
        """:meth:`variant`'s ways to move an input of a prompt (``tokens``, ``extras``) one token later or earlier:
        ``(its blocks change, token ids change, input order, kind, ident, run, moved)`` each, never onto another
        input (a cut input's key would name a placeholder run it does not have)."""
        bs, ways = self.bs, []
        for order, start in enumerate(sorted(p for p, key in extras.items() if key[2] == 0)):
            kind, ident = extras[start][:2]
            run = [p for p in range(start, len(tokens)) if extras.get(p) == (kind, ident, p - start)]
            shifts = (([p + 1 for p in run], run[-1] + 1), ([p - 1 for p in run], run[0] - 1)) if run else ()
            for moved, over in shifts:  # (the run moved, the token it moves over)
                if min(moved) >= 0 and max(moved) < len(tokens) and all(p in run or p not in extras for p in moved):
                    ways.append(({p // bs for p in moved} != {p // bs for p in run},  # token ids change:
                                 kind == "embed" and not (0 <= over < len(tokens) and tokens[over] == PLACEHOLDER),
                                 order, kind, ident, run, moved))
        return ways

    @rule(rid=reqs, n=st.integers(1, 6), token=VOCAB, write_now=st.booleans())
    def step(self, rid, n, token, write_now):
        """The next chunk: up to ``n`` prompt tokens, or one decode token once the prompt is reserved; with
        asynchronous steps, reserved while the previous step is still in flight."""
        self.log("step", rid=rid, n=n, token=token, write_now=write_now)
        req = self.live[rid]
        if req.loading is not None or req.in_flight and not (self.caps.async_steps and len(req.in_flight) < 2):
            return  # a pending reservation is written first; a loading request waits
        if req.reserved < req.num_prompt:
            tokens = req.tokens[req.reserved:min(req.reserved + n, req.num_prompt)]
        else:
            tokens = [token if req.correction is None else req.correction]
        if self.reserve(rid, req, tokens, write_now):
            req.correction = None

    @rule(rid=reqs, tokens=st.lists(VOCAB, min_size=2, max_size=6))
    def decode(self, rid, tokens):
        """A generation running on: the prompt's unreserved rest in one chunk, then one decode step per token
        of ``tokens``, each written and committed before the next (most of a request's life), so that output
        fills blocks: a block completed by decode, a window passing a long chunk's blocks at once, a
        preemption with output. The request's steps in flight complete first (a running request's next
        step follows them); nothing happens while a load is pending."""
        self.log("decode", rid=rid, tokens=tokens)
        self.decode_tokens(rid, tokens)

    def decode_tokens(self, rid, tokens):
        req = self.live[rid]
        while req.loading is None and req.in_flight:
            self.write_pending_rid(rid)
        if req.loading is not None or req.correction is not None:
            return
        if req.reserved < req.num_prompt and not self.reserve(rid, req, req.tokens[req.reserved:req.num_prompt], True):
            return
        for token in tokens:
            if req.in_flight or not self.reserve(rid, req, [token], True):
                return

    @precondition(lambda self: any(q.in_flight for q in (*self.live.values(), *self.zombies.values())))
    @rule(data=st.data())
    def write_pending(self, data):
        """Write and commit the oldest reservation left pending (a step completing)."""
        pending = sorted(r for r, q in (*self.live.items(), *self.zombies.items()) if q.in_flight)
        rid = data.draw(st.sampled_from(pending), label="rid")
        self.log("write_pending_rid", rid=rid)
        self.write_pending_rid(rid)

    def write_pending_rid(self, rid):
        req = self.live.get(rid) or self.zombies[rid]
        step = req.in_flight.pop(0)
        self.write(rid, req, step.slots, step.start)
        if rid in self.live and not req.in_flight:
            self.propose(rid, req)
        self.commit(rid, req)

    @precondition(lambda self: self.speculative)
    @rule(rid=reqs, token=VOCAB, drafts=st.lists(VOCAB, min_size=1, max_size=MAX_DRAFTS), rejected=st.integers(0, 3))
    def speculate(self, rid, token, drafts, rejected):
        """A decode step with draft tokens: the next token and ``drafts`` reserved, their K/V (and each
        draft's state) written, then the last ``rejected`` drafts dropped (verification). A request still in
        prefill is brought to decode first: its steps in flight complete and the rest of its prompt is prefilled."""
        self.log("speculate", rid=rid, token=token, drafts=drafts, rejected=rejected)
        req = self.live[rid]
        while req.loading is None and req.in_flight and rid in self.live:
            self.write_pending_rid(rid)
        if rid in self.live and req.loading is None and req.reserved < req.num_prompt:
            self.reserve(rid, req, req.tokens[req.reserved:req.num_prompt], True)
        if rid not in self.live or req.loading is not None or req.in_flight or req.reserved < req.num_prompt:
            return
        rejected = min(rejected, len(drafts))
        token = token if req.correction is None else req.correction
        if self.reserve(rid, req, [token, *drafts], True, drafts=len(drafts)):
            before = self.holdings()
            self.m.drop(rid, rejected)
            if rejected:
                self.rejected = [*self.rejected[-3:], (req.namespace, list(req.tokens), dict(req.extras))]
            req.truncate(len(req.tokens) - rejected)
            # the target model's token at the first rejected position differs from that draft
            req.correction = (drafts[-rejected] + 1) % 4 if rejected else None
            self.commit(rid, req)
            self.account(before, f"drop of request {rid}")

    @precondition(lambda self: self.rejected)
    @rule(target=reqs, pick=st.integers(0, 3), token=VOCAB, chunk=st.integers(1, 12), write_now=st.booleans())
    def spell_rejected(self, pick, token, chunk, write_now):
        """A request whose prompt spells a rejected timeline (a speculating request's tokens and the drafts
        verification rejected) and one more token: whatever it hits must have been committed, and reads
        its own tokens' K/V, never what the rejected drafts left."""
        self.log("spell_rejected", pick=pick, token=token, chunk=chunk, write_now=write_now)
        namespace, tokens, extras = self.rejected[-1 - pick % len(self.rejected)]
        rid = self.new_id()
        return rid if self.admit(rid, [*tokens, token], namespace, extras, chunk, write_now) else multiple()

    @precondition(lambda self: any(q.loading is not None for q in (*self.live.values(), *self.zombies.values())))
    @rule(data=st.data(), ok=st.booleans())
    def finish_load(self, data, ok):
        """A connector load completes (its K/V written) or fails (garbage written, recomputed)."""
        loading = sorted(r for r, q in (*self.live.items(), *self.zombies.items()) if q.loading is not None)
        rid = data.draw(st.sampled_from(loading), label="rid")
        self.log("finish_load_rid", rid=rid, ok=ok)
        self.finish_load_rid(rid, ok)

    def finish_load_rid(self, rid, ok):
        req = self.live.get(rid) or self.zombies[rid]
        start, slots = req.loading
        end = start + len(slots[0])
        garbage = None if ok else [i ^ 0x5A5A for i in req.identities[start:end]]
        self.write(rid, req, slots, start, identities=garbage)
        # what the worker zeroes for the load races its data: the zeroing may land last
        self.zero_pages(req.zero_after_load)
        self.zeroed_under_load.update(dict.fromkeys(req.zero_after_load, rid))
        req.zero_after_load = set()
        before = self.holdings()
        req.loading = None
        again, hits = self.m.load_done(rid, ok), ()
        req.written = end if ok else start
        if ok:  # valid K/V: hittable even where the request was freed meanwhile (not promised then: vLLM frees
            # such a load's blocks uncached), less the re-prefillable tail
            self.register(rid, req, end - self.reprefill, promised=rid in self.live)
        elif again is not None and rid in self.live:  # let go and looked up again: an admitted hit, held
            assert 0 <= again <= start and (again == 0 or req.identities[again - 1] in self.committed_prefixes), \
                f"request {rid}: after its failed load a hit of {again} tokens (its local hit was {start}), " \
                f"which no request committed"
            req.written, req.adopted = again, self.m.holds(rid)  # from its next reserve
            if req.adopted:  # held at once (a scheduler looks up and allocates in one pass): hit, not handed out
                hits = [b for table in self.m.block_table(rid) for b in table if b >= 0]
        req.reserved = req.committed = req.written
        if not ok:  # its computation starts again from the hit looked up again
            req.hit, req.replay_open = req.written, None
        self.settle(rid)
        self.account(before, f"load_done of request {rid}", hits=hits, moves=self.cow_moves())

    @precondition(lambda self: any(q.storing for q in self.zombies.values()))
    @rule(data=st.data())
    def finish_store(self, data):
        """A freed request's connector store completes: its deferred free happens."""
        rid = data.draw(st.sampled_from(sorted(r for r, q in self.zombies.items() if q.storing)), label="rid")
        self.log("finish_store_rid", rid=rid)
        self.finish_store_rid(rid)

    def finish_store_rid(self, rid):
        before = self.holdings()
        self.zombies[rid].storing = False
        self.m.store_done(rid)
        self.settle(rid)
        self.account(before, f"store_done of request {rid}")

    def pause(self, stored: int, conversation: Request) -> int:
        """The pause before a finished ``conversation``'s next turn, whose prompt the store holds ahead of the
        device (``store_ahead``, which leaves the ``stored`` draw unused): on a layout of several KV-cache groups
        with a connector and ``stored`` > 0, a busy server's traffic meanwhile: every store in flight completes
        (finished requests' blocks enter the free queue, still cached), then one request no one shares takes the
        free blocks ahead of the conversation's (never-used, uncached, and cached ones released before it; ``stored
        - 1`` more, its lookahead's blocks counted, rounded to whole blocks per group) and finishes, its store
        completing too (:meth:`pressure`). The conversation's blocks are then the free queue's front (each group's
        tail first) but for what the pressure gave back uncached (its lookahead's blocks) or left; the turn's hit
        is touched there and its load's blocks taken, a load long enough to pass what is ahead of them (vLLM's
        two-phase touch, #33775). Other programs are unchanged: the draw decides only here; no pressure where none
        of the conversation's blocks is free and cached.

        Args:
            stored: ``next_turn``'s draw, 0-3: blocks of the hit size (the lcm of the groups' block sizes) the
                conversation went on elsewhere past what the free queue holds ahead of its blocks (0: no pause).
            conversation: the finished request whose turn this is (its block tables).

        Returns:
            the tokens the conversation went on elsewhere (0: no pause): ``stored`` blocks of the hit size, and
            where the free-queue model holds blocks ahead of the conversation's after the pressure, enough more for
            the first KV-cache group's blocks of the load to pass them.
        """
        if not (stored and self.connector and len(self.groups) > 1):
            return 0
        for rid in sorted(r for r, q in self.zombies.items() if q.storing):
            self.finish_store_rid(rid)
        if self.total is None:
            # no free count to size the traffic by: the largest request the pool admits (its groups' blocks of
            # num_blocks shared, ``stored`` - 1 more), down to one block, each refused one taking nothing
            for n in range(self.num_blocks // len(self.groups) + stored - 1, 0, -1):
                rid = self.next_id
                if self.pressure(n):
                    if rid in self.zombies and self.zombies[rid].storing:
                        self.finish_store_rid(rid)
                    break
            return stored * self.bs

        def ahead_of_conversation() -> int | None:  # free blocks the queue model holds ahead of its last release
            mine = {b for g, table in enumerate(conversation.table) for i, b in enumerate(table)
                    if b >= 0 and (i + 1) * self.gbs[g] <= len(conversation.identities)
                    and self.cached.get(b) == (g, conversation.identities[(i + 1) * self.gbs[g] - 1])}
            # the tier of its last release (blocks a window let go while it ran were released earlier)
            tiers = [tier.blocks() if kind == "chains" else tier for kind, tier in self.queue]
            last = max((i for i, blocks in enumerate(tiers) if blocks & mine), default=None)
            return None if last is None else sum(self.total - len(self.ever_used) if kind == "initial" else len(blocks)
                                                 for (kind, _), blocks in zip(self.queue[:last], tiers))

        ahead = ahead_of_conversation()
        if ahead is None:
            return stored * self.bs
        lookahead = self.caps.lookahead if self.speculative else 0

        def taken(n: int) -> int:  # the blocks a pressure of n hit-size blocks takes, its lookahead's included
            return sum(-(-(n * self.bs + lookahead) // size) for size in self.gbs)

        room = ahead + stored - 1
        n = max((n for n in range(1, room + 1) if taken(n) <= room), default=0)
        if n:
            rid = self.next_id
            self.pressure(n)
            if rid in self.zombies and self.zombies[rid].storing:
                self.finish_store_rid(rid)
            ahead = ahead_of_conversation() or 0  # what it gave back uncached (its lookahead's blocks) or left
        # the load reaches past what is still ahead of the conversation's blocks: the first KV-cache group's blocks
        # for it come from the queue's front
        return (stored + -(-ahead * self.gbs[0] // self.bs)) * self.bs

    def pressure(self, n) -> bool:
        """Memory pressure: a request of ``n`` blocks of every group's size, prompt tokens no other request
        has, prefilled in one step and finished: the free queue's front ``n`` blocks per group are handed
        out (what they cached evicted, in the order the manager promises) and come back holding its prefix.
        ``False``: the request was refused (nothing taken)."""
        rid = self.new_id()
        tokens, history = [1000 + rid] + [0] * (n * self.bs - 1), self.history
        admitted = self.admit(rid, tokens, None, {}, len(tokens), True)
        if admitted:
            self.release(rid)
        self.history = history  # not a conversation to continue
        return admitted

    @rule(rid=consumes(reqs))
    def free(self, rid):
        """Finish or abort (a pending reservation is dropped unwritten, or completes later where steps
        are asynchronous)."""
        self.log("free", rid=rid)
        self.release(rid)

    @precondition(lambda self: self.caps.preempt)
    @rule(target=reqs, rid=consumes(reqs))
    def preempt(self, rid):
        """Preempt (free) and resume by recompute: re-admit every token so far under a new id, or, where the
        manager resumes (``capabilities.resume``) and the request has nothing pending, the same request
        looked up again with its output, as vLLM's scheduler resumes it (its hit may reach past the prompt)."""
        self.log("preempt", rid=rid)
        req = self.live[rid]
        if (self.caps.resume and req.adopted and not req.pending() and req.correction is None
                and req.written == req.reserved == len(req.tokens)):
            before = self.holdings()
            del self.live[rid]
            ok = self.admit(rid, list(req.tokens), req.namespace, req.extras, len(req.tokens), True, resumed=before)
            return rid if ok else multiple()
        self.release(rid)
        new = self.new_id()
        ok = self.admit(new, req.tokens[:max(req.written, 1)] if req.tokens else [0], req.namespace, req.extras,
                        len(req.tokens), True)
        return new if ok else multiple()

    @precondition(lambda self: self.caps.fork)
    @rule(target=reqs, rid=reqs)
    def fork(self, rid):
        """Fork (beam search, parallel sampling): the child shares the parent's blocks."""
        self.log("fork", rid=rid)
        parent = self.live[rid]
        if parent.in_flight or parent.loading is not None:
            return multiple()
        child = self.new_id()
        before = self.holdings()
        self.m.fork(rid, child)
        self.live[child] = dataclasses.replace(parent, tokens=list(parent.tokens), identities=list(parent.identities),
                                               extras=dict(parent.extras), in_flight=[], adopted=True)
        self.account(before, f"fork of request {rid}")
        return child

    @precondition(lambda self: self.history)
    @rule(target=reqs, turn=st.integers(0, 7), cut=st.integers(0, 15), suffix=st.lists(VOCAB, max_size=4),
          chunk=st.integers(1, 12), write_now=st.booleans())
    def branch(self, turn, cut, suffix, chunk, write_now):
        """A finished conversation branched at an earlier point (a message edited, a reply regenerated): its
        first ``cut`` tokens and a new ``suffix``. Its hit ends inside the conversation, where a window's
        blocks were released while the conversation ran on (the free queue's front, evicted first)."""
        self.log("branch", turn=turn, cut=cut, suffix=suffix, chunk=chunk, write_now=write_now)
        namespace, tokens, extras, _ = self.history[-1 - turn % len(self.history)]
        cut = 1 + cut % len(tokens)
        rid = self.new_id()
        ok = self.admit(rid, [*tokens[:cut], *suffix], namespace, whole_inputs(extras, cut), chunk, write_now)
        return rid if ok else multiple()

    @precondition(lambda self: self.caps.evict and self.next_id > 0)  # nothing is cached before a request
    @rule(n=st.integers(1, 4), by_allocation=st.booleans())
    def evict(self, n, by_allocation=False):
        """Evict up to ``n`` unreferenced cached blocks (what the manager evicted is no longer promised), or
        ``by_allocation``: memory pressure (:meth:`pressure`) of ``2 * n`` blocks per group, or, where the
        manager promises the ``"lru"`` order (never-used blocks go first), sized to reach ``n`` blocks past the
        never-used ones: the first cached blocks that order gives up are evicted, the rest stay (a window's
        tail, say, while the full group's stays)."""
        self.log("evict", n=n, by_allocation=by_allocation)
        if by_allocation and self.caps.eviction_order == "lru" and self.model_known and self.total is not None:
            self.pressure(-(-(max(0, self.total - len(self.ever_used)) + n) // len(self.groups)))
            return
        if by_allocation:
            self.pressure(2 * n)
            return
        evicted = self.m.evict(n)
        if evicted is None:
            self.model_known = False
        else:
            for b in evicted:
                self.cached.pop(b, None)
        if evicted is None or evicted:
            self.end_replay_windows()

    @precondition(lambda self: self.caps.reset and self.next_id > 0)
    @rule()
    def reset(self):
        """Reset the prefix cache: a success forgets every committed prefix not held by a live request."""
        self.log("reset")
        if self.m.reset():
            assert self.kv_events is None or self.drain_events("reset"), \
                "reset emptied the prefix cache, but no KV event AllBlocksCleared said so"
            self.committed_prefixes = {r.identities[e - 1] for r in self.live.values()
                                       for e in range(self.unit, r.committed + 1, self.unit)}
            self.cached.clear()
            self.end_replay_windows()

    # -- checks --------------------------------------------------------------------------------------
    @invariant()
    def check(self):
        """Every live request reads the oracle's K/V; counts add up; the manager's own state is consistent."""
        if not hasattr(self, "m"):
            return
        type(self).checks_run += 1
        if self.kv_events is not None:
            self.drain_events("the step's calls")
        pending = self.pending_slots()
        for rid, req in self.live.items():
            tables = self.m.block_table(rid)
            # a loading request's next query is past the load: of what it reads there, only the tokens
            # below the load are written yet (a window or chunk may start past them, a state is the load's)
            at = None if req.loading is None else req.loading[0] + len(req.loading[1][0])
            for g, group in enumerate(self.groups):
                self.check_reads(rid, req, g, group, tables[g], pending, at=at, below=req.written)
        owner: dict[int, int] = {}
        refs: dict[int, int] = {}
        for rid, tables in self.tables():
            for g, table in enumerate(tables):
                for b in {b for b in table if b >= 0}:
                    refs[b] = refs.get(b, 0) + 1
                    assert owner.setdefault(b, g) == g, \
                        f"block {b} is held by KV-cache groups {owner[b]} and {g} (request {rid}): one page " \
                        f"serves two groups' layers"
        reference_counts = getattr(self.m, "reference_counts", None)
        if reference_counts is not None:
            got = {b: n for b, n in reference_counts().items() if n}
            assert got == refs, f"reference counts {dict(sorted(got.items()))} != the block tables holding each " \
                                f"block {dict(sorted(refs.items()))}"
        counts = self.m.counts()
        if counts is not None:
            free, used, total = counts
            held = self.holdings()
            assert free + used == total, f"free {free} + used {used} != total {total}"
            assert self.total is None or total == self.total, \
                f"the pool's total is {total} blocks, {self.total} when the manager was built: a pool does not resize"
            assert used == len(held), \
                f"{used} blocks used, but live requests (and deferred frees) hold {len(held)}: {sorted(held)}"
        self.m.self_check()

    def drain_events(self, call: str) -> bool:
        """Judge the manager's KV events since the last drain (:class:`~.kv_events.EventIndex`); True when one
        said the cache was cleared."""
        cleared = self.kv_events.feed(self.m.take_events(), call)
        cached_keys = getattr(self.m, "cached_keys", None)
        if cached_keys is not None:
            self.kv_events.agree(cached_keys(), call)
        return cleared

    def pending_slots(self) -> set[int]:
        """Pages (:meth:`flat`) an in-flight step still writes, and those a manager owning the pools says a copy
        fills from them (``in_flight_pages``: a copy-on-write the worker runs after those steps)."""
        copied = getattr(self.m, "in_flight_pages", None) if self.caps.owns_pools else None
        steps = [step for q in (*self.live.values(), *self.zombies.values()) for step in q.in_flight]
        pages = set(copied()) if copied else set()
        # a copy waits on an in-flight step: with none in flight, no page is left unread
        assert steps or not pages, \
            f"in_flight_pages() names pages {sorted(pages)[:8]} while no step is in flight: a copy fills a page " \
            f"from a block an in-flight step still writes, so with none in flight every page is read"
        written = {self.flat(g, s) for step in steps for g, slots in enumerate(step.slots) for s in slots if s >= 0}
        return written | pages

    def check_reads(self, rid: int, req: Request, g: int, group, table: list[int], pending: set,
                    at: int | None = None, below: int | None = None) -> None:
        """What request ``rid``'s query at position ``at`` (default: its next, ``req.written``) reads in
        group ``g`` below position ``below`` (default ``at``) equals the oracle's K/V (or, Mamba, the state
        it continues from)."""
        bs, at = self.gbs[g], req.written if at is None else at
        if group.kind == "mamba":
            first = at - 1 if at else at
        else:
            first = group.first_read(at)
            if not self.grouped:
                first = 0 if self.window is None else max(0, at - self.window)
        need = range(first, at if below is None else min(at, below))
        positions, slots = [], []
        for p in need:
            assert p // bs < len(table) and table[p // bs] >= 0, \
                f"request {rid}: token {p} (written) has no block in its table {table}" + \
                (f" (group {g}, {group.kind})" if self.grouped else "")
            slot = table[p // bs] * self.page + p % bs
            if slot not in pending:  # a hit on a block an in-flight step still writes: read later
                positions.append(p)
                slots.append(slot)
        if not slots:
            return
        type(self).tokens_read += len(slots)
        for layer in range(group.num_layers):
            k_pool, v_pool = self.pools[layer]
            k, v = self.io.expected([req.identities[p] for p in positions], layer_key(g, layer))
            got_k, got_v = self.io.read(k_pool, v_pool, slots, None if self.grouped else table, positions)
            for name, want, got in (("K", k, got_k), ("V", v, got_v)):
                bad = self.io.differs(want, got)
                if bool(bad.any()):
                    i = int(bad.nonzero()[0])
                    where = f"group {g} ({group.kind}) layer {layer}" if self.grouped else f"layer {layer}"
                    what = "state" if group.kind == "mamba" else name
                    block = table[positions[i] // bs]
                    zeroed = self.zeroed_under_load.get(block)
                    why = "" if zeroed is None else (
                        f"; block {block} was named by take_zeroed() for request {zeroed}'s connector load, so the "
                        f"worker's zeroing landed after the load's data (a load's own blocks are not zeroed: vLLM's "
                        f"skip_zeroing_group_ids)")
                    raise AssertionError(
                        f"request {rid} (namespace {req.namespace!r}) reads wrong {what} at token {positions[i]} "
                        f"({where}, slot {block * bs + positions[i] % bs}, block table "
                        f"{table}): expected {want[i].flatten().tolist()}, got {got[i].flatten().tolist()}{why}")

    def teardown(self):
        if sys.exc_info()[0] is not None:  # a step failed: that failure is the verdict, not a cleanup's
            return
        if hasattr(self, "m"):
            loading = [rid for rid, req in self.live.items() if req.loading is not None]
            for rid in loading:  # a load the program left in flight lands, and its request reads it once
                self.finish_load_rid(rid, True)
            if loading:
                self.check()
            for rid in list(self.live):
                self.release(rid)
            for rid in list(self.zombies):
                while rid in self.zombies and self.zombies[rid].in_flight:
                    self.write_pending_rid(rid)
                if rid in self.zombies and self.zombies[rid].loading is not None:
                    self.finish_load_rid(rid, False)
                if rid in self.zombies and self.zombies[rid].storing:
                    self.finish_store_rid(rid)
            counts = self.m.counts()
            if counts is not None:
                assert counts[1] == 0, f"{counts[1]} blocks still used after every request was freed"


def machine_for(make_manager: Callable, *, block_sizes=(1, 2, 4), windows=(None,), layouts=(ONE_GROUP,),
                name: str = "Machine", rule_sets: tuple = (), **attributes):
    """A :class:`ManagerMachine` subclass over ``make_manager`` (a factory taking :class:`ManagerConfig`)
    in ``layouts`` (:data:`~.protocol.HYBRID_LAYOUTS` names or :data:`~.protocol.ONE_GROUP`), with the
    rules of ``rule_sets`` mixed in (e.g. :class:`~.api_rules.ApiRules`; :class:`~.branch_points.BranchPoints`
    where a layout has a Mamba group) and class ``attributes`` set
    (``kv_backend``, ``num_kv_heads``, ``head_dim``, ``dtype``).

    Raises:
        ValueError: an unknown layout name.
    """
    # ValueError for an unknown name, before any run
    mamba = any(group.kind == "mamba" for layout in layouts for group in layout_groups(layout, 1, 0))
    # branch points only where a Mamba group may be: every other machine draws what it drew before
    rule_sets = (*rule_sets, BranchPoints) if mamba else tuple(rule_sets)
    return type(name, (*rule_sets, ManagerMachine), {"make_manager": staticmethod(make_manager),
                                                     "capabilities_seen": {}, "pools_seen": set(),
                                                     "block_sizes": tuple(block_sizes),
                                                     "windows": tuple(windows),
                                                     "layouts": tuple(layouts), **attributes})
