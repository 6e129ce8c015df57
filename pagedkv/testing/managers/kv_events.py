"""KV-cache events (``capabilities.kv_events``): what a manager announces to a KV-aware router, judged by an index
rebuilt from the events alone.

An engine with prefix caching can publish what it caches (vLLM's ``BlockPool(enable_kv_cache_events=True)`` and
``KVCacheManager.take_events``, ``vllm/v1/core/block_pool.py``: ``BlockStored`` in ``cache_full_blocks``,
``BlockRemoved`` in ``_maybe_evict_cached_block``, ``AllBlocksCleared`` in ``reset_prefix_cache``); routers (llm-d,
Dynamo) rebuild each instance's cache from them and send a prompt where its prefix is cached. A manager with the
capability answers ``take_events()``: the events since the last call, oldest first, as :class:`BlockStored`,
:class:`BlockRemoved` and :class:`AllBlocksCleared` (its adapter translates the engine's own).

:class:`EventIndex` is the router's index. A stored block's prefix is its parent's prefix and its own tokens (a
run of ``block_size`` tokens per block key, chained from the parent key; a run with no parent starts the prompt),
under the run's namespace (a cache salt named by the first block, the LoRA adapter by every run). Judged:

- a stored run is whole blocks, exactly one per key in a full-attention group (a window or state group may skip
  blocks it does not cache inside the run: vLLM's null and masked blocks); in a full-attention group its parent is
  a key the events announced before;
- each placed block's prefix (namespace and tokens) is one some request committed (a wrong token range, a block
  announced under another's tokens);
- a removed key is one the events stored and did not remove since (a lost store, a removal twice);
- a hit served on a full-attention group reads only blocks the events announced and did not remove (a lost
  removal: the router sends prompts to a cache that dropped them; a lost store);
- a successful reset is announced (``AllBlocksCleared``) and empties the index;
- where the manager exposes its prefix-cache index (``cached_keys() -> {(group, key): blocks}``), the index
  rebuilt from the events equals it after every step (a lost, invented or repeated event).

What an event says of multimodal inputs and prompt embeddings (their keys) is not judged: two prompts of the same
tokens under one namespace are one prefix here.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Hashable, Sequence

from pagedkv.testing.managers.protocol import namespace_parts


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Blocks newly cached in KV-cache group ``group``: ``keys`` (opaque, one per cached block, in order),
    chained from ``parent`` (the key of the block before the run, ``None`` at the prompt's start); ``token_ids``
    the run's tokens (``block_size`` per block; more where the group skipped blocks of the run); ``lora`` the
    LoRA adapter's name, ``salt`` the cache salt the run's first block names (``None``: none)."""

    group: int
    keys: tuple
    parent: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    lora: str | None = None
    salt: str | None = None


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """Blocks of group ``group`` no longer cached (evicted, their hashes dropped): one key per block."""

    group: int
    keys: tuple


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was emptied (a reset)."""


def namespace_identity(namespace: Hashable) -> tuple[str | None, str | None]:
    """``(cache salt, LoRA adapter name)`` an event names for requests of ``namespace``
    (:func:`~pagedkv.testing.managers.protocol.namespace_parts`; an adapter is named, not its path)."""
    salt, lora = namespace_parts(namespace)
    return salt, None if lora is None else lora[0]


class EventIndex:
    """The router's index over one manager's events, judging them as they arrive (module docstring).

    ``kinds``: each KV-cache group's kind (:data:`~pagedkv.testing.managers.protocol.GROUP_KINDS`);
    ``step``: the hash block size (every committed prefix is recorded at its multiples)."""

    def __init__(self, kinds: Sequence[str], step: int) -> None:
        self.kinds, self.step = tuple(kinds), step
        self.committed: set[tuple] = set()  # (salt, lora, tokens) of every committed prefix of whole hash blocks
        self.prefix: dict[tuple, tuple | None] = {}  # (group, key) -> (salt, lora, tokens) it stands for, or None
        self.present: Counter = Counter()  # (group, key) -> blocks cached under it
        self.served: Counter = Counter()  # (group, (salt, lora, tokens)) -> blocks cached under it
        self.events = 0

    def commit(self, namespace: Hashable, tokens: Sequence[int], upto: int) -> None:
        """A request of ``namespace`` committed its first ``upto`` tokens (``tokens``): their prefixes of
        whole hash blocks may be announced."""
        salt, lora = namespace_identity(namespace)
        for end in range(self.step, upto + 1, self.step):
            self.committed.add((salt, lora, tuple(tokens[:end])))

    def feed(self, events: Sequence, call: str) -> bool:
        """Judge and apply ``events`` (``take_events()`` after ``call``); True when one was an
        :class:`AllBlocksCleared`.

        Raises:
            AssertionError: an event the cache's state contradicts (module docstring).
            TypeError: an event of another type.
        """
        cleared = False
        for event in events:
            self.events += 1
            if isinstance(event, BlockStored):
                self.stored(event, call)
            elif isinstance(event, BlockRemoved):
                for key in event.keys:
                    where = (event.group, key)
                    assert self.present[where] > 0, \
                        f"{call}: KV event BlockRemoved of group {event.group} names block {key!r}, which the " \
                        f"events never stored (or removed already): a router's index and the cache disagree"
                    self.present[where] -= 1
                    if self.prefix.get(where) is not None:
                        self.served[(event.group, self.prefix[where])] -= 1
            elif isinstance(event, AllBlocksCleared):
                self.present.clear()
                self.served.clear()
                cleared = True
            else:
                raise TypeError(f"take_events() returned {event!r}: expected BlockStored, BlockRemoved or "
                                f"AllBlocksCleared")
        return cleared

    def stored(self, event: BlockStored, call: str) -> None:
        g, n, bs = event.group, len(event.keys), event.block_size
        kind = self.kinds[g] if 0 <= g < len(self.kinds) else None
        assert kind is not None, f"{call}: KV event BlockStored names group {g}; the layout has {len(self.kinds)}"
        tokens = tuple(event.token_ids)
        exact = len(tokens) == n * bs
        assert bs > 0 and len(tokens) % bs == 0 and len(tokens) >= n * bs and (exact or kind != "full"), \
            f"{call}: KV event BlockStored of group {g} ({kind}) carries {len(tokens)} tokens {list(tokens)} for " \
            f"{n} block(s) of {bs}: a router cuts them into other blocks than the cache holds"
        if event.parent is None:
            base = (event.salt, event.lora, ())
        else:
            base = self.prefix.get((g, event.parent))
            assert base is not None or kind != "full", \
                f"{call}: KV event BlockStored of group {g} ({kind}) chains from block {event.parent!r}, which the " \
                f"events never announced: a router cannot place its {n} block(s)"
            if base is not None:
                assert base[1] == event.lora, \
                    f"{call}: KV event BlockStored of group {g} names LoRA adapter {event.lora!r}, its parent " \
                    f"block {base[1]!r}"
        for i, key in enumerate(event.keys):
            where = (g, key)
            placed = None
            if exact and base is not None:
                placed = (base[0], base[1], base[2] + tokens[:(i + 1) * bs])
                assert placed in self.committed, \
                    f"{call}: KV event BlockStored of group {g} ({kind}) announces block {i} of its run as tokens " \
                    f"{list(placed[2])} (salt {placed[0]!r}, LoRA {placed[1]!r}), a prefix no request committed " \
                    f"(the run's tokens {list(tokens)}, chained from {event.parent!r})"
            if self.prefix.get(where) is None:
                self.prefix[where] = placed
            self.present[where] += 1
            if self.prefix[where] is not None:
                self.served[(g, self.prefix[where])] += 1

    def agree(self, cached: dict, call: str) -> None:
        """The index holds exactly ``cached`` (``{(group, key): blocks}``: the manager's own prefix-cache index).

        Raises:
            AssertionError: the two differ (naming the first few keys each holds alone).
        """
        mine = {where: n for where, n in self.present.items() if n}
        theirs = {where: n for where, n in cached.items() if n}
        if mine != theirs:
            only_events = sorted((w, n) for w, n in mine.items() if theirs.get(w) != n)[:4]
            only_cache = sorted((w, n) for w, n in theirs.items() if mine.get(w) != n)[:4]
            raise AssertionError(
                f"{call}: the index rebuilt from the KV events disagrees with the cache's own: (group, block key): "
                f"blocks as the events say {only_events}, as the cache holds {only_cache} (an event lost, invented "
                f"or repeated)")

    def judge_hit(self, rid: int, namespace: Hashable, tokens: Sequence[int], cached: int,
                  block_sizes: Sequence[int]) -> None:
        """A hit of ``cached`` tokens served to request ``rid``: each full-attention group's blocks of it are
        announced and not removed (``block_sizes``: each group's)."""
        salt, lora = namespace_identity(namespace)
        for g, (kind, bs) in enumerate(zip(self.kinds, block_sizes)):
            if kind != "full":
                continue
            for end in range(bs, cached + 1, bs):
                assert self.served[(g, (salt, lora, tuple(tokens[:end])))] > 0, \
                    f"request {rid}: a hit of {cached} tokens reads group {g}'s block of tokens " \
                    f"{end - bs}..{end - 1}, which the KV events did not announce or said was removed: a router " \
                    f"rebuilding the cache from them does not see it"
