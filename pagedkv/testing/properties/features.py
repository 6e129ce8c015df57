"""Properties of the optional attention features (``docs/contract.md``): identities between a
feature and its absence, the window's frame condition, and exact fp8 storage.

Each is a check ``(backend, case, device)`` like those of :mod:`pagedkv.testing.properties.definitions`, run on
cases that use the feature (the registry draws them with it forced on) and skipped, as *not
covered*, for a backend whose ``FEATURES`` does not declare it.

- a window of at least the context equals no window; a soft-cap far above every logit approaches
  none; zero ALiBi slopes equal none; sinks of ``-inf`` equal none (within the dtype's tolerance);
- blocks wholly outside every query's window may hold NaN: the output is bit-identical;
- ``write_kv`` into an fp8 pool then ``gather`` returns exactly ``pagedkv.fp8.quantize`` of what was
  written (bit for bit);
- scaling the stored K by a power of two ``c`` (exactly) and ``k_scale`` by ``1 / c`` changes nothing
  beyond rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.fp8 import quantize
from pagedkv.testing.cases.case import Case, reference_gather, writable, write_slot_mapping
from pagedkv.testing.properties.definitions import _compare_rows, reference_output
from pagedkv.testing.compare import Mismatch, require
from pagedkv.testing.compare import assert_attention_close, assert_bitwise_equal


def _attention(backend: Any, case: Case, device: str, caches=None, **overrides) -> torch.Tensor:
    """The backend's attention on the case with its features, ``overrides`` replacing them (``None``
    removes one); ``caches`` replaces the case's pools."""
    attn = require(backend, "paged_attention")
    features = {k: v for k, v in {**case.attention_features(device), **overrides}.items() if v is not None}
    k_cache, v_cache = caches if caches is not None else case.caches(device)
    return attn(case.query(device), k_cache, v_cache, case.block_tables(device), case.seq_lens(device),
                case.query_start_loc(device), case.scale, **features).cpu()


