"""Which unused slots a failing ``paged_attention`` read, for replay's block map.

A sequence's last block holds ``seq_len % block_size`` of its tokens; the slots past them (its
*unused tail*, owned by no sequence) hold the case's poison and must not reach the output. When an
attention check fails, the query's own slot is where the bad output row *is*, not what was read
wrongly. This probe finds the slots that were: for each last block with an unused tail, it refills
just that tail (in K and V) with a different value and reruns the call; when the output changes
(bit for bit), the kernel read those slots. One extra call per
partial last block (plus one to check the call repeats bit for bit; a kernel whose output varies
between identical calls is not probed).

What a mark means (sound, not complete): re-poisoning the marked slots changes the output, so the
kernel read them. A tail read whose values the kernel then masks exactly (a ``where`` after the load)
changes nothing and is not marked: it is harmless.
"""

from __future__ import annotations

from typing import Any

import torch


def _alternative(poison: str) -> float:
    """A finite value unlike the case's poison (NaN, inf, the dtype's max or zero)."""
    return 0.5 if poison == "sentinel" else 1.0 if poison in ("nan", "inf", "zero") else 0.0


def unused_tails(case: Any) -> dict[int, list[int]]:
    """``{physical block: [offsets]}``: the unused tail of each sequence's partial last block (offsets no
    sequence owns)."""
    bs, owned, out = case.geometry.block_size, case.owned_slots(), {}
    for i, s in enumerate(case.seqs):
        if s.seq_len % bs == 0:
            continue
        block = case.used_table(i)[-1]
        tail = [o for o in range(s.seq_len % bs, bs) if block * bs + o not in owned]
        if tail:
            out[block] = tail
    return out


def unused_slots_read(backend: Any, case: Any, device: str = "cpu") -> dict[int, list[int]]:
    """``{physical block: [offsets]}`` of the unused tail slots whose contents change ``backend``'s
    ``paged_attention`` output on ``case`` (``Case``), called as the suite calls it (in the declared
    pool layout). Empty when the backend has no ``paged_attention``, its output varies between two
    identical calls, or no tail changes it.

    Raises:
        whatever the backend's ``paged_attention`` raises on the case.
    """
    from pagedkv.backends.capabilities import capabilities_of
    from pagedkv.testing.cases.memory import pool_layout
    from pagedkv.testing.compare import bits
    from pagedkv.testing.space import as_declared_layout

    caps = capabilities_of(backend)
    view = as_declared_layout(backend, caps)
    attention = getattr(view, "paged_attention", None)
    tails = unused_tails(case)
    if not callable(attention) or not tails:
        return {}

    def run(refill: tuple[int, list[int]] | None = None) -> torch.Tensor:
        k_cache, v_cache = case.caches(device)
        if refill is not None:
            block, offsets = refill
            for pool in (k_cache, v_cache):
                fill = torch.tensor(_alternative(case.poison), device=pool.device).to(pool.dtype)
                pool[block, offsets] = fill
        out = attention(case.query(device), k_cache, v_cache, case.block_tables(device), case.seq_lens(device),
                        case.query_start_loc(device), case.scale, **case.attention_features(device))
        return bits(out.cpu())

    with pool_layout(caps.layout):
        base = run()
        if not torch.equal(base, run()):
            return {}
        read = {}
        for block, offsets in tails.items():
            if not torch.equal(run((block, offsets)), base):
                read[block] = offsets
    return read
