"""End to end: a transformers causal LM whose attention is served from a :class:`PagedKVCache`.

The model is a ``transformers`` Llama-architecture causal LM (by default a small
``LlamaForCausalLM`` with seeded random weights: RoPE, GQA, RMSNorm, SwiGLU; or any local checkpoint
directory of a decoder-only model whose attention goes through transformers' ``AttentionInterface``).
Its attention is replaced, not wrapped: :func:`register_attention` registers ``"pagedkv"`` with
``transformers.AttentionInterface`` and the model is built with ``attn_implementation="pagedkv"``.
Transformers then builds no mask and keeps no cache of its own (every call is ``use_cache=False``);
for every layer the registered function

1. writes the step's new K and V (after RoPE) into the layer's pools with the backend's
   ``write_kv(k_cache, v_cache, key, value, slot_mapping)``, and
2. computes causal varlen attention with the backend's ``paged_attention(query, k_cache, v_cache,
   block_tables, seq_lens, query_start_loc, scale)`` straight from the blocks,

using a :class:`StepContext` passed to the model as the keyword argument ``pagedkv_step`` (transformers
forwards unknown keyword arguments down to the attention function, as its own continuous batching
does with ``cu_seq_lens_q`` and the block table).

Every step is one packed varlen batch, as in vLLM and transformers' continuous batching: the new
tokens of all running requests are concatenated into ``input_ids [1, total_q]`` with their absolute
``position_ids [1, total_q]`` (RoPE needs them); ``query_start_loc`` splits the rows per request.

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
  can need, as vLLM pads to ``max_num_blocks_per_req``), not to the step's longest table.

A backend that raises during the run (a validation error, an out-of-range index) fails the check
with that error in the report.

The oracle (:func:`dense_oracle`) is transformers itself: a copy of the same model with
``attn_implementation="eager"`` runs each request's full token sequence (prompt + generated tokens)
densely, in float64. Per request it reports the max ``|logit|`` difference over every position the
paged run computed, and whether every paged greedy token is the dense argmax at its position. The
dense run is teacher-forced on the paged tokens, so "every paged token is the dense argmax" is the
same statement as "dense greedy decoding from the prompt produces exactly the paged tokens".

Tolerance on the logits (``E2E_LOGIT_TOLERANCE``): absolute, multiplied by ``max(1, max|dense
logit|)`` of the request (the random model's logits reach about 6). Measured with the default
scenario over seeds 0-3 against the float64 oracle:

========  =========  ========  ===============================================================
dtype     tolerance  observed  why
========  =========  ========  ===============================================================
float32   5e-5       3e-6      float32 rounding through the layers (paged attention sums in a
                               different order than eager attention, the MLPs see a packed
                               batch); ~15x headroom
float16   2.5e-2     6.5e-3    the whole model runs in float16 (eps 9.8e-4): every matmul,
                               norm and residual add rounds; ~4x headroom
bfloat16  1.5e-1     4.4e-2    as float16 with bfloat16's 8x coarser eps (7.8e-3); ~3x headroom
========  =========  ========  ===============================================================

The half-precision budgets measure the model's own rounding against float64, not the cache: the
cache's data movement is bit-exact (the property suite proves it bitwise). A broken attention path
(causal offset ignored, GQA heads mapped with ``h % num_kv_heads``, a wrong block) moves the logits
by 7-10, far beyond every budget, and changes the greedy tokens of every request.

Greedy tokens: every paged token must be the dense argmax at its position. In float16 and bfloat16
a random model's top two logits are often closer than the dtype's rounding (bfloat16 logits are
quantized to ~0.03 at magnitude 4, so exact ties occur), so a few tokens flip against *any*
oracle. transformers' own dense bfloat16 run does the same: on the default scenario its eager
(sdpa) attention is off the float64 run by up to 0.28 (0.24) and flips 6 of 203 greedy tokens;
the paged bfloat16 run is off by 0.26 and flips 8. Such a difference is a *near tie* when the dense
top logit leads the paged token's dense logit by at most twice the logit error observed at that
position (and that error is within tolerance): rounding alone explains the swap. Near ties are
counted apart: by default any token difference fails (the exit status is 1), and
``--allow-near-ties`` accepts near ties while still failing any other difference. Because the oracle is
teacher-forced, positions after a near tie are still compared on identical inputs. The last line
``tokens identical: yes|no`` is always the strict statement.

Command line: ``python -m pagedkv e2e [--backend NAME | --impl module:attr] [--device cpu|cuda]
[--dtype float32|bfloat16|float16] [--model DIR] [--seed N] [--requests N] [--decode-steps N]
[--block-size N] [--allow-near-ties]``; exit status 0 when the logits are within tolerance and the
greedy tokens are identical (or differ only at near ties, with ``--allow-near-ties``), 1 otherwise, 2 for
a usage or setup error.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

#: attention implementation name registered with ``transformers.AttentionInterface``.
ATTN_IMPLEMENTATION = "pagedkv"

#: keyword argument that carries the :class:`StepContext` through the model's forward.
STEP_KWARG = "pagedkv_step"

#: absolute logit tolerance per run dtype, multiplied by ``max(1, max|dense logit|)`` (see module doc).
E2E_LOGIT_TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 5e-5,
    torch.float16: 2.5e-2,
    torch.bfloat16: 1.5e-1,
}

#: token ids of the pre-fragmentation dummies start here: outside any vocabulary, so they never match
#: a real prompt in the prefix cache (and are never fed to the model).
_DUMMY_TOKEN_OFFSET = 1_000_000


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("pagedkv.cli.e2e needs transformers: pip install 'pagedkv[hf]'") from exc
    return transformers


# -- the attention hook -------------------------------------------------------------------------------
@dataclass
class StepContext:
    """What the attention function of every layer needs for one packed step.

    Attributes:
        cache: the :class:`pagedkv.cache.PagedKVCache`; layer ``l`` uses ``cache.k_cache(l)``/``v_cache(l)``.
        backend: any object with the contract's ``write_kv`` and ``paged_attention``.
        slot_mapping: ``int64 [total_q]``, where each new token's K/V goes.
        block_tables: ``int32 [batch, max_blocks]``, ``-1``-padded, *after* this step's ``append``.
        seq_lens: ``int32 [batch]``, context lengths including this step's tokens.
        query_start_loc: ``int32 [batch + 1]``, row offsets of each request in the packed batch.
    """

    cache: Any
    backend: Any
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


def pagedkv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, scaling: float | None = None,
                              dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function backed by pagedkv (registered as ``"pagedkv"``).

    Args:
        module: the attention module; its ``layer_idx`` selects the layer's pools.
        query: ``[1, num_q_heads, total_q, head_dim]`` (after RoPE), the packed step.
        key, value: ``[1, num_kv_heads, total_q, head_dim]``, the step's new K/V only.
        attention_mask: ignored (transformers builds none for this implementation; causality and
            request boundaries come from ``seq_lens`` / ``query_start_loc``).
        scaling: logits multiplier (the model's ``head_dim ** -0.5``).
        dropout: must be 0 (inference only).
        kwargs: must hold ``pagedkv_step``, a :class:`StepContext`.

    Returns:
        ``([1, total_q, num_q_heads, head_dim], None)`` in ``query.dtype``, as transformers expects.

    Raises:
        ValueError: no ``pagedkv_step`` keyword, a batch dimension other than 1, non-zero dropout, or
            a module without ``layer_idx``. The backend's own errors propagate unchanged.
    """
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, StepContext):
        raise ValueError(f"attention implementation {ATTN_IMPLEMENTATION!r} needs the keyword argument "
                         f"{STEP_KWARG}=StepContext(...) in the model call, got {type(step).__name__}")
    if query.shape[0] != 1:
        raise ValueError(f"pagedkv attention expects a packed batch of 1, got query batch {query.shape[0]}")
    if dropout:
        raise ValueError(f"pagedkv attention is inference only, got dropout={dropout}")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx; cannot pick the layer's K/V pools")
    cache = step.cache
    k_cache, v_cache = cache.k_cache(layer), cache.v_cache(layer)
    q = query[0].transpose(0, 1).contiguous()  # [total_q, Hq, D]
    k = key[0].transpose(0, 1).contiguous()  # [total_q, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()
    step.backend.write_kv(k_cache, v_cache, k, v, step.slot_mapping)
    out = step.backend.paged_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens,
                                       step.query_start_loc, scaling)
    return out.unsqueeze(0), None


