"""What a backend supports: sizes, dtypes, layouts, features, and the preconditions it assumes.

Production kernels support a space of inputs, not every input: vLLM's CPU attention takes head
dims in {32, 48, ..., 512} and block sizes that are multiples of 16; many kernels need contiguous
pools. A backend says so with a ``capabilities`` attribute::

    from pagedkv.backends.capabilities import Capabilities, Sizes

    capabilities = Capabilities(
        block_sizes=Sizes(multiple_of=16),
        head_dims=Sizes(values={32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}),
        dtypes={"float32", "bfloat16"},
        strided_pools=False,
        preconditions={"finite_unused_slots"},
    )

The conformance suite draws cases inside the declared space, skips a property that needs more
(with the reason), and runs the properties a declared *precondition* would exclude as separate,
non-gating checks whose failures are reported as findings. A backend without the attribute is
assumed to support everything (as the built-in ``loop``, ``indexed`` and ``triton`` do).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pagedkv.validation.arguments import ALL_FEATURES
from pagedkv.layouts import NHD, PoolLayout, pool_layouts
from pagedkv.layouts import describe as describe_layout

DTYPE_NAMES = frozenset({"float32", "float16", "bfloat16"})
FEATURE_NAMES = ALL_FEATURES  # the optional attention features (defined with their argument checks)

#: name -> what a backend that declares it assumes about its inputs.
PRECONDITIONS = {
    "finite_unused_slots": "slots no sequence owns (the unused tail of a last block, unowned blocks) hold finite "
                           "values, as an engine that zeroes new blocks guarantees",
}


@dataclass(frozen=True)
class Sizes:
    """A set of allowed positive integers: explicit ``values``, or ``min .. max`` in steps of ``multiple_of``.

    Raises (on construction):
        ValueError: ``multiple_of`` or ``min`` below 1, ``max < min``, or a non-positive value.
    """

    values: frozenset[int] | None = None
    multiple_of: int = 1
    min: int = 1
    max: int | None = None

    def __post_init__(self) -> None:
        if self.values is not None:
            object.__setattr__(self, "values", frozenset(int(v) for v in self.values))
            if not self.values or min(self.values) < 1:
                raise ValueError(f"Sizes.values must be non-empty positive ints, got {sorted(self.values)}")
        if self.multiple_of < 1 or self.min < 1 or (self.max is not None and self.max < self.min):
            raise ValueError(f"Sizes needs multiple_of >= 1, min >= 1, max >= min; got {self}")

    def allows(self, n: int) -> bool:
        """Whether ``n`` is in the set."""
        if self.values is not None:
            return n in self.values
        return n >= self.min and (self.max is None or n <= self.max) and n % self.multiple_of == 0

    def choose(self, preferred: Iterable[int]) -> tuple[int, ...]:
        """The allowed members of ``preferred`` in its order; when none is allowed, the smallest few
        members of the set itself (so a strategy always has something to draw)."""
        picked = tuple(n for n in preferred if self.allows(n))
        if picked:
            return picked
        if self.values is not None:
            return tuple(sorted(self.values))
        first = -(-self.min // self.multiple_of) * self.multiple_of
        return tuple(n for n in range(first, first + 4 * self.multiple_of, self.multiple_of)
                     if self.max is None or n <= self.max) or (first,)

    def describe(self) -> str:
        if self.values is not None:
            return "{" + ", ".join(map(str, sorted(self.values))) + "}"
        parts = [f"multiple of {self.multiple_of}"] if self.multiple_of > 1 else []
        if self.min > 1 or self.max is not None:
            parts.append(f"{self.min}..{self.max if self.max is not None else 'inf'}")
        return ", ".join(parts) or "any"


ANY = Sizes()
#: Pool layouts a backend may declare by name (``Capabilities.layout``; a
#: :class:`~pagedkv.layouts.PoolLayout` or a ``(key, value)`` pair of them declares any other).
LAYOUTS = ("NHD", "HND")
#: Parameters that may specialise a backend's kernels (``Capabilities.specialize_on``).
SPECIALIZATION_NAMES = frozenset({"block_size", "head_dim", "gqa_group", "dtype", "features"})
#: Page-table formats a backend's ``paged_attention`` may declare (``Capabilities.page_table``).
PAGE_TABLES = ("padded", "csr")
#: LSE layouts (``Capabilities.lse``): vLLM's ``[num_q_heads, total_q]``, FlashInfer's ``[total_q, num_q_heads]``.
LSE_LAYOUTS = ("head_major", "token_major")
#: LSE bases (``Capabilities.lse_base``): natural log, or log2 (kernels whose softmax runs in exp2).
LSE_BASES = ("e", "2")
#: Largest ``Capabilities.nondeterminism_ulp`` (a reduction's order moves a result by a few ulps, not more).
MAX_NONDETERMINISM_ULP = 64
#: The nondeterminism the guard's rerun allows, per output dtype, in ulps of the values summed
#: (:func:`pagedkv.testing.compare.rerun_differs`); a declaration above a dtype's cap is judged at the cap
#: there. float32: a float32 accumulation reordered over up to a few dozen partials moves a result by a few
#: ulps of the terms (64 is ~8e-6 of max|V|). float16 / bfloat16: a kernel accumulating in float32 rounds
#: once into the half output, so a reorder moves it by at most one half ulp step (two adjacent roundings
#: of nearly equal float32 values), plus one where partials are stored in the output dtype before the
#: merge: 2. 64 ulps at bfloat16 would be ~25% of max|V|, a wrong kernel's room, not a reorder's.
NONDETERMINISM_ULP_CAP = {"float32": MAX_NONDETERMINISM_ULP, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class NonPromise:
    """A declared non-promise: why a property is not promised exactly, and the bound it still keeps.

    On a bit-identical invariance (``a_request_alone_equals_the_same_request_in_a_batch``,
    ``outputs_are_bit_identical_under_*``, ...) it means "not bit-identical": the attention outputs may
    differ, within the attention tolerance of :mod:`pagedkv.testing.compare` widened by the bound
    given here. On a property judged within a tolerance (the fp64 reference, the feature identities,
    ...) it widens that tolerance and a bound is required: ``ulps`` (units in the last place of the
    output dtype, as an absolute and a relative error), ``rtol`` and / or ``atol``. Which properties take
    one and the limits on the reference property: :mod:`pagedkv.testing.non_promises`.

    Raises (on construction):
        ValueError: an empty reason, or a bound that is not a positive finite number.
    """

    reason: str
    ulps: float | None = None
    rtol: float | None = None
    atol: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(f"NonPromise.reason: give the reason the property is not promised (a non-empty "
                             f"string), got {self.reason!r}")
        for name in ("ulps", "rtol", "atol"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"NonPromise.{name}: a positive finite number or None, got {value!r}")

    @property
    def widens(self) -> bool:
        """Whether it names a tolerance (``ulps``, ``rtol`` or ``atol``) beyond the attention tolerance."""
        return any(v is not None for v in (self.ulps, self.rtol, self.atol))

    def describe(self) -> str:
        """The bound in words: ``"within 4 ulps"``, ``"within rtol 1e-3, atol 1e-3"``, ``"within the attention
        tolerance"``."""
        parts = [f"{self.ulps:g} ulps" if self.ulps else "", f"rtol {self.rtol:g}" if self.rtol else "",
                 f"atol {self.atol:g}" if self.atol else ""]
        return "within " + (", ".join(p for p in parts if p) or "the attention tolerance")

    def as_dict(self) -> dict:
        """The declaration as JSON data."""
        return {"reason": self.reason, "bound": self.describe(), "ulps": self.ulps, "rtol": self.rtol,
                "atol": self.atol}


