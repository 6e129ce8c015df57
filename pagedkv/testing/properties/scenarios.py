"""Cache scenarios: histories of add, reserve, write, append, fork and free on a real cache, and the
properties over them (sharing never leaks one sequence into another; prefix caching changes no output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedkv.backends.capabilities import capabilities_of
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.testing.cases.case import CacheScenario, token_kv
from pagedkv.testing.compare import Mismatch, bits, require, rerun_differs, rerun_scale
from pagedkv.testing.compare import assert_bitwise_equal
from pagedkv.testing.properties.cache_model import latent_pools


def run_scenario(backend: Any, scenario: CacheScenario, device: str = "cpu",
                 after_op: Callable[[PagedKVCache, dict], None] | None = None) -> tuple[PagedKVCache, dict]:
    """Replay ``scenario.ops`` on a real :class:`PagedKVCache` through a
    :class:`~pagedkv.testing.properties.cache_model.CacheModel`, writing each token's K/V (every layer) with the
    backend's ``write_kv`` and committing it with ``mark_written``. Returns the cache and the shadow
    ``{seq_id: token_ids}`` (its ``.model`` attribute is the model). Operations the cache refuses (out
    of blocks) are skipped, as a scheduler would; a ``free`` of a sequence that is not live must raise
    and change nothing (else :class:`Mismatch`). ``after_op`` sees both after each op.

    A backend that ships its own cache manager exposes it as ``backend.cache_class`` (a class with
    :class:`PagedKVCache`'s constructor and methods); the scenario then runs on that class."""
    from pagedkv.errors import OutOfBlocksError
    from pagedkv.testing.properties.cache_model import CacheModel, ModelMismatch

    write_kv = require(backend, "write_kv")
    g = scenario.geometry
    cache_class = getattr(backend, "cache_class", None) or PagedKVCache
    cache = cache_class(g.cache_config(device, scenario.num_layers),
                        enable_prefix_caching=scenario.enable_prefix_caching,
                        **({"hash_fn": lambda parent, tokens: 0} if scenario.constant_hash else {}))
    gather = getattr(backend, "gather", None)
    model = CacheModel(cache, g, scenario.seed, scenario.num_layers, write_kv, gather,
                       attention=None if gather else getattr(backend, "paged_attention", None),
                       latent=_latent(backend))
    shadow = _Shadow()
    shadow.model = model

    for op in scenario.ops:
        kind, seq_id = op[0], op[1]
        try:
            try:
                if kind in ("add", "reserve") and seq_id not in model.seqs:
                    tokens = list(op[2])
                    cached = model.add(seq_id, tokens, op[3] if len(op) > 3 else None)
                    try:
                        model.reserve(seq_id, tokens[cached:])
                    except OutOfBlocksError:
                        model.free(seq_id)
                        raise
                    if kind == "add":
                        model.write(seq_id)
                elif kind in ("append", "reserve") and seq_id in model.seqs:
                    model.reserve(seq_id, list(op[2]))
                    if kind == "append":
                        model.write(seq_id)
                elif kind == "write" and seq_id in model.seqs:
                    model.write(seq_id, op[2] if len(op) > 2 else None)
                elif kind == "fork" and seq_id in model.seqs and op[2] not in model.seqs:
                    model.fork(seq_id, op[2])
                elif kind == "free" and seq_id in model.seqs:
                    model.free(seq_id)
                elif kind == "free":  # a sequence freed twice (or never added): refused, nothing changes
                    _check_refused_free(cache, seq_id)
            except OutOfBlocksError:
                pass
            model.observe_evictions(f"after {op!r}")
        except ModelMismatch as exc:
            raise Mismatch(str(exc), exc.where or {"seq": seq_id}) from None
        shadow.clear()
        shadow.update({s: list(m.tokens) for s, m in model.seqs.items()})
        if after_op is not None:
            after_op(cache, shadow)
    return cache, shadow


def _latent(backend: Any) -> bool:
    """The backend declares ``shared_kv_storage`` (it reads V from K's storage)."""
    from pagedkv.backends.capabilities import capabilities_of

    return bool(capabilities_of(backend).shared_kv_storage)


class _Shadow(dict):
    """``{seq_id: token_ids}`` of the live sequences, with ``.model`` (the scenario's CacheModel)."""

    model: Any = None


def _check_refused_free(cache: PagedKVCache, seq_id: int) -> None:
    from pagedkv.errors import DoubleFreeError, UnknownBlockError

    a = cache.allocator
    before = (a.snapshot(), cache.reference_counts())
    try:
        cache.free(seq_id)
    except (DoubleFreeError, UnknownBlockError):
        pass
    else:
        raise Mismatch(f"freeing sequence {seq_id}, which is not live, was accepted (a reference dropped twice)",
                       {"seq": seq_id})
    if (a.snapshot(), cache.reference_counts()) != before:
        raise Mismatch(f"a refused free of sequence {seq_id} changed the allocator", {"seq": seq_id})


def check_live_sequences(backend: Any, cache: PagedKVCache, shadow: dict, scenario: CacheScenario) -> None:
    """Every live sequence gathers, bit for bit and in every layer, the K/V of the tokens it has
    written, and the cache's counts hold. With a shadow from :func:`run_scenario`, also everything its
    :class:`~pagedkv.testing.properties.cache_model.CacheModel` checks: no cached block was never written, cached
    blocks hold their prefix's K/V, hits are found, and sharing is kept."""
    from pagedkv.testing.properties.cache_model import ModelMismatch

    model = getattr(shadow, "model", None)
    if model is not None:
        try:
            model.check()
        except ModelMismatch as exc:
            raise Mismatch(str(exc), exc.where) from None
        return
    cache.check_invariants()
    for seq_id, tokens in shadow.items():
        k_exp, v_exp = token_kv(scenario.geometry, tokens, 0, scenario.seed)
        table = cache.block_table(seq_id)
        for pool, exp, name in ((cache.k_cache(), k_exp, "K"), (cache.v_cache(), v_exp, "V")):
            got = backend.gather(pool, table, len(tokens)).cpu()
            a, e = bits(got), bits(exp)
            if got.shape != exp.shape or not torch.equal(a, e):
                p = int((a != e).flatten(1).any(1).nonzero()[0]) if got.shape == exp.shape else -1
                block = int(table[p // scenario.geometry.block_size]) if p >= 0 else -1
                raise Mismatch(f"sequence {seq_id} reads a wrong {name} at position {p} (block {block}) of "
                               f"{len(tokens)} tokens: another sequence's write, or a stale block",
                               {"seq": seq_id, "position": p, "block": block})


def sharing_isolated(backend: Any, scenario: CacheScenario, device: str = "cpu") -> None:
    """After every operation, every live sequence (forked, copy-on-write, prefix-cached) reads exactly
    its own tokens' K/V, and the allocator's counts match the live tables. The reads are the backend's
    ``gather``; a backend without one is read through its ``paged_attention`` (against the fp64
    reference over the sequence's own tokens) and the pools by definition."""
    run_scenario(backend, scenario, device,
                 lambda cache, shadow: check_live_sequences(backend, cache, shadow, scenario))


def prefix_cache_transparent(backend: Any, scenario: CacheScenario, device: str = "cpu") -> None:
    """Prefix caching on and off give every sequence live in both runs with the same tokens the same
    K/V and the same attention output (bit for bit, or within a declared nondeterminism). (Caching saves
    blocks, so under pool pressure the run without it may refuse operations the other accepted; those
    sequences are not comparable.)"""
    attn = require(backend, "paged_attention")
    runs = [run_scenario(backend, scenario.replace(enable_prefix_caching=on), device) for on in (True, False)]
    (_, shadow_on), (_, shadow_off) = runs
    ids = sorted(i for i in shadow_on if shadow_off.get(i) == shadow_on[i]  # written in full in both runs
                 and all(cache.num_written(i) == len(shadow_on[i]) for cache, _ in runs))
    if not ids:
        return
    g = scenario.geometry
    q = torch.randn((len(ids), g.num_q_heads, g.head_dim), generator=torch.Generator().manual_seed(scenario.seed))
    q = q.to(g.torch_dtype).to(device)
    qsl = torch.arange(len(ids) + 1, dtype=torch.int32, device=device)
    outs = [attn(q, *latent_pools(cache.k_cache(), cache.v_cache(), _latent(backend)), cache.block_tables(ids),
                 cache.seq_lens(ids), qsl, None).cpu() for cache, _ in runs]
    # a kernel nondeterministic by design (Capabilities.nondeterminism_ulp): the two runs read the same K/V, so
    # they agree within its declared ulps of the values summed (non-finite values exactly); bit for bit otherwise
    ulps = capabilities_of(backend).rerun_ulps(outs[0].dtype)
    scale = rerun_scale(outs[0], outs[1], runs[0][0].v_cache()) if ulps else 0.0
    for row, seq_id in enumerate(ids):
        if ulps:
            if bool(rerun_differs(outs[0][row], outs[1][row], ulps, scale).any()):
                raise Mismatch(f"sequence {seq_id}: decode attention with prefix caching on vs off differs beyond the "
                               f"declared nondeterminism of {ulps} ulps", {"seq": seq_id})
            continue
        try:
            assert_bitwise_equal(outs[0][row], outs[1][row], f"sequence {seq_id}: decode attention with prefix "
                                                            f"caching on vs off: ")
        except AssertionError as exc:
            raise Mismatch(str(exc), {"seq": seq_id}) from None


# -- registry, failure files -------------------------------------------------------------------------------
