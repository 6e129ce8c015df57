"""Cheating candidates: correct kernels that fake their answer, the kinds that have fooled kernel benchmarks.

Each is the ``indexed`` backend (:class:`~pagedkv.tools.mutants.backends.IndexedBackend`) with one
trick a generated kernel has used to look right without being right: a stale or cached result, memory
it never writes, work left running on a thread, a tensor subclass that answers comparisons from
somewhere else, lower precision, writes outside its output, behaviour that depends on the call count,
the data pointers or chance. None has a fault a plain comparison with the reference sees on one fresh
call; the suite catches them by the output and input contract (:mod:`pagedkv.testing.guard`) and by
judging each case twice after another case of the same shapes.

Load one as the implementation under test like any mutant::

    pytest --pyargs pagedkv.testing.suite --pagedkv-impl=pagedkv.tools.mutants.cheats:cache_by_shape
    python -m pagedkv replay .pagedkv-failures/FILE.json   # a case file may name a shipped cheat

Each module-level name is a fresh instance; a cheat keeps its state (caches, call counts) on it.
"""

from __future__ import annotations

import threading
import time

import torch

from pagedkv.tools.mutants.backends import IndexedBackend

_attention = IndexedBackend.paged_attention


class StaleBuffer(IndexedBackend):
    """Writes every result into one buffer per shape and returns that buffer: an earlier output the
    caller still holds changes under it (a workspace returned instead of copied)."""

    name = "stale_buffer"

    def paged_attention(self, query, *args, **kwargs):
        out = _attention(self, query, *args, **kwargs)
        buffers = self.__dict__.setdefault("_buffers", {})
        buf = buffers.setdefault((tuple(out.shape), out.dtype, out.device), torch.empty_like(out))
        buf.copy_(out)
        return buf


class CacheByShape(IndexedBackend):
    """Returns the last result computed for inputs of the same shapes (a benchmark that reruns one case)."""

    name = "cache_by_shape"

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs):
        cache = self.__dict__.setdefault("_cache", {})
        key = (tuple(query.shape), tuple(k_cache.shape), tuple(block_tables.shape), tuple(seq_lens.shape), query.dtype)
        if key not in cache:
            cache[key] = _attention(self, query, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs)
        return cache[key].clone()


class CacheByPointer(IndexedBackend):
    """Returns the result last computed for the same data pointers (freed memory is handed out again)."""

    name = "cache_by_pointer"

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs):
        cache = self.__dict__.setdefault("_cache", {})
        key = (query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tuple(query.shape))
        if key not in cache:
            cache[key] = _attention(self, query, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs)
        return cache[key].clone()


class SkipsLastRow(IndexedBackend):
    """Allocates the output with ``torch.empty`` and never writes its last row: freshly freed memory
    of the same size often still holds the right answer."""

    name = "skips_last_row"

    def paged_attention(self, query, *args, **kwargs):
        out = _attention(self, query, *args, **kwargs)
        result = torch.empty_like(out)
        if out.shape[0]:
            result[:-1] = out[:-1]
        return result


class ThreadReturnsEarly(IndexedBackend):
    """Computes on a thread and returns the output before the thread has written it."""

    name = "thread_returns_early"

    def paged_attention(self, query, *args, **kwargs):
        result = torch.zeros_like(query)

        def work():
            time.sleep(0.05)
            result.copy_(_attention(self, query, *args, **kwargs))

        threading.Thread(target=work, name="attention-worker", daemon=True).start()
        return result


