"""Batches of sequences over one pool: random, fragmented and large-pool block tables."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from pagedkv.cache.allocator import BlockAllocator
from pagedkv.backends.capabilities import FEATURE_NAMES
from pagedkv.testing.cases.case import FINITE_POISONS, LAYOUTS, POISONS, VALUE_PATTERNS, Case, Geometry, SeqSpec
from pagedkv.cache.config import blocks_needed

from .palette import MLA_WIDTHS
from .geometry import BLOCK_SIZES, DTYPES, REALISTIC_BLOCK_SIZES, geometries, positions_in, run_palette, seq_lens


#: Key tiles kernels loop over (vLLM's ``unified_attention``: 16, 32 or 64 keys; pagedkv's Triton
#: kernel: 16 or 32): lengths just around one or two tiles, drawn at block sizes up to 16, most of which
#: do not divide a tile, so a tile ends inside a block and a block inside a tile.
TILE_EDGES = tuple(sorted({k * t + d for t in (16, 32, 64) for k in (1, 2) for d in (-1, 0, 1)}))
#: A long sequence's query may cross a query tile (16 rows) too: a chunked prefill past one tile.
LONG_MAX_Q_LEN = 17
#: A long case's chunked prefill may also end at a production kernel's query tile (32, 64, 128 rows) or one past it.
LONG_Q_TILE_EDGES = (31, 32, 33, 63, 64, 65, 127, 128, 129)

#: Contexts (keys before the new tokens) of the long-context cases: hundreds to several thousand tokens,
#: around powers of two (where a float16 accumulator's spacing doubles and split-KV kernels change their
#: part counts) and between them. Errors that grow with the context (a float16 softmax denominator, a
#: split merge that drops a part's maximum, a mask wrong only far from the query) show here, not at the
#: short lengths the other cases draw.
LONG_CONTEXTS = (255, 256, 500, 511, 513, 1000, 1023, 1025, 2047, 2048, 2049, 3000, 4095, 4096, 8191, 8193)
#: The most blocks a long case's table has (Hypothesis draws lists of at most 8192 elements)
LONG_MAX_BLOCKS = 4096
#: One attention case in this many is long (a uniform draw; see ``docs/gating.md`` for the measured share).
LONG_ONE_IN = 4
#: Decode batches past a kernel's batch tile (8 or 16 sequences a program): one short batch in
#: :data:`WIDE_ONE_IN` at block sizes up to 16 holds :data:`WIDE_BATCH` sequences, every query one token
#: at most (the shape continuous batching decodes in), where the caller allows four sequences or more.
WIDE_BATCH = (9, 17)
WIDE_ONE_IN = 8
#: Long cases stay cheap: one kv head, a GQA group of 1 or 2 and the smallest head dims, where the
#: declared space allows (else its smallest sizes).
LONG_HEAD_DIMS = (1, 2, 4, 8)
LONG_GROUP_SIZES = (1, 2)
#: Value patterns of the short cases; a long case draws ``"diffuse"`` in half the cases (attention spread
#: over thousands of keys with values of mean 1: far keys carry weight, so a kernel that drops, masks or
#: mis-accumulates them moves the output; with peaked attention it would still be close).
SHORT_VALUE_PATTERNS = tuple(p for p in VALUE_PATTERNS if p != "diffuse")


@st.composite
def _long_lengths(draw, block_size: int):
    """``[(seq_len, q_len, start)]`` of a long case: one sequence whose context is drawn from
    :data:`LONG_CONTEXTS`, as a decode (one new token) or a chunked prefill (up to
    :data:`LONG_MAX_Q_LEN` new tokens after the context, or :data:`LONG_Q_TILE_EDGES`), and in half the cases a
    short second sequence (decode, prefill or empty) before or after it. Contexts of more than
    :data:`LONG_MAX_BLOCKS` blocks are left out (a block table Hypothesis draws entry by entry)."""
    context = draw(st.sampled_from([c for c in LONG_CONTEXTS if -(-(c + LONG_Q_TILE_EDGES[-1]) // block_size)
                                    <= LONG_MAX_BLOCKS]))
    q_len = draw(st.one_of(st.just(1), st.integers(1, LONG_MAX_Q_LEN), st.sampled_from(LONG_Q_TILE_EDGES)))
    n = context + q_len
    out = [(n, q_len, draw(st.sampled_from(sorted({0, context, n - 1}))))]
    if draw(st.booleans()):
        m = draw(seq_lens(block_size, 24))
        out.insert(draw(st.integers(0, 1)), (m, draw(st.integers(0, min(m, 6))), draw(positions_in(m, block_size))))
    return out


def long_geometry(caps=None, dtypes=DTYPES) -> st.SearchStrategy[Geometry]:
    """The geometry of a long case: any declared block size (small and production ones), one kv head,
    a GQA group of 1 or 2 and a head_dim of at most 8 (each the smallest the declared space allows
    when it allows none of these)."""
    return geometries(num_blocks=1, dtypes=dtypes, caps=caps, realistic=False,
                      block_sizes=BLOCK_SIZES + REALISTIC_BLOCK_SIZES, head_dims=LONG_HEAD_DIMS,
                      group_sizes=LONG_GROUP_SIZES, max_kv_heads=1)


@st.composite
def _geometry_and_lengths(draw, caps, dtypes, long_contexts: bool, max_seqs: int, max_len: int, max_q_len: int,
                          geometry_kwargs: dict):
    """``(geometry, [(seq_len, q_len, start)], long)``: a long case one time in :data:`LONG_ONE_IN` when
    ``long_contexts``, else the short batch of :func:`_lengths`."""
    if long_contexts and draw(st.integers(0, LONG_ONE_IN - 1)) == LONG_ONE_IN - 1:
        geometry = draw(long_geometry(caps, dtypes))
        return geometry, draw(_long_lengths(geometry.block_size)), True
    geometry = draw(geometries(num_blocks=1, dtypes=dtypes, caps=caps, **geometry_kwargs))
    bs = geometry.block_size
    return geometry, draw(_lengths(bs, *_scaled(bs, max_seqs, max_len), max_q_len)), False


@st.composite
def _lengths(draw, block_size: int, max_seqs: int, max_len: int, max_q_len: int):
    """``[(seq_len, q_len, start)]`` for 1..max_seqs sequences; q_len biased to 1 (decode) and whole prompts.

    Swarm-style, one case in four at block sizes up to 16 turns *long* on: one sequence (any of
    them) takes a length from :data:`TILE_EDGES` (past ``max_len``, up to 129 tokens) and a query of
    up to :data:`LONG_MAX_Q_LEN` tokens, and in half of those its context (the keys before its query)
    is that length instead, so a kernel's key loop ends exactly on a tile edge at the new tokens; the
    other sequences keep their short lengths, so a batch mixes decodes, prefills, chunked prefills and
    empty sequences with one sequence crossing kernel tiles.
    One batch in four is decodes only (every query at most one token, empty sequences included), the
    shape a kernel's split-KV path (vLLM's 3D ``unified_attention``, flash-decoding) is chosen for; one in
    :data:`WIDE_ONE_IN` is a wide decode batch (:data:`WIDE_BATCH` sequences), past a batch tile.
    """
    count = draw(st.integers(1, max_seqs))
    wide = max_seqs >= 4 and block_size <= 16 and draw(st.integers(0, WIDE_ONE_IN - 1)) == WIDE_ONE_IN - 1
    if wide:  # the top value turns it on: a failure shrinks toward the short batch
        count = draw(st.integers(*WIDE_BATCH))
    long_lens = [n for n in TILE_EDGES if n > max_len] if block_size <= 16 else []
    longest = draw(st.integers(0, count - 1)) if long_lens and draw(st.integers(0, 3)) == 3 else None
    decode_only = wide or draw(st.integers(0, 3)) == 3  # a batch of decodes only: what split-KV (3D) paths serve
    out = []
    for i in range(count):
        n = draw(st.sampled_from(long_lens)) if i == longest else draw(seq_lens(block_size, max_len))
        q_cap = min(n, 1 if decode_only else LONG_MAX_Q_LEN if i == longest else max_q_len)
        q_len = draw(st.one_of(st.sampled_from(sorted({min(1, n), q_cap})), st.integers(0, q_cap)))
        if i == longest and draw(st.booleans()):  # the context (keys before the new tokens) ends on the tile edge
            n += q_len
        out.append((n, q_len, draw(positions_in(n, block_size))))
    return out


def poisons_for(caps=None) -> tuple[str, ...]:
    """The poisons a backend's declared preconditions allow (finite ones under ``finite_unused_slots``)."""
    if caps is not None and "finite_unused_slots" in caps.preconditions:
        return FINITE_POISONS
    return POISONS


