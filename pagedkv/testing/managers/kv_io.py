"""How the cache-manager machine writes and reads K/V: through a kernel backend's ``write_kv`` and
``gather`` (pagedkv's ``indexed`` backend by default; a candidate's own under the kernel property
``cache_state_machine_holds_its_invariants``), in the pools' dtype, with the oracle's values
(:func:`~.oracle.expected_kv`) cut to integers the dtype holds exactly, compared bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.testing.managers.oracle import expected_kv

#: Bits of each oracle value a dtype holds exactly as an integer (its significand, implicit bit included).
EXACT_BITS = {torch.float32: 16, torch.float16: 11, torch.bfloat16: 8}


class KVIO:
    """K/V in and out of a manager's pools.

    Args:
        backend: the kernel backend whose ``write_kv`` (and ``gather``, where it has one) moves K/V;
            ``None``: pagedkv's ``indexed`` backend, with reads by plain indexing.
        num_kv_heads, head_dim: the pools' per-token shape.
        dtype: the pools' dtype (float32, float16 or bfloat16).

    Raises:
        ValueError: a dtype without exact integer values here.
    """

    def __init__(self, backend: Any = None, num_kv_heads: int = 1, head_dim: int = 2,
                 dtype: torch.dtype = torch.float32) -> None:
        if dtype not in EXACT_BITS:
            raise ValueError(f"dtype {dtype}: expected one of {sorted(map(str, EXACT_BITS))}")
        from pagedkv import get_backend

        self.write_kv = (backend or get_backend("indexed")).write_kv
        self.gather = getattr(backend, "gather", None) if backend is not None else None
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype

    def expected(self, identities: list[int], layer: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[len(identities), num_kv_heads, head_dim]`` in the pools' dtype on ``device``: the
        oracle's values, as many low bits as the dtype holds exactly (float32: all of them)."""
        k, v = expected_kv(identities, layer, self.num_kv_heads, self.head_dim)
        if self.dtype is not torch.float32:
            mask = (1 << EXACT_BITS[self.dtype]) - 1
            k, v = (torch.bitwise_and(x.to(torch.int64), mask).to(self.dtype) for x in (k, v))
        return k.to(device), v.to(device)

    def write(self, k_pool: torch.Tensor, v_pool: torch.Tensor, identities: list[int], layer: int,
              slots: list[int]) -> None:
        """``write_kv`` the oracle's K/V of ``identities`` at ``slots`` (flat slot indices of the pools)."""
        k, v = self.expected(identities, layer, k_pool.device)
        self.write_kv(k_pool, v_pool, k, v, torch.tensor(slots, dtype=torch.int64, device=k_pool.device))

    def read(self, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: list[int], table: list[int] | None,
             positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at token ``positions`` of a request (``[n, num_kv_heads, head_dim]`` each, on the CPU):
        through the backend's ``gather`` over its block ``table`` (released entries read as block 0, never
        compared) where it has one and ``table`` is given (one page per block), else ``slots`` indexed."""
        if self.gather is None or table is None:
            index = torch.tensor(slots, dtype=torch.int64, device=k_pool.device)
            shape = (-1, self.num_kv_heads, self.head_dim)
            return k_pool.reshape(shape)[index].cpu(), v_pool.reshape(shape)[index].cpu()
        ids = torch.tensor([max(b, 0) for b in table], dtype=torch.int32, device=k_pool.device)
        at = torch.tensor(positions, dtype=torch.int64)
        seq_len = max(positions) + 1
        return tuple(self.gather(pool, ids, seq_len).cpu()[at] for pool in (k_pool, v_pool))

    @staticmethod
    def differs(want: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
        """Per token (``[n]`` bool): ``got`` is not bit for bit ``want`` (a NaN differs from everything)."""
        from pagedkv.testing.compare import bits

        if got.shape != want.shape or got.dtype != want.dtype:
            return torch.ones(want.shape[0], dtype=torch.bool)
        return (bits(want.cpu()) != bits(got)).flatten(1).any(1)
