"""The property registry: every property of the conformance suite, declared once.

A :class:`Property` names what it checks (one sentence), the ops a backend needs for it, the check
function (``check(backend, case, device)``, raising :class:`~pagedkv.testing.compare.Mismatch`),
the strategy its cases are drawn from and the explicit examples that always run. Everything that
runs properties is driven from here:

- the pytest conformance suite (:mod:`pagedkv.testing.suite`): one test per property, named
  ``test_<name>``;
- ``python -m pagedkv mutate`` / ``fuzz`` / ``peers`` / ``replay`` and the mutation command: each runs
  a property through the one execution core, :mod:`pagedkv.testing.execute`;
- case files: the ``check`` field is a property name (:func:`property_for_record`).

Adding a property is one entry in :func:`_declare`. ``tests/gate/test_registry.py`` fails when a check
function is not registered or a registered property is not collected by pytest.

Strategies are built lazily (``strategy(caps)``): importing the registry needs neither Hypothesis nor
:mod:`pagedkv.testing.strategies`, so a case file replays on a machine without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

#: Examples per large-pool property (each builds a pool of more than 2**24 slots).
LARGE_POOL_EXAMPLES = 10
#: Examples per feature identity property (every other property draws the features too).
FEATURE_EXAMPLES = 20


@dataclass(frozen=True)
class Property:
    """One property of the conformance suite.

    Attributes:
        name: identifier; the pytest test is ``test_<name>`` and case files record it.
        sentence: what the property asserts, in one sentence.
        ops: backend ops it needs; a backend lacking one has the property skipped with the reason.
        check: ``check(backend, case, device)``; with ``pair=True``, ``check(first, second, case, device)``.
        strategy: ``strategy(caps)`` returns the Hypothesis strategy of its cases inside the declared
            space ``caps`` (a :class:`~pagedkv.backends.capabilities.Capabilities`, or ``None``: everything).
        examples: a zero-argument callable returning explicit cases that always run (``@example``).
        max_examples: a cap below the profile's example count (expensive cases).
        pair: the check compares two backends (a candidate is compared with the ``indexed`` backend).
        kind: ``"case"`` (a :class:`~pagedkv.testing.cases.case.Case`), ``"scenario"``
            (:class:`~pagedkv.testing.cases.case.CacheScenario`), ``"invalid"``
            (:class:`~pagedkv.testing.cases.invalid_call.InvalidCall`) or ``"machine"`` (a Hypothesis state
            machine: ``check(backend, device, settings)``, no strategy, no case file).
        requires: ``requires(caps)`` says why a backend's declared space cannot run the property
            (``None``: it can); the suite skips it with that reason.
    """

    name: str
    sentence: str
    ops: tuple[str, ...]
    check: Callable[..., None]
    strategy: Callable[[Any], Any]
    examples: Callable[[], tuple] = tuple
    max_examples: int | None = None
    pair: bool = False
    kind: str = "case"
    requires: Callable[[Any], str | None] = lambda caps: None

    def cannot_run(self, backends: tuple, caps: Any) -> str | None:
        """Why this property cannot be judged on ``backends`` (the candidate last) inside the declared
        space ``caps``, or ``None`` when it can: a feature the candidate does not declare, an op a backend lacks,
        or a space the property needs, in that order (a :class:`~pagedkv.testing.verdict.Skip` carrying its
        reason; plain text: outside the declared space)."""
        from pagedkv.testing.verdict import Skip, SkipReason, skip_reason

        outside = self.requires(caps)
        if outside and skip_reason(outside) is SkipReason.FEATURE_NOT_DECLARED:
            return outside  # a feature never declared is why, whatever op the candidate lacks besides
        for b in backends:
            missing = [op for op in self.ops if not callable(getattr(b, op, None))]
            if missing:
                return Skip(f"{getattr(b, 'name', None) or type(b).__name__} does not provide {missing[0]!r}",
                            SkipReason.MISSING_OP)
        return outside

    def strategy_in(self, caps: Any, **overrides):
        """The Hypothesis strategy of this property's cases inside ``caps`` (``None`` for a state machine)."""
        return None if self.kind == "machine" else self.strategy(caps, **overrides)

    def examples_in(self, caps: Any, *, violating: bool = False) -> list:
        """The explicit examples inside ``caps``, each moved into the declared sizes and dtypes first where
        it lies outside them (:func:`pagedkv.testing.cases.translate.into_space`: an undeclared dtype or
        block size is no part of what an example is about); with ``violating``: those that break its
        declared precondition instead, for findings."""
        from pagedkv.testing.cases.translate import into_space

        moved = [case if caps is None else into_space(case, caps)[0] for case in self.examples()]
        return [case for case in moved if case is not None and _fits(case, caps, violating)]


