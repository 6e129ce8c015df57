"""End to end, the scenario and the engine that serves it from the paged cache.

The scenario (:func:`make_scenario`, :class:`PagedEngine`) is a small engine run:

- the pool is pre-fragmented (dummy sequences allocated, some freed) and poisoned with NaN, so a
  read of any slot a sequence does not own turns the logits into NaN;
- requests join at different steps; several share a multi-block prompt prefix and are admitted with
  ``cache.add_sequence``: the cached full blocks are *not* recomputed, only the uncached suffix is
  run through the model (one request joins after the first owner of the prefix has finished, so
  part of its hit is revived from blocks freed with that owner, still in the prefix cache);
- one request forks another mid-block after its prompt (``cache.fork``): the partially filled
  block is shared, and the first append to it copies it (copy-on-write);
- prompt lengths straddle block boundaries (``bs - 1``, ``bs``, ``bs + 1``, unaligned prefixes);
- a long prompt is prefilled in chunks over several steps while other requests decode;
- greedy decode runs for dozens of steps; requests finish (and are freed) at different steps;
- block tables are padded with ``-1`` to one width for the whole run (the most blocks a request
  can need, as vLLM pads to ``max_num_blocks_per_req``), not to the step's longest table;
- with a sliding window on every layer (``window_left``), the cache releases the blocks no later
  query reads (``CacheConfig.window_left``): their table entries become ``-1`` and the attention of
  every layer must skip them.

A backend that raises during the run (a validation error, an out-of-range index) fails the check
with that error in the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.cli.e2e.fp8 import gather_codes, kv_cache_dtype_name
from pagedkv.cli.e2e.model import STEP_KWARG, StepContext, model_geometry

#: token ids of the pre-fragmentation dummies start here: outside any vocabulary, so they never match
#: a real prompt in the prefix cache (and are never fed to the model).
_DUMMY_TOKEN_OFFSET = 1_000_000


@dataclass(frozen=True)
class Request:
    """One generation request: prompt token ids, the step it arrives at, how many tokens to generate.

    With ``fork_of`` set, the request forks that (running) request once its prompt is done: it
    shares every token the parent has in the cache (``PagedKVCache.fork``, nothing recomputed or
    copied) and continues with ``prompt`` as its own suffix, so its full prompt is the parent's
    cached tokens followed by ``prompt``. A fork in the middle of a block makes the first append
    (parent's or child's) copy that block (copy-on-write).
    """

    seq_id: int
    prompt: tuple[int, ...]
    arrival: int
    max_new_tokens: int
    fork_of: int | None = None


def make_scenario(*, seed: int = 0, num_requests: int = 9, decode_steps: int = 32, block_size: int = 8,
                  vocab_size: int = 256) -> list[Request]:
    """Requests that exercise prefix hits, block-boundary lengths, chunked prefill and staggered decode.

    With ``bs = block_size`` and a shared prefix ``S`` of ``2 * bs + bs // 2 + 1`` tokens (more than
    two blocks, not block aligned), the first nine requests are:

    ====  =========================  =======  =============================================
    id    prompt                     arrives  why
    ====  =========================  =======  =============================================
    0     S + 3 tokens               0        owns the prefix; finishes after 3 tokens
    1     S + bs tokens              1        prefix hit on live blocks (2 blocks not recomputed)
    2     5 * bs + 3 tokens          0        long prompt, prefilled in chunks
    3     bs - 1 tokens              2        one short of a block
    4     bs tokens                  3        exactly one block
    5     bs + 1 tokens              4        one past a block
    6     request 5's tokens         6        fork of request 5 after its prompt (mid-block):
          + bs // 2 + 2 tokens                copy-on-write of the shared partial block
    7     S + 1 token                7        hit on blocks freed with request 0 (still cached)
    8     request 1's prompt         9        identical prompt: hit on every full block
    ====  =========================  =======  =============================================

    Further requests get random lengths in ``[1, 4 * bs]``. ``max_new_tokens`` varies around
    ``decode_steps`` so requests finish at different steps.

    Returns:
        ``num_requests`` requests (seq ids ``0 .. num_requests - 1``).

    Raises:
        ValueError: ``num_requests < 1``, ``decode_steps < 1``, ``block_size < 1`` or ``vocab_size < 2``.
    """
    for name, value, low in (("num_requests", num_requests, 1), ("decode_steps", decode_steps, 1),
                             ("block_size", block_size, 1), ("vocab_size", vocab_size, 2)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab_size, (n,), generator=gen).tolist())

    bs = block_size
    shared = tokens(2 * bs + bs // 2 + 1)
    prompt1 = shared + tokens(bs)
    templates = [
        (shared + tokens(3), 0, min(3, decode_steps)),
        (prompt1, 1, decode_steps),
        (tokens(5 * bs + 3), 0, max(1, decode_steps - 5)),
        (tokens(max(bs - 1, 1)), 2, max(1, decode_steps - 2)),
        (tokens(bs), 3, max(1, decode_steps // 2)),
        (tokens(bs + 1), 4, max(3, decode_steps)),
        (tokens(bs // 2 + 2), 6, max(1, decode_steps - 4), 5),
        (shared + tokens(1), 7, max(1, decode_steps - 7)),
        (prompt1, 9, max(1, decode_steps // 3)),
    ]
    requests = []
    for i in range(num_requests):
        if i < len(templates):
            prompt, arrival, new, *fork_of = templates[i]
        else:
            length = int(torch.randint(1, 4 * bs + 1, (1,), generator=gen))
            prompt, arrival, fork_of = tokens(length), int(torch.randint(0, 12, (1,), generator=gen)), []
            new = int(torch.randint(1, decode_steps + 1, (1,), generator=gen))
        if fork_of and fork_of[0] >= num_requests:
            fork_of = []
        requests.append(Request(i, prompt, arrival, new, fork_of[0] if fork_of else None))
    return requests


@dataclass
class RequestResult:
    """What the paged run produced for one request.

    Attributes:
        prompt: the full prompt (for a fork: the parent's tokens at the fork, then ``request.prompt``).
        logits: ``{position: float32 [vocab]}`` (on the CPU) for every position the model computed.
        cached_tokens: prompt tokens not computed for this request (prefix-cache hit, or shared by a fork).
        prefill_chunks: model calls that carried part of this request's prompt.
        kv_codes: fp8 cache only: ``{layer: (k, v)}``, the bytes the request's attention read at the
            end (``[n, num_kv_heads, head_dim]``, positions ``0 .. n - 1``), for the oracle.
    """

    request: Request
    prompt: tuple[int, ...] = ()
    generated: list[int] = field(default_factory=list)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    cached_tokens: int = 0
    prefill_chunks: int = 0
    first_step: int = -1
    finish_step: int = -1
    kv_codes: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


class PagedEngine:
    """A minimal continuous-batching engine: one packed model call per step over a PagedKVCache.

    Args:
        model: from :func:`build_model` or :func:`load_model` (``attn_implementation="pagedkv"``).
        backend: object with the contract's ``write_kv`` and ``paged_attention``.
        block_size: tokens per cache block.
        num_blocks: pool size; ``None`` sizes it from the requests (plus the fragmentation dummies).
        chunk_size: most prompt tokens one request prefills per step (chunked prefill).
        fragment: allocate and free dummy sequences first, so blocks come from a scrambled free list.
        poison: run the cache with ``CacheConfig(debug_poison="nan")``: new, allocated and emptied blocks
            hold NaN, so a read of a slot nobody wrote poisons the logits.
        window_left: ``None``, or the window every layer attends through: the cache then releases the
            blocks no later query reads (``CacheConfig.window_left``; :attr:`window_released_peak`).
            Not with an fp8 cache (its oracle reads every position's stored code at the end).
        kv_cache_dtype: ``None`` (pools in the model's dtype) or ``torch.float8_e4m3fn`` /
            ``torch.float8_e5m2``: fp8 pools with per-layer, per-tensor ``k_scale`` / ``v_scale``
            chosen on the first prefill (:attr:`kv_scales`, see :mod:`pagedkv.cli.e2e.fp8`).

    The cache is ``backend.cache_class(config)`` when the backend ships its own cache manager (a
    :class:`PagedKVCache` subclass), else :class:`PagedKVCache`.
    """

    def __init__(self, model: torch.nn.Module, backend: Any, *, block_size: int = 8, num_blocks: int | None = None,
                 chunk_size: int | None = None, fragment: bool = True, poison: bool = True, seed: int = 0,
                 kv_cache_dtype: torch.dtype | None = None, window_left: int | None = None,
                 layer_types: tuple[str, ...] | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if window_left is not None and kv_cache_dtype is not None:
            raise ValueError("window_left (released blocks) and an fp8 cache (whose oracle reads every position's "
                             "stored code at the end) do not go together")
        if layer_types is not None and (window_left is None or kv_cache_dtype is not None):
            raise ValueError("layer_types (KV-cache groups) needs the sliding layers' window_left and no fp8 cache")
        self.window_left = window_left
        self.layer_types = layer_types  # a hybrid model: one KV-cache group per kind (HybridKVCache)
        self.window_released_peak = 0  # most table entries released by the window at once, over the run
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.chunk_size = chunk_size if chunk_size is not None else 2 * block_size - 1
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        self.fragment = fragment
        self.poison = poison
        self.seed = seed
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_scales: dict[int, tuple[float, float]] | None = {} if kv_cache_dtype is not None else None
        self.cache = None
        self.table_width = 0
        self.steps = 0
        self.steps_done = 0  # steps completed so far (for error reports)
        self.tokens_computed = 0

    @staticmethod
    def max_tokens(requests: Sequence[Request]) -> dict[int, int]:
        """``{seq_id: most tokens the sequence can hold}`` (a fork adds its parent's bound).

        Raises:
            ValueError: forks that form a cycle.
        """
        by_id = {r.seq_id: r for r in requests}
        bound: dict[int, int] = {}

        def total(r: Request, seen: tuple[int, ...] = ()) -> int:
            if r.seq_id in seen:
                raise ValueError(f"requests fork in a cycle: {list(seen)}")
            if r.seq_id not in bound:
                parent = total(by_id[r.fork_of], seen + (r.seq_id,)) if r.fork_of is not None else 0
                bound[r.seq_id] = parent + len(r.prompt) + r.max_new_tokens
            return bound[r.seq_id]

        for r in requests:
            total(r)
        return bound

    def _make_cache(self, requests: Sequence[Request]):
        from pagedkv.cache.paged_cache import PagedKVCache
        from pagedkv.cache.config import CacheConfig, blocks_needed

        param = next(self.model.parameters())
        num_layers, num_kv_heads, head_dim = model_geometry(self.model)
        bs = self.block_size
        gen = torch.Generator().manual_seed(self.seed + 1)
        dummies = [int(torch.randint(1, 3 * bs + 1, (1,), generator=gen)) for _ in range(6)] if self.fragment else []
        bounds = self.max_tokens(requests)
        num_blocks = self.num_blocks
        if num_blocks is None:
            need = sum(blocks_needed(n, bs) + 1 for n in bounds.values())  # + 1: a copy-on-write copy
            num_blocks = need + sum(blocks_needed(n, bs) for n in dummies) + 2
        # Block tables are padded to one fixed width for the whole run (vLLM's max_num_blocks_per_req),
        # not to the longest table of the step.
        self.table_width = max((blocks_needed(n, bs) for n in bounds.values()), default=1)
        config = CacheConfig(num_blocks=num_blocks, block_size=bs, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             dtype=param.dtype, device=str(param.device), num_layers=num_layers,
                             kv_cache_dtype=kv_cache_dtype_name(self.kv_cache_dtype) if self.kv_cache_dtype else "auto",
                             window_left=self.window_left, debug_poison="nan" if self.poison else None,
                             layer_types=self.layer_types)
        cache_class = getattr(self.backend, "cache_class", None) or PagedKVCache  # a backend's own cache manager
        if self.layer_types is not None:
            from pagedkv.cache.hybrid import HybridKVCache

            cache_class = HybridKVCache
        cache = cache_class(config)
        # Earlier traffic: dummies allocated in turn, every other one freed, the rest live throughout.
        # Nothing is written for them, so nothing is committed: their blocks cache nothing (a freed
        # dummy's blocks go back to the free list). Their ids lie outside the vocabulary.
        for i, n in enumerate(dummies):
            sid = -1 - i
            cache.add_sequence(sid, ())
            cache.append(sid, [_DUMMY_TOKEN_OFFSET + 31 * i + j for j in range(n)])
        for i in range(0, len(dummies), 2):
            cache.free(-1 - i)
        return cache

    def _codes(self, sid: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The fp8 bytes of every position of ``sid`` in every layer (what its attention read)."""
        cache = self.cache
        table, n = list(cache.block_table(sid).tolist()), int(cache.seq_lens([sid])[0])
        return {layer: (gather_codes(cache.k_cache(layer), table, n), gather_codes(cache.v_cache(layer), table, n))
                for layer in range(cache.config.num_layers)}

    @torch.no_grad()
    def run(self, requests: Sequence[Request], max_steps: int = 100_000) -> dict[int, RequestResult]:
        """Serve ``requests`` to completion (greedy decoding); returns ``{seq_id: RequestResult}``.

        Each step: admit arrived requests (``add_sequence`` with its prefix-cache lookup, or ``fork``
        once the parent's prompt is done), give every running request its next prompt chunk (at
        most ``chunk_size`` tokens) or its last generated token, ``append`` them, run the model once
        on the packed batch, sample greedily where a prompt is complete, free finished requests.

        Raises:
            ValueError: duplicate or negative seq ids (negative ids are the dummies), an empty prompt
                (allowed only for a fork), ``max_new_tokens < 1``, a fork whose parent is unknown or
                finished before the fork could happen, forks in a cycle.
            OutOfBlocksError: the pool is too small (this engine does not preempt).
            RuntimeError: not finished after ``max_steps`` steps.
        """
        ids = [r.seq_id for r in requests]
        if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
            raise ValueError(f"seq ids must be distinct and >= 0, got {ids}")
        for r in requests:
            if (len(r.prompt) == 0 and r.fork_of is None) or r.max_new_tokens < 1:
                raise ValueError(f"request {r.seq_id}: needs a non-empty prompt and max_new_tokens >= 1")
            if r.fork_of is not None and (r.fork_of not in ids or r.fork_of == r.seq_id):
                raise ValueError(f"request {r.seq_id}: fork_of={r.fork_of} is not another request")
        self.max_tokens(requests)  # rejects fork cycles before anything is allocated
        cache = self.cache = self._make_cache(requests)
        device = cache.config.device
        results = {r.seq_id: RequestResult(r, r.prompt) for r in requests}
        waiting = sorted(requests, key=lambda r: (r.arrival, r.seq_id))
        running: list[int] = []
        finished: set[int] = set()
        computed: dict[int, int] = {}  # tokens of (prompt + generated) whose K/V is in the cache
        step = 0
        while waiting or running:
            if step >= max_steps:
                raise RuntimeError(f"not finished after {max_steps} steps")
            for req in [r for r in waiting if r.arrival <= step]:  # admit
                res = results[req.seq_id]
                if req.fork_of is not None:
                    parent = results[req.fork_of]
                    if req.fork_of in finished:
                        raise ValueError(f"request {req.seq_id}: parent {req.fork_of} finished before the fork")
                    if req.fork_of not in running or computed[req.fork_of] < len(parent.prompt):
                        continue  # wait until the parent's prompt is in the cache
                    base = (parent.prompt + tuple(parent.generated))[: computed[req.fork_of]]
                    cache.fork(req.fork_of, req.seq_id)
                    res.prompt = base + req.prompt
                    cached = len(base)
                else:
                    cached = cache.add_sequence(req.seq_id, req.prompt)  # prefix-cache lookup
                waiting.remove(req)
                res.cached_tokens = cached
                res.first_step = step
                computed[req.seq_id] = cached
                running.append(req.seq_id)
            if not running:
                step += 1
                continue
            batch_ids, input_ids, positions, slots, q_lens = [], [], [], [], []
            for sid in running:
                res = results[sid]
                done = computed[sid]
                if done < len(res.prompt):  # (chunked) prefill of the uncached rest of the prompt
                    new = list(res.prompt[done: done + self.chunk_size])
                    res.prefill_chunks += 1
                else:  # decode: feed the last generated token
                    new = [res.generated[-1]]
                slots.append(cache.append(sid, new))
                batch_ids.append(sid)
                input_ids.extend(new)
                positions.extend(range(done, done + len(new)))
                q_lens.append(len(new))
            qsl = [0]
            for n in q_lens:
                qsl.append(qsl[-1] + n)
            hybrid = self.layer_types is not None
            ctx = StepContext(cache=cache, backend=self.backend,
                              slot_mapping=[torch.cat([s[g] for s in slots]) for g in range(len(cache.groups))]
                              if hybrid else torch.cat(slots).to(torch.int64),
                              block_tables=[cache.block_tables(batch_ids, width=self.table_width, group=g)
                                            for g in range(len(cache.groups))] if hybrid else
                              cache.block_tables(batch_ids, width=self.table_width),
                              layer_group=[cache.group_of(layer) for layer in range(cache.config.num_layers)]
                              if hybrid else None,
                              seq_lens=cache.seq_lens(batch_ids),
                              query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                              kv_scales=self.kv_scales)
            out = self.model(input_ids=torch.tensor([input_ids], device=device),
                             position_ids=torch.tensor([positions], device=device), use_cache=False,
                             **{STEP_KWARG: ctx})
            logits = out.logits[0].float().cpu()  # [total_q, vocab]
            for sid in batch_ids:  # every layer's K/V of this step is written: commit it (prefix cache)
                cache.mark_written(sid)
            self.tokens_computed += len(input_ids)
            for b, sid in enumerate(batch_ids):
                res = results[sid]
                lo, hi = qsl[b], qsl[b + 1]
                start = computed[sid]
                for j in range(hi - lo):
                    res.logits[start + j] = logits[lo + j].clone()
                computed[sid] = start + hi - lo
                if computed[sid] >= len(res.prompt):  # prompt done: sample the next token
                    res.generated.append(int(torch.argmax(logits[hi - 1])))
                    if len(res.generated) >= res.request.max_new_tokens:
                        if self.kv_scales is not None:
                            res.kv_codes = self._codes(sid)
                        cache.free(sid)
                        running.remove(sid)
                        finished.add(sid)
                        res.finish_step = step
            self.window_released_peak = max(self.window_released_peak, cache.stats()["window_released_live"])
            step += 1
            self.steps_done = step
        self.steps = step
        cache.check_invariants()
        return results