#: Soft-caps drawn (``softcap * tanh(logit / softcap)``): 30 and 50 are Grok-1's and Gemma-2's and
#: bend only the "large" pattern's logits (in the hundreds); 5 bends the tail of normal ones (|logit| up
#: to ~4); 1 and below saturate nearly every logit, down to 2**-4, near the switch-off at 0 a kernel tests
#: (``softcap > 0``). Four of seven are at most 1, so a fault on that side is drawn as often as the rest.
SOFTCAPS = (1.0, 0.5, 0.25, 0.0625, 5.0, 30.0, 50.0)
FP8_SCALES = (0.5, 0.0625, 0.03, 2.0, 1.0)


def declared_features(caps=None, features: bool | tuple = True) -> frozenset[str]:
    """The features a case may use: those ``caps`` declares (every one for ``caps=None``), none when
    ``features`` is False, only the named ones when it is a tuple."""
    declared = FEATURE_NAMES if caps is None else caps.features
    if features is True:
        return frozenset(declared)
    return frozenset(declared) & frozenset(features or ())


@st.composite
def feature_fields(draw, geometry: Geometry, seqs, *, allowed=FEATURE_NAMES, force=(), palette=None,
                   lse: bool = False) -> dict:
    """The optional features of a case, each drawn only when ``allowed`` (a backend's declared features)
    names it; ``force`` (feature names) turns those on. Half the cases draw none unless forced, so the
    plain path keeps its share; the other half is swarm-style: each declared feature on with
    probability one half, at least one. The switch is a 1-in-3 draw for "none": Hypothesis's generation
    (which mutates and splices earlier examples, the first of them the simplest) lands a fair coin deep
    in a case this large on True only about 35% of the time in 25-example runs (measured), so a coin
    gave 35% featured cases; 1 in 3 gives 51%.
    Windows are biased to 0, 1, ``bs - 1``, ``bs``, the whole context and past it; a quarter of the sinks
    are ``-inf`` (:meth:`Case.sink_values`); fp8 scales are per tensor or per kv head. With a ``palette``
    (:class:`~pagedkv.testing.strategies.palette.Palette` declaring ``features``), the features on are one
    of its feature sets that holds ``force``; with ``lse`` (a case of the LSE properties) one of the sets
    that hold the LSE variant (:data:`~pagedkv.testing.strategies.palette.LSE`), the others without it."""
    from pagedkv.testing.strategies.palette import LSE

    force = frozenset(force) & frozenset(allowed)
    if not allowed or not force and draw(st.integers(0, 2)) == 0:  # none: shrinks toward no feature
        return {}
    sets = [s - {LSE} for s in (palette.feature_sets if palette else ()) if (LSE in s) == lse]
    sets = [s for s in sets if s and force <= s <= frozenset(allowed)]
    if sets:  # the run's compile budget: a feature set of its palette
        on = set(draw(st.sampled_from(sets)))
    else:
        on = {f for f in sorted(allowed) if f in force or draw(st.booleans())}
        on = on or {draw(st.sampled_from(sorted(allowed)))}
    out: dict = {}
    if "window" in on:
        bs, context = geometry.block_size, max((s.seq_len for s in seqs), default=0)
        edges = sorted({0, 1, bs - 1, bs, context, context + 1, context + bs} - {-1})
        out["window_left"] = draw(st.one_of(st.sampled_from(edges), st.integers(0, context + 1)))
    if "softcap" in on:
        out["softcap"] = draw(st.sampled_from(SOFTCAPS))
    out.update(alibi="alibi" in on, sinks="sinks" in on)
    if "fp8" in on:
        out["kv_cache_dtype"] = draw(st.sampled_from(("fp8_e4m3", "fp8_e5m2")))
        for name in ("k_scale", "v_scale"):
            per_head = st.tuples(*[st.sampled_from(FP8_SCALES)] * geometry.num_kv_heads)
            out[name] = draw(st.one_of(st.sampled_from(FP8_SCALES), per_head))
    return out


