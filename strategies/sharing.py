"""Sharing scenarios: prompts with common prefixes, forks (also mid-block), appends, frees."""

from __future__ import annotations

from hypothesis import strategies as st

from pagedkv.testing.cases.case import CacheScenario, Geometry

from .geometry import allowed_dtypes, run_palette, seq_lens, sized

#: The block sizes a scenario draws (its cost grows with the block size).
SCENARIO_BLOCK_SIZES = (1, 2, 3, 4, 5, 8)


def _palette_shape(caps) -> st.SearchStrategy[dict | None]:
    """A shape of the run's palette for a scenario (its attention is a compiled kernel like any other:
    drawing its geometry freely would compile specialisations past the run's budget): those of
    :data:`SCENARIO_BLOCK_SIZES` with V as wide as K, else those of the smallest block size; ``None``
    (draw freely) without a palette or where no shape has one V width."""
    palette = run_palette(caps)
    shapes = [s for s in (palette.shapes if palette else ())
              if s.get("head_dim_v", s.get("head_dim")) == s.get("head_dim")]
    small = [s for s in shapes if s.get("block_size", 1) <= max(SCENARIO_BLOCK_SIZES)]
    smallest = [s for s in shapes if s.get("block_size") == min(t.get("block_size", 1) for t in shapes)]
    return st.sampled_from(small or smallest) if shapes else st.none()


@st.composite
def scenarios(draw, *, max_ops: int = 14, max_seqs: int = 6, constant_hash: bool | None = None,
              enable_prefix_caching: bool = True, caps=None) -> CacheScenario:
    """A history of ``add`` (prompt = a shared system prompt + own suffix, under one of two cache
    namespaces or none), ``append``, ``reserve`` (slots without a write: the sequence may be freed
    before it is written, as a preemption or an abort does, or forked first), ``write`` (all or part of
    what was reserved), ``fork`` and ``free`` over a small pool of 1-3 layers, so prefix-cache hits,
    shared partial blocks (copy-on-write), evictions and out-of-blocks refusals all happen. Half the
    forks are followed at once by an append to the parent and one to the child (parallel sampling):
    both write into a block they still share. ``caps`` keeps the geometry inside a backend's declared
    space (its smallest allowed sizes: scenario cost grows with the block size) and, where the space declares a
    compile budget, inside the run's palette (:func:`_palette_shape`)."""
    shape = (draw(_palette_shape(caps)) or {}) if run_palette(caps) else {}  # no palette: no draw spent
    bs = shape.get("block_size") or draw(sized(SCENARIO_BLOCK_SIZES, (), caps.block_sizes if caps else None))
    small_pools = st.integers(2, 8)  # half the pools are small: evictions and refusals are common
    geometry = Geometry(num_blocks=draw(small_pools | st.integers(2, 24)), block_size=bs,
                        num_kv_heads=draw(sized((1, 2), (), caps.num_kv_heads if caps else None)),
                        head_dim=shape.get("head_dim") or draw(sized((1, 2, 4), (), caps.head_dims if caps else None)),
                        num_queries_per_kv=shape.get("gqa_group") or draw(sized((1, 3), (),
                                                                                 caps.gqa_groups if caps else None)),
                        dtype=shape.get("dtype") or draw(st.sampled_from(allowed_dtypes(("float32", "bfloat16"),
                                                                                          caps))))
    vocab = st.integers(0, 7)  # a small vocabulary makes equal blocks (and hash hits) likely
    systems = draw(st.lists(st.lists(vocab, min_size=0, max_size=0).flatmap(
        lambda _: st.integers(0, 3 * bs + 1).flatmap(lambda n: st.lists(vocab, min_size=n, max_size=n))),
        min_size=1, max_size=2))
    keys = draw(st.sampled_from(((None,), (None, "tenant-a"), ("lora-1", "lora-2"))))
    ops, live, next_id = [], [], 0
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(("add", "add", "append", "append", "fork", "free", "reserve", "write")))
        if kind in ("add", "reserve") and (kind == "add" or not live or draw(st.booleans())) or not live:
            system = draw(st.sampled_from(systems))
            suffix = draw(seq_lens(bs, 2 * bs).flatmap(lambda n: st.lists(vocab, min_size=n, max_size=n)))
            if not system and not suffix:
                suffix = [draw(vocab)]
            key = draw(st.sampled_from(keys))
            op_kind = "reserve" if kind == "reserve" else "add"
            ops.append((op_kind, next_id, tuple(system + suffix)) + ((key,) if key is not None else ()))
            live.append(next_id)
            next_id += 1
        elif kind in ("append", "reserve"):
            n = draw(st.integers(1, bs + 1))
            ops.append((kind, draw(st.sampled_from(live)), tuple(draw(st.lists(vocab, min_size=n, max_size=n)))))
        elif kind == "write":
            ops.append(("write", draw(st.sampled_from(live)), draw(st.none() | st.integers(1, 2 * bs))))
        elif kind == "fork" and next_id < max_seqs * 3:
            parent = draw(st.sampled_from(live))
            ops.append(("fork", parent, next_id))
            if draw(st.booleans()):  # parallel sampling: parent and child each append their own tokens at once
                first = None
                for seq in (parent, next_id):
                    n = draw(st.integers(1, bs))
                    tokens = draw(st.lists(vocab, min_size=n, max_size=n))
                    if first is not None and tokens[0] == first:  # the samples diverge at their first token
                        tokens[0] = (first + 1) % 8
                    first = tokens[0]
                    ops.append(("append", seq, tuple(tokens)))
            live.append(next_id)
            next_id += 1
        elif kind == "free":
            victim = draw(st.sampled_from(live))
            ops.append(("free", victim))
            live.remove(victim)
    return CacheScenario(geometry, tuple(ops), enable_prefix_caching=enable_prefix_caching,
                         constant_hash=draw(st.booleans()) if constant_hash is None else constant_hash,
                         seed=draw(st.integers(0, 1000)), num_layers=draw(st.sampled_from((1, 2, 3))))
