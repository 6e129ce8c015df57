"""Slot arithmetic past 2**31 (and 2**32) slots on an *aliased pool*, where no such pool is allocated.

The pool of :meth:`LimitCase.aliased <pagedkv.testing.cases.limit.LimitCase.aliased>` is a
``[2**23 + 1, 512, 1, 1]`` float32 view of a 32 MiB buffer with block stride 1: ``pool[b, o]`` is
buffer element ``b + o`` and holds the value ``b + o`` (exact in float32). It has more than 2**32
slots, so every op's validation, slot formation and indexing runs past 2**31 (int32 wraps to a
negative or a wrong block), while every read and write stays checkable against the buffer.

Each check is run by :mod:`pagedkv.testing.execute` like every property, so a failure leaves a case
file and a located message (the slot or block that went wrong).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.testing.cases.limit import LimitCase
from pagedkv.testing.compare import Mismatch, MissingOp, bits, require
from pagedkv.testing.device_lease import leased

# block ids whose slots lie past 2**31 (and past 2**32), spaced so their buffer elements never alias
_HIGH = (-1, 2**22 + 7, 2**23 - 3 * 512, 2**22 + 2 * 512 + 5)


def high_blocks(case: LimitCase) -> tuple[int, ...]:
    """Four block ids of ``case``'s pool whose slots lie past 2**31 (the first past 2**32)."""
    return tuple(case.geometry.num_blocks - 1 if b < 0 else b for b in _HIGH)


def _inside_declared_space(backend: Any) -> None:
    """Skip (``MissingOp``, with the reason) a backend whose *declared* space excludes the aliased pool.

    The declared space, not the one cases are drawn from: a backend run by Triton's interpreter draws
    small geometries to stay cheap, but this one fixed case is cheap at block size 512 too."""
    from pagedkv.testing.space import capabilities_under_test

    caps = capabilities_under_test(backend)
    reason = LimitCase.aliased_unsupported(caps)
    if reason and LimitCase.for_space("2_31_elements", caps)[0] is not None:
        # at a declared geometry 2**31 slots are at least 2**31 elements: the declared-geometry twin past
        # 2**31 elements judges the int32 arithmetic such a kernel can reach
        raise MissingOp(f"not applicable: {reason}; the *_past_2_31_elements_at_a_declared_geometry "
                        "properties judge int32 slot and offset arithmetic at the declared geometry", "not_applicable")
    if reason:
        raise MissingOp(reason, "outside_declared_space")


def _buffer_bytes(case: LimitCase) -> int:
    """Device bytes of the aliased pool's buffer (float32, ``num_blocks + block_size - 1`` elements)."""
    return 4 * (case.geometry.num_blocks + case.geometry.block_size - 1)


