"""``python -m pagedkv demo``: a simulated serving run through the paged cache, checked as it goes.

Requests arrive built from a few shared system prompts plus their own text, are prefilled in
chunks (a prompt's cached prefix is not recomputed), then decode token by token; some fork (parallel
sampling, sharing every block), some finish and free their blocks while others arrive, so the pool
fragments. K/V are written with the ``indexed`` backend's ``write_kv``. At every check interval each
live sequence is read back through the ``loop`` and the ``indexed`` gathers and compared bit for bit
with the K/V its tokens must have. The report gives blocks used / shared / free, the prefix-cache hit
rate, copy-on-write copies, and loop vs indexed gather time.
"""

from __future__ import annotations

import argparse
import random
import time


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="simulate serving through the paged cache and verify every read path",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--requests", type=int, default=48, help="requests to serve (default 48)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--num-blocks", type=int, default=128, help="blocks in the pool (default 128)")
    p.add_argument("--num-kv-heads", type=int, default=4, help="kv heads (default 4)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--prefill-chunk", type=int, default=64, help="max prompt tokens prefilled per step (default 64)")
    p.add_argument("--check-every", type=int, default=8, help="verify all live sequences every N steps (default 8)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedkv.backends import get_backend
    from pagedkv.cache import PagedKVCache
    from pagedkv.testing.cases import Geometry, token_kv
    from pagedkv.config import CacheConfig
    from pagedkv.errors import OutOfBlocksError
    from pagedkv.testing.tolerance import bits

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rng = random.Random(args.seed)
    bs = args.block_size
    geometry = Geometry(args.num_blocks, bs, args.num_kv_heads, args.head_dim, 1, args.dtype)
    cache = PagedKVCache(CacheConfig(args.num_blocks, bs, args.num_kv_heads, args.head_dim, args.dtype, device))
    loop, indexed = get_backend("loop"), get_backend("indexed")
    systems = [[rng.randrange(32000) for _ in range(rng.randrange(2 * bs, 6 * bs))] for _ in range(3)]
    waiting = []
    for rid in range(args.requests):
        prompt = rng.choice(systems) + [rng.randrange(32000) for _ in range(rng.choice([1, bs - 1, bs, bs + 1,
                                                                                         rng.randrange(2, 8 * bs)]))]
        waiting.append({"id": rid, "prompt": prompt, "max_new": rng.randrange(4, 48), "arrive": rid // 3})
    tokens: dict[int, list[int]] = {}  # what each live sequence holds (its K/V follow from these)
    todo: dict[int, list[int]] = {}  # prompt tokens still to prefill
    budget: dict[int, int] = {}  # decode tokens left
    next_id, step, checks_done, preempted, forks = 10_000, 0, 0, 0, 0
    t_loop = t_indexed = 0.0
    finished = 0

    def write(seq_id: int, new: list[int]) -> None:
        start = len(tokens[seq_id])
        slots = cache.append(seq_id, new)
        k, v = token_kv(geometry, new, start, args.seed)
        indexed.write_kv(cache.k_cache(), cache.v_cache(), k.to(device), v.to(device), slots)
        tokens[seq_id] += new

    def release(seq_id: int) -> None:
        cache.free(seq_id)
        for table in (tokens, todo, budget):
            table.pop(seq_id, None)

    def verify() -> None:
        nonlocal t_loop, t_indexed, checks_done
        for seq_id, toks in tokens.items():
            k_exp, _ = token_kv(geometry, toks, 0, args.seed)
            table = cache.block_table(seq_id)
            t0 = time.perf_counter()
            a = loop.gather(cache.k_cache(), table, len(toks))
            t1 = time.perf_counter()
            b = indexed.gather(cache.k_cache(), table, len(toks))
            t2 = time.perf_counter()
            t_loop, t_indexed = t_loop + t1 - t0, t_indexed + t2 - t1
            for name, got in (("loop", a), ("indexed", b)):
                if not torch.equal(bits(got.cpu()), bits(k_exp)):
                    raise SystemExit(f"demo: FAILED at step {step}: the {name} gather of sequence {seq_id} "
                                     f"({len(toks)} tokens) differs from what was written")
            checks_done += 1
        cache.check_invariants()

    while waiting or tokens:
        step += 1
        while waiting and waiting[0]["arrive"] <= step:  # admit arrivals
            req = waiting.pop(0)
            cached = cache.add_sequence(req["id"], req["prompt"])
            tokens[req["id"]] = list(req["prompt"][:cached])
            todo[req["id"]] = list(req["prompt"][cached:])
            budget[req["id"]] = req["max_new"]
        for seq_id in list(tokens):
            if seq_id not in tokens:
                continue
            try:
                if todo.get(seq_id):  # chunked prefill
                    chunk, todo[seq_id] = todo[seq_id][: args.prefill_chunk], todo[seq_id][args.prefill_chunk:]
                    write(seq_id, chunk)
                elif budget[seq_id] > 0:  # decode one token; sometimes fork (parallel sampling)
                    if rng.random() < 0.01 and len(tokens) < 64:
                        cache.fork(seq_id, next_id)
                        tokens[next_id], todo[next_id], budget[next_id] = list(tokens[seq_id]), [], budget[seq_id] // 2
                        next_id, forks = next_id + 1, forks + 1
                    write(seq_id, [rng.randrange(32000)])
                    budget[seq_id] -= 1
                else:
                    release(seq_id)
                    finished += 1
            except OutOfBlocksError:  # preempt the sequence (recompute later, as vLLM does)
                req_prompt = tokens[seq_id] + todo.get(seq_id, [])
                left = budget[seq_id]
                release(seq_id)
                preempted += 1
                waiting.append({"id": seq_id, "prompt": req_prompt, "max_new": left, "arrive": step + 2})
        if step % args.check_every == 0:
            verify()
        if step == 40:
            mid = cache.stats()
    verify()
    stats = cache.stats()
    mid = locals().get("mid", stats)
    print(f"pagedkv demo: {args.requests} requests (+{forks} forks), block_size {bs}, {args.num_blocks} blocks, "
          f"{args.num_kv_heads}x{args.head_dim} {args.dtype} on {device}")
    print(f"  steps                 {step}  (preemptions {preempted}, finished {finished})")
    print(f"  blocks at step 40     used {mid['used']}, shared {mid['shared']}, free {mid['free']} "
          f"(cached {mid['cached']}) of {mid['num_blocks']}")
    print(f"  blocks at the end     used {stats['used']}, free {stats['free']}, cached for reuse {stats['cached']}")
    print(f"  prefix cache          hit rate {stats['prefix_hit_rate']:.1%} of full prompt blocks, "
          f"{stats['cached_tokens']} prompt tokens not recomputed, {stats['evictions']} evictions")
    print(f"  copy-on-write copies  {stats['cow_copies']}")
    print(f"  reads verified        {checks_done} sequence reads, loop == indexed == written, bit for bit")
    print(f"  gather time           loop {t_loop * 1e3:.1f} ms, indexed {t_indexed * 1e3:.1f} ms "
          f"({t_loop / max(t_indexed, 1e-9):.2f}x)")
    if stats["used"] != 0:
        print("demo: FAILED: blocks leaked after every request finished")
        return 1
    print("demo: OK")
    return 0