def _geometry(case: Any) -> Any:
    return getattr(case, "geometry", None) or case.case.geometry


def _fits(case: Any, caps: Any, violating: bool = False) -> bool:
    if caps.rejects(_geometry(case)):
        return False
    if getattr(case, "features", frozenset()) - caps.features:  # a feature the backend does not declare
        return False
    poison = getattr(case, "poison", None) or getattr(getattr(case, "case", None), "poison", None)
    breaks = "finite_unused_slots" in caps.preconditions and poison in ("nan", "inf")
    return breaks if violating else not breaks


def _declare() -> list[Property]:
    from pagedkv.testing.cases import invalid_call as invalid, known as kc
    from pagedkv.testing.managers import kernel_property
    from pagedkv.testing.properties import definitions as checks, features as fc, invariances, rejection
    from pagedkv.testing.properties import scenarios

    def mixed(**kw):
        def build(caps=None, poisons=None):
            import pagedkv.testing.strategies as s

            long = {k: v for k, v in kw.items() if k == "long_contexts"}  # fragmented tables take no other
            return (s.cases(caps=caps, poisons=poisons, **kw)
                    | s.fragmented_cases(caps=caps, poisons=poisons, **long))
        return build

    def lazy(name, **kw):
        def build(caps=None, poisons=None):
            import pagedkv.testing.strategies as s

            return getattr(s, name)(caps=caps, **kw, **({"poisons": poisons} if poisons else {}))
        return build

    def featured(feature, **kw):  # cases with ``feature`` on (others drawn as usual)
        def build(caps=None, poisons=None):
            import pagedkv.testing.strategies as s

            return (s.cases(caps=caps, poisons=poisons, force=(feature,), **kw)
                    | s.fragmented_cases(caps=caps, poisons=poisons, force=(feature,)))
        return build

    def large_pool(op, caps):
        """The head_dim-1 large-pool cases: run where the space declares head_dim 1 (and a 16-bit dtype);
        else not applicable when the declared-geometry twin of ``op`` past 2**24 slots runs (it judges the
        same fault, float32 slot arithmetic, at a declared head_dim), else skipped with the reason."""
        from pagedkv.testing.strategies.batches import large_pool_unsupported

        reason = large_pool_unsupported(caps)
        if reason and _limit_space("2_24_slots", caps) is None:
            return _not_applicable(f"not applicable: {reason}; {op}_is_exact_past_2_24_slots_at_a_declared_geometry "
                                   f"judges the same slot arithmetic at the declared geometry")
        return reason

    transform_needs = {
        "layout": lambda caps: None if caps.strided_pools else "the backend declares contiguous pools only",
        "strided_metadata": lambda caps: None if caps.strided_metadata else "the backend declares contiguous "
                                                                              "metadata only",
    }

    attn = ("paged_attention",)
    props = [
        Property("gather_returns_exactly_what_each_slot_holds",
                 "gather returns, bit for bit, cache[table[p // bs], p % bs] for every position and writes nothing",
                 ("gather",), checks.gather_matches_definition, mixed(), lambda: (kc.C5, kc.C6, kc.C8)),
        Property("scatter_then_gather_round_trips_and_touches_no_other_slot",
                 "scatter writes exactly positions start .. seq_len - 1 (frame condition) and gather reads them back",
                 ("scatter", "gather"), checks.scatter_round_trip, mixed(repeats=False), lambda: (kc.C6, kc.C8)),
        Property("write_kv_lands_at_slot_mapping_and_skips_negative_slots",
                 "write_kv puts token t at slot_mapping[t] in both pools, skips negative slots, touches nothing else",
                 ("write_kv",), checks.write_kv_matches_definition, mixed(repeats=False), lambda: (kc.C5,)),
        Property("backends_agree_on_every_op_both_provide",
                 "two backends agree: data movement bit for bit, attention bitwise between gathering backends "
                 "and within tolerance otherwise", (), checks.backends_agree, mixed(), lambda: (kc.C8,), pair=True),
        Property("paged_attention_matches_fp64_dense_reference",
                 "paged_attention equals the fp64 dense reference within the dtype's tolerance; NaN never passes",
                 attn, checks.attention_matches_reference, mixed(long_contexts=True),
                 lambda: (kc.C5, kc.C6, *kc.C7, kc.C8, kc.F_WINDOW, kc.F_ALL, kc.F_FP8)),
        Property("a_request_alone_equals_the_same_request_in_a_batch",
                 "each request's attention alone equals, bit for bit, its rows in the batch",
                 attn, invariances.alone_equals_in_batch, lazy("cases", max_seqs=4, long_contexts=True),
                 lambda: (kc.C5, kc.C8)),
        Property("decoding_token_by_token_equals_one_prefill_and_chunked_prefill",
                 "one prefill call equals decoding token by token and chunked prefill, within tolerance",
                 attn, invariances.decode_matches_prefill,
                 lazy("cases", max_seqs=2, max_q_len=6, long_contexts=True), lambda: (kc.C7[0],)),
        Property("every_live_sequence_reads_only_its_own_tokens",
                 "after every fork, append, copy-on-write and prefix hit, each live sequence reads exactly its "
                 "own tokens' K/V and the allocator's counts match the live tables",
                 ("write_kv",), scenarios.sharing_isolated, lazy("scenarios"),
                 lambda: (kc.C2, kc.C4, kc.C1[0]), kind="scenario"),
        Property("prefix_caching_changes_no_output",
                 "prefix caching on and off give every comparable sequence the same K/V and attention output",
                 ("write_kv", "paged_attention"), scenarios.prefix_cache_transparent,
                 lazy("scenarios", constant_hash=False), lambda: (*kc.C1, kc.C4), kind="scenario"),
    ]
    for t in sorted(invariances.TRANSFORMS):
        props.append(Property(
            f"outputs_are_bit_identical_under_{t}",
            f"gathers and attention are bit-identical after the '{t}' transform of the inputs",
            (), partial(invariances.invariant_under, transform=t), lazy("cases"), lambda: (kc.C6, kc.C8),
            requires=transform_needs.get(t, lambda caps: None)))
    for op, fn in (("gather", checks.gather_matches_definition), ("scatter", checks.scatter_round_trip),
                   ("write_kv", checks.write_kv_matches_definition)):
        props.append(Property(
            f"{op}_is_exact_on_pools_past_2_24_slots",
            f"{op} places tokens exactly in the last blocks of pools of more than 2**24 slots",
            (op,), fn, lazy("large_pool_cases"), max_examples=LARGE_POOL_EXAMPLES, requires=partial(large_pool, op)))
    from pagedkv.testing.cases.limit import LIMITS
    from pagedkv.testing.properties import large_pools

    for limit in LIMITS:
        for op, check, sentence in (
                ("gather", large_pools.gather_exact_past_the_limit,
                 "gather reads, bit for bit, the rows in the block past {} and in the last blocks at the "
                 "declared geometry"),
                ("scatter", large_pools.scatter_exact_past_the_limit,
                 "scatter writes each position into its slot past {} and in the last blocks at the declared "
                 "geometry, and nowhere else"),
                ("write_kv", large_pools.write_kv_exact_past_the_limit,
                 "write_kv puts each token at its slot past {} at the declared geometry, and nowhere else"),
                ("paged_attention", large_pools.attention_past_the_limit,
                 "paged_attention over the last blocks of pools past {} at the declared geometry equals the "
                 "fp64 reference")):
            props.append(Property(
                f"{op}_is_exact_past_{limit}_at_a_declared_geometry", sentence.format(limit.replace("_", " ", 1)),
                (op,), check, partial(_limit_case, limit), max_examples=1, kind="limit",
                requires=partial(_limit_space, limit)))
    from pagedkv.testing.properties import aliased_pools

    for name, ops, check, sentence in aliased_pools.PROPERTIES:
        props.append(Property(name, sentence, ops, check, _aliased_case, max_examples=1, kind="limit"))
    props.append(Property(
        "cache_state_machine_holds_its_invariants",
        "driven like a scheduler (admit with prefix lookup, reserve, write in part or not at all, commit, fork, "
        "copy-on-write, preempt, abort, double free), every request reads back its own K/V after every step",
        ("write_kv",), kernel_property.cache_state_machine, lambda caps=None: None, kind="machine"))
    for name, feature, sentence, check, kw, examples in (
            ("a_window_of_at_least_the_context_equals_no_window", "window",
             "a window_left of at least the longest context equals no window, within tolerance",
             fc.window_past_context_equals_no_window, {}, lambda: (kc.F_WINDOW,)),
            ("a_huge_softcap_equals_no_softcap", "softcap",
             "a soft-cap 10**4 times above every logit equals no soft-cap, within tolerance",
             fc.huge_softcap_equals_no_softcap, {}, lambda: (kc.F_ALL,)),
            ("zero_alibi_slopes_equal_no_alibi", "alibi", "ALiBi slopes of zero equal no ALiBi, within tolerance",
             fc.zero_slopes_equal_no_alibi, {}, lambda: (kc.F_ALL,)),
            ("sinks_of_minus_inf_equal_no_sinks", "sinks", "sinks of -inf equal no sinks, within tolerance",
             fc.neg_inf_sinks_equal_no_sinks, {}, lambda: (kc.F_ALL,)),
            ("nan_in_blocks_outside_the_window_changes_nothing", "window",
             "NaN in every block wholly outside each query's window leaves the output bit-identical",
             fc.nan_outside_the_window_changes_nothing, {"max_len": 40}, lambda: (kc.F_WINDOW, kc.F_ALL)),
            ("fp8_write_then_gather_returns_exactly_the_quantized_values", "fp8",
             "write_kv into an fp8 pool then gather returns, bit for bit, sat(x / scale) rounded to nearest even",
             fc.fp8_write_then_gather_is_exact, {"repeats": False}, lambda: (kc.F_FP8,)),
            ("scaling_stored_k_by_c_and_k_scale_by_1_over_c_changes_nothing", "fp8",
             "stored K times a power of two c with k_scale / c gives the same attention, within tolerance",
             fc.fp8_scale_moves_between_k_and_k_scale, {}, lambda: (kc.F_FP8,))):
        ops = ("write_kv", "gather") if feature == "fp8" and "write" in name else attn
        props.append(Property(name, sentence, ops, check, featured(feature, **kw), examples,
                              max_examples=FEATURE_EXAMPLES, requires=partial(_feature_declared, feature)))
    props.append(Property(
        "a_nan_value_shows_exactly_in_the_outputs_that_read_it",
        "one NaN in V (an fp8 pool's NaN byte in at least half the cases where fp8 is declared) makes every output "
        "that attends its token NaN in its head group and dim, and no output without that token in its context",
        attn, fc.nan_value_shows_exactly_where_it_is_read,
        lambda caps=None, poisons=None: featured("fp8")(caps, poisons) | mixed()(caps, poisons),
        lambda: (kc.C8, kc.F_ALL, kc.F_FP8), max_examples=FEATURE_EXAMPLES))
    from pagedkv.testing.properties import partial_attention as pa

    def cut(parts):
        def build(caps=None, poisons=None):
            from pagedkv.testing.strategies.partial import partial_cases

            return partial_cases(caps=caps, poisons=poisons, parts=parts)
        return build

    for name, sentence, ops, check, strategy in (
            ("paged_attention_returns_the_log_sum_exp_of_the_reference",
             "paged_attention(..., return_lse=True) returns the output and the fp64 reference's log-sum-exp of "
             "each row's visible logits in the declared layout and base, at any drawn split count; poison in "
             "unused slots reaches neither", attn, pa.lse_matches_reference, cut((1,))),
            ("merged_parts_of_any_cut_equal_attention_over_the_whole",
             "paged_attention over each part of a cut of the context (empty parts, parts a window or causality "
             "masks), merged by the fp64 merge, equals attention over the whole, output and LSE", attn,
             pa.merged_parts_equal_attention_over_the_whole, cut((2, 3))),
            ("merge_attn_states_of_any_cut_equals_attention_over_the_whole",
             "merge_attn_states of the fp64 parts of a cut equals attention over the whole, output and LSE, and "
             "three parts merge the same either way round", ("merge_attn_states",),
             pa.merge_attn_states_of_parts_equals_the_whole, cut((2, 3))),
            ("merge_attn_states_with_no_keys_is_exact_and_never_nan",
             "merging with a part of no keys (out 0, lse -inf) returns the other part exactly; two empty parts "
             "give out 0 and lse -inf, never NaN", ("merge_attn_states",), pa.merge_with_no_keys_is_exact,
             cut((2,)))):
        props.append(Property(name, sentence, ops, check, strategy, lambda: (), max_examples=FEATURE_EXAMPLES,
                              requires=pa.lse_requires))
    for op in invalid.OPS:
        props.append(Property(
            f"{op}_rejects_bad_arguments_and_writes_nothing",
            f"{op} with one argument broken raises the contract's error naming it, and both pools are unchanged",
            (op,), rejection.check_rejected, lazy("invalid_calls", ops=(op,)), partial(kc.invalid_examples, op),
            kind="invalid", requires=_padded_tables if op == "paged_attention" else lambda caps: None))
    props.append(Property(
        "paged_attention_rejects_bad_csr_page_metadata",
        "paged_attention with FlashInfer page metadata broken one way (kv_indptr not monotone, a last page "
        "length of 0 or past the page size, indices past the pool, a row longer than its pages) raises the "
        "contract's error", attn, rejection.csr_metadata_rejected, mixed(), lambda: (kc.C5, kc.C8),
        requires=_csr_tables))
    return props


