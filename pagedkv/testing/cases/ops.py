"""A case's ops applied to a backend: the one place the kit turns a :class:`~pagedkv.testing.cases.case.Case`
into backend calls and collects what they computed.

The properties (:func:`pagedkv.testing.properties.definitions.backends_agree`, the invariances), the
baseline's drift report (:func:`pagedkv.tools.baseline.drift.measure`) and replay's first differences
all run a case through :func:`run_ops`; :func:`inputs` / :func:`outputs` serve the properties that
transform the inputs before the call (renumbered blocks, another table dtype, ...).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.testing.cases.case import Case, writable, write_slot_mapping

#: Every op :func:`run_ops` knows, in the order it runs them.
OPS = ("gather", "scatter", "write_kv", "paged_attention")


def inputs(case: Case, device: str = "cpu") -> dict[str, Any]:
    """The case as backend inputs: ``query`` ``[total_q, num_heads, head_dim]``, ``k_cache`` / ``v_cache``
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` (fresh pools), ``block_tables`` ``[num_seqs,
    max_blocks]``, ``seq_lens`` ``[num_seqs]``, ``query_start_loc`` ``[num_seqs + 1]`` (int32), ``scale``
    (float or ``None``) and ``features`` (the keyword arguments of the features in use), all on ``device``."""
    k_cache, v_cache = case.caches(device)
    return {"query": case.query(device), "k_cache": k_cache, "v_cache": v_cache,
            "block_tables": case.block_tables(device), "seq_lens": case.seq_lens(device),
            "query_start_loc": case.query_start_loc(device), "scale": case.scale,
            "features": case.attention_features(device)}


def outputs(backend: Any, args: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Everything a backend reads on ``args`` (see :func:`inputs`), as CPU tensors keyed by op and
    sequence: ``gather[i]`` ``[seq_len_i, num_kv_heads, head_dim]`` and ``paged_attention[i]`` ``[q_len_i,
    num_heads, head_dim]``; ops it lacks are left out. Raises whatever the backend raises."""
    out: dict[str, torch.Tensor] = {}
    if callable(getattr(backend, "gather", None)):
        for i, n in enumerate(args["seq_lens"].tolist()):
            out[f"gather[{i}]"] = backend.gather(args["k_cache"], args["block_tables"][i], n).cpu()
    if callable(getattr(backend, "paged_attention", None)):
        attn = call_attention(backend, args).cpu()
        qsl = args["query_start_loc"].tolist()
        for i in range(len(qsl) - 1):
            out[f"paged_attention[{i}]"] = attn[qsl[i]:qsl[i + 1]]
    return out


def call_attention(backend: Any, args: dict[str, Any]) -> torch.Tensor:
    """``backend.paged_attention`` on ``args`` (see :func:`inputs`): ``[total_q, num_heads, head_dim]`` on
    the inputs' device. Raises whatever the backend raises."""
    return backend.paged_attention(args["query"], args["k_cache"], args["v_cache"], args["block_tables"],
                                   args["seq_lens"], args["query_start_loc"], args["scale"], **args["features"])


def run_ops(backend: Any, case: Case, device: str = "cpu", ops: tuple[str, ...] = OPS, *,
            declared: bool = False) -> dict[str, torch.Tensor]:
    """Run each of ``ops`` on ``backend`` on fresh tensors of ``case`` and return what it computed, as
    CPU tensors in logical positions:

    - ``gather[i]``: sequence ``i``'s rows, ``[seq_len_i, num_kv_heads, head_dim]``;
    - ``scatter.k_cache``: the key pool after scattering each writable sequence's new keys from its ``start``;
    - ``write_kv.k_cache`` / ``write_kv.v_cache``: both pools after ``write_kv`` of random keys (and their
      negation as values) at the case's ``slot_mapping`` (padding slots ``-1`` included);
    - ``paged_attention``: ``[total_q, num_heads, head_dim]`` in the case's dtype.

    Args:
        backend: any object with the contract's ops (each op of ``ops`` must be there).
        case: the case; every op gets pools of its own, so one op's writes never reach another.
        device: where the tensors live.
        ops: a subset of :data:`OPS`.
        declared: build the pools in ``backend``'s declared layout and honour its declared page table
            (:func:`pagedkv.testing.space.as_declared_layout`), as :func:`pagedkv.testing.execute.call`
            does; ``False`` when the caller already sees the backend that way.

    Raises:
        ValueError: ``ops`` names an op outside :data:`OPS` (before any call).
        Exception: whatever the backend raises.
    """
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"ops: {unknown} are not ops of the contract; choose from {OPS}")
    if declared:
        from pagedkv.backends.capabilities import capabilities_of
        from pagedkv.testing.cases.memory import pool_layout
        from pagedkv.testing.space import as_declared_layout

        caps = capabilities_of(backend)
        with pool_layout(caps.layout):
            return run_ops(as_declared_layout(backend, caps), case, device, ops)
    out: dict[str, torch.Tensor] = {}
    if "gather" in ops:
        k_cache, _ = case.caches(device)
        tables = case.block_tables(device)
        for i, s in enumerate(case.seqs):
            out[f"gather[{i}]"] = backend.gather(k_cache, tables[i], s.seq_len).cpu()
    if "scatter" in ops:
        k_cache, _ = case.caches(device)
        tables, new = case.block_tables(device), case.stored_kv(1)
        for i in writable(case):
            start = case.seqs[i].start
            backend.scatter(k_cache, tables[i], new[i][0][start:].to(device), start)
        out["scatter.k_cache"] = k_cache.cpu()
    if "write_kv" in ops:  # MLA's latent view is written through K: write_kv's pools never overlap
        k_cache, v_cache = case.replace(layout="contiguous" if case.layout == "latent" else case.layout).caches(device)
        slots, _ = write_slot_mapping(case)
        g = case.geometry
        key = torch.randn((len(slots), g.num_kv_heads, g.head_dim), generator=case._generator(3)).to(g.torch_dtype)
        value = -key if g.v_dim == g.head_dim else torch.randn(
            (len(slots), g.num_kv_heads, g.v_dim), generator=case._generator(13)).to(g.torch_dtype)
        backend.write_kv(k_cache, v_cache, key.to(device), value.to(device),
                         torch.tensor(slots, dtype=torch.int64, device=device), **case.kv_scales(device))
        out["write_kv.k_cache"], out["write_kv.v_cache"] = k_cache.cpu(), v_cache.cpu()
    if "paged_attention" in ops:
        out["paged_attention"] = call_attention(backend, inputs(case, device)).cpu()
    return out
