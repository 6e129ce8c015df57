"""End to end: a transformers causal LM whose attention is served from a :class:`PagedKVCache`,
checked against transformers' own dense run.

One concept a module:

- :mod:`pagedkv.cli.e2e.model`: the attention hookup (``StepContext``, the ``"pagedkv"`` attention
  function registered with transformers), building or loading the model;
- :mod:`pagedkv.cli.e2e.scenario`: the requests (:func:`make_scenario`) and the engine that serves
  them from the cache (:class:`PagedEngine`);
- :mod:`pagedkv.cli.e2e.oracle`: the float64 dense oracle, the tolerance and the report;
- :mod:`pagedkv.cli.e2e.fp8`: the fp8 cache's scales and the oracle's quantize -> dequantize round trip;
- this module: :func:`run_e2e`, which ties them together, and the command line.

Command line: ``python -m pagedkv e2e [--backend NAME | --impl module:attr] [--device cpu|cuda]
[--dtype float32|bfloat16|float16] [--arch llama|mistral|gemma2|deepseek_v3] [--sliding-window N]
[--kv-cache-dtype auto|fp8|fp8_e4m3|fp8_e5m2] [--model DIR] [--seed N] [--requests N]
[--decode-steps N] [--block-size N] [--allow-near-ties]``; exit status 0 when the logits are within tolerance and the
greedy tokens are identical (or differ only at near ties, with ``--allow-near-ties``), 1 otherwise, 2 for
a usage or setup error.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from pagedkv.cli.e2e.fp8 import (KV_CACHE_DTYPES, Fp8OracleStep, kv_cache_dtype_from_name,  # noqa: F401
                                 kv_cache_dtype_name)
from pagedkv.cli.e2e.model import (ARCHS, ATTN_IMPLEMENTATION, DEFAULT_SLIDING_WINDOW, STEP_KWARG,  # noqa: F401
                                   StepContext, build_model, every_layer_window_left, load_model, model_geometry,
                                   install_latent_attention, is_mla, pagedkv_attention_forward,
                                   register_attention)
from pagedkv.cli.e2e.oracle import (E2E_LOGIT_TOLERANCE, E2EReport, RequestCheck, TokenMismatch,  # noqa: F401
                                    dense_model, dense_oracle)
from pagedkv.cli.e2e.scenario import PagedEngine, Request, RequestResult, make_scenario  # noqa: F401


def run_e2e(backend: Any = "indexed", *, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
            model: torch.nn.Module | str | None = None, seed: int = 0, num_requests: int = 9,
            decode_steps: int = 32, block_size: int = 8, chunk_size: int | None = None,
            model_kwargs: dict | None = None, strict_tokens: bool = True, arch: str = "llama",
            kv_cache_dtype: str | torch.dtype | None = None, release_window_blocks: bool = True) -> E2EReport:
    """Build (or load) the model, serve the scenario from a PagedKVCache, check it against dense.

    Args:
        backend: a built-in name, a ``"module:attr"`` spec, or a backend object.
        dtype: ``float32`` / ``bfloat16`` / ``float16`` (name or torch dtype): model and cache dtype.
        device: ``"cpu"`` or ``"cuda"`` (or ``"cuda:N"``).
        model: ``None`` (a seeded random Llama, see :func:`build_model`), a local checkpoint
            directory, or a model already built with ``attn_implementation="pagedkv"``.
        model_kwargs: extra :func:`build_model` arguments (``num_layers``, ``hidden_size``,
            ``sliding_window``, ...).
        arch: the random model's architecture (:data:`ARCHS`: ``llama``; ``mistral``, sliding window;
            ``gemma2``, sliding window and soft-capping); ignored for a given or loaded ``model``.
        kv_cache_dtype: ``None`` / ``"auto"`` (pools in ``dtype``), ``"fp8_e4m3"`` (or ``"fp8"``) or
            ``"fp8_e5m2"``: fp8 pools with scales from the first prefill, judged against the dense run
            with the same quantize -> dequantize round trip (see :mod:`pagedkv.cli.e2e.fp8`); the max
            logit diff against the unquantized dense run is reported as information.
        strict_tokens: reject near-tie token differences too (see :class:`E2EReport`).
        release_window_blocks: when every layer slides (Mistral; :func:`every_layer_window_left`) and
            the pools are not fp8, run the cache with ``CacheConfig.window_left``: it releases the
            blocks no later query reads, and the report says how many.

    Returns:
        An :class:`E2EReport`.

    Raises:
        ImportError: transformers is missing. BackendError: unknown backend / spec.
        DTypeMismatchError: unsupported dtype. ValueError: bad scenario sizes or CUDA unavailable.
    """
    from pagedkv.backends import backend_name, get_backend, load_backend
    from pagedkv.cache.config import dtype_from_name

    dtype = dtype_from_name(dtype)
    kv_dtype = kv_cache_dtype_from_name(kv_cache_dtype)
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
        model = build_model(arch=arch, seed=seed, dtype=dtype, device=device, **(model_kwargs or {}))
    elif isinstance(model, str):
        model = load_model(model, dtype=dtype, device=device)
    else:
        register_attention()
    if is_mla(model):
        install_latent_attention(model)
    vocab = model.config.vocab_size
    requests = make_scenario(seed=seed, num_requests=num_requests, decode_steps=decode_steps,
                             block_size=block_size, vocab_size=vocab)
    window = every_layer_window_left(model) if release_window_blocks and kv_dtype is None else None
    t0 = time.perf_counter()
    engine = PagedEngine(model, backend, block_size=block_size, chunk_size=chunk_size, seed=seed,
                         kv_cache_dtype=kv_dtype, window_left=window)
    try:
        results = engine.run(requests)
    except Exception as exc:  # the backend (or its cache manager) failed mid-run: a failed check
        error = f"{type(exc).__name__} at step {engine.steps_done}: {exc}"
        return E2EReport(backend_name(backend), dtype, str(device), [], E2E_LOGIT_TOLERANCE[dtype], engine.steps_done,
                         engine.tokens_computed, engine.cache.stats() if engine.cache is not None else {},
                         time.perf_counter() - t0, strict_tokens, error)
    seconds = time.perf_counter() - t0
    notes = [_model_note(model)]
    if window is not None:
        notes.append(f"sliding window on every layer: the cache ran with window_left {window} and released "
                     f"{engine.cache.stats()['window_released']} blocks early (no later query read them; "
                     f"their table entries became -1), at most {engine.window_released_peak} at once")
    if kv_dtype is None:
        checks = dense_oracle(model, results)
    else:
        fp8 = Fp8OracleStep(kv_dtype, dict(engine.kv_scales))
        checks = dense_oracle(model, results, fp8=fp8)
        plain = max((c.max_logit_diff for c in dense_oracle(model, results)), default=0.0)
        scales = ", ".join(f"layer {layer} {k:.3g}/{v:.3g}" for layer, (k, v) in sorted(fp8.scales.items()))
        notes += [f"kv cache {kv_cache_dtype_name(kv_dtype)}: k_scale/v_scale = max|K|/200, max|V|/100 of the first "
                  f"prefill ({scales}); the oracle's K/V go through the same quantize -> dequantize "
                  f"({fp8.count.adopted} of {fp8.count.total} elements at an fp8 rounding boundary took the "
                  "stored code)",
                  f"information: max |logit diff| against the unquantized float64 run {plain:.3e} (the fp8 cache's "
                  "own error, not judged)"]
    return E2EReport(backend_name(backend), dtype, str(device), checks, E2E_LOGIT_TOLERANCE[dtype], engine.steps,
                     engine.tokens_computed, engine.cache.stats(), seconds, strict_tokens, notes=notes)


def _model_note(model: torch.nn.Module) -> str:
    """One line: the architecture and the attention features its layers use."""
    cfg = model.config
    parts = [f"model {cfg.model_type}"]
    if is_mla(model):
        parts.append(f"multi-head latent attention from the paged latent cache (one pool of width "
                     f"{cfg.kv_lora_rank} + {cfg.qk_rope_head_dim}, V its first {cfg.kv_lora_rank} columns, "
                     f"{cfg.num_attention_heads} query heads, W_UK / W_UV absorbed)")
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True):
        kinds = getattr(cfg, "layer_types", None)
        which = (f"layers {[i for i, t in enumerate(kinds) if t == 'sliding_attention']}" if kinds else "every layer")
        parts.append(f"sliding window {window} (window_left {window - 1}) on {which}")
    if getattr(cfg, "attn_logit_softcapping", None):
        parts.append(f"attention softcap {cfg.attn_logit_softcapping:g}")
    if getattr(cfg, "final_logit_softcapping", None):
        parts.append(f"final logit softcap {cfg.final_logit_softcapping:g} (in the model)")
    if getattr(cfg, "query_pre_attn_scalar", None):
        parts.append(f"scale query_pre_attn_scalar ** -0.5 = {cfg.query_pre_attn_scalar ** -0.5:.4g}")
    return ", ".join(parts)


# -- command line -------------------------------------------------------------------------------------
def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``e2e`` with its arguments and ``func=run``."""
    p = subparsers.add_parser(
        "e2e", help="serve a transformers model from the paged cache and check it against dense",
        description="Run a small Llama, Mistral or Gemma 2 causal LM (seeded random weights, or --model DIR) with "
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
    p.add_argument("--arch", default="llama", choices=list(ARCHS),
                   help="random model's architecture: llama (full causal), mistral (sliding window on every "
                        "layer), gemma2 (alternating sliding/full layers, attention and final logit soft-capping, "
                        "query_pre_attn_scalar), deepseek_v3 (multi-head latent attention served from the paged "
                        "latent cache, V a view of K); default llama; ignored with --model")
    p.add_argument("--sliding-window", type=int, default=DEFAULT_SLIDING_WINDOW, metavar="N",
                   help=f"sliding window of mistral / gemma2 in tokens, the query included (default "
                        f"{DEFAULT_SLIDING_WINDOW}; passed to the backend as window_left = N - 1)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPES],
                   help="auto: pools in --dtype; fp8 / fp8_e4m3 / fp8_e5m2: float8 pools with per-layer k_scale, "
                        "v_scale from the first prefill (max|K|/200, max|V|/100), judged against the dense run "
                        "with the same quantize -> dequantize of K/V")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="local checkpoint directory (no download); only its .safetensors weights are loaded "
                        "(never pickle .bin/.pt files) and never code shipped with it (trust_remote_code=False)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts seed (default 0)")
    p.add_argument("--requests", type=int, default=9,
                   help="number of requests (default 9; the fork with copy-on-write is request 7, "
                        "so fewer than 7 have none)")
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
                         strict_tokens=not args.allow_near_ties, arch=args.arch,
                         kv_cache_dtype=args.kv_cache_dtype,
                         model_kwargs={"sliding_window": args.sliding_window} if args.model is None else None)
    except ImportError as exc:
        print(f"e2e: error: {exc}", file=sys.stderr)
        return 2
    except (PagedKVError, ValueError, OSError) as exc:
        print(f"e2e: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1
