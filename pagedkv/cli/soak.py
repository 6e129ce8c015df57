"""``python -m pagedkv soak``: a long simulated serving trace through the real cache, checked throughout.

Each scheduler step:

1. requests arrive (a shared system prompt plus their own text, so later prompts hit the prefix
   cache) and wait;
2. waiting requests are admitted (``add_sequence``: prefix lookup) while the running batch has room
   and the pool can hold their first prefill chunk;
3. every running sequence gets its next piece of work: a prefill chunk (chunked prefill) or one
   decode token, and its slots are reserved (``append``). When the pool cannot hold it, the most
   recently admitted sequence is *preempted* (freed, and re-queued to be recomputed from its tokens
   so far, as vLLM's recompute preemption does); shared blocks stay with their other owners;
4. *mid-step*, between the reservation and the write, a scheduled sequence is sometimes aborted
   (the client went away) or preempted (re-queued): its slots are reserved but never committed. Half
   the time its rows are dropped from the batch, half the time the forward pass has already run and
   its K/V still lands in the blocks it just released (which must then cache nothing);
5. the step's K/V is written, in every layer, with one ``write_kv`` call per layer over the
   concatenated ``slot_mapping``, then committed with ``mark_written``: only now do full blocks enter
   the prefix cache;
6. some decoding sequences fork (parallel sampling: every block shared; the next append to a
   shared partial block copies it), and sequences that reached their length finish and free.

Every token's K/V is a deterministic function of its token, position, every token before it and the
layer (:func:`pagedkv.testing.cases.case.token_kv`), so a sequence's K/V follows from its committed tokens.
Every ``check_every`` steps each live sequence is gathered in every layer and compared with the K/V
of its tokens bit for bit, the allocator/cache invariants are checked, and every block the prefix
cache holds (and a lookup can reach) must cache a prefix that was written and committed, and store
that prefix's K/V in every layer. At the end everything is checked once more, every sequence is
freed, and every block must be free (no leak).

With ``--window-left N`` the cache runs with ``CacheConfig(window_left=N)``: each append releases
the blocks no later query reads (table entries ``-1``, shared and cached blocks just lose a
reference), the full check reads each sequence from its first held block and checks that no
``-1`` lies in its window; the report counts the blocks released. The pools run with
``CacheConfig(debug_poison="nan")`` throughout.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from pagedkv.cli.common import device_option, seed_option

import torch


class SoakFailure(AssertionError):
    """A check failed during the soak; the message names the step and what differed."""


@dataclass
class _Request:
    seq_id: int
    tokens: list[int]  # what must be in the cache once prefilled (prompt, or prompt + output on recompute)
    target_len: int  # finish when the sequence holds this many tokens
    computed: int = 0  # tokens of ``tokens`` already in the cache

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.tokens)


def run_soak(steps: int = 10_000, seed: int = 0, *, num_blocks: int = 32, block_size: int = 4,
             num_kv_heads: int = 2, head_dim: int = 4, dtype: str = "float32", device: str = "cpu",
             backend: Any = "indexed", check_every: int = 50, max_running: int = 10, prefill_chunk: int | None = None,
             arrival_prob: float = 0.6, fork_prob: float = 0.02, num_systems: int = 3, num_layers: int = 2,
             abort_prob: float = 0.05, progress: bool = False, window_left: int | None = None) -> dict:
    """Run ``steps`` scheduler steps of a simulated serving trace and check the cache throughout.

    Args:
        steps: scheduler steps (``>= 1``).
        seed: seeds the trace (arrivals, prompts, lengths, forks) and the K/V values.
        num_blocks, block_size, num_kv_heads, head_dim, dtype, device: the cache geometry; a small pool
            (the default: 32 blocks of 4 tokens) forces eviction and preemption.
        backend: a backend object or built-in name; its ``write_kv`` writes and ``gather`` reads.
        check_every: steps between full checks of every live sequence (``>= 1``).
        max_running: sequences in the running batch at most.
        prefill_chunk: prompt tokens prefilled per step per sequence (default ``2 * block_size - 1``,
            so chunks end mid-block).
        arrival_prob: chance of a new request each step; fork_prob: chance per step that a decoding
            sequence forks.
        num_systems: distinct shared system prompts.
        num_layers: layers of the cache (each written and checked; values differ per layer).
        abort_prob: chance per step that a scheduled sequence is aborted or preempted between its
            slot reservation and the write.
        progress: show a tqdm progress bar.
        window_left: ``None``, or the sliding window of every layer: the cache releases what it never
            reads (``CacheConfig.window_left``).

    Returns:
        A report dict: ``ok`` (bool), ``failure`` (message or ``None``), ``steps`` run, ``seconds``,
        ``checks`` (full checks run), ``arrived``, ``admitted``, ``finished``, ``preempted``,
        ``aborted_mid_step``, ``preempted_mid_step``, ``forks``,
        ``refused_admissions``, ``tokens_written``, ``max_live``, ``leaked_blocks`` and the cache's
        ``stats()`` (prefix hit rate, copy-on-write copies, evictions, ...).

    Raises:
        ValueError: ``steps < 1``, ``check_every < 1`` or a pool too small for one request.
    """
    from pagedkv.backends import load_backend
    from pagedkv.cache.paged_cache import PagedKVCache
    from pagedkv.cache.engine import Step, admit
    from pagedkv.testing.cases.case import Geometry, token_kv
    from pagedkv.cache.config import blocks_needed
    from pagedkv.errors import OutOfBlocksError
    from pagedkv.testing.compare import bits

    if steps < 1 or check_every < 1 or num_layers < 1:
        raise ValueError(f"steps, check_every and num_layers must be >= 1, got steps={steps}, "
                         f"check_every={check_every}, num_layers={num_layers}")
    if not 0 <= abort_prob <= 1:
        raise ValueError(f"abort_prob must be in [0, 1], got {abort_prob}")
    be = load_backend(backend) if isinstance(backend, str) else backend
    rng = random.Random(seed)
    geometry = Geometry(num_blocks, block_size, num_kv_heads, head_dim, 1, dtype)
    bs = block_size
    chunk = prefill_chunk or max(1, 2 * bs - 1)
    max_prompt, max_new = 6 * bs, 4 * bs
    if blocks_needed(max_prompt + max_new, bs) + 1 > num_blocks:
        raise ValueError(f"num_blocks {num_blocks} cannot hold one request of up to {max_prompt + max_new} tokens "
                         f"(block_size {bs})")
    import dataclasses

    cache = PagedKVCache(dataclasses.replace(geometry.cache_config(device, num_layers), window_left=window_left,
                                             debug_poison="nan"))
    layers = range(num_layers)
    written_prefixes: set[tuple[int, ...]] = set()  # full-block prefixes whose K/V was written and committed
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(bs, 3 * bs + 2))] for _ in range(num_systems)]

    waiting: list[_Request] = []
    running: list[_Request] = []
    counts = dict(arrived=0, admitted=0, finished=0, preempted=0, aborted_mid_step=0, preempted_mid_step=0, forks=0,
                  refused_admissions=0, tokens_written=0, checks=0, max_live=0)
    next_id = 0
    step = 0

    def kv_of(tokens, start: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``tokens[start:]`` in ``layer`` (``tokens`` from position 0)."""
        tokens = list(tokens)
        return token_kv(geometry, tokens[start:], start, seed, prefix=tokens[:start], layer=layer)

    def full_check(where: str) -> None:
        counts["checks"] += 1
        try:
            cache.check_invariants()
        except AssertionError as exc:
            raise SoakFailure(f"{where}: cache invariants: {exc}") from None
        for req in running:
            n = cache.seq_len(req.seq_id)
            if n != req.computed or cache.num_written(req.seq_id) != n:
                raise SoakFailure(f"{where}: sequence {req.seq_id} holds {n} tokens, {cache.num_written(req.seq_id)} "
                                  f"committed; {req.computed} were written")
            table = cache.block_table(req.seq_id)
            first = cache.first_held_position(req.seq_id)  # 0 without a window
            if window_left is not None and first > max(0, n - window_left):
                raise SoakFailure(f"{where}: sequence {req.seq_id} released position {first - 1}, which its next "
                                  f"query (at {n}, window_left {window_left}) reads")
            for layer in layers:
                k_exp, v_exp = kv_of(req.tokens[:n], 0, layer)
                for pool, exp, name in ((cache.k_cache(layer), k_exp[first:], "K"),
                                        (cache.v_cache(layer), v_exp[first:], "V")):
                    got = be.gather(pool, table[first // bs:], n - first).cpu()
                    if got.shape != exp.shape or not torch.equal(bits(got), bits(exp)):
                        bad = (bits(got) != bits(exp)).flatten(1).any(1).nonzero() if got.shape == exp.shape else None
                        p = first + int(bad[0]) if bad is not None and bad.numel() else -1
                        raise SoakFailure(f"{where}: sequence {req.seq_id} ({n} tokens) reads a wrong {name} in layer "
                                          f"{layer} at position {p} (block {int(table[p // bs]) if p >= 0 else '?'}), "
                                          f"not the K/V written for its tokens")
        for block, entry in cache.allocator.cached_entries().items():
            prefix = cache.allocator.cached_prefix(block)
            if prefix is None:
                continue  # a parent was evicted: no lookup reaches this block
            if prefix not in written_prefixes:
                raise SoakFailure(f"{where}: cached block {block} (block {entry.depth} of a prompt) caches a prefix "
                                  f"whose K/V was never written and committed")
            for layer in layers:
                k, v = kv_of(prefix, len(prefix) - bs, layer)
                if not (torch.equal(bits(cache.k_cache(layer)[block].cpu()), bits(k))
                        and torch.equal(bits(cache.v_cache(layer)[block].cpu()), bits(v))):
                    raise SoakFailure(f"{where}: cached block {block} does not hold, in layer {layer}, the K/V of its "
                                      f"prefix (block {entry.depth} of a prompt)")

    def preempt(victim: _Request) -> None:
        """Free ``victim`` and re-queue it, to be recomputed from its tokens so far."""
        cache.free(victim.seq_id)
        running.remove(victim)
        waiting.insert(0, _Request(victim.seq_id, list(victim.tokens), victim.target_len))
        counts["preempted"] += 1

    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=steps, desc="soak", unit="step")
        except ImportError:  # the progress bar is optional (pip install "pagedkv[bench]")
            bar = None
    t0 = time.perf_counter()
    failure = None
    try:
        for step in range(steps):
            # 1. arrivals
            if rng.random() < arrival_prob:
                prompt = list(rng.choice(systems)) + [rng.randrange(1000) for _ in range(rng.randrange(1, 3 * bs))]
                prompt = prompt[:max_prompt]
                waiting.append(_Request(next_id, prompt, len(prompt) + rng.randrange(1, max_new)))
                next_id += 1
                counts["arrived"] += 1
            # 2. admission (prefix lookup)
            while waiting and len(running) < max_running:
                req = waiting[0]
                cached = admit(cache, req.seq_id, req.tokens, chunk)
                if cached is None:
                    counts["refused_admissions"] += 1
                    break
                waiting.pop(0)
                req.computed = cached  # a hit must equal recomputing these tokens (the full check compares)
                running.append(req)
                counts["admitted"] += 1
            # 3. work for every running sequence, preempting the newest when the pool is full
            batch = Step(cache)
            histories: dict[int, list[int]] = {}  # seq_id -> its tokens up to the end of this step's reservation
            scheduled: set[int] = set()
            for req in list(running):
                if req not in running:
                    continue  # preempted earlier in this step
                if req.prefilling:
                    new = req.tokens[req.computed:req.computed + chunk]
                else:
                    new = [rng.randrange(1000)]
                while not cache.can_append(req.seq_id, len(new)):
                    # the newest sequence not yet scheduled this step (its slots are not in this write)
                    preempt(next(r for r in reversed(running) if r.seq_id not in scheduled))
                    if req not in running:
                        break
                if req not in running:
                    continue
                scheduled.add(req.seq_id)
                try:
                    batch.reserve(req.seq_id, new)
                except OutOfBlocksError as exc:
                    raise SoakFailure(f"step {step}: can_append said yes but append refused: {exc}") from None
                if req.prefilling:
                    req.computed += len(new)
                else:
                    req.tokens.append(new[0])
                    req.computed += 1
                histories[req.seq_id] = req.tokens[:batch.reserved[req.seq_id][1] + len(new)]
            # 4. mid-step: a scheduled sequence aborted or preempted between its reservation and the write
            if batch.reserved and rng.random() < abort_prob:
                chosen = rng.choice(sorted(batch.reserved))
                victim = next(r for r in running if r.seq_id == chosen)
                if rng.random() < 0.5:
                    cache.free(victim.seq_id)
                    running.remove(victim)
                    counts["aborted_mid_step"] += 1
                else:
                    preempt(victim)
                    counts["preempted"] -= 1
                    counts["preempted_mid_step"] += 1
                if rng.random() < 0.5:  # dropped from the batch; else the forward already ran and writes it
                    batch.drop(victim.seq_id)
            # 5. one write_kv per layer for the whole step, then commit
            if batch.reserved:
                counts["tokens_written"] += batch.num_tokens
                # an aborted or preempted sequence commits nothing (its rows land in released blocks)
                def step_kv(seq_id, start, new, layer, histories=histories):
                    return kv_of(histories[seq_id], start, layer)

                for seq_id in batch.write(be.write_kv, step_kv):
                    tokens = histories[seq_id]
                    written_prefixes.update(tuple(tokens[:e]) for e in range(bs, len(tokens) + 1, bs))
            # 6. forks (parallel sampling) and finishes
            decoding = [r for r in running if not r.prefilling]
            if decoding and len(running) < max_running and rng.random() < fork_prob:
                parent = rng.choice(decoding)
                child = _Request(next_id, list(parent.tokens), parent.target_len + rng.randrange(0, bs + 1),
                                 parent.computed)
                next_id += 1
                cache.fork(parent.seq_id, child.seq_id)
                running.append(child)
                counts["forks"] += 1
            for req in [r for r in running if not r.prefilling and len(r.tokens) >= r.target_len]:
                cache.free(req.seq_id)
                running.remove(req)
                counts["finished"] += 1
            counts["max_live"] = max(counts["max_live"], len(running))
            if (step + 1) % check_every == 0:
                full_check(f"step {step}")
            if bar is not None:
                bar.update(1)
                if (step + 1) % 100 == 0:
                    bar.set_postfix(live=len(running), waiting=len(waiting), preempted=counts["preempted"],
                                    hit=f"{cache.stats()['prefix_hit_rate']:.2f}")
        full_check("end")
        stats = cache.stats()
        for req in list(running):
            cache.free(req.seq_id)
            running.remove(req)
        cache.check_invariants()
        leaked = [b for b in range(num_blocks) if not cache.allocator.is_free(b)]
        if leaked or cache.allocator.num_free != num_blocks:
            raise SoakFailure(f"after freeing every sequence, blocks {leaked} are still held")
    except SoakFailure as exc:
        failure = str(exc)
        stats = cache.stats()
        leaked = None
    except Exception as exc:  # noqa: BLE001 - an op or the cache raising mid-trace is a finding too
        failure = f"step {step}: {type(exc).__name__}: {exc}"
        stats = cache.stats()
        leaked = None
    finally:
        if bar is not None:
            bar.close()
    return {
        "ok": failure is None, "failure": failure, "steps": step + 1, "seconds": round(time.perf_counter() - t0, 3),
        "seed": seed, "backend": getattr(be, "name", str(backend)), "num_blocks": num_blocks,
        "block_size": block_size, **counts, "leaked_blocks": leaked, "stats": stats,
    }


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``soak`` with its arguments and ``func=run``."""
    p = subparsers.add_parser("soak", parents=[seed_option("the trace and the values"), device_option("cpu")],
                              help="a long simulated serving trace through the cache, checked throughout",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10_000, help="scheduler steps (default 10000)")
    p.add_argument("--num-blocks", type=int, default=32, help="blocks in the pool (default 32: a small pool)")
    p.add_argument("--block-size", type=int, default=4, help="tokens per block (default 4)")
    p.add_argument("--num-kv-heads", type=int, default=2, help="kv heads (default 2)")
    p.add_argument("--head-dim", type=int, default=4, help="head dim (default 4)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--backend", default="indexed", help="loop, indexed, triton or MODULE:ATTR (default indexed)")
    p.add_argument("--check-every", type=int, default=50, help="steps between full checks (default 50)")
    p.add_argument("--max-running", type=int, default=10, help="running batch size (default 10)")
    p.add_argument("--num-layers", type=int, default=2, help="layers, each written and checked (default 2)")
    p.add_argument("--abort-prob", type=float, default=0.05,
                   help="chance per step of an abort or preemption between reserve and write (default 0.05)")
    p.add_argument("--window-left", type=int, default=None, metavar="N",
                   help="every layer attends through this sliding window: the cache releases the blocks no "
                        "later query reads (default: full attention)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the soak from parsed arguments; print the report; exit status 0 when every check passed."""
    report = run_soak(args.steps, args.seed, num_blocks=args.num_blocks, block_size=args.block_size,
                      num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, dtype=args.dtype, device=args.device,
                      backend=args.backend, check_every=args.check_every, max_running=args.max_running,
                      num_layers=args.num_layers, abort_prob=args.abort_prob, progress=not args.no_progress,
                      window_left=args.window_left)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        s = report["stats"]
        print(f"soak: {report['steps']} steps in {report['seconds']:.1f} s, backend {report['backend']}, "
              f"seed {report['seed']}: {'OK' if report['ok'] else 'FAILED'}")
        print(f"  requests: {report['arrived']} arrived, {report['admitted']} admitted, {report['finished']} finished, "
              f"{report['preempted']} preempted, {report['aborted_mid_step']} aborted and "
              f"{report['preempted_mid_step']} preempted between reserve and write, {report['forks']} forks, "
              f"{report['refused_admissions']} admissions "
              f"deferred; max live {report['max_live']}")
        print(f"  tokens written {report['tokens_written']}, full checks {report['checks']}, prefix hit rate "
              f"{s['prefix_hit_rate']:.3f}, copy-on-write copies {s['cow_copies']}, evictions {s['evictions']}, "
              f"leaked blocks {report['leaked_blocks']}")
        if args.window_left is not None:
            print(f"  sliding window (window_left {args.window_left}): {s['window_released']} blocks released early")
        if report["failure"]:
            print(f"  failure: {report['failure']}")
    return 0 if report["ok"] else 1