@dataclass(frozen=True)
class Capabilities:
    """The input space a backend supports (see the module docstring).

    Attributes:
        block_sizes, head_dims, gqa_groups, num_kv_heads: allowed sizes (``num_q_heads // num_kv_heads``
            for ``gqa_groups``).
        dtypes: names of the pool/query dtypes it takes (``float32``, ``float16``, ``bfloat16``).
        max_pool_bytes: the largest pool (one of K or V) it should be given; ``None`` = no limit.
        strided_pools: takes non-contiguous pool views (``kv[:, 0]`` of an interleaved arena).
        strided_metadata: takes strided ``block_tables`` / ``seq_lens`` / ``query_start_loc`` views.
        repeated_blocks: reads tables that name one physical block twice.
        features: attention features it implements (:data:`FEATURE_NAMES`).
        preconditions: assumptions about its inputs (:data:`PRECONDITIONS`).
        split_k: its ``paged_attention`` takes ``num_splits`` (split-K decode; ``None``: its heuristic),
            so the suite draws split counts (``Case.num_splits``). Read from a ``SPLIT_K`` attribute
            when the backend has no ``capabilities``.
        page_table: ``"padded"`` (``block_tables [batch, max_blocks]`` padded with ``-1``, vLLM's and
            flash-attn's) or ``"csr"`` (FlashInfer's ``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len``,
            :mod:`pagedkv.csr`): its ``paged_attention`` is then called as ``paged_attention(query,
            k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, query_start_loc, scale=None,
            **features)``, the suite builds that metadata from every drawn case, and the CSR faults
            replace the padded-table faults of the rejection property.
        specialize_on: the parameters that specialise its kernels (a compiled variant each:
            :data:`SPECIALIZATION_NAMES`); the suite draws them from a small per-run palette
            (:mod:`pagedkv.testing.strategies.palette`). ``None``: all of them for a Triton backend
            (read from a ``SPECIALIZE_ON`` attribute when the backend has no ``capabilities``), else none.
        layout: the pool layout its ops take: ``"NHD"`` (``[num_blocks, block_size, num_kv_heads,
            head_dim]``, the contract's), ``"HND"`` (``[num_blocks, num_kv_heads, block_size, head_dim]``,
            FlashInfer's and vLLM's head-major layout), a :class:`~pagedkv.layouts.PoolLayout` (its own
            mapping of logical positions to storage, for both pools) or a ``(key, value)`` pair of them
            where the pools differ (vLLM's packed CPU layout). The suite builds and poisons the pools
            in that storage, hands the backend the storage (no copy when the layout is a view), and
            compares in logical positions as for any backend (:mod:`pagedkv.layouts`).
        head_dims_v: allowed V widths (``v_cache [num_blocks, block_size, num_kv_heads, head_dim_v]``, the
            output ``[total_q, num_q_heads, head_dim_v]``); ``None``: only ``head_dim_v == head_dim``. Read
            from a ``HEAD_DIMS_V`` attribute when the backend has no ``capabilities``.
        shared_kv_storage: ``paged_attention`` reads V from K's storage (MLA's latent cache: V is the first
            ``head_dim_v`` columns of K), so the suite builds ``v_cache`` as ``k_cache[..., :head_dim_v]``
            for it (``head_dim_v <= head_dim``) and never writes V separately. ``False``: separate pools
            (and, where ``head_dims_v`` allows, sometimes that view). ``SHARED_KV_STORAGE`` attribute.
        lse: ``paged_attention(..., return_lse=True)`` returns ``(out, lse)``, ``lse`` float32
            ``[num_q_heads, total_q]`` (``"head_major"``, vLLM) or ``[total_q, num_q_heads]``
            (``"token_major"``, FlashInfer): the log of each row's softmax denominator (sink included).
            ``None``: no LSE (the argument is never passed). The same layout is taken and returned by a
            ``merge_attn_states`` op when the backend has one. ``LSE`` attribute.
        lse_base: ``"e"`` (natural log) or ``"2"`` (log2) for :attr:`lse` and ``merge_attn_states``.
            ``LSE_BASE`` attribute.
        non_promises: properties the backend does not promise exactly, by design, each with the reason and
            a bound the suite checks (:class:`NonPromise`; ``{name: "reason"}`` is ``NonPromise("reason")``,
            "not bit-identical, within the attention tolerance", allowed on the bit-identical invariances
            only). They still run; within the bound a difference is a finding with its case file, beyond
            it, and for any exception, guard violation or non-finite output, the property fails
            (:mod:`pagedkv.testing.non_promises`; docs/gating.md, "Non-promises and their bounds").
            Stored as sorted ``(name, NonPromise)`` pairs (hashable); :meth:`non_promise` reads one.
        nondeterminism_ulp: the kernel is nondeterministic by design (atomics in a split reduction): two
            runs of one call may differ by up to this many ulps per output element. The guard's rerun of a
            call (:meth:`pagedkv.testing.guard.GuardedBackend.judge_again`) compares within it; every
            comparison with the reference keeps its usual bar. ``0`` (the default): bit-deterministic.
            At most :data:`MAX_NONDETERMINISM_ULP`; ulps of the scale of the values summed (max|V|), not
            of each element; judged at :data:`NONDETERMINISM_ULP_CAP` where an output dtype's cap is
            lower (:meth:`rerun_ulps`).

    Raises (on construction):
        TypeError: a size field that is not exactly a :class:`Sizes` (a subclass could draw one space and
            print another).
        ValueError: an unknown dtype, feature, precondition or layout name; a non-promise without a reason
            or with a malformed bound.
    """

    block_sizes: Sizes = ANY
    head_dims: Sizes = ANY
    gqa_groups: Sizes = ANY
    num_kv_heads: Sizes = ANY
    dtypes: frozenset[str] = DTYPE_NAMES
    max_pool_bytes: int | None = None
    strided_pools: bool = True
    strided_metadata: bool = True
    repeated_blocks: bool = True
    features: frozenset[str] = frozenset()
    preconditions: frozenset[str] = frozenset()
    split_k: bool = False
    layout: Any = "NHD"
    page_table: str = "padded"
    non_promises: Any = ()
    specialize_on: frozenset[str] | None = None
    nondeterminism_ulp: int = 0
    head_dims_v: Sizes | None = None
    shared_kv_storage: bool = False
    lse: str | None = None
    lse_base: str = "e"

    def __post_init__(self) -> None:
        for name in ("block_sizes", "head_dims", "gqa_groups", "num_kv_heads", "head_dims_v"):
            sizes = getattr(self, name)
            # exactly Sizes: what the strategies draw (allows, choose) and what the verdict prints (describe)
            # must be one declaration, which a subclass overriding either could split
            if not (type(sizes) is Sizes or (sizes is None and name == "head_dims_v")):
                raise TypeError(f"Capabilities.{name} must be a pagedkv Sizes (values=, or min=/max=/multiple_of=), "
                                f"not {type(sizes).__name__}")
        if isinstance(self.nondeterminism_ulp, bool) or not isinstance(self.nondeterminism_ulp, int) or \
                not 0 <= self.nondeterminism_ulp <= MAX_NONDETERMINISM_ULP:
            raise ValueError(f"Capabilities.nondeterminism_ulp must be an int in [0, {MAX_NONDETERMINISM_ULP}], got "
                             f"{self.nondeterminism_ulp!r}")
        if self.lse not in (None, *LSE_LAYOUTS):
            raise ValueError(f"Capabilities.lse: unknown {self.lse!r}; known: None, {list(LSE_LAYOUTS)}")
        if self.lse_base not in LSE_BASES:
            raise ValueError(f"Capabilities.lse_base: unknown {self.lse_base!r}; known: {list(LSE_BASES)}")
        pairs = self.non_promises.items() if hasattr(self.non_promises, "items") else self.non_promises
        bounded = []
        for name, value in pairs:
            if isinstance(value, str):
                value = NonPromise(value) if value.strip() else None
            if not isinstance(value, NonPromise):
                raise ValueError(f"Capabilities.non_promises[{name!r}]: give the reason the property is not "
                                 f"promised and its bound, NonPromise(reason, ulps=...), got {value!r}")
            bounded.append((str(name), value))
        object.__setattr__(self, "non_promises", tuple(sorted(bounded, key=lambda pair: pair[0])))
        if self.page_table not in PAGE_TABLES:
            raise ValueError(f"Capabilities.page_table: unknown {self.page_table!r}; known: {list(PAGE_TABLES)}")
        try:
            pool_layouts(self.layout)
        except ValueError as exc:
            raise ValueError(f"Capabilities.layout: {exc}") from None
        for name, allowed in (("dtypes", DTYPE_NAMES), ("features", FEATURE_NAMES),
                              ("preconditions", frozenset(PRECONDITIONS))):
            value = frozenset(getattr(self, name))
            unknown = value - allowed
            if unknown:
                raise ValueError(f"Capabilities.{name}: unknown {sorted(unknown)}; known: {sorted(allowed)}")
            object.__setattr__(self, name, value)
        if self.specialize_on is not None:
            unknown = frozenset(self.specialize_on) - SPECIALIZATION_NAMES
            if unknown:
                raise ValueError(f"Capabilities.specialize_on: unknown {sorted(unknown)}; known: "
                                 f"{sorted(SPECIALIZATION_NAMES)}")
            object.__setattr__(self, "specialize_on", frozenset(self.specialize_on))
        if not self.dtypes:
            raise ValueError("Capabilities.dtypes must name at least one dtype")

    def non_promise(self, prop: str) -> NonPromise | None:
        """What the backend declares it does not promise of property ``prop`` and its bound, or ``None``."""
        return dict(self.non_promises).get(prop)

    def rerun_ulps(self, dtype: Any) -> int:
        """The nondeterminism (ulps of the values summed) two runs of one call producing ``dtype`` may differ
        by: :attr:`nondeterminism_ulp`, at most :data:`NONDETERMINISM_ULP_CAP` of that dtype (a name or a
        ``torch.dtype``; 0 for a dtype without a cap: bit for bit)."""
        cap = NONDETERMINISM_ULP_CAP.get(str(dtype).removeprefix("torch."), 0)
        return min(self.nondeterminism_ulp, cap)

    @property
    def pool_layouts(self) -> tuple[PoolLayout, PoolLayout]:
        """``(key_layout, value_layout)``: the declared :attr:`layout` as :class:`~pagedkv.layouts.PoolLayout` s."""
        return pool_layouts(self.layout)

    @property
    def layout_other_than_nhd(self) -> str | None:
        """The declared :attr:`layout`'s name where it is not the contract's NHD (reports name it), else ``None``."""
        return None if self.pool_layouts == (NHD, NHD) else describe_layout(self.layout)

    def rejects(self, geometry: Any) -> str | None:
        """Why ``geometry`` (anything with ``block_size``, ``head_dim``, ``num_kv_heads``,
        ``num_queries_per_kv``, ``dtype``, ``num_blocks``) is outside the space, or ``None``."""
        head_dim_v = getattr(geometry, "head_dim_v", None)
        if head_dim_v is not None and head_dim_v != geometry.head_dim and not (
                self.head_dims_v is not None and self.head_dims_v.allows(head_dim_v)):
            declared = self.head_dims_v.describe() if self.head_dims_v is not None else "None (equal widths only)"
            return f"head_dim_v {head_dim_v} != head_dim {geometry.head_dim} is outside the declared head_dims_v " \
                   f"{declared}"
        checks = (("block_size", self.block_sizes, geometry.block_size),
                  ("head_dim", self.head_dims, geometry.head_dim),
                  ("num_kv_heads", self.num_kv_heads, geometry.num_kv_heads),
                  ("GQA group", self.gqa_groups, geometry.num_queries_per_kv))
        for what, sizes, n in checks:
            if not sizes.allows(n):
                return f"{what} {n} is outside the declared {sizes.describe()}"
        if geometry.dtype not in self.dtypes:
            return f"dtype {geometry.dtype} is not among the declared {sorted(self.dtypes)}"
        if self.max_pool_bytes is not None:
            bytes_per = {"float32": 4, "float16": 2, "bfloat16": 2}[geometry.dtype]
            size = geometry.num_blocks * geometry.block_size * geometry.num_kv_heads * geometry.head_dim * bytes_per
            if size > self.max_pool_bytes:
                return f"a pool of {size} bytes exceeds the declared max_pool_bytes {self.max_pool_bytes}"
        return None

    def summary(self) -> str:
        """One line for reports: the sizes and dtypes, then every declaration that differs from the default."""
        parts = [f"block_size {self.block_sizes.describe()}", f"head_dim {self.head_dims.describe()}",
                 f"GQA group {self.gqa_groups.describe()}", f"dtypes {sorted(self.dtypes)}"]
        if not self.strided_pools:
            parts.append("contiguous pools only")
        if self.layout_other_than_nhd:
            parts.append(f"layout {self.layout_other_than_nhd}")
        if self.page_table != "padded":
            parts.append(f"page_table {self.page_table}")
        if self.split_k:
            parts.append("split-K")
        if self.head_dims_v is not None:
            parts.append(f"head_dim_v {self.head_dims_v.describe()}")
        if self.shared_kv_storage:
            parts.append("V in K's storage (shared_kv_storage)")
        if self.lse is not None:
            parts.append(f"LSE {self.lse} base {self.lse_base}")
        if self.nondeterminism_ulp:
            parts.append(f"reruns differ within {self.nondeterminism_ulp} ulps")
        if self.preconditions:
            parts.append(f"assumes {sorted(self.preconditions)}")
        if self.non_promises:
            parts.append("does not promise " + ", ".join(f"{name} ({bound.describe()})"
                                                           for name, bound in self.non_promises))
        return "; ".join(parts)


