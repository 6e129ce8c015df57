"""Invalid calls as plain data: a valid :class:`~pagedkv.testing.cases.case.Case` with exactly one thing broken.

An :class:`InvalidCall` names the op, the fault planted and where (``seq``, ``amount``); it builds
the op's arguments from the case (every other argument stays valid), and :func:`check_rejected`
runs it against a backend and checks the contract's error rules:

- the call raises the builtin type the contract names for that fault (``IndexError`` for a block id
  or slot outside the pool, ``ValueError`` for shapes/lengths/devices, ``TypeError`` for dtypes and
  argument kinds);
- the message names the offending argument;
- both pools are bit-identical afterwards (nothing was written before the error).

Plain data like the cases: ``repr`` is valid Python, JSON round trips through :meth:`to_dict`, and
``python -m pagedkv replay`` style tools can rebuild one without Hypothesis. ``pagedkv.testing.strategies.invalid``
draws them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.testing.cases.case import Case, Geometry, write_slot_mapping
from pagedkv.cache.config import blocks_needed

OPS = ("gather", "scatter", "write_kv", "paged_attention")
_BUILTINS = {"IndexError": IndexError, "ValueError": ValueError, "TypeError": TypeError}
OTHER_DEVICE = "meta"  # a device no cache lives on: a device mismatch on any machine


@dataclass(frozen=True)
class Fault:
    """One kind of bad argument: the op it targets, the builtin error it must raise, the argument the
    message must name, and what the case needs for the fault to be plantable (``needs``)."""

    op: str
    name: str
    expected: str
    argument: str
    needs: str = ""  # "" | "read" (a sequence reading >= 1 block) | "write" (>= 1 written token) | ...
    doc: str = ""


_F = Fault
FAULTS: dict[tuple[str, str], Fault] = {(f.op, f.name): f for f in (
    # gather(cache, block_table, seq_len)
    _F("gather", "block_id_too_large", "IndexError", "block_table", "read", "an id >= num_blocks among the read entries"),
    _F("gather", "block_id_negative", "IndexError", "block_table", "read", "a negative id among the read entries"),
    _F("gather", "table_too_short", "ValueError", "block_table", "read", "fewer than ceil(seq_len / bs) entries"),
    _F("gather", "seq_len_negative", "ValueError", "seq_len", "", "seq_len < 0"),
    _F("gather", "seq_len_float", "TypeError", "seq_len", "", "seq_len a float"),
    _F("gather", "seq_len_bool", "TypeError", "seq_len", "", "seq_len a bool"),
    _F("gather", "table_float", "TypeError", "block_table", "", "a float32 table"),
    _F("gather", "table_bool", "TypeError", "block_table", "", "a bool table"),
    _F("gather", "table_list_float", "TypeError", "block_table", "read", "a list table with a float entry"),
    _F("gather", "table_2d", "ValueError", "block_table", "", "a [1, n] table"),
    _F("gather", "table_device", "ValueError", "block_table", "", "a table on another device"),
    _F("gather", "cache_rank", "ValueError", "cache", "", "a 3-D cache"),
    _F("gather", "cache_int_dtype", "TypeError", "cache", "", "an int32 cache"),
    # scatter(cache, block_table, values, start)
    _F("scatter", "block_id_too_large", "IndexError", "block_table", "write", "an id >= num_blocks among the written entries"),
    _F("scatter", "block_id_negative", "IndexError", "block_table", "write", "a negative id among the written entries"),
    _F("scatter", "table_too_short", "ValueError", "block_table", "write", "fewer than ceil((start + n) / bs) entries"),
    _F("scatter", "duplicate_block", "ValueError", "block_table", "write2", "one physical block at two written entries"),
    _F("scatter", "start_negative", "ValueError", "start", "", "start < 0"),
    _F("scatter", "start_float", "TypeError", "start", "", "start a float"),
    _F("scatter", "values_heads", "ValueError", "values", "", "values with num_kv_heads + 1 heads"),
    _F("scatter", "values_head_dim", "ValueError", "values", "", "values with head_dim + 1"),
    _F("scatter", "values_rank", "ValueError", "values", "", "values flattened to 2-D"),
    _F("scatter", "values_dtype", "TypeError", "values", "", "values in another float dtype"),
    _F("scatter", "values_device", "ValueError", "values", "", "values on another device"),
    _F("scatter", "table_float", "TypeError", "block_table", "", "a float32 table"),
    _F("scatter", "values_overlap_cache", "ValueError", "values", "write", "values a view into the pool it writes"),
    # write_kv(k_cache, v_cache, key, value, slot_mapping)
    _F("write_kv", "slot_too_large", "IndexError", "slot_mapping", "write", "a slot >= num_blocks * block_size"),
    _F("write_kv", "duplicate_slot", "ValueError", "slot_mapping", "write2", "one slot written by two tokens"),
    _F("write_kv", "slot_mapping_short", "ValueError", "slot_mapping", "token", "one entry fewer than tokens"),
    _F("write_kv", "slot_mapping_float", "TypeError", "slot_mapping", "", "a float32 slot_mapping"),
    _F("write_kv", "slot_mapping_bool", "TypeError", "slot_mapping", "", "a bool slot_mapping"),
    _F("write_kv", "slot_mapping_2d", "ValueError", "slot_mapping", "", "a [1, n] slot_mapping"),
    _F("write_kv", "slot_mapping_device", "ValueError", "slot_mapping", "", "slot_mapping on another device"),
    _F("write_kv", "key_dtype", "TypeError", "key", "", "key in another float dtype"),
    _F("write_kv", "value_dtype", "TypeError", "value", "", "value in another float dtype"),
    _F("write_kv", "key_heads", "ValueError", "key", "", "key with num_kv_heads + 1 heads"),
    _F("write_kv", "value_head_dim", "ValueError", "value", "", "value with head_dim + 1"),
    _F("write_kv", "value_fewer_tokens", "ValueError", "value", "token", "value with one token fewer than key"),
    _F("write_kv", "v_cache_dtype", "TypeError", "v_cache", "", "v_cache in another dtype than k_cache"),
    _F("write_kv", "v_cache_fewer_blocks", "ValueError", "v_cache", "blocks2", "v_cache with one block fewer"),
    _F("write_kv", "same_pool", "ValueError", "v_cache", "", "v_cache the same tensor as k_cache"),
    _F("write_kv", "pools_overlap", "ValueError", "v_cache", "blocks2", "k_cache and v_cache overlapping views of one buffer"),
    _F("write_kv", "value_overlaps_pool", "ValueError", "value", "token", "value a view into v_cache"),
    # paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    _F("paged_attention", "block_id_too_large", "IndexError", "block_tables", "read", "an id >= num_blocks among a row's read entries"),
    _F("paged_attention", "block_id_negative", "IndexError", "block_tables", "read", "a negative id among a row's read entries"),
    _F("paged_attention", "table_too_narrow", "ValueError", "block_tables", "read", "fewer columns than a seq_len needs"),
    _F("paged_attention", "seq_len_negative", "ValueError", "seq_lens", "", "a negative seq_lens entry"),
    _F("paged_attention", "q_len_exceeds_seq_len", "ValueError", "seq_lens", "query", "seq_lens[b] = q_len_b - 1"),
    _F("paged_attention", "query_start_loc_decreasing", "ValueError", "query_start_loc", "batch2", "an interior entry above its successor"),
    _F("paged_attention", "query_start_loc_not_zero", "ValueError", "query_start_loc", "", "query_start_loc[0] != 0"),
    _F("paged_attention", "query_start_loc_total", "ValueError", "query_start_loc", "", "query_start_loc[-1] != total_q"),
    _F("paged_attention", "query_start_loc_length", "ValueError", "query_start_loc", "", "batch entries instead of batch + 1"),
    _F("paged_attention", "seq_lens_length", "ValueError", "seq_lens", "", "one entry fewer than block_tables rows"),
    _F("paged_attention", "heads_not_divisible", "ValueError", "query", "", "num_q_heads not a positive multiple of num_kv_heads"),
    _F("paged_attention", "query_head_dim", "ValueError", "query", "", "query head_dim + 1"),
    _F("paged_attention", "query_rank", "ValueError", "query", "", "query flattened to 2-D"),
    _F("paged_attention", "query_dtype", "TypeError", "query", "", "query in another float dtype"),
    _F("paged_attention", "query_device", "ValueError", "query", "", "query on another device"),
    _F("paged_attention", "v_cache_dtype", "TypeError", "v_cache", "", "v_cache in another dtype than k_cache"),
    _F("paged_attention", "block_tables_float", "TypeError", "block_tables", "", "float32 block_tables"),
    _F("paged_attention", "block_tables_1d", "ValueError", "block_tables", "", "a 1-D block_tables"),
    _F("paged_attention", "seq_lens_bool", "TypeError", "seq_lens", "", "bool seq_lens"),
    _F("paged_attention", "seq_lens_device", "ValueError", "seq_lens", "", "seq_lens on another device"),
    _F("paged_attention", "scale_nan", "ValueError", "scale", "", "scale = nan"),
    _F("paged_attention", "scale_inf", "ValueError", "scale", "", "scale = inf"),
)}


def faults_for(op: str) -> list[Fault]:
    """Every fault of ``op``, in a fixed order."""
    return [f for (o, _), f in FAULTS.items() if o == op]


def inexpressible(op: str, fault: str, caps: Any) -> str | None:
    """Why ``fault`` cannot reach a backend with capabilities ``caps`` (``None``: it can). Two overlapping
    views of one buffer exist only in one layout: where the key and value pools are declared in different
    layouts (vLLM's packed CPU keys beside head-major values) the kit hands each pool over in its own
    storage, so the overlap would not survive the conversion; nor does any overlap with a pool whose
    layout is a copy pair (the pool reaches the backend as a new tensor)."""
    if fault == "pools_overlap" and caps is not None and caps.pool_layouts[0] != caps.pool_layouts[1]:
        return f"{op}/{fault}: the key and value pools are declared in different layouts"
    if fault == "pools_overlap" and caps is not None and not caps.pool_layouts[0].is_view:
        return (f"{op}/{fault}: the pools' layout is declared as a copy pair, so each pool reaches the backend "
                f"as a storage of its own and no overlap survives the conversion")
    # a source that is a view into the pool it writes: the pool reaches a copy-pair backend as a new storage
    overlapped = {"value_overlaps_pool": 1, "values_overlap_cache": 0}.get(fault)
    if overlapped is not None and caps is not None and not caps.pool_layouts[overlapped].is_view:
        return (f"{op}/{fault}: the {'value' if overlapped else 'key'} pool's layout is declared as a copy pair, so "
                f"the pool reaches the backend as a new storage the source cannot overlap")
    return None


def _overlapping_pools(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical ``(k_cache, v_cache)`` holding the given pools' contents as views of one buffer of
    ``num_blocks + 1`` blocks, one block apart, built in the storage of the declared key layout
    (:func:`pagedkv.testing.cases.memory.new_pools`): the backend is handed two views of one storage
    (``storage[:-1]`` and ``storage[1:]``, each its pool's first columns: the buffer is as wide as the wider
    of K and V), as an engine that mis-slices its arena would."""
    from pagedkv.testing.cases.memory import new_pools

    k_width, v_width = k_cache.shape[-1], v_cache.shape[-1]
    shape = (k_cache.shape[0] + 1, *k_cache.shape[1:-1], max(k_width, v_width))
    buffer, _ = new_pools(shape, k_cache.dtype, k_cache.device, None)
    buffer[:-1, ..., :k_width].copy_(k_cache)
    buffer[-1:, ..., :v_width].copy_(v_cache[-1:])
    return buffer[:-1][..., :k_width], buffer[1:][..., :v_width]


# -- what a case offers ------------------------------------------------------------------------------
def _written(case: Case, i: int) -> tuple[int, int]:
    """``(first, last)`` table entries a scatter of sequence ``i`` (``start .. seq_len - 1``) writes."""
    s, bs = case.seqs[i], case.geometry.block_size
    if s.seq_len <= s.start:
        return 0, 0
    return s.start // bs, blocks_needed(s.seq_len, bs)


def _write_tokens(case: Case) -> tuple[list[int], list[tuple[int, int]]]:

    return write_slot_mapping(case)


def _scatter_ok(case: Case, i: int) -> bool:
    """Sequence ``i``'s written blocks are distinct (a valid scatter before the fault is planted)."""
    first, last = _written(case, i)
    blocks = case.used_table(i)[first:last]
    return len(set(blocks)) == len(blocks)


def fault_sites(op: str, fault: str, case: Case) -> list[int]:
    """The sequences (or, for ``write_kv``/batch-wide faults, ``[0]``) where ``fault`` can be planted in
    ``case``; empty when the case cannot carry it."""
    f = FAULTS[(op, fault)]
    seqs = range(len(case.seqs))
    if op == "scatter":
        ok = [i for i in seqs if _scatter_ok(case, i)]
        if f.needs == "write":
            return [i for i in ok if _written(case, i)[1] > _written(case, i)[0]]
        if f.needs == "write2":
            return [i for i in ok if _written(case, i)[1] - _written(case, i)[0] >= 2]
        return ok
    if op == "write_kv":
        slots, _ = _write_tokens(case)
        real = sum(1 for x in slots if x >= 0)
        need = {"": True, "write": real >= 1, "write2": real >= 2, "token": len(slots) >= 1,
                "blocks2": case.geometry.num_blocks >= 2}[f.needs]
        return [0] if need else []
    if f.needs == "read":
        return [i for i in seqs if case.seqs[i].seq_len >= 1]
    if f.needs == "query":
        return [i for i in seqs if case.seqs[i].q_len >= 1]
    if f.needs == "batch2":
        return list(range(1, len(case.seqs)))
    return list(seqs)


def _other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype != torch.float16 else torch.float32


def _widen(x: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] += 1
    return torch.zeros(shape, dtype=x.dtype, device=x.device)


@dataclass(frozen=True)
class InvalidCall:
    """``op`` called on ``case`` with ``fault`` planted at sequence ``seq`` (``amount`` says how far out
    of range, or which entry)."""

    op: str
    fault: str
    case: Case
    seq: int = 0
    amount: int = 0

    @property
    def spec(self) -> Fault:
        return FAULTS[(self.op, self.fault)]

    @property
    def expected(self) -> type[Exception]:
        """The builtin exception type the contract requires."""
        return _BUILTINS[self.spec.expected]

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "case": self.case.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "InvalidCall":
        return cls(**{**data, "case": Case.from_dict(data["case"])})

    # -- arguments ----------------------------------------------------------------------------------
    def arguments(self, device: str = "cpu") -> tuple[tuple, dict, tuple[torch.Tensor, torch.Tensor]]:
        """``(args, kwargs, (k_cache, v_cache))``: the corrupted call and the two pools it may touch."""
        build: Callable = getattr(self, f"_{self.op}")
        return build(device)

    def _oob(self, g: Geometry, dtype: torch.dtype) -> int:
        """An id ``>= num_blocks``, ``amount`` past the end (capped to what ``dtype`` holds)."""
        return min(g.num_blocks + self.amount, torch.iinfo(dtype).max)

    def _neg(self, dtype: torch.dtype) -> int:
        """A negative id, ``-1 - amount`` (capped to what ``dtype`` holds)."""
        return max(-1 - self.amount, torch.iinfo(dtype).min)

    def _gather(self, device):
        c, f, i, g = self.case, self.fault, self.seq, self.case.geometry
        k_cache, v_cache = c.caches(device)
        s = c.seqs[i]
        table = c.block_tables(device)[i].clone()
        need = blocks_needed(s.seq_len, g.block_size)
        seq_len: Any = s.seq_len
        cache: Any = k_cache
        entry = need - 1 - self.amount % max(need, 1)  # late in the read range
        if f == "block_id_too_large":
            table[entry] = self._oob(g, table.dtype)
        elif f == "block_id_negative":
            table[entry] = self._neg(table.dtype)
        elif f == "table_too_short":
            table = table[: need - 1]
        elif f == "seq_len_negative":
            seq_len = -1 - self.amount
        elif f == "seq_len_float":
            seq_len = float(s.seq_len)
        elif f == "seq_len_bool":
            seq_len = bool(s.seq_len % 2)
        elif f == "table_float":
            table = table.float()
        elif f == "table_bool":
            table = table.bool()
        elif f == "table_list_float":
            table = [float(b) for b in table.tolist()]
        elif f == "table_2d":
            table = table.unsqueeze(0)
        elif f == "table_device":
            table = table.to(OTHER_DEVICE)
        elif f == "cache_rank":
            cache = k_cache[0]
        elif f == "cache_int_dtype":
            cache = torch.zeros(k_cache.shape, dtype=torch.int32, device=k_cache.device)
        return (cache, table, seq_len), {}, (k_cache, v_cache)

    def _scatter(self, device):
        c, f, i, g = self.case, self.fault, self.seq, self.case.geometry
        k_cache, v_cache = c.caches(device)
        s = c.seqs[i]
        table = c.block_tables(device)[i].clone()
        values = c.logical_kv(1)[i][0][s.start:].to(device)
        start: Any = s.start
        first, last = _written(c, i)
        entry = last - 1 - self.amount % max(last - first, 1)  # late in the written range: an early write would show
        if f == "block_id_too_large":
            table[entry] = self._oob(g, table.dtype)
        elif f == "block_id_negative":
            table[entry] = self._neg(table.dtype)
        elif f == "table_too_short":
            table = table[: last - 1]
        elif f == "duplicate_block":
            table[last - 1] = table[first]
        elif f == "start_negative":
            start = -1 - self.amount
        elif f == "start_float":
            start = float(s.start)
        elif f == "values_heads":
            values = _widen(values, 1)
        elif f == "values_head_dim":
            values = _widen(values, 2)
        elif f == "values_rank":
            values = values.flatten(1)
        elif f == "values_dtype":
            values = values.to(_other_dtype(values.dtype))
        elif f == "values_device":
            values = values.to(OTHER_DEVICE)
        elif f == "table_float":
            table = table.float()
        elif f == "values_overlap_cache":
            values = k_cache[0, 0].expand(values.shape)
        return (k_cache, table, values, start), {}, (k_cache, v_cache)

    def _write_kv(self, device):
        c, f, g = self.case, self.fault, self.case.geometry
        k_cache, v_cache = c.caches(device)
        slots, _ = _write_tokens(c)
        n = len(slots)
        gen = torch.Generator().manual_seed(c.seed)
        key = torch.randn((n, g.num_kv_heads, g.head_dim), generator=gen).to(g.torch_dtype).to(device)
        value = torch.randn((n, g.num_kv_heads, g.v_dim), generator=gen).to(g.torch_dtype).to(device)
        real = [t for t, x in enumerate(slots) if x >= 0]
        sm = torch.tensor(slots, dtype=torch.int64, device=device)
        kc, vc = k_cache, v_cache
        if f == "slot_too_large":
            sm[real[-1 - self.amount % len(real)]] = g.num_blocks * g.block_size + self.amount
        elif f == "duplicate_slot":
            a = self.amount % (len(real) - 1)
            sm[real[-1]] = sm[real[a]]
        elif f == "slot_mapping_short":
            sm = sm[:-1]
        elif f == "slot_mapping_float":
            sm = sm.float()
        elif f == "slot_mapping_bool":
            sm = sm >= 0
        elif f == "slot_mapping_2d":
            sm = sm.unsqueeze(0)
        elif f == "slot_mapping_device":
            sm = sm.to(OTHER_DEVICE)
        elif f == "key_dtype":
            key = key.to(_other_dtype(key.dtype))
        elif f == "value_dtype":
            value = value.to(_other_dtype(value.dtype))
        elif f == "key_heads":
            key = _widen(key, 1)
        elif f == "value_head_dim":
            value = _widen(value, 2)
        elif f == "value_fewer_tokens":
            value = value[:-1]
        elif f == "v_cache_dtype":
            vc = v_cache.to(_other_dtype(v_cache.dtype))
        elif f == "v_cache_fewer_blocks":
            vc = v_cache[:-1]
        elif f == "same_pool":
            vc = k_cache
        elif f == "pools_overlap":  # two views of one buffer, one block apart, in the declared storage
            kc, vc = k_cache, v_cache = _overlapping_pools(k_cache, v_cache)
        elif f == "value_overlaps_pool":
            value = v_cache[0, 0].expand(value.shape)
        return (kc, vc, key, value, sm), {}, (k_cache, v_cache)

    def _paged_attention(self, device):
        c, f, i, g = self.case, self.fault, self.seq, self.case.geometry
        k_cache, v_cache = c.caches(device)
        query = c.query(device)
        tables = c.block_tables(device).clone()
        seq_lens = c.seq_lens(device).clone()
        qsl = c.query_start_loc(device).clone()
        scale: Any = c.scale
        vc = v_cache
        s = c.seqs[i] if c.seqs else None
        need = blocks_needed(s.seq_len, g.block_size) if s else 0
        entry = need - 1 - self.amount % max(need, 1)
        if f == "block_id_too_large":
            tables[i, entry] = self._oob(g, tables.dtype)
        elif f == "block_id_negative":
            tables[i, entry] = self._neg(tables.dtype)
        elif f == "table_too_narrow":
            widest = max(blocks_needed(x.seq_len, g.block_size) for x in c.seqs)
            tables = tables[:, : widest - 1]
        elif f == "seq_len_negative":
            seq_lens[i] = self._neg(seq_lens.dtype)
        elif f == "q_len_exceeds_seq_len":
            seq_lens[i] = s.q_len - 1
        elif f == "query_start_loc_decreasing":
            qsl[i] = min(int(qsl[i + 1]) + 1 + self.amount, torch.iinfo(qsl.dtype).max)
        elif f == "query_start_loc_not_zero":
            qsl[0] = min(1 + self.amount, torch.iinfo(qsl.dtype).max)
        elif f == "query_start_loc_total":
            qsl[-1] = min(int(qsl[-1]) + 1 + self.amount, torch.iinfo(qsl.dtype).max)
        elif f == "query_start_loc_length":
            qsl = qsl[:-1]
        elif f == "seq_lens_length":
            seq_lens = seq_lens[:-1]
        elif f == "heads_not_divisible":
            heads = g.num_q_heads + 1 if g.num_kv_heads > 1 else 0
            query = torch.zeros((query.shape[0], heads, g.head_dim), dtype=query.dtype, device=query.device)
        elif f == "query_head_dim":
            query = _widen(query, 2)
        elif f == "query_rank":
            query = query.flatten(1)
        elif f == "query_dtype":
            query = query.to(_other_dtype(query.dtype))
        elif f == "query_device":
            query = query.to(OTHER_DEVICE)
        elif f == "v_cache_dtype":
            vc = v_cache.to(_other_dtype(v_cache.dtype))
        elif f == "block_tables_float":
            tables = tables.float()
        elif f == "block_tables_1d":
            tables = tables.flatten()
        elif f == "seq_lens_bool":
            seq_lens = seq_lens > 0
        elif f == "seq_lens_device":
            seq_lens = seq_lens.to(OTHER_DEVICE)
        elif f == "scale_nan":
            scale = float("nan")
        elif f == "scale_inf":
            scale = float("inf")
        return (query, k_cache, vc, tables, seq_lens, qsl, scale), {}, (k_cache, v_cache)