def _padded_tables(caps) -> str | None:
    """The padded-table faults apply to a backend that takes padded tables (a CSR one has its own)."""
    return None if caps.page_table == "padded" else \
        _not_applicable("not applicable: the backend takes CSR page tables (paged_attention_rejects_bad_csr_page_"
                        "metadata)")


def _csr_tables(caps) -> str | None:
    return None if caps.page_table == "csr" else _not_applicable("not applicable: the backend takes padded block "
                                                                 "tables")


def _not_applicable(text: str) -> str:
    from pagedkv.testing.verdict import Skip, SkipReason

    return Skip(text, SkipReason.NOT_APPLICABLE)


def _limit_case(limit: str, caps=None, **_):
    """The one case of a limit property: pools past ``limit`` at the declared geometry."""
    from hypothesis import strategies as st

    from pagedkv.backends.capabilities import Capabilities
    from pagedkv.testing.cases.limit import LimitCase

    return st.just(LimitCase.for_space(limit, caps or Capabilities())[0])


def _aliased_case(caps=None, **_):
    """The one case of an aliased-pool property (:meth:`LimitCase.aliased`)."""
    from hypothesis import strategies as st

    from pagedkv.testing.cases.limit import LimitCase

    return st.just(LimitCase.aliased())


def _limit_space(limit: str, caps) -> str | None:
    from pagedkv.testing.cases.limit import LimitCase

    return LimitCase.for_space(limit, caps)[1] or None


def _feature_declared(feature: str, caps) -> str | None:
    """A feature property runs only on a backend that declares the feature (else: not covered)."""
    from pagedkv.testing.verdict import Skip, SkipReason

    return None if feature in caps.features else Skip(f"feature {feature!r} not declared: not covered",
                                                      SkipReason.FEATURE_NOT_DECLARED)


@cache
def properties() -> dict[str, Property]:
    """Every registered property by name, in declaration order."""
    props = _declare()
    by_name = {p.name: p for p in props}
    if len(by_name) != len(props):
        raise ValueError("two registered properties share a name")
    return by_name


def property_for_record(check: str) -> Property:
    """The property a case file's ``check`` field names.

    Raises:
        KeyError: no registered property has that name.
    """
    try:
        return properties()[check]
    except KeyError:
        raise KeyError(f"no registered property {check!r}") from None


def check_functions() -> set[Callable]:
    """The underlying check functions the registry refers to (``partial`` unwrapped)."""
    return {getattr(p.check, "func", p.check) for p in properties().values()}
