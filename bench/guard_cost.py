"""What the guard costs on large pools: the storage digest that checks inputs over the snapshot limit
unchanged (:func:`pagedkv.testing.guard.storage_digest`), per pool size, and a whole guarded
``paged_attention`` call whose pools are that large against the same call unguarded.

    python bench/guard_cost.py [--device cuda] [--sizes-mib 256 1024] [--repeat 3]

Prints one line per size: digest time and throughput, the guarded and plain call times and their difference
(a guarded call digests every input storage twice: before and after).
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedkv.testing.guard import GuardedBackend, storage_digest


def _time(fn, device: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


class _Decode:
    """A decode step reading two blocks of the pools: the kernel's own cost is negligible beside the guard's."""

    name = "decode"

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        from pagedkv.backends import indexed

        return indexed.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024], help="size of each of K and V")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    heads, dim, block_size = 8, 128, 16
    for mib in args.sizes_mib:
        num_blocks = (mib << 20) // (block_size * heads * dim * 2)
        shape = (num_blocks, block_size, heads, dim)
        k_cache = torch.ones(shape, dtype=torch.float16, device=args.device)
        v_cache = torch.ones(shape, dtype=torch.float16, device=args.device)
        query = torch.randn(1, heads, dim, dtype=torch.float16, device=args.device)
        tables = torch.tensor([[0, 1]], dtype=torch.int32, device=args.device)
        seq_lens = torch.tensor([block_size + 1], dtype=torch.int32, device=args.device)
        qsl = torch.tensor([0, 1], dtype=torch.int32, device=args.device)
        call = (query, k_cache, v_cache, tables, seq_lens, qsl)
        digest = _time(lambda pool=k_cache: storage_digest(pool), args.device, args.repeat)
        plain = _time(lambda c=call: _Decode().paged_attention(*c), args.device, args.repeat)
        guarded = _time(lambda c=call: GuardedBackend(_Decode()).paged_attention(*c), args.device, args.repeat)
        print(f"{args.device} pools 2 x {mib} MiB: digest of one pool {digest * 1e3:.1f} ms "
              f"({mib / 1024 / digest:.2f} GiB/s); call plain {plain * 1e3:.1f} ms, guarded {guarded * 1e3:.1f} ms "
              f"(+{(guarded - plain) * 1e3:.1f} ms)", flush=True)


if __name__ == "__main__":
    main()