@st.composite
def _extras(draw, geometry: Geometry, seqs, *, read_only: bool, caps=None, poisons=None, features=True,
            force=(), long: bool = False, lse: bool = False) -> Case:
    layouts = LAYOUTS if caps is None or caps.strided_pools else ("contiguous",)
    case = Case(
        geometry=geometry,
        seqs=tuple(seqs),
        values=draw(st.one_of(st.just("diffuse"), st.sampled_from(SHORT_VALUE_PATTERNS)) if long
                    else st.sampled_from(SHORT_VALUE_PATTERNS)),
        poison=draw(st.sampled_from(poisons or poisons_for(caps))),
        pad_value=draw(st.sampled_from((-1, -1, 0, geometry.num_blocks))) if read_only else -1,
        pad_columns=draw(st.integers(0, 2)),
        table_dtype=draw(st.sampled_from(("int32", "int64"))),
        layout=draw(st.sampled_from(layouts)),
        scale=draw(st.one_of(st.none(), st.sampled_from((0.5, 1.0, 0.1)))),
        seed=draw(st.integers(0, 2**16)),
        **draw(feature_fields(geometry, seqs, allowed=declared_features(caps, features), force=force,
                              palette=run_palette(caps), lse=lse)),
        num_splits=draw(split_counts(caps, row_key_counts(seqs))),
    )
    return case.replace(**draw(latent_view(case, caps)))