def register_attention() -> str:
    """Register :func:`pagedkv_attention_forward` as ``"pagedkv"`` with transformers (idempotent).

    Returns:
        The implementation name, for ``attn_implementation=``.

    Raises:
        ImportError: transformers is not installed.
    """
    _require_transformers()
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, pagedkv_attention_forward)
    return ATTN_IMPLEMENTATION


# -- models -------------------------------------------------------------------------------------------
def build_model(*, seed: int = 0, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 2,
                num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                initializer_range: float = 0.2, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> torch.nn.Module:
    """A small ``LlamaForCausalLM`` with seeded random weights, attention served by pagedkv.

    ``initializer_range`` is larger than a trained model's init (0.02) so that attention is sharp
    (far from uniform): a wrong key or a missing causal offset then changes the output visibly.

    Returns:
        The model in eval mode, in ``dtype`` on ``device``, ``config._attn_implementation == "pagedkv"``.

    Raises:
        ImportError: transformers is not installed. ValueError: heads that do not divide.
    """
    _require_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size {hidden_size}, num_heads {num_heads}, num_kv_heads {num_kv_heads} must divide")
    register_attention()
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=4096,
                         initializer_range=initializer_range, tie_word_embeddings=False)
    config._attn_implementation = ATTN_IMPLEMENTATION
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def load_model(path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """Load a local causal-LM checkpoint directory with pagedkv attention (no network access).

    Raises:
        ImportError: transformers is not installed. OSError: ``path`` is not a directory or not a
            loadable checkpoint.
        ValueError: the model uses sliding-window attention (pagedkv attention is full causal).
    """
    _require_transformers()
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise OSError(f"model directory {path!r} does not exist (only local checkpoints are loaded)")
    register_attention()
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation=ATTN_IMPLEMENTATION)
    window = getattr(model.config, "sliding_window", None)
    if window is not None and getattr(model.config, "use_sliding_window", True):
        raise ValueError(f"{path}: sliding_window={window} is not supported (pagedkv attention is full causal)")
    return model.to(device=device, dtype=dtype).eval()