def capabilities_of(backend: Any) -> Capabilities:
    """``backend.capabilities`` when it is a :class:`Capabilities`; else every size, dtype and layout,
    with ``features`` taken from a ``FEATURES`` attribute (none when the backend has no such attribute:
    an undeclared feature is reported as not covered, never as passed), ``split_k`` from ``SPLIT_K`` and
    ``page_table`` from a ``page_table`` attribute. The one place a backend's declarations are read.

    Raises:
        TypeError: ``backend.capabilities`` exists but is not a :class:`Capabilities`.
        ValueError: a ``page_table`` attribute that names no format, or one beside ``capabilities`` that
            disagrees with ``capabilities.page_table`` (it would be ignored: the field is the declaration).
    """
    caps = getattr(backend, "capabilities", None)
    attribute = getattr(backend, "page_table", None)
    if caps is None:
        return Capabilities(features=frozenset(getattr(backend, "FEATURES", ())),
                            split_k=bool(getattr(backend, "SPLIT_K", False)),
                            page_table=attribute or "padded",
                            specialize_on=getattr(backend, "SPECIALIZE_ON", None),
                            head_dims_v=getattr(backend, "HEAD_DIMS_V", None),
                            shared_kv_storage=bool(getattr(backend, "SHARED_KV_STORAGE", False)),
                            lse=getattr(backend, "LSE", None), lse_base=getattr(backend, "LSE_BASE", "e"))
    if not isinstance(caps, Capabilities):
        raise TypeError(f"{getattr(backend, 'name', backend)!r}.capabilities must be a "
                        f"pagedkv.backends.capabilities.Capabilities, got {type(caps).__name__}")
    if isinstance(attribute, str) and attribute != caps.page_table:
        raise ValueError(f"{getattr(backend, 'name', backend)!r} has a page_table = {attribute!r} attribute beside "
                         f"capabilities whose page_table is {caps.page_table!r}: declare it on the capabilities, "
                         f'Capabilities(page_table="{attribute}")')
    return caps


def misspelled_capabilities(backend: Any) -> str | None:
    """When ``backend`` has no ``capabilities`` but an attribute that looks like a misspelling of it
    (``capabilites``), the message saying so (its declared space would otherwise be ignored without a
    word); else ``None``. Checked once, when a candidate is loaded."""
    import difflib

    if getattr(backend, "capabilities", None) is not None:
        return None
    names = [n for n in dir(backend) if not n.startswith("__")]
    close = [n for n in difflib.get_close_matches("capabilities", names, n=3, cutoff=0.8) if n != "capabilities"]
    if not close:
        return None
    return (f"{getattr(backend, 'name', None) or type(backend).__name__} has no 'capabilities' attribute but has "
            f"{close[0]!r}: a misspelling? Its declared space is ignored (everything is drawn)")
