"""One engine step on a :class:`~pagedkv.cache.paged_cache.PagedKVCache`: admit, reserve, write, commit.

What every driver of the cache repeats (the demo, the soak, the end-to-end model run, the kit's
scenarios), in the order a serving engine must keep (after vLLM's scheduler + model runner)::

    admit(cache, seq_id, prompt, first)      # prefix lookup; refused (nothing held) when the pool is full
    step = Step(cache)
    step.reserve(seq_id, tokens)              # append: slots for this step's new tokens (copy-on-write)
    ...                                       # a sequence aborted or preempted here is dropped: step.drop(seq_id)
    step.write(write_kv, kv_of)               # one write_kv per layer over the whole step's slot_mapping
                                              # then mark_written: only now do full blocks enter the prefix cache

A block reaches the prefix cache only after its K/V is written (``docs/cache.md``), so a request freed
between ``reserve`` and ``write`` leaves no cache entry.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.cache.paged_cache import PagedKVCache

#: ``kv_of(seq_id, start, tokens, layer) -> (key, value)``: the K/V rows of ``tokens`` at positions
#: ``start ..`` in ``layer``, each ``[len(tokens), num_kv_heads, head_dim]``.
KVFn = Callable[[int, int, Sequence[int], int], "tuple[torch.Tensor, torch.Tensor]"]
#: ``write_kv(k_cache, v_cache, key, value, slot_mapping)``: a backend's op.
WriteFn = Callable[..., None]


def admit(cache: PagedKVCache, seq_id: int, prompt: Sequence[int], first: int | None = None, *,
          cache_key: Hashable = None) -> int | None:
    """Start ``seq_id`` with a prefix-cache lookup when its first chunk fits.

    Args:
        cache: the cache.
        seq_id: a sequence id not live in ``cache``.
        prompt: the prompt's token ids.
        first: tokens of the prompt to reserve in the first step after the cached prefix
            (``None``: the whole uncached rest).
        cache_key: the namespace (:meth:`PagedKVCache.add_sequence`).

    Returns:
        The number of leading prompt tokens served by the prefix cache, or ``None`` when the first
        chunk cannot be reserved: the sequence is released again and the cache holds nothing of it.

    Raises:
        as :meth:`PagedKVCache.add_sequence`.
    """
    cached = cache.add_sequence(seq_id, prompt, cache_key=cache_key)
    need = len(prompt) - cached if first is None else min(first, len(prompt) - cached)
    if not cache.can_append(seq_id, need):
        cache.free(seq_id)
        return None
    return cached


@dataclass
class Step:
    """One engine step's reservations, written together and then committed.

    Attributes:
        cache: the cache the step reserves in.
        reserved: ``{seq_id: (slot_mapping, start, tokens)}`` in reservation order.
    """

    cache: PagedKVCache
    reserved: dict[int, tuple[torch.Tensor, int, list[int]]] = field(default_factory=dict)

    def reserve(self, seq_id: int, tokens: Sequence[int]) -> torch.Tensor:
        """Reserve slots for ``tokens`` after ``seq_id``'s current ones (:meth:`PagedKVCache.append`).

        Returns:
            ``int64 [len(tokens)]`` slot_mapping (a tuple of them, one per KV-cache group, for a
            :class:`~pagedkv.cache.hybrid.HybridKVCache`; :meth:`write` writes each layer at its group's).

        Raises:
            ValueError: ``seq_id`` was reserved in this step already. OutOfBlocksError and the rest:
            as :meth:`PagedKVCache.append` (nothing changes).
        """
        if seq_id in self.reserved:
            raise ValueError(f"sequence {seq_id} is reserved twice in one step")
        start = self.cache.seq_len(seq_id)
        slots = self.cache.append(seq_id, tokens)
        self.reserved[seq_id] = (slots, start, list(tokens))
        return slots

    def drop(self, seq_id: int) -> None:
        """Forget ``seq_id``'s reservation (it was aborted or preempted before the forward pass)."""
        self.reserved.pop(seq_id, None)

    @property
    def num_tokens(self) -> int:
        """Tokens reserved in this step."""
        return sum(len(t) for _, _, t in self.reserved.values())

    def write(self, write_kv: WriteFn, kv_of: KVFn, *, num_layers: int | None = None,
              commit: bool = True) -> list[int]:
        """Write every reservation with one ``write_kv`` per layer, then commit what is still live.

        Args:
            write_kv: the backend's ``write_kv``.
            kv_of: K/V of a reservation in one layer (see :data:`KVFn`).
            num_layers: layers to write (default: the cache's).
            commit: call :meth:`PagedKVCache.mark_written` for each sequence still live (a sequence
                freed after its reservation commits nothing: its rows land in released blocks).

        Returns:
            The sequence ids committed.
        """
        if not self.reserved:
            return []
        device = self.cache.config.device
        group_of = getattr(self.cache, "group_of", None)  # a hybrid cache: one slot_mapping per KV-cache group
        if group_of is None:
            slots = [torch.cat([s for s, _, _ in self.reserved.values()]).to(device)]
        else:
            slots = [torch.cat([s[g] for s, _, _ in self.reserved.values()]).to(device)
                     for g in range(len(self.cache.groups))]
        for layer in range(self.cache.config.num_layers if num_layers is None else num_layers):
            kvs = [kv_of(seq_id, start, tokens, layer) for seq_id, (_, start, tokens) in self.reserved.items()]
            write_kv(self.cache.k_cache(layer), self.cache.v_cache(layer), torch.cat([k for k, _ in kvs]).to(device),
                     torch.cat([v for _, v in kvs]).to(device), slots[0 if group_of is None else group_of(layer)])
        committed = [s for s in self.reserved if s in self.cache.sequences] if commit else []
        for seq_id in committed:
            self.cache.mark_written(seq_id)
        return committed