def model_geometry(model: torch.nn.Module) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers decoder-only model."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


# -- the scenario -------------------------------------------------------------------------------------
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
    """

    request: Request
    prompt: tuple[int, ...] = ()
    generated: list[int] = field(default_factory=list)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    cached_tokens: int = 0
    prefill_chunks: int = 0
    first_step: int = -1
    finish_step: int = -1


class PagedEngine:
    """A minimal continuous-batching engine: one packed model call per step over a PagedKVCache.

    Args:
        model: from :func:`build_model` or :func:`load_model` (``attn_implementation="pagedkv"``).
        backend: object with the contract's ``write_kv`` and ``paged_attention``.
        block_size: tokens per cache block.
        num_blocks: pool size; ``None`` sizes it from the requests (plus the fragmentation dummies).
        chunk_size: most prompt tokens one request prefills per step (chunked prefill).
        fragment: allocate and free dummy sequences first, so blocks come from a scrambled free list.
        poison: fill the pools with NaN first, so a read of an unowned slot poisons the logits.

    The cache is ``backend.cache_class(config)`` when the backend ships its own cache manager (a
    :class:`PagedKVCache` subclass), else :class:`PagedKVCache`.
    """

    def __init__(self, model: torch.nn.Module, backend: Any, *, block_size: int = 8, num_blocks: int | None = None,
                 chunk_size: int | None = None, fragment: bool = True, poison: bool = True, seed: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
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
        from pagedkv.cache import PagedKVCache
        from pagedkv.config import CacheConfig, blocks_needed

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
                             dtype=param.dtype, device=str(param.device), num_layers=num_layers)
        cache_class = getattr(self.backend, "cache_class", None) or PagedKVCache  # a backend's own cache manager
        cache = cache_class(config)
        if self.poison:
            cache.kv.fill_(float("nan"))
        # Earlier traffic: dummies allocated in turn, every other one freed (their full blocks stay
        # cached but evictable), the rest live throughout. Their ids lie outside the vocabulary.
        for i, n in enumerate(dummies):
            sid = -1 - i
            cache.add_sequence(sid, ())
            cache.append(sid, [_DUMMY_TOKEN_OFFSET + 31 * i + j for j in range(n)])
        for i in range(0, len(dummies), 2):
            cache.free(-1 - i)
        return cache

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
            ctx = StepContext(cache=cache, backend=self.backend, slot_mapping=torch.cat(slots).to(torch.int64),
                              block_tables=cache.block_tables(batch_ids, width=self.table_width),
                              seq_lens=cache.seq_lens(batch_ids),
                              query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device))
            out = self.model(input_ids=torch.tensor([input_ids], device=device),
                             position_ids=torch.tensor([positions], device=device), use_cache=False,
                             **{STEP_KWARG: ctx})
            logits = out.logits[0].float().cpu()  # [total_q, vocab]
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
                        cache.free(sid)
                        running.remove(sid)
                        finished.add(sid)
                        res.finish_step = step
            step += 1
            self.steps_done = step
        self.steps = step
        cache.check_invariants()
        return results


# -- the oracle ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenMismatch:
    """A paged greedy token that is not the dense argmax: generated token ``index`` at ``position``."""

    index: int
    position: int
    paged: int
    dense: int
    margin: float  # dense logit of the dense argmax minus dense logit of the paged token (>= 0)
    row_diff: float  # max |paged - dense| logit at this position

    def describe(self) -> str:
        return (f"generated token {self.index} (position {self.position}): paged {self.paged}, "
                f"dense {self.dense}, dense margin {self.margin:.3g}, logit diff there {self.row_diff:.3g}")


@dataclass
class RequestCheck:
    """Paged vs dense for one request: max logit diff, the greedy-token verdict, and bookkeeping.

    Attributes:
        max_logit_diff: max ``|paged - dense|`` over every position the paged run computed (inf on NaN).
        max_abs_logit: max ``|dense logit|`` at those positions (scales the tolerance).
        mismatches: every paged greedy token that differs from the dense argmax at its position.
    """

    seq_id: int
    prompt_len: int
    cached_tokens: int
    prefill_chunks: int
    generated: int
    steps: tuple[int, int]
    max_logit_diff: float
    max_abs_logit: float
    mismatches: list[TokenMismatch] = field(default_factory=list)

    @property
    def tokens_identical(self) -> bool:
        return not self.mismatches


def dense_model(model: torch.nn.Module, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A copy of ``model`` with transformers' own eager attention, in ``dtype`` (the oracle)."""
    dense = copy.deepcopy(model).to(dtype=dtype)
    if hasattr(dense, "set_attn_implementation"):
        dense.set_attn_implementation("eager")
    else:  # older transformers
        dense.config._attn_implementation = "eager"
    return dense.eval()