def aliased_pool(case: LimitCase, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pool, buffer)``: ``pool[b, o, 0, 0]`` is ``buffer[b + o]``, which holds ``b + o``."""
    g = case.geometry
    buffer = torch.arange(g.num_blocks + g.block_size - 1, dtype=torch.float32, device=device)
    return buffer.as_strided((g.num_blocks, g.block_size, 1, 1), (1, 1, 1, 1)), buffer


def _first_difference(actual: torch.Tensor, expected: torch.Tensor, what: str, block_size: int | None = None) -> None:
    """Raise :class:`Mismatch` naming the first buffer element (or gathered row) that differs."""
    diff = bits(actual.cpu()) != bits(expected.cpu())
    if bool(diff.any()):
        i = int(torch.nonzero(diff.flatten())[0])
        where = {"slot": i} if block_size is None else {"position": i, "block_offset": i % block_size}
        raise Mismatch(f"{what}: element {i} is {actual.flatten()[i].item()!r}, expected "
                       f"{expected.flatten()[i].item()!r} ({int(diff.sum())} of {diff.numel()} differ; int32 "
                       f"slot or block arithmetic?)", {**where, "expected": [expected.flatten()[i].item()],
                                                       "actual": [actual.flatten()[i].item()]})


@leased(lambda case: _buffer_bytes(case))
def gather_past_2_31(backend: Any, case: LimitCase, device: str = "cpu") -> None:
    """``gather`` over four blocks past 2**31 slots returns each block's slots (``b + o``), bit for bit."""
    gather = require(backend, "gather")
    _inside_declared_space(backend)
    pool, _ = aliased_pool(case, device)
    blocks, bs = high_blocks(case), case.geometry.block_size
    seq_len = 3 * bs + 17
    out = gather(pool, torch.tensor(blocks, dtype=torch.int32, device=device), seq_len)
    expected = torch.tensor([blocks[p // bs] + p % bs for p in range(seq_len)], dtype=torch.float32).view(-1, 1, 1)
    _first_difference(out, expected, f"gather of blocks {list(blocks)} past 2**31 slots", bs)


@leased(lambda case: _buffer_bytes(case))
def write_kv_past_2_31(backend: Any, case: LimitCase, device: str = "cpu") -> None:
    """``write_kv`` to slots past 2**31 and 2**32 (and a padding slot -1) writes exactly those slots."""
    write_kv = require(backend, "write_kv")
    _inside_declared_space(backend)
    (k_pool, k_buffer), (v_pool, v_buffer) = aliased_pool(case, device), aliased_pool(case, device)
    g, blocks = case.geometry, high_blocks(case)
    slots = [b * g.block_size + o for b, o in zip(blocks, (0, 0, 5, 300))] + [-1, g.num_blocks * g.block_size - 1]
    key = torch.tensor([-(i + 1.0) for i in range(len(slots))], device=device).view(-1, 1, 1)
    value = -2 * key
    k_expected, v_expected = k_buffer.cpu().clone(), v_buffer.cpu().clone()
    for i, s in enumerate(slots):
        if s >= 0:
            b, o = divmod(s, g.block_size)
            k_expected[b + o], v_expected[b + o] = key[i, 0, 0].item(), value[i, 0, 0].item()
    write_kv(k_pool, v_pool, key, value, torch.tensor(slots, dtype=torch.int64, device=device))
    _first_difference(k_buffer, k_expected, f"k_cache after write_kv to slots {slots}")
    _first_difference(v_buffer, v_expected, f"v_cache after write_kv to slots {slots}")


@leased(lambda case: _buffer_bytes(case))
def scatter_past_2_31(backend: Any, case: LimitCase, device: str = "cpu") -> None:
    """``scatter`` across the end of one block past 2**31 slots, a whole block and the start of a third
    writes exactly those slots."""
    scatter = require(backend, "scatter")
    _inside_declared_space(backend)
    pool, buffer = aliased_pool(case, device)
    blocks, bs = high_blocks(case), case.geometry.block_size
    start, n = bs - 2, bs + 4
    values = -torch.arange(1, n + 1, dtype=torch.float32, device=device).view(-1, 1, 1)
    expected = buffer.cpu().clone()
    for j in range(n):
        p = start + j
        expected[blocks[p // bs] + p % bs] = values[j, 0, 0].item()
    scatter(pool, torch.tensor(blocks, dtype=torch.int64, device=device), values, start)
    _first_difference(buffer, expected, f"the pool after scatter of {n} tokens at {start} into blocks {list(blocks)}")


def _rejects(call, bound: int, what: str) -> None:
    try:
        call()
    except IndexError as exc:
        if str(bound) not in str(exc):
            raise Mismatch(f"{what}: IndexError does not name the bound {bound}: {exc}") from None
    else:
        raise Mismatch(f"{what} was accepted (the bound is {bound}; int32 arithmetic wraps it)",
                       {"slot" if "slot" in what else "block": bound})


@leased(lambda case: 2 * _buffer_bytes(case))  # a K and a V pool
def validation_bounds_past_2_31(backend: Any, case: LimitCase, device: str = "cpu") -> None:
    """The last slot and block past 2**32 are accepted; one past them (and one 2**32 further, which
    wraps to a valid slot in 32 bits) is an ``IndexError`` naming the bound, and nothing is written."""
    gather, write_kv = require(backend, "gather"), require(backend, "write_kv")
    _inside_declared_space(backend)
    (k_pool, k_buffer), (v_pool, _) = aliased_pool(case, device), aliased_pool(case, device)
    g = case.geometry
    num_slots = g.num_blocks * g.block_size
    before = k_buffer.cpu().clone()
    one = torch.ones((1, 1, 1), device=device)
    for slot in (num_slots, num_slots + 2**32):
        _rejects(lambda slot=slot: write_kv(k_pool, v_pool, one, one, torch.tensor([slot], dtype=torch.int64,
                                                                               device=device)),
                 num_slots, f"write_kv to slot {slot}")
    _rejects(lambda: gather(k_pool, torch.tensor([g.num_blocks], dtype=torch.int64, device=device), 1),
             g.num_blocks, f"gather of block {g.num_blocks}")
    _first_difference(k_buffer, before, "k_cache after rejected writes")
    out = gather(k_pool, torch.tensor([g.num_blocks - 1], dtype=torch.int64, device=device), g.block_size).cpu()
    last = float(g.num_blocks - 1 + g.block_size - 1)
    if out[-1].item() != last:
        raise Mismatch(f"gather of the last block {g.num_blocks - 1}: its last slot holds {out[-1].item()!r}, "
                       f"expected {last!r}", {"block": g.num_blocks - 1, "slot": num_slots - 1})


#: (name, ops, check, sentence) of each registered aliased-pool property.
PROPERTIES = (
    ("gather_reads_the_right_block_past_2_31_slots", ("gather",), gather_past_2_31,
     "gather over blocks past 2**31 and 2**32 slots of an aliased pool returns exactly their slots"),
    ("write_kv_hits_slots_past_2_31_exactly", ("write_kv",), write_kv_past_2_31,
     "write_kv to slots past 2**31 and 2**32 of an aliased pool writes exactly those slots"),
    ("scatter_writes_the_right_blocks_past_2_31_slots", ("scatter",), scatter_past_2_31,
     "scatter across blocks past 2**31 slots of an aliased pool writes exactly their slots"),
    ("validation_bounds_are_exact_past_2_31_slots", ("gather", "write_kv"), validation_bounds_past_2_31,
     "the last slot and block of a pool past 2**32 slots are accepted and one past them is rejected, unwritten"),
)
