"""Properties of the optional attention features (``docs/contract.md``): identities between a
feature and its absence, the window's frame condition, and exact fp8 storage.

Each is a check ``(backend, case, device)`` like those of :mod:`pagedkv.testing.properties.definitions`, run on
cases that use the feature (the registry draws them with it forced on) and skipped, as *not
covered*, for a backend whose ``FEATURES`` does not declare it.

- a window of at least the context equals no window; a soft-cap far above every logit approaches
  none; zero ALiBi slopes equal none; sinks of ``-inf`` equal none (within the dtype's tolerance);
- blocks wholly outside every query's window may hold NaN: the output is bit-identical;
- one NaN in V (an fp8 pool's NaN byte too) shows exactly in the outputs that read it;
- ``write_kv`` into an fp8 pool then ``gather`` returns exactly ``pagedkv.attention.fp8.quantize`` of what was
  written (bit for bit);
- scaling the stored K by a power of two ``c`` (exactly) and ``k_scale`` by ``1 / c`` changes nothing
  beyond rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.backends.capabilities import capabilities_of
from pagedkv.attention.fp8 import quantize
from pagedkv.testing.cases.case import Case, reference_gather, writable, write_slot_mapping
from pagedkv.testing.properties.definitions import _compare_rows, reference_output, separate_pools
from pagedkv.testing.compare import Mismatch, require
from pagedkv.testing.compare import assert_attention_close, assert_attention_identical, rerun_differs, rerun_scale


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
        _reject_in_a_search()
    before = _attention(backend, case, device)
    k_cache, v_cache = case.caches(device)
    if blocks:
        ids = torch.tensor(blocks, device=device)
        nan = torch.tensor(float("nan"), device=device).to(k_cache.dtype)
        k_cache[ids] = nan
        v_cache[ids] = nan
    after = _attention(backend, case, device, caches=(k_cache, v_cache))
    try:
        assert_attention_identical(after, before, f"NaN in blocks {blocks} (outside window_left={case.window_left}): ")
    except AssertionError as exc:
        raise Mismatch(str(exc), {"blocks": blocks}) from None


def nan_value_readers(case: Case, block: int, offset: int, kv_head: int, dim: int, *,
                      tails_masked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reads, masked)``, each ``[total_q, num_q_heads, head_dim_v]`` bool, for V at ``(block, offset,
    kv_head, dim)``: the outputs that read it, and those that hold it in their context but mask it.

    Row ``r`` of sequence ``j`` (query position ``q``) reads the slot when a position ``p <= q`` of ``j``
    inside its window (``p >= q - window_left`` with a window) lives there: ``used_table(j)[p // bs] ==
    block`` and ``p % bs == offset``; it masks it when such a ``p`` lies after ``q`` or before its window
    (a kernel that multiplies a masked weight of 0 by the NaN gets NaN, IEEE's 0 * NaN), and, with
    ``tails_masked`` (a backend that assumes ``finite_unused_slots``), when the slot is past ``seq_len``
    in ``j``'s last block (a block shared by a longer sequence). Only the query heads of ``kv_head``
    (GQA), in ``dim``."""
    g, qsl = case.geometry, case.query_start_loc_list
    reads = torch.zeros((qsl[-1], g.num_q_heads, g.v_dim), dtype=torch.bool)
    masked = torch.zeros_like(reads)
    heads = slice(kv_head * g.num_queries_per_kv, (kv_head + 1) * g.num_queries_per_kv)
    for j, s in enumerate(case.seqs):
        table = case.used_table(j)
        span = len(table) * g.block_size if tails_masked else s.seq_len
        here = [p for p in range(span) if table[p // g.block_size] == block and p % g.block_size == offset]
        for t in range(s.q_len):
            q = s.seq_len - s.q_len + t
            seen = any(p <= q and (case.window_left < 0 or p >= q - case.window_left) for p in here)
            (reads if seen else masked)[qsl[j] + t, heads, dim] = bool(here)
    if case.layout == "latent":  # V is K's storage: the NaN is a logit too, so every dim of a reader is NaN
        reads, masked = (m.any(-1, keepdim=True).expand_as(m).clone() for m in (reads, masked))
    return reads, masked


def nan_value_shows_exactly_where_it_is_read(backend: Any, case: Case, device: str = "cpu") -> None:
    """One NaN planted in V (stored as the pool's NaN: fp8's too) makes every output that attends its
    token NaN, in its head group and dim, and leaves bit-identical every output that has no such token
    in its context (other sequences, kv heads and dims); for a kernel that declares nondeterminism
    (``Capabilities.nondeterminism_ulp``) those outputs stay finite and within its declared ulps of the
    values summed (:func:`pagedkv.testing.compare.rerun_differs`), NaN exactly where it was. An output
    with the token in its context but masked (a later position, or before its window) is unchanged or NaN:
    IEEE's ``0 * NaN`` is NaN, so a kernel that weights a masked value by 0 is not wrong here (the
    window's frame condition is :func:`nan_outside_the_window_changes_nothing`). For a backend that
    assumes ``finite_unused_slots``, the NaN in another sequence's unused tail (a shared block) is masked
    too.

    The slot is a token some query of a sequence sees (drawn from the case's seed); a case with no
    query checks nothing, and Hypothesis draws another. K is left alone: a NaN logit may vanish in a
    running maximum (Triton's ``tl.maximum`` drops NaN); a NaN value may not. In MLA's latent cache V is
    K's storage, so the NaN is in a logit too: every dim of a reader's head group is NaN."""
    g = case.geometry
    seen = [(i, p) for i, s in enumerate(case.seqs) if s.q_len
            for p in range(s.seq_len) if case.window_left < 0 or p >= s.seq_len - s.q_len - case.window_left]
    if not seen:
        _reject_in_a_search()
        return
    gen = case._generator(12)
    i, p = seen[int(torch.randint(len(seen), (1,), generator=gen))]
    kv_head, dim = (int(torch.randint(n, (1,), generator=gen)) for n in (g.num_kv_heads, g.v_dim))
    block, offset = case.used_table(i)[p // g.block_size], p % g.block_size
    before = _attention(backend, case, device)
    k_cache, v_cache = case.caches(device)
    v_cache[block, offset, kv_head, dim] = torch.tensor(float("nan"), device=device).to(v_cache.dtype)
    after = _attention(backend, case, device, caches=(k_cache, v_cache))
    tails = "finite_unused_slots" in capabilities_of(backend).preconditions
    reads, masked = nan_value_readers(case, block, offset, kv_head, dim, tails_masked=tails)
    where = f"NaN in V at block {block}, slot {offset}, kv head {kv_head}, dim {dim} (sequence {i}, position {p})"
    missing = reads & ~after.isnan()
    if bool(missing.any()):
        row, head, d = (int(x) for x in torch.nonzero(missing)[0])
        seq, q = case.row_position(row)
        raise Mismatch(f"{where}: output of sequence {seq}, query position {q}, query head {head}, dim {d} reads "
                       f"it and is {float(after[row, head, d])!r}, not NaN ({int(missing.sum())} of "
                       f"{int(reads.sum())} readers)", {"seq": seq, "position": q, "query_head": head, "dim": d})
    # a kernel nondeterministic by design: the two runs agree within its declared ulps of the values summed
    # (NaN and infinities exactly); bit for bit otherwise
    ulps = capabilities_of(backend).rerun_ulps(after.dtype)
    unchanged = ~rerun_differs(after, before, ulps, rerun_scale(before, after, v_cache) if ulps else 0.0)
    wrong = ~reads & ~unchanged & ~(masked & after.isnan())  # a masked output: unchanged, or IEEE's 0 * NaN
    if bool(wrong.any()):
        row, head, d = (int(x) for x in torch.nonzero(wrong)[0])
        seq, q = case.row_position(row)
        raise Mismatch(f"{where}: output of sequence {seq}, query position {q}, query head {head}, dim {d} "
                       f"{'masks' if masked[row, head, d] else 'does not have'} it in its context and changed: "
                       f"{float(after[row, head, d])!r}, was {float(before[row, head, d])!r} ({int(wrong.sum())} "
                       f"outputs changed)", {"seq": seq, "position": q, "query_head": head, "dim": d})


def _reject_in_a_search() -> None:
    """Inside a Hypothesis test, reject the case (it checks nothing; another is drawn); a replay outside
    one (Hypothesis possibly not installed) passes it."""
    try:
        from hypothesis import assume, currently_in_test_context
    except ImportError:
        return
    if currently_in_test_context():
        assume(False)


def _magnitudes(case: Case) -> list[torch.Tensor]:
    """Per sequence, a ``[seq_len, 1, 1]`` power of two per token, ``2**-40`` to ``2**3`` (in the case's
    dtype): written K/V then span fp8's saturation, normal and subnormal ranges and underflow to zero."""
    gen = case._generator(11)
    dtype = case.geometry.torch_dtype
    return [torch.pow(2.0, torch.randint(-40, 4, (s.seq_len, 1, 1), generator=gen).double()).to(dtype)
            for s in case.seqs]


def fp8_write_then_gather_is_exact(backend: Any, case: Case, device: str = "cpu") -> None:
    """``write_kv`` into an fp8 pool then ``gather`` returns, bit for bit, ``pagedkv.attention.fp8.quantize`` of the
    keys and values written (``sat(x / scale)``, round to nearest even), each token's K/V scaled by a
    power of two (:func:`_magnitudes`) so that every fp8 rounding path is written."""
    write_kv, gather = require(backend, "write_kv"), require(backend, "gather")
    case = separate_pools(case)
    slots, owners = write_slot_mapping(case)
    new = [(k * m, v * m) for (k, v), m in zip(case.logical_kv(1), _magnitudes(case))]
    g = case.geometry
    key = torch.zeros((len(slots), g.num_kv_heads, g.head_dim), dtype=g.torch_dtype)
    value = torch.zeros((len(slots), g.num_kv_heads, g.v_dim), dtype=g.torch_dtype)
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