@torch.no_grad()
def dense_oracle(model: torch.nn.Module, results: dict[int, RequestResult],
                 dtype: torch.dtype = torch.float64) -> list[RequestCheck]:
    """Run each request's prompt + generated tokens densely and compare with the paged run.

    The dense run is teacher-forced on the paged tokens, so "no mismatches" is exactly "dense greedy
    decoding from the prompt reproduces the paged tokens", and after a mismatch the later positions
    are still compared on the same inputs.

    Args:
        model: the paged model (copied, not modified).
        results: :meth:`PagedEngine.run`'s output.
        dtype: the dense run's dtype (float64: the truth the paged run is judged against).

    Returns:
        One :class:`RequestCheck` per request, in seq id order.
    """
    dense = dense_model(model, dtype)
    device = next(dense.parameters()).device
    checks = []
    for sid in sorted(results):
        res = results[sid]
        prompt = list(res.prompt)
        ids = prompt + res.generated
        logits = dense(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].double().cpu()
        positions = sorted(res.logits)
        paged = torch.stack([res.logits[p] for p in positions]).double()
        ref = logits[positions]
        row_diff = (paged - ref).abs().amax(dim=1).nan_to_num(nan=float("inf"))
        diff = float(row_diff.max())
        row_of = {p: i for i, p in enumerate(positions)}
        mismatches = []
        for j, token in enumerate(res.generated):
            p = len(prompt) - 1 + j
            want = int(torch.argmax(logits[p]))
            if want != token:
                mismatches.append(TokenMismatch(j, p, token, want, float(logits[p, want] - logits[p, token]),
                                                float(row_diff[row_of[p]])))
        checks.append(RequestCheck(sid, len(prompt), res.cached_tokens, res.prefill_chunks, len(res.generated),
                                   (res.first_step, res.finish_step), diff, float(ref.abs().max()), mismatches))
    return checks