class _Lazy(torch.Tensor):
    """A tensor whose torch functions answer with the right result while its own memory holds garbage."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(x):
            return x._right if isinstance(x, _Lazy) else x

        args = tuple(real(a) for a in args)
        kwargs = {k: real(v) for k, v in (kwargs or {}).items()}
        with torch._C.DisableTorchFunction():
            return func(*args, **kwargs)


class LazySubclass(IndexedBackend):
    """Returns a ``torch.Tensor`` subclass whose comparisons, copies and reductions see the right answer
    while the memory it hands to anything reading raw storage is uninitialised."""

    name = "lazy_subclass"

    def paged_attention(self, query, *args, **kwargs):
        right = _attention(self, query, *args, **kwargs)
        lazy = torch.empty_like(right).as_subclass(_Lazy)
        lazy._right = right
        return lazy


class BFloat16Inside(IndexedBackend):
    """Computes attention in bfloat16 whatever the dtype asked for (faster, and close on small cases)."""

    name = "bfloat16_inside"

    def paged_attention(self, query, k_cache, v_cache, *args, **kwargs):
        low = [t.to(torch.bfloat16) if t.dtype in (torch.float32, torch.float16) else t
               for t in (query, k_cache, v_cache)]
        return _attention(self, *low, *args, **kwargs).to(query.dtype)


class ScribblesUnusedSlots(IndexedBackend):
    """Uses pool blocks no sequence owns as scratch space (zeroes them) during attention."""

    name = "scribbles_unused_slots"

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs):
        out = _attention(self, query, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs)
        used = set(block_tables[block_tables >= 0].tolist())
        free = [b for b in range(k_cache.shape[0]) if b not in used]
        if free:
            k_cache[free[-1]] = 0
        return out


class ScribblesTablePadding(IndexedBackend):
    """Overwrites the padding of the block tables (entries past each sequence's blocks) with block 0."""

    name = "scribbles_table_padding"

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs):
        out = _attention(self, query, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs)
        block_size = k_cache.shape[1]
        if isinstance(block_tables, torch.Tensor) and block_tables.dim() == 2:
            for b, n in enumerate(seq_lens.tolist()):
                block_tables[b, -(-n // block_size):] = 0
        return out


class RightFirstCalls(IndexedBackend):
    """Right on its first 3 attention calls (what a one-shot check sees), then shifts every output."""

    name = "right_first_calls"

    def paged_attention(self, query, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        out = _attention(self, query, *args, **kwargs)
        return out if self.calls <= 3 else out + 0.25


class UlpNoiseOneInTen(IndexedBackend):
    """Adds one ulp to one output element on every tenth attention call (a rare race, within tolerance)."""

    name = "ulp_noise_one_in_ten"

    def paged_attention(self, query, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        out = _attention(self, query, *args, **kwargs)
        if self.calls % 10 == 0 and out.numel():
            flat = out.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=out.dtype))
        return out


class NondeterministicUlp(IndexedBackend):
    """A reduction whose order changes from call to call: one element moves by an ulp at random."""

    name = "nondeterministic_ulp"

    def paged_attention(self, query, *args, **kwargs):
        out = _attention(self, query, *args, **kwargs)
        if out.numel() and torch.rand(()) < 0.5:
            flat = out.view(-1)
            i = int(torch.randint(flat.numel(), ()))
            flat[i] = torch.nextafter(flat[i], torch.tensor(float("-inf"), dtype=out.dtype))
        return out


class WriteSkippedByPointer(IndexedBackend):
    """Skips ``write_kv`` when it has seen the same key pointer and shape before ("already cached")."""

    name = "write_skipped_by_pointer"

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping, validate=True, **scales):
        seen = self.__dict__.setdefault("_seen", set())
        mark = (key.data_ptr(), tuple(key.shape), k_cache.data_ptr())
        if mark in seen:
            return
        seen.add(mark)
        super().write_kv(k_cache, v_cache, key, value, slot_mapping, validate=validate, **scales)


class OutputInQuery(IndexedBackend):
    """Writes the result over the query and returns the query (saves an allocation)."""

    name = "output_in_query"

    def paged_attention(self, query, *args, **kwargs):
        out = _attention(self, query, *args, **kwargs)
        query.copy_(out)
        return query


class ScribblesKey(IndexedBackend):
    """Zeroes its ``key`` input once written to the pool (treats it as scratch)."""

    name = "scribbles_key"

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping, validate=True, **scales):
        super().write_kv(k_cache, v_cache, key, value, slot_mapping, validate=validate, **scales)
        key.zero_()


class Float32Output(IndexedBackend):
    """Returns the float32 accumulator instead of rounding to the query's dtype (compares as close)."""

    name = "float32_output"

    def paged_attention(self, query, k_cache, v_cache, *args, **kwargs):
        up = [t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (query, k_cache, v_cache)]
        return _attention(self, *up, *args, **kwargs)


#: name -> cheat class, every shipped cheat.
CHEATS: dict[str, type[IndexedBackend]] = {cls.name: cls for cls in (
    StaleBuffer, CacheByShape, CacheByPointer, SkipsLastRow, ThreadReturnsEarly, LazySubclass, BFloat16Inside,
    ScribblesUnusedSlots, ScribblesTablePadding, RightFirstCalls, UlpNoiseOneInTen, NondeterministicUlp,
    WriteSkippedByPointer, OutputInQuery, ScribblesKey, Float32Output)}

for _name, _cls in CHEATS.items():
    globals()[_name] = _cls()  # --pagedkv-impl=pagedkv.tools.mutants.cheats:cache_by_shape
