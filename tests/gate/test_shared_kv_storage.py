"""A kernel that reads V from K's storage (MLA's latent cache as FlashMLA and vLLM's MLA decode read it: the
``v_cache`` argument never read) declares ``shared_kv_storage``; every case the gate hands it, drawn or fixed
(the contract's explicit examples, the regression case files, the pools past 2**24 slots and 2**31 elements),
then holds V in K's first columns, so the honest kernel is green."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pagedkv.backends import indexed
from pagedkv.backends.capabilities import Capabilities, Sizes
from pagedkv.testing import execute
from pagedkv.testing.cases.case import Case
from pagedkv.testing.cases.limit import LIMITS, LimitCase
from pagedkv.testing.cases.translate import into_space
from pagedkv.testing.registry import properties

MLA = Capabilities(block_sizes=Sizes(values={16, 64}), head_dims=Sizes(values={576}), head_dims_v=Sizes(values={512}),
                   num_kv_heads=Sizes(values={1}), shared_kv_storage=True, dtypes={"float16", "bfloat16"})


class LatentReader:
    """pagedkv's ``indexed`` attention over ``k_cache[..., :head_dim_v]``: ``v_cache`` gives V's width only."""

    name = "latent_reader"
    capabilities = MLA

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None, **kw):
        return indexed.paged_attention(query, k_cache, k_cache[..., :v_cache.shape[-1]], block_tables, seq_lens,
                                       query_start_loc, scale, **kw)


def _attention_examples() -> list:
    return [(prop, case) for prop in properties().values() if "paged_attention" in prop.ops
            for case in prop.examples_in(MLA) if isinstance(case, Case)]


def test_every_explicit_attention_example_holds_v_in_k_storage():
    examples = _attention_examples()
    assert examples, "no explicit attention example inside an MLA space"
    assert {case.layout for _, case in examples} == {"latent"}, [(p.name, c.layout) for p, c in examples]


def test_the_reference_property_passes_its_fixed_cases_on_a_kernel_reading_v_from_k():
    prop = properties()["paged_attention_matches_fp64_dense_reference"]
    cases = [case for p, case in _attention_examples() if p is prop]
    assert cases
    for case in cases:
        outcome = execute.run_case(prop, (LatentReader(),), case)
        assert outcome.status == "passed", (case, outcome)


def test_a_translated_case_keeps_v_in_k_storage_and_v_wider_than_k_has_no_translation():
    prop = properties()["paged_attention_matches_fp64_dense_reference"]
    translated = [(c, *into_space(c, MLA)) for c in prop.examples() if isinstance(c, Case) and c.layout == "contiguous"]
    base, moved, how = next(t for t in translated if t[1] is not None)
    assert moved.layout == "latent" and moved.v_scale == moved.k_scale and "K's storage" in how
    wide = base.replace(geometry=dataclasses.replace(base.geometry, head_dim=576, head_dim_v=1024))
    moved, why = into_space(wide, dataclasses.replace(MLA, head_dims_v=Sizes(values={512, 1024})))
    assert moved is None and "wider than K" in why


@pytest.mark.parametrize("limit", sorted(LIMITS))
def test_the_pools_past_a_limit_hold_v_in_k_storage_and_the_case_file_says_so(limit):
    case, why = LimitCase.for_space(limit, MLA)
    assert case is not None, why
    assert case.latent
    record = json.loads(json.dumps(case.to_dict()))
    assert LimitCase.from_dict(record) == case
    assert LimitCase.from_dict({"limit": limit, "geometry": record["geometry"]}).latent is False  # older case files
    if limit != "2_31_elements":  # the attention run at the smaller pools (head_dim 576: 3.7M slots) says enough
        return
    prop = properties()[f"paged_attention_is_exact_past_{limit}_at_a_declared_geometry"]
    outcome = execute.run_case(prop, (LatentReader(),), case)
    assert outcome.status in ("passed", "skipped"), outcome  # skipped: no lazy zero pages on this machine
    if outcome.status == "skipped":
        assert "machine" in outcome.reason or "zero pages" in outcome.reason, outcome


class ViewAsserting(LatentReader):
    """An MLA kernel that refuses a V of its own (FlashMLA takes one cache): ``v_cache`` must be K's storage."""

    name = "view_asserting"

    def paged_attention(self, query, k_cache, v_cache, *args, **kw):
        if v_cache.untyped_storage().data_ptr() != k_cache.untyped_storage().data_ptr():
            raise ValueError("v_cache must be a view of k_cache (MLA's latent cache)")
        return super().paged_attention(query, k_cache, v_cache, *args, **kw)

    def write_kv(self, *args, **kw):
        return indexed.write_kv(*args, **kw)


@pytest.mark.parametrize("name", ["prefix_caching_changes_no_output", "every_live_sequence_reads_only_its_own_tokens"])
def test_the_cache_scenarios_hand_v_in_k_storage_to_attention(name):
    prop = properties()[name]
    scenarios = prop.examples_in(MLA)
    assert scenarios
    for scenario in scenarios:
        outcome = execute.run_case(prop, (ViewAsserting(),), scenario)
        assert outcome.status == "passed", (scenario, outcome)