def _same_within_tolerance(case: Case, actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    _, max_logit, max_v = reference_output(case)
    try:
        assert_attention_close(actual, expected.double(), max_abs_logit=max_logit, max_abs_value=max_v)
    except AssertionError as exc:
        raise Mismatch(f"{what}: {exc}") from None


def window_past_context_equals_no_window(backend: Any, case: Case, device: str = "cpu") -> None:
    """A window of at least the longest context (``window_left >= max(seq_lens)``) equals no window."""
    window = max([case.window_left, *case.seq_lens_list])
    _same_within_tolerance(case, _attention(backend, case, device, window_left=window),
                           _attention(backend, case, device, window_left=None),
                           f"window_left={window} (context {max(case.seq_lens_list, default=0)}) vs no window")


def huge_softcap_equals_no_softcap(backend: Any, case: Case, device: str = "cpu") -> None:
    """A soft-cap ``10**4`` times above every logit leaves them unchanged within rounding: equals no soft-cap."""
    _, max_logit, _ = reference_output(case, softcap=0.0)
    cap = 1e4 * max(max_logit, 1.0)
    _same_within_tolerance(case, _attention(backend, case, device, softcap=cap),
                           _attention(backend, case, device, softcap=None), f"softcap={cap:g} vs no soft-cap")


def zero_slopes_equal_no_alibi(backend: Any, case: Case, device: str = "cpu") -> None:
    """ALiBi slopes of zero equal no ALiBi."""
    zeros = torch.zeros(case.geometry.num_q_heads, dtype=torch.float32, device=device)
    _same_within_tolerance(case, _attention(backend, case, device, alibi_slopes=zeros),
                           _attention(backend, case, device, alibi_slopes=None), "zero ALiBi slopes vs no ALiBi")


def neg_inf_sinks_equal_no_sinks(backend: Any, case: Case, device: str = "cpu") -> None:
    """Sinks of ``-inf`` (every head) equal no sinks."""
    off = torch.full((case.geometry.num_q_heads,), float("-inf"), dtype=torch.float32, device=device)
    _same_within_tolerance(case, _attention(backend, case, device, sinks=off),
                           _attention(backend, case, device, sinks=None), "-inf sinks vs no sinks")


def blocks_outside_the_window(case: Case) -> list[int]:
    """Physical blocks no query can see: every use of the block (in a read part of a table) lies wholly
    before its sequence's first query position minus ``window_left`` (or its sequence has no query)."""
    if case.window_left < 0:
        return []
    bs, inside, outside = case.geometry.block_size, set(), set()
    for i, s in enumerate(case.seqs):
        low = s.seq_len - s.q_len - case.window_left if s.q_len else s.seq_len
        for j, block in enumerate(case.used_table(i)):
            (outside if (j + 1) * bs <= low else inside).add(block)
    return sorted(outside - inside)


def nan_outside_the_window_changes_nothing(backend: Any, case: Case, device: str = "cpu") -> None:
    """NaN planted in every block wholly outside each query's window leaves the output bit-identical.

    A drawn case with no such block (a window that reaches every sequence's start) checks nothing here:
    Hypothesis rejects it and draws another, so every generated example plants NaN somewhere."""
    blocks = blocks_outside_the_window(case)
    if not blocks:
        from hypothesis import assume, currently_in_test_context

        if currently_in_test_context():
            assume(False)
    before = _attention(backend, case, device)
    k_cache, v_cache = case.caches(device)
    if blocks:
        ids = torch.tensor(blocks, device=device)
        nan = torch.tensor(float("nan"), device=device).to(k_cache.dtype)
        k_cache[ids] = nan
        v_cache[ids] = nan
    after = _attention(backend, case, device, caches=(k_cache, v_cache))
    try:
        assert_bitwise_equal(after, before, f"NaN in blocks {blocks} (outside window_left={case.window_left}): ")
    except AssertionError as exc:
        raise Mismatch(str(exc), {"blocks": blocks}) from None


def _magnitudes(case: Case) -> list[torch.Tensor]:
    """Per sequence, a ``[seq_len, 1, 1]`` power of two per token, ``2**-40`` to ``2**3`` (in the case's
    dtype): written K/V then span fp8's saturation, normal and subnormal ranges and underflow to zero."""
    gen = case._generator(11)
    dtype = case.geometry.torch_dtype
    return [torch.pow(2.0, torch.randint(-40, 4, (s.seq_len, 1, 1), generator=gen).double()).to(dtype)
            for s in case.seqs]


def fp8_write_then_gather_is_exact(backend: Any, case: Case, device: str = "cpu") -> None:
    """``write_kv`` into an fp8 pool then ``gather`` returns, bit for bit, ``pagedkv.fp8.quantize`` of the
    keys and values written (``sat(x / scale)``, round to nearest even), each token's K/V scaled by a
    power of two (:func:`_magnitudes`) so that every fp8 rounding path is written."""
    write_kv, gather = require(backend, "write_kv"), require(backend, "gather")
    slots, owners = write_slot_mapping(case)
    new = [(k * m, v * m) for (k, v), m in zip(case.logical_kv(1), _magnitudes(case))]
    g = case.geometry
    key = torch.zeros((len(slots), g.num_kv_heads, g.head_dim), dtype=g.torch_dtype)
    value = torch.zeros_like(key)
    for t, (i, p) in enumerate(owners):
        if i >= 0:
            key[t], value[t] = new[i][0][p], new[i][1][p]
    k_cache, v_cache = case.caches(device)
    originals = (k_cache.cpu(), v_cache.cpu())
    write_kv(k_cache, v_cache, key.to(device), value.to(device), torch.tensor(slots, dtype=torch.int64, device=device),
             **case.kv_scales(device))
    tables = case.block_tables(device)
    for i in writable(case):
        s = case.seqs[i]
        for cache, original, x, sc, what in zip((k_cache, v_cache), originals, new[i], case.scale_vectors(), "KV"):
            expected = reference_gather(original, case.used_table(i), s.seq_len)
            expected[s.start:] = quantize(x[s.start:], sc, case.pool_dtype)  # the definition, not the backend's
            _compare_rows(gather(cache, tables[i], s.seq_len).cpu(), expected, case, i,
                          f"fp8 {what} written from position {s.start} then gathered")


def _exact_power_of_two(stored: torch.Tensor) -> float:
    """A power of two ``c`` by which every finite stored value scales exactly in its fp8 format (1.0: none)."""
    x = stored.float()
    x = x[torch.isfinite(x)]
    for c in (2.0, 0.5, 4.0, 0.25):
        if bool(((x * c).to(stored.dtype).float() == x * c).all()):
            return c
    return 1.0


def fp8_scale_moves_between_k_and_k_scale(backend: Any, case: Case, device: str = "cpu") -> None:
    """Stored K times a power of two ``c`` (exact in fp8) with ``k_scale / c`` gives the same attention
    within the dtype's tolerance."""
    before = _attention(backend, case, device)
    k_cache, v_cache = case.caches(device)
    owned = [k_cache[b, p % case.geometry.block_size] for i, s in enumerate(case.seqs)
             for p in range(s.seq_len) for b in [case.used_table(i)[p // case.geometry.block_size]]]
    c = _exact_power_of_two(torch.stack(owned).cpu()) if owned else 2.0
    k_cache.copy_((k_cache.float() * c).to(k_cache.dtype))
    k_scale = case.k_scale / c if not isinstance(case.k_scale, tuple) else (case.scale_vectors()[0] / c).to(device)
    after = _attention(backend, case, device, caches=(k_cache, v_cache), k_scale=k_scale)
    _same_within_tolerance(case, after, before, f"stored K x {c} with k_scale / {c}")