@st.composite
def latent_view(draw, case: Case, caps) -> dict:
    """The fields that make ``case`` MLA's latent cache (``v_cache = k_cache[..., :head_dim_v]``, layout
    ``"latent"``), or ``{}``: always for a backend declaring ``shared_kv_storage`` (an fp8 pool then takes
    V's scale from K's: one storage, one scale); where ``caps`` declares V widths of their own, V is at most
    K's width and the pool is not fp8 (a scale moved onto K alone would move V's): always at MLA's widths
    (576 / 512: MLA's cache is the latent one, and a kernel's MLA path, vLLM's ``is_mla`` with its rope tile,
    runs only on it), else one case in two."""
    g = case.geometry
    if caps is None or g.v_dim > g.head_dim:
        return {}
    if caps.shared_kv_storage:
        return {"layout": "latent", "v_scale": case.k_scale}
    if caps.head_dims_v is None or case.kv_cache_dtype != "auto":
        return {}
    if MLA_WIDTHS.get(g.head_dim) != g.v_dim and not draw(st.booleans()):
        return {}
    return {"layout": "latent"}


#: split-K counts drawn for a backend that declares ``split_k``: no split and a few. Three parts already
#: outnumber the key tiles (16 to 64 keys) of most drawn contexts, so empty parts are drawn too; more
#: parts only add empty programs, which cost Triton's interpreter as much as full ones.
SPLIT_COUNTS = (1, 2, 3)
#: The largest split count drawn at a split edge (:func:`empty_split_counts`).
MAX_EDGE_SPLITS = 6