@dataclass
class E2EReport:
    """Outcome of :func:`run_e2e`.

    ``ok`` means: every request's logit diff is within tolerance, and every greedy token equals the
    dense argmax, except (unless ``strict_tokens``) at a *near tie*: the dense top logit leads the
    paged token's dense logit by at most twice the logit error observed at that very position (and
    that error is within tolerance), so rounding alone explains the swap.
    """

    backend: str
    dtype: torch.dtype
    device: str
    checks: list[RequestCheck]
    tolerance: float
    steps: int
    tokens_computed: int
    cache_stats: dict[str, float]
    seconds: float
    strict_tokens: bool = True
    error: str = ""  # the paged run raised (backend or cache manager fault): no checks, not ok

    @property
    def max_logit_diff(self) -> float:
        if self.error:
            return float("inf")
        return max((c.max_logit_diff for c in self.checks), default=0.0)

    @property
    def tokens_identical(self) -> bool:
        return not self.error and all(c.tokens_identical for c in self.checks)

    def allowed(self, check: RequestCheck) -> float:
        """The absolute logit tolerance for one request (scaled by its largest dense logit)."""
        return self.tolerance * max(1.0, check.max_abs_logit)

    def is_near_tie(self, check: RequestCheck, mismatch: TokenMismatch) -> bool:
        """Whether rounding explains ``mismatch``: margin <= 2 x the (tolerated) logit error there."""
        return mismatch.row_diff <= self.allowed(check) and mismatch.margin <= 2 * mismatch.row_diff

    @property
    def within_tolerance(self) -> bool:
        return not self.error and all(math.isfinite(c.max_logit_diff) and c.max_logit_diff <= self.allowed(c) for c in self.checks)

    @property
    def tokens_ok(self) -> bool:
        if self.error:
            return False
        if self.strict_tokens:
            return self.tokens_identical
        return all(self.is_near_tie(c, m) for c in self.checks for m in c.mismatches)

    @property
    def ok(self) -> bool:
        return self.tokens_ok and self.within_tolerance

    def _verdict(self, check: RequestCheck) -> str:
        if check.tokens_identical:
            return "yes"
        ties = sum(self.is_near_tie(check, m) for m in check.mismatches)
        bad = [m for m in check.mismatches if not self.is_near_tie(check, m)]
        first = bad[0] if bad else check.mismatches[0]
        kind = f"{len(bad)} differ, {ties} near ties" if bad else f"{ties} near ties"
        return f"no ({kind}; first: {first.describe()})"

    def lines(self) -> list[str]:
        """The human-readable report; the last line is ``e2e: max |logit diff| X, tokens identical: yes|no``."""
        s = self.cache_stats
        if self.error:
            return [f"backend {self.backend}, dtype {str(self.dtype).removeprefix('torch.')}, device {self.device}: "
                    f"the paged run failed: {self.error}",
                    "e2e: max |logit diff| inf, tokens identical: no"]
        out = [f"backend {self.backend}, dtype {str(self.dtype).removeprefix('torch.')}, device {self.device}: "
               f"{len(self.checks)} requests, {self.steps} steps, {self.tokens_computed} tokens computed, "
               f"{int(s['cached_tokens'])} prompt tokens from the prefix cache, "
               f"{int(s['cow_copies'])} copy-on-write copies, {int(s['evictions'])} evictions "
               f"({self.seconds:.1f} s)",
               f"{'req':>4} {'prompt':>6} {'cached':>6} {'chunks':>6} {'new':>4} {'steps':>9} "
               f"{'max|logit diff|':>16} {'allowed':>9}  tokens identical"]
        for c in self.checks:
            out.append(f"{c.seq_id:>4} {c.prompt_len:>6} {c.cached_tokens:>6} {c.prefill_chunks:>6} "
                       f"{c.generated:>4} {c.steps[0]:>4}-{c.steps[1]:<4} {c.max_logit_diff:>16.3e} "
                       f"{self.allowed(c):>9.2e}  {self._verdict(c)}")
        if not self.tokens_identical and self.tokens_ok:
            out.append("greedy tokens differ only at near ties (dense margin <= 2 x the logit error there): "
                       "accepted only with --allow-near-ties")
        if not self.within_tolerance:
            out.append(f"logit diff exceeds the {str(self.dtype).removeprefix('torch.')} tolerance "
                       f"{self.tolerance:g} x max(1, max|dense logit|)")
        out.append(f"e2e: max |logit diff| {self.max_logit_diff:.3e}, "
                   f"tokens identical: {'yes' if self.tokens_identical else 'no'}")
        return out


