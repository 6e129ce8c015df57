"""``python -m pagedkv demo``: a simulated serving run through the paged cache, every read verified.

Requests arrive built from a few shared system prompts plus their own text, are prefilled in
chunks (a prompt's cached prefix is not recomputed), then decode token by token; some fork (parallel
sampling, sharing every block), some finish and free their blocks while others arrive, so the pool
fragments; when no block is left a sequence is preempted (freed and queued again to recompute).

Every backend chosen with ``--impl`` (default: every built-in backend available here) serves the
same workload on its own cache: each step it writes the step's new K/V with its ``write_kv`` and
computes the step's packed batch (prefill chunks and decode tokens, causal) with its
``paged_attention``. The reads and how each is verified:

- every ``paged_attention`` call, at every step: against an fp64 dense reference over the K/V the
  demo wrote (kept apart from the cache), with the tolerance policy of
  :mod:`pagedkv.testing.compare`;
- every ``--check-every`` steps and at the end: a ``gather`` of K and of V of every live sequence,
  compared bit for bit with the K/V written for its tokens; the cache's invariants are checked then.

The pools run with ``CacheConfig(debug_poison="nan")``: new, allocated and emptied blocks hold NaN,
so a read of a slot nobody wrote poisons the output. With ``--window-left N`` every read attends
through a sliding window (``window_left=N``) and the cache runs with ``CacheConfig(window_left=N)``:
it releases the blocks no later query reads (their table entries become ``-1``), the gathers read
from each sequence's first held block, and the report counts the blocks released.

With ``--layer-types`` (transformers' ``layer_types``: e.g. ``sliding_attention,full_attention`` for
Gemma 2's alternating layers; one name per layer) the model has that many layers and the cache is a
:class:`~pagedkv.cache.hybrid.HybridKVCache`: one KV-cache group per kind on one block pool, the sliding
group releasing what its window leaves behind, the full group keeping every block, one agreed prefix
hit. Every layer is written at its group's slots and read through its group's block table: each
``paged_attention`` with the layer's window (``--window-left`` for the sliding layers), each gather of
a sliding layer from its group's first held block.

The first read that differs stops the run with exit status 1.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.cli.common import device_option, seed_option


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", parents=[seed_option("requests, prompts and values"), device_option(None)],
                              help="simulate serving through the paged cache and verify every read",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", action="append", default=None, metavar="NAME",
                   help="backend to serve through: loop, indexed, triton or a candidate spec (pkg.module:attr, "
                        "path.py); repeatable or a comma list (default: every built-in backend available)")
    p.add_argument("--requests", type=int, default=24, help="requests to serve (default 24)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--num-blocks", type=int, default=88, help="blocks in the pool (default 88)")
    p.add_argument("--num-kv-heads", type=int, default=2, help="kv heads (default 2)")
    p.add_argument("--queries-per-kv", type=int, default=2, help="query heads per kv head (GQA; default 2)")
    p.add_argument("--head-dim", type=int, default=32, help="head dim (default 32)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--prefill-chunk", type=int, default=64, help="max prompt tokens prefilled per step (default 64)")
    p.add_argument("--interpreted-every", type=int, default=4,
                   help="a backend running in Triton's CPU interpreter (orders of magnitude slower than compiled "
                        "code) computes paged_attention every N steps, not every step; 1: every step (default 4)")
    p.add_argument("--check-every", type=int, default=16,
                   help="gather every live sequence's K and V every N steps and at the end (default 16)")
    p.add_argument("--window-left", type=int, default=None, metavar="N",
                   help="attend through a sliding window (a query at p reads p - N .. p) and let the cache "
                        "release the blocks no later query reads (default: full attention, every block kept)")
    p.add_argument("--layer-types", default=None, metavar="KINDS",
                   help="a hybrid model (transformers' layer_types): one comma-separated name per layer, "
                        "full_attention or sliding_attention (e.g. sliding_attention,full_attention as Gemma 2); "
                        "the sliding layers attend through --window-left; the cache keeps one KV-cache group per "
                        "kind on one block pool (default: one layer, as --window-left says)")
    p.set_defaults(func=run, _parser=p)


@dataclass
class Reads:
    """What one backend read, all of it verified."""

    attention_every: int = 1  # paged_attention at every step (1), or at one step in N
    attention_calls: int = 0
    query_rows: int = 0
    max_attention_error: float = 0.0  # max |output - fp64 reference| over every attention output
    gathers: int = 0  # gather calls (one per live sequence and pool, K or V)
    gathered_tokens: int = 0
    seconds: float = 0.0  # in the backend's read calls


@dataclass
class DemoReport:
    """What :func:`run_demo` did. Block counts are snapshots of the allocator (:func:`block_counts`)."""

    backends: list[str]
    config: dict
    steps: int = 0
    served_steps: int = 0  # steps with tokens to write and attend (the others only free finished sequences)
    forks: int = 0
    finished: int = 0
    preemptions: int = 0
    gather_checks: int = 0  # steps at which every live sequence was gathered
    peak_step: int = 0  # first step at which the most blocks were used
    peak: dict = field(default_factory=dict)
    mid_step: int = 0
    mid: dict = field(default_factory=dict)  # block counts after step ``steps // 2``
    end: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    reads: dict[str, Reads] = field(default_factory=dict)
    failure: str = ""
    caches: list = field(default_factory=list)  # one per backend, as left at the end
    window_left: int | None = None
    window_released_peak: int = 0  # most table entries released by the window in the live tables at once


def block_counts(cache) -> dict[str, int]:
    """The pool's blocks by state, read from the allocator (the one source every report line uses).

    ``used`` blocks are held by at least one live sequence (``shared``: by two or more); ``free``
    blocks can be handed out now: ``empty`` ones hold nothing, ``evictable`` ones still hold a
    prefix-cache entry (a later prompt with that prefix reuses them, else they are taken, oldest
    first). ``cached`` counts every block holding a prefix-cache entry: ``cached_used`` in use plus
    the ``evictable`` free ones. So ``used + free == total`` and ``cached == cached_used + evictable``.
    """
    a = cache.allocator
    refs = cache.reference_counts()
    evictable = a.num_free - len(a._free)
    return {"total": a.num_blocks, "used": a.num_used, "shared": sum(1 for n in refs.values() if n > 1),
            "free": a.num_free, "empty": len(a._free), "evictable": evictable, "cached": a.num_cached,
            "cached_used": a.num_cached - evictable}


class DemoFailure(Exception):
    """A read differed from what was written, or the cache broke an invariant."""


def run_demo(impls: list[Any], *, seed: int = 0, requests: int = 24, block_size: int = 16, num_blocks: int = 88,
             num_kv_heads: int = 2, queries_per_kv: int = 2, head_dim: int = 32, dtype: str = "float32",
             device: str = "cpu", prefill_chunk: int = 64, check_every: int = 16,
             interpreted_every: int = 4, on_step: Callable[[int, Any], None] | None = None,
             window_left: int | None = None, layer_types: tuple[str, ...] | None = None) -> DemoReport:
    """Serve the workload through every backend in ``impls`` (objects or specs); see the module doc.

    ``on_step(step, cache)`` is called after every step with the first backend's cache.
    ``window_left``: attend through this sliding window and let the caches release what it never reads
    (``CacheConfig.window_left``); ``None``: full attention. ``layer_types``: one kind per layer
    (``CacheConfig.layer_types``), served by a :class:`~pagedkv.cache.hybrid.HybridKVCache`.

    Returns:
        The report; ``failure`` is set (and the run stopped) at the first read that differs.
    """
    import dataclasses

    import torch

    from pagedkv.attention.dense import reference_attention
    from pagedkv.backends import backend_name, load_backend
    from pagedkv.cache.engine import Step
    from pagedkv.cache.paged_cache import PagedKVCache
    from pagedkv.errors import OutOfBlocksError
    from pagedkv.testing.cases.case import Geometry, token_kv
    from pagedkv.testing.compare import assert_attention_close, bits

    backends = [load_backend(b) if isinstance(b, str) else b for b in impls]
    names = [backend_name(b) for b in backends]
    geometry = Geometry(num_blocks, block_size, num_kv_heads, head_dim, queries_per_kv, dtype)
    # unwritten slots read as NaN (new, allocated and emptied blocks): a read of one poisons the output
    from pagedkv.cache.hybrid import HybridKVCache

    hybrid = layer_types is not None
    num_layers = len(layer_types) if hybrid else 1
    config = dataclasses.replace(geometry.cache_config(device, num_layers), debug_poison="nan",
                                 window_left=window_left, layer_types=tuple(layer_types) if hybrid else None)
    caches = [HybridKVCache(config) if hybrid else (getattr(b, "cache_class", None) or PagedKVCache)(config)
              for b in backends]
    windows = [{} if w is None else {"window_left": w} for w in config.layer_windows]  # per layer

    def group(cache, layer: int) -> dict:
        return {"group": cache.group_of(layer)} if hybrid else {}
    report = DemoReport(names, dict(requests=requests, block_size=block_size, num_blocks=num_blocks,
                                    num_kv_heads=num_kv_heads, queries_per_kv=queries_per_kv, head_dim=head_dim,
                                    dtype=dtype, device=str(device), check_every=check_every,
                                    layer_types=",".join(layer_types) if hybrid else None),
                        reads={n: Reads(interpreted_every if _interpreted(b, device) else 1)
                               for n, b in zip(names, backends)}, caches=caches, window_left=window_left)
    rng = random.Random(seed)
    qgen = torch.Generator().manual_seed(seed)
    bs, main = block_size, caches[0]
    systems = [[rng.randrange(32000) for _ in range(rng.randrange(2 * bs, 6 * bs))] for _ in range(3)]
    waiting = []
    for rid in range(requests):
        tail = rng.choice([1, bs - 1, bs, bs + 1, rng.randrange(2, 8 * bs)])
        waiting.append({"id": rid, "prompt": rng.choice(systems) + [rng.randrange(32000) for _ in range(tail)],
                        "max_new": rng.randrange(4, 48), "arrive": rid // 3})
    tokens: dict[int, list[int]] = {}  # each live sequence's tokens whose K/V is written
    shadow: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (seq, layer): their K/V, apart
    todo: dict[int, list[int]] = {}  # prompt tokens still to prefill
    budget: dict[int, int] = {}  # decode tokens left
    next_id = 10_000
    history: list[dict] = []  # block counts after each step

    def on_all(method: str, *args) -> list:
        return [getattr(cache, method)(*args) for cache in caches]

    def release(seq_id: int) -> None:
        on_all("free", seq_id)
        for table in (tokens, todo, budget):
            table.pop(seq_id, None)
        for layer in range(num_layers):
            shadow.pop((seq_id, layer), None)

    def verify_gathers() -> None:
        report.gather_checks += 1
        for name, backend, cache in zip(names, backends, caches):
            reads = report.reads[name]
            cache.check_invariants()
            for (seq_id, layer), (k_written, v_written) in shadow.items():
                toks = tokens[seq_id]
                # a sliding window released the blocks before this position: read from the first held one
                p = cache.first_held_position(seq_id, **group(cache, layer)) if window_left is not None else 0
                for pool, expected, which in ((cache.k_cache(layer), k_written[p:], "K"),
                                              (cache.v_cache(layer), v_written[p:], "V")):
                    t0 = time.perf_counter()
                    got = backend.gather(pool, cache.block_table(seq_id, **group(cache, layer))[p // bs:],
                                         len(toks) - p)
                    reads.seconds += time.perf_counter() - t0
                    reads.gathers += 1
                    reads.gathered_tokens += len(toks) - p
                    if got.shape != expected.shape or not torch.equal(bits(got.cpu()), bits(expected)):
                        raise DemoFailure(f"step {report.steps}: {name} gather of {which} of sequence {seq_id} "
                                          f"({len(toks)} tokens, layer {layer}) differs from what was written")

    def serve(batch: list[tuple[int, list[int]]], steps: list[Step]) -> None:
        """Write the step's new K/V, commit it, then read the packed batch's attention on every backend."""
        new_kv, qsl = {}, [0]
        for seq_id, new in batch:
            for layer in range(num_layers):
                k, v = token_kv(geometry, new, len(tokens[seq_id]), seed, prefix=tokens[seq_id], layer=layer)
                new_kv[seq_id, layer] = (k, v)
                old = shadow.get((seq_id, layer))
                shadow[seq_id, layer] = (k, v) if old is None else (torch.cat([old[0], k]), torch.cat([old[1], v]))
            tokens[seq_id] += new
            qsl.append(qsl[-1] + len(new))
        ids = [seq_id for seq_id, _ in batch]
        query = torch.randn((qsl[-1], geometry.num_q_heads, head_dim), generator=qgen).to(geometry.torch_dtype)
        qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
        for backend, cache, step in zip(backends, caches, steps):
            # one write_kv per layer for the step (at its group's slots), then commit: full blocks enter the
            # prefix cache
            step.write(backend.write_kv, lambda seq_id, start, new, layer: new_kv[seq_id, layer],
                       num_layers=num_layers, commit=hasattr(cache, "mark_written"))
        for layer in range(num_layers):
            keys, values = [shadow[i, layer][0] for i in ids], [shadow[i, layer][1] for i in ids]
            expected = reference_attention(query, keys, values, qsl, **windows[layer])
            max_logit = head_dim ** -0.5 * float(query.double().abs().max()) * head_dim * \
                max(float(k.double().abs().max()) for k in keys)
            max_v = max(float(v.double().abs().max()) for v in values)
            for name, backend, cache in zip(names, backends, caches):
                reads = report.reads[name]
                if report.steps % reads.attention_every:
                    continue
                t0 = time.perf_counter()
                out = backend.paged_attention(query.to(device), cache.k_cache(layer), cache.v_cache(layer),
                                              cache.block_tables(ids, **group(cache, layer)), cache.seq_lens(ids),
                                              qsl_t, None, **windows[layer])
                reads.seconds += time.perf_counter() - t0
                reads.attention_calls += 1
                reads.query_rows += qsl[-1]
                try:
                    assert_attention_close(out.cpu(), expected, max_abs_logit=max_logit, max_abs_value=max_v)
                except AssertionError as exc:
                    raise DemoFailure(f"step {report.steps}: {name} paged_attention of sequences {ids} (layer "
                                      f"{layer}) differs from the fp64 reference: {exc}") from None
                err = float((out.cpu().double() - expected).abs().max()) if out.numel() else 0.0
                reads.max_attention_error = max(reads.max_attention_error, err)

    try:
        while waiting or tokens:
            report.steps += 1
            step = report.steps
            for req in [r for r in waiting if r["arrive"] <= step]:  # admit arrivals
                waiting.remove(req)
                cached = on_all("add_sequence", req["id"], req["prompt"])[0]
                tokens[req["id"]] = list(req["prompt"][:cached])
                if cached:
                    for layer in range(num_layers):
                        shadow[req["id"], layer] = token_kv(geometry, tokens[req["id"]], 0, seed, layer=layer)
                todo[req["id"]], budget[req["id"]] = list(req["prompt"][cached:]), req["max_new"]
            batch, steps = [], [Step(cache) for cache in caches]
            for seq_id in list(tokens):
                if todo.get(seq_id):  # chunked prefill
                    new = todo[seq_id][:prefill_chunk]
                elif budget[seq_id] > 0:  # decode one token; sometimes fork (parallel sampling)
                    if rng.random() < 0.02 and len(tokens) < 64:
                        on_all("fork", seq_id, next_id)
                        tokens[next_id] = list(tokens[seq_id])
                        for layer in range(num_layers):
                            if (seq_id, layer) in shadow:
                                shadow[next_id, layer] = shadow[seq_id, layer]
                        todo[next_id], budget[next_id] = [], budget[seq_id] // 2 + 1
                        next_id, report.forks = next_id + 1, report.forks + 1
                    new = [rng.randrange(32000)]
                else:
                    release(seq_id)
                    report.finished += 1
                    continue
                try:
                    steps[0].reserve(seq_id, new)  # raises before any change when no block is left
                except OutOfBlocksError:  # preempt: free it, recompute later (as vLLM does)
                    waiting.append({"id": seq_id, "prompt": tokens[seq_id] + todo.get(seq_id, []),
                                    "max_new": budget[seq_id], "arrive": step + 2})
                    release(seq_id)
                    report.preemptions += 1
                    continue
                for other in steps[1:]:
                    other.reserve(seq_id, new)
                if todo.get(seq_id):
                    todo[seq_id] = todo[seq_id][len(new):]
                else:
                    budget[seq_id] -= 1
                batch.append((seq_id, new))
            if batch:
                serve(batch, steps)
                report.served_steps += 1
            history.append(block_counts(main))
            report.window_released_peak = max(report.window_released_peak, main.stats()["window_released_live"])
            if on_step is not None:
                on_step(step, main)
            if history[-1]["used"] > report.peak.get("used", -1):
                report.peak, report.peak_step = history[-1], step
            if step % check_every == 0:
                verify_gathers()
        verify_gathers()
    except (DemoFailure, AssertionError) as exc:  # AssertionError: a cache invariant
        report.failure = str(exc)
    report.mid_step = max(1, report.steps // 2)
    report.mid = history[report.mid_step - 1] if history else block_counts(main)
    report.end = block_counts(main)
    report.stats = main.stats()
    return report


def _interpreted(backend: Any, device: str) -> bool:
    """True for pagedkv's Triton backend running in Triton's CPU interpreter."""
    return not str(device).startswith("cuda") and getattr(backend, "__name__", "") == "pagedkv.backends.triton.backend"


def report_lines(r: DemoReport) -> list[str]:
    """The report, one figure a line, each saying what it counts."""
    c, p, m, e, s = r.config, r.peak, r.mid, r.end, r.stats
    out = [f"pagedkv demo: {c['requests']} requests, {c['num_blocks']} blocks of {c['block_size']} tokens, "
           f"{c['num_kv_heads']} kv heads x {c['head_dim']} ({c['num_kv_heads'] * c['queries_per_kv']} query heads), "
           f"{c['dtype']} on {c['device']}",
           f"  backends              {', '.join(r.backends)}: each serves the same workload on its own cache "
           "(its write_kv, its paged_attention, its gather)",
           f"  steps                 {r.steps}: each admits arrivals, then prefills a chunk or decodes one token "
           f"for every running sequence in one packed batch ({r.served_steps} steps had one; the others only freed)",
           f"  forks                 {r.forks}: a decoding sequence split in two (parallel sampling), sharing every "
           "block until one appends (copy-on-write)",
           f"  finished              {r.finished} of {c['requests']} requests + {r.forks} forks: sequences run to "
           "their last token and freed",
           f"  preemptions           {r.preemptions}: times a sequence found no free block; it was freed and "
           "queued again, its tokens recomputed later (as vLLM does)",
           f"  peak use              {p.get('used')} of {p.get('total')} blocks held by live sequences, first at "
           f"step {r.peak_step}",
           f"  blocks at step {r.mid_step:<6} used {m.get('used')} + free {m.get('free')} = {m.get('total')}; "
           f"{m.get('shared')} of the used are shared by several sequences (forks, prefix hits)",
           f"                        free = {m.get('empty')} empty + {m.get('evictable')} evictable (still holding a "
           "prefix-cache entry: reused on a prefix hit, else taken oldest first)",
           f"                        cached {m.get('cached')} = blocks holding a prefix-cache entry: "
           f"{m.get('cached_used')} in use + {m.get('evictable')} evictable among the free",
           f"  blocks at the end     used {e.get('used')}, free {e.get('free')} = {e.get('empty')} empty + "
           f"{e.get('evictable')} evictable (cached {e.get('cached')}, all of them free)",
           f"  prefix cache          {s.get('prefix_hit_rate', 0.0):.1%} of the full prompt blocks looked up were "
           f"found; {s.get('cached_tokens')} prompt tokens not recomputed; {s.get('evictions')} entries evicted",
           f"  copy-on-write         {s.get('cow_copies')} shared partial blocks copied before an append"]
    if c.get("layer_types"):
        out.append(f"  kv-cache groups       layers {c['layer_types']}: one block table per kind on one pool of "
                   f"{c['num_blocks']} blocks; every prefix hit agreed by both (the sliding group needs only the "
                   "window of the hit's end); each layer reads through its group's table")
    if r.window_left is not None:
        out.append(f"  sliding window        window_left {r.window_left}: {s.get('window_released')} blocks released "
                   "early (table entries set to -1: no later query reads them); at most "
                   f"{r.window_released_peak} at once in the live tables, blocks they would hold without the window")
    out.append("  verified              every read below: each paged_attention call against an fp64 dense "
               "reference over the K/V written (tolerance policy), each gather bit for bit")
    for name, reads in r.reads.items():
        when = "one per served step" if reads.attention_every == 1 else \
            f"at served steps {reads.attention_every}, {2 * reads.attention_every}, ... (Triton's CPU " \
            "interpreter; --interpreted-every)"
        out.append(f"  reads by {name:<12} {reads.attention_calls} paged_attention calls, {when}: {reads.query_rows} "
                   f"query rows, max |error| vs fp64 {reads.max_attention_error:.1e}")
        out.append(f"  {'':<21} {reads.gathers} gathers, K and V of every live sequence every {c['check_every']} "
                   f"steps and at the end ({r.gather_checks} times): {reads.gathered_tokens} tokens; "
                   f"{reads.seconds:.2f} s in reads")
    return out


def _impls(values: list[str] | None) -> list[str]:
    from pagedkv.backends import available_backends

    names = [n.strip() for v in values or [] for n in v.split(",") if n.strip()]
    return names or available_backends()


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedkv.backends import load_backend
    from pagedkv.errors import BackendError

    parser = getattr(args, "_parser", None)
    layer_types = None
    if args.layer_types:
        from pagedkv.cache.config import LAYER_TYPES

        layer_types = tuple(t.strip() for t in args.layer_types.split(",") if t.strip())
        bad = [t for t in layer_types if t not in LAYER_TYPES]
        message = (f"--layer-types entries must be one of {', '.join(LAYER_TYPES)}, got {bad[0]!r}" if bad else
                   "--layer-types with sliding_attention layers needs --window-left N"
                   if "sliding_attention" in layer_types and args.window_left is None else "")
        if message:
            if parser is not None:
                parser.error(message)
            print(f"demo: error: {message}", file=sys.stderr)
            return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not device.startswith("cuda"):
        torch.set_num_threads(1)  # small tensors: more threads only spin against each other on a shared machine
    backends = []
    for spec in _impls(args.impl):
        try:
            backend = load_backend(spec, required=("write_kv", "gather", "paged_attention"))
        except (BackendError, ImportError) as exc:
            message = f"--impl {spec!r}: {exc}"
            if parser is not None:
                parser.error(message)
            print(f"demo: error: {message}", file=sys.stderr)
            return 2
        backends.append(backend)
    report = run_demo(backends, seed=args.seed, requests=args.requests, block_size=args.block_size,
                      num_blocks=args.num_blocks, num_kv_heads=args.num_kv_heads, queries_per_kv=args.queries_per_kv,
                      head_dim=args.head_dim, dtype=args.dtype, device=device, prefill_chunk=args.prefill_chunk,
                      check_every=args.check_every, interpreted_every=args.interpreted_every,
                      window_left=args.window_left, layer_types=layer_types)
    for line in report_lines(report):
        print(line)
    if report.failure:
        print(f"demo: FAILED: {report.failure}")
        return 1
    if report.end["used"] != 0:
        print("demo: FAILED: blocks still used after every request finished (leaked)")
        return 1
    print("demo: OK")
    return 0