def empty_split_counts(key_counts, most: int = MAX_EDGE_SPLITS) -> list[int]:
    """Split counts ``S`` in ``2 .. most`` at which flash-decoding's cut of a row of ``n`` keys (``n`` one of
    ``key_counts``) into ``S`` splits of ``ceil(n / S)`` keys (vLLM's, SGLang's and pagedkv's split-K
    kernels) leaves a split that starts exactly at the row's end: the edge of an empty split, whose
    scratch the first stage never writes and the merge must skip (vllm#47188), as a block boundary is the
    edge of a block. Each row's smallest such count: one key and two splits, two keys and three, four and
    three, six and four, ...; every ``n`` below ``most`` has one (``n + 1`` at most)."""
    edges = ({s for s in range(2, most + 1) if any(k * -(-n // s) == n for k in range(1, s))} for n in set(key_counts)
             if n > 0)
    return sorted({min(e) for e in edges if e})  # each row's fewest: more splits only cost interpreted programs


def split_counts(caps=None, key_counts=()) -> st.SearchStrategy:
    """``Case.num_splits``: ``None`` (the backend's heuristic) for a backend without ``split_k``; for one
    with it, ``None`` in about a quarter of the cases (shrinks there), a count from :data:`SPLIT_COUNTS` in
    another and, where the rows' ``key_counts`` have one, a count at a split edge (:func:`empty_split_counts`)
    in half, as lengths are biased to block boundaries, so
    split decodes and empty splits are drawn on every device (the CUDA heuristic never splits on a CPU)."""
    if caps is None or not getattr(caps, "split_k", False):
        return st.none()
    edges = empty_split_counts(key_counts)
    plain = (None, *SPLIT_COUNTS)  # None first: a failure shrinks toward the backend's own count
    at_edges = tuple(edges[i % len(edges)] for i in range(len(plain))) if edges else ()
    return st.sampled_from(plain[:1] + at_edges + plain[1:])


def row_key_counts(seqs) -> list[int]:
    """The keys each query row sees under causality, per sequence ``seq_len - q_len + 1 .. seq_len``."""
    return [n for s in seqs for n in range(s.seq_len - s.q_len + 1, s.seq_len + 1)]


def _scaled(block_size: int, max_seqs: int, max_len: int) -> tuple[int, int]:
    """``(max_seqs, max_len)`` for a block size: large blocks get lengths that cross a block boundary
    (past two blocks up to 64 tokens a block, one block and a bit beyond) and fewer sequences, so a case
    stays cheap for a kernel run by Triton's interpreter."""
    if block_size <= 16:
        return max_seqs, max_len
    if block_size <= 64:
        return min(max_seqs, 2), max(max_len, 2 * block_size + 1)
    return 1, max(max_len, block_size + 2)


@st.composite
def cases(draw, *, max_seqs: int = 4, max_len: int = 24, max_q_len: int = 6, repeats: bool | None = None,
          dtypes=DTYPES, caps=None, poisons=None, features: bool | tuple = True, force=(),
          long_contexts: bool = False, lse: bool = False, **geometry_kwargs) -> Case:
    """A batch: geometry, per-sequence block tables, lengths, query lengths, scatter starts, pattern, seed.

    Tables are a random permutation of the pool split among the sequences (every block owned once,
    unused blocks left over), or, with ``repeats`` (drawn when ``None``), ids drawn independently so
    one physical block can appear several times (valid for reads; writes skip such sequences).
    ``caps`` (:class:`pagedkv.backends.capabilities.Capabilities`) keeps the case inside a backend's
    declared space, its features included (:func:`feature_fields`; ``caps=None``: every feature);
    ``features=False`` draws none, a tuple only those; ``force`` turns features on; ``poisons``
    overrides the poisons drawn. With ``long_contexts``, one case in :data:`LONG_ONE_IN` is long
    (:data:`LONG_CONTEXTS`: a context of hundreds to several thousand tokens, decode or chunked
    prefill, at most two sequences, small heads: :func:`long_geometry`). V of its own width and MLA's
    latent view are drawn where ``caps`` declares them (:func:`~.geometry.v_widths`, :func:`latent_view`);
    ``lse``: the feature sets of the LSE properties (:func:`feature_fields`).
    """
    geometry, lengths, long = draw(_geometry_and_lengths(caps, dtypes, long_contexts, max_seqs, max_len, max_q_len,
                                                         geometry_kwargs))
    bs = geometry.block_size
    need = [blocks_needed(n, bs) for n, _, _ in lengths]
    if caps is not None and not caps.repeated_blocks:
        repeats = False
    repeats = draw(st.booleans()) if repeats is None else repeats
    if repeats:
        num_blocks = draw(st.integers(1, max(1, sum(need))))
        tables = [tuple(draw(st.lists(st.integers(0, num_blocks - 1), min_size=k, max_size=k))) for k in need]
    else:
        num_blocks = draw(st.integers(max(1, sum(need)), sum(need) + 3))
        perm = draw(st.permutations(range(num_blocks)))
        tables, at = [], 0
        for k in need:
            tables.append(tuple(perm[at:at + k]))
            at += k
    geometry = dataclasses.replace(geometry, num_blocks=num_blocks)
    seqs = [SeqSpec(t, n, q, s) for t, (n, q, s) in zip(tables, lengths)]
    return draw(_extras(geometry, seqs, read_only=repeats, caps=caps, poisons=poisons, features=features,
                        force=force, long=long, lse=lse))


@st.composite
def fragmented_cases(draw, *, max_seqs: int = 4, max_len: int = 24, max_q_len: int = 6, dtypes=DTYPES,
                     caps=None, poisons=None, features: bool | tuple = True, force=(), long_contexts: bool = False,
                     **geometry_kwargs) -> Case:
    """A batch whose block tables come from a real :class:`BlockAllocator` after a random alloc/free
    history has scrambled its free list (the layouts a long-running server produces); ``long_contexts``
    as in :func:`cases`."""
    geometry, lengths, long = draw(_geometry_and_lengths(caps, dtypes, long_contexts, max_seqs, max_len, max_q_len,
                                                         geometry_kwargs))
    bs = geometry.block_size
    need = [blocks_needed(n, bs) for n, _, _ in lengths]
    num_blocks = draw(st.integers(max(1, sum(need)), sum(need) + 6))
    allocator = BlockAllocator(num_blocks, bs, enable_prefix_caching=False)
    held: list[int] = []
    for grab in draw(st.lists(st.integers(-3, 3), max_size=16)):
        if grab > 0 and allocator.num_free >= grab:
            held += allocator.allocate(grab)
        elif grab <= 0 and held:
            allocator.free(held.pop(draw(st.integers(0, len(held) - 1))))
    allocator.free_all(held)  # everything back, in a scrambled order
    tables = [tuple(allocator.allocate(k)) for k in need]
    geometry = dataclasses.replace(geometry, num_blocks=num_blocks)
    return draw(_extras(geometry, [SeqSpec(t, n, q, s) for t, (n, q, s) in zip(tables, lengths)], read_only=False,
                        caps=caps, poisons=poisons, features=features, force=force, long=long))


LARGE_POOL_BLOCK_SIZES = (1, 16, 64, 256)


def large_pool_unsupported(caps) -> str | None:
    """Why :func:`large_pool_cases` cannot be drawn for a backend's declared space (``None``: it can).

    The cases keep pools of more than 2**24 slots cheap with one kv head of ``head_dim`` 1 in a 16-bit
    dtype (32 MiB a pool)."""
    if not caps.head_dims.allows(1) or not caps.num_kv_heads.allows(1):
        return f"large-pool cases use head_dim 1 and one kv head; declared head_dim {caps.head_dims.describe()}"
    if not {"float16", "bfloat16"} & caps.dtypes:
        return "large-pool cases use a 16-bit dtype; none is declared"
    if caps.max_pool_bytes is not None and caps.max_pool_bytes < 2 * (2**24 + 4 * 256):
        return f"large-pool cases need pools of 32 MiB; declared max_pool_bytes {caps.max_pool_bytes}"
    return None


@st.composite
def large_pool_cases(draw, *, min_slots: int = 2**24 + 1, caps=None, poisons=None) -> Case:
    """One or two short sequences placed at the *end* of a pool of more than ``min_slots`` slots
    (2**24 by default: past float32's exact integers), with tiny heads so the pool stays cheap
    (``num_kv_heads = head_dim = 1``, float16/bfloat16: 2 bytes a slot). Index arithmetic in float32 or
    int32 element offsets misplaces these tokens."""
    bs = draw(st.sampled_from(LARGE_POOL_BLOCK_SIZES if caps is None
                              else caps.block_sizes.choose(LARGE_POOL_BLOCK_SIZES)))
    num_blocks = -(-min_slots // bs) + draw(st.integers(0, 3))
    dtypes = ("float16", "bfloat16") if caps is None else tuple(d for d in ("float16", "bfloat16") if d in caps.dtypes)
    groups = (1, 2) if caps is None else caps.gqa_groups.choose((1, 2))
    geometry = Geometry(num_blocks, bs, 1, 1, draw(st.sampled_from(groups)), draw(st.sampled_from(dtypes)))
    seqs = []
    top = num_blocks
    for _ in range(draw(st.integers(1, 2))):
        n = draw(seq_lens(bs, 2 * bs, min_len=1))
        k = blocks_needed(n, bs)
        table = tuple(range(top - k, top))
        top -= k
        seqs.append(SeqSpec(table, n, min(n, draw(st.integers(1, 3))), draw(positions_in(n, bs))))
    return Case(geometry, tuple(seqs), values="identity", poison=draw(st.sampled_from(poisons or poisons_for(caps))),
                seed=draw(st.integers(0, 100)))