def run_e2e(backend: Any = "indexed", *, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
            model: torch.nn.Module | str | None = None, seed: int = 0, num_requests: int = 9,
            decode_steps: int = 32, block_size: int = 8, chunk_size: int | None = None,
            model_kwargs: dict | None = None, strict_tokens: bool = True) -> E2EReport:
    """Build (or load) the model, serve the scenario from a PagedKVCache, check it against dense.

    Args:
        backend: a built-in name, a ``"module:attr"`` spec, or a backend object.
        dtype: ``float32`` / ``bfloat16`` / ``float16`` (name or torch dtype): model and cache dtype.
        device: ``"cpu"`` or ``"cuda"`` (or ``"cuda:N"``).
        model: ``None`` (a seeded random Llama, see :func:`build_model`), a local checkpoint
            directory, or a model already built with ``attn_implementation="pagedkv"``.
        model_kwargs: extra :func:`build_model` arguments (``num_layers``, ``hidden_size``, ...).
        strict_tokens: reject near-tie token differences too (see :class:`E2EReport`).

    Returns:
        An :class:`E2EReport`.

    Raises:
        ImportError: transformers is missing. BackendError: unknown backend / spec.
        DTypeMismatchError: unsupported dtype. ValueError: bad scenario sizes or CUDA unavailable.
    """
    from pagedkv.backends import backend_name, get_backend, load_backend
    from pagedkv.config import dtype_from_name

    dtype = dtype_from_name(dtype)
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if isinstance(backend, str):
        backend = get_backend(backend) if ":" not in backend and "." not in backend else load_backend(backend)
    for op in ("write_kv", "paged_attention"):
        if not callable(getattr(backend, op, None)):
            from pagedkv.errors import BackendError
            raise BackendError(f"backend {backend_name(backend)} has no callable {op!r}; e2e needs write_kv "
                               "and paged_attention")
    if model is None:
        model = build_model(seed=seed, dtype=dtype, device=device, **(model_kwargs or {}))
    elif isinstance(model, str):
        model = load_model(model, dtype=dtype, device=device)
    else:
        register_attention()
    vocab = model.config.vocab_size
    requests = make_scenario(seed=seed, num_requests=num_requests, decode_steps=decode_steps,
                             block_size=block_size, vocab_size=vocab)
    t0 = time.perf_counter()
    engine = PagedEngine(model, backend, block_size=block_size, chunk_size=chunk_size, seed=seed)
    try:
        results = engine.run(requests)
    except Exception as exc:  # the backend (or its cache manager) failed mid-run: a failed check
        error = f"{type(exc).__name__} at step {engine.steps_done}: {exc}"
        return E2EReport(backend_name(backend), dtype, str(device), [], E2E_LOGIT_TOLERANCE[dtype], engine.steps_done,
                         engine.tokens_computed, engine.cache.stats() if engine.cache is not None else {},
                         time.perf_counter() - t0, strict_tokens, error)
    seconds = time.perf_counter() - t0
    checks = dense_oracle(model, results)
    return E2EReport(backend_name(backend), dtype, str(device), checks, E2E_LOGIT_TOLERANCE[dtype], engine.steps,
                     engine.tokens_computed, engine.cache.stats(), seconds, strict_tokens)


