"""Whether two tensors may address a common byte: the memory-overlap test behind the write checks.

A write whose source overlaps its destination reads what it overwrites, so ``scatter`` and ``write_kv``
refuse ``values`` / ``key`` / ``value`` that share an element with a pool they write, and ``write_kv``
refuses ``k_cache`` and ``v_cache`` that share one (``pagedkv.validation.calls``). The test only looks at
addresses, shapes and strides (no tensor data is read), so it is part of every validation level but
``"none"``; it needs real tensors (a fake tensor under ``torch.compile`` has no address).
"""

from __future__ import annotations

import torch


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may address a common byte.

    Compares absolute address ranges (so views that reach one buffer through different storages,
    ``torch.from_numpy`` or DLPack, are caught). Two views of equal shape, strides and dtype whose
    strides nest (each stride exceeds the reach of the smaller ones: any view of an ordinary pool)
    are decided exactly: ``kv[:, 0]`` and ``kv[:, 1]`` of one ``[num_blocks, 2, ...]`` pool share a
    buffer but no element. Anything else whose ranges intersect counts as overlapping (conservative:
    e.g. a ``key`` staged in a gap of an interleaved pool arena is refused).
    """
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False

    def span(x: torch.Tensor) -> tuple[int, int]:
        lo = x.data_ptr()
        return lo, lo + (sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1) * x.element_size()

    (a_lo, a_hi), (b_lo, b_hi) = span(a), span(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        return True
    diff, size = abs(a.data_ptr() - b.data_ptr()), a.element_size()
    if diff % size:
        return True  # elements straddle each other
    dims = sorted(((st, n) for n, st in zip(a.shape, a.stride()) if n > 1 and st > 0), reverse=True)
    reach = [sum((n - 1) * st for st, n in dims[k + 1:]) for k in range(len(dims))]
    if any(reach[k] >= dims[k][0] for k in range(len(dims))):
        return True  # strides do not nest: no exact answer attempted

    def reachable(rest: int, k: int) -> bool:
        # An element of a sits at offset sum(i_k * st_k), of b at diff + sum(j_k * st_k): they meet
        # when diff = sum(c_k * st_k) with |c_k| <= n_k - 1. Nested strides leave only floor/ceil.
        if rest == 0:
            return True
        if k == len(dims) or abs(rest) > dims[k][0] * (dims[k][1] - 1) + reach[k]:
            return False
        st, n = dims[k]
        return any(abs(c) <= n - 1 and reachable(rest - c * st, k + 1) for c in {rest // st, rest // st + 1})

    return reachable(diff // size, 0)