# -- command line -------------------------------------------------------------------------------------
def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``e2e`` with its arguments and ``func=run``."""
    p = subparsers.add_parser(
        "e2e", help="serve a transformers Llama model from the paged cache and check it against dense",
        description="Run a small Llama-architecture causal LM (seeded random weights, or --model DIR) with "
                    "its attention served from a PagedKVCache (prefix hits, a fork with copy-on-write, "
                    "chunked prefill, staggered greedy decode on a fragmented pool) and compare logits and "
                    "greedy tokens with transformers' own dense eager attention in float64. Exit 0 when "
                    "the logits are within the dtype's tolerance and the greedy tokens are identical "
                    "(near ties accepted with --allow-near-ties), 1 otherwise, 2 on a usage or setup error.")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--backend", default=None, help="built-in backend: loop, indexed or triton (default indexed)")
    which.add_argument("--impl", default=None, metavar="MODULE:ATTR", help="a candidate backend to load")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--model", default=None, metavar="DIR", help="local checkpoint directory (no download)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts seed (default 0)")
    p.add_argument("--requests", type=int, default=9, help="number of requests (default 9; the fork with copy-on-write is request 7, so fewer than 7 have none)")
    p.add_argument("--decode-steps", type=int, default=32, help="tokens generated by the longest requests (default 32)")
    p.add_argument("--block-size", type=int, default=8, help="tokens per cache block (default 8)")
    p.add_argument("--allow-near-ties", action="store_true",
                   help="accept greedy token differences where the dense top-2 logits are closer than the "
                        "rounding error measured there (float16/bfloat16 runs of a random model have some)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the ``e2e`` subcommand; print the report; 0 ok, 1 mismatch, 2 usage error."""
    from pagedkv.errors import PagedKVError

    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        print(f"e2e: error: --device must be cpu or cuda, got {args.device!r}", file=sys.stderr)
        return 2
    try:
        report = run_e2e(args.impl or args.backend or "indexed", dtype=args.dtype, device=args.device,
                         model=args.model, seed=args.seed, num_requests=args.requests,
                         decode_steps=args.decode_steps, block_size=args.block_size,
                         strict_tokens=not args.allow_near_ties)
    except ImportError as exc:
        print(f"e2e: error: {exc}", file=sys.stderr)
        return 2
    except (PagedKVError, ValueError, OSError) as exc:
        print(f"e2e: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1
