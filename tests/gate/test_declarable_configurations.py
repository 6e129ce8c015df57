"""Every configuration a backend can declare is gated honestly: an honest candidate goes green, and a
planted fault in it is caught.

The candidates (``tests/gate/declarable.py``) wrap pagedkv's ``indexed`` ops behind a declared layout (NHD,
HND, a view ``PoolLayout``, a copy pair, a key/value pair of them), page table (padded, CSR), op subset
(attention only, ``write_kv`` + attention, all four), dtype subset, block sizes, head dims, features
(none, some, all), ``finite_unused_slots`` (on, off) and ``shared_kv_storage`` (on, off: MLA's latent
cache). :data:`CONFIGURATIONS` is a covering set: every value of every axis appears, each layout with
both page tables across the set, rather than the cross product. Each runs every registered property
through the gate's core (:func:`pagedkv.testing.execute.run`, the function the pytest plugin runs per
property) with one drawn example beside the explicit ones; the properties past 2**24 slots and 2**31
elements (tens of seconds each, independent of the layout's code path beyond what the other properties
cover) are left to the full gate. Each outcome goes through the gate's verdict policy
(:func:`pagedkv.testing.verdict.decide`) and the judged share is the policy's count
(:func:`pagedkv.testing.verdict.count`, what the plugin's summary prints); it must reach
:data:`TARGET_SHARE`. About 25 s on two cores with ``-n 2``.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

from pagedkv.backends.capabilities import Capabilities, Sizes
from pagedkv.testing import execute
from pagedkv.testing.registry import properties
from pagedkv.testing.settings import suite_settings
from pagedkv.testing.verdict import count, decide

sys.path.insert(0, os.path.dirname(__file__))
from declarable import PACKED_KEYS, PACKED_PAIR, REVERSED_SLOTS, SLOTS_LAST, honest, with_fault  # noqa: E402

ALL_OPS = ("gather", "scatter", "write_kv", "paged_attention")
WRITE_AND_ATTEND = ("write_kv", "paged_attention")
ATTEND = ("paged_attention",)
SMALL = dict(block_sizes=Sizes(values={1, 4, 16}), head_dims=Sizes(values={4, 8}))

#: id -> (capabilities, ops, the fault planted in it).
CONFIGURATIONS = {
    "nhd-padded-attention-float32": (
        Capabilities(dtypes={"float32"}, **SMALL), ATTEND, "drops_last_token"),
    "hnd-csr-write-attention-half-finite": (
        Capabilities(layout="HND", page_table="csr", dtypes={"float16", "bfloat16"}, block_sizes=Sizes(values={1, 16}),
                     head_dims=Sizes(values={64, 128}), preconditions={"finite_unused_slots"}),
        WRITE_AND_ATTEND, "reads_storage_as_nhd"),
    "hnd-padded-all-ops-all-features": (
        Capabilities(layout="HND", features={"window", "softcap", "alibi", "sinks", "fp8"}, **SMALL),
        ALL_OPS, "reads_storage_as_nhd"),
    "view-layout-csr-all-ops-some-features": (
        Capabilities(layout=SLOTS_LAST, page_table="csr", dtypes={"float32", "bfloat16"},
                     features={"window", "softcap"}, **SMALL), ALL_OPS, "ignores_last_page_len"),
    "copy-pair-padded-write-attention-finite": (
        Capabilities(layout=REVERSED_SLOTS, dtypes={"float32", "float16"}, features={"sinks"},
                     preconditions={"finite_unused_slots"}, **SMALL), WRITE_AND_ATTEND, "write_kv_swaps_pools"),
    "copy-pair-keys-csr-attention": (
        Capabilities(layout=PACKED_KEYS, page_table="csr", dtypes={"float32"}, features={"alibi"}, **SMALL),
        ATTEND, "reads_storage_as_nhd"),
    "key-value-pair-padded-all-ops": (
        Capabilities(layout=PACKED_PAIR, dtypes={"bfloat16", "float32"}, **SMALL), ALL_OPS, "write_kv_swaps_pools"),
    "mla-latent-csr-write-attention": (
        Capabilities(page_table="csr", shared_kv_storage=True, head_dims_v=Sizes(), dtypes={"float32", "float16"},
                     **SMALL), WRITE_AND_ATTEND, "write_kv_swaps_pools"),
    "key-value-pair-csr-write-attention-all-features": (
        Capabilities(layout=PACKED_PAIR, page_table="csr", features={"window", "softcap", "alibi", "sinks", "fp8"},
                     preconditions={"finite_unused_slots"}, **SMALL), WRITE_AND_ATTEND, "ignores_last_page_len"),
}

#: The share of what its ops allow that the gate must judge (the target of the user-repository test).
TARGET_SHARE = 0.9
#: The properties a planted fault must fail (one of them suffices).
CATCHES = {"drops_last_token": "paged_attention_matches_fp64_dense_reference",
           "ignores_last_page_len": "paged_attention_matches_fp64_dense_reference",
           "reads_storage_as_nhd": "paged_attention_matches_fp64_dense_reference",
           "write_kv_swaps_pools": "write_kv_lands_at_slot_mapping_and_skips_negative_slots"}
FEW = suite_settings(settings(max_examples=1, database=None, derandomize=True))


def _gated(prop) -> bool:
    return prop.kind != "limit" and "past_2_" not in prop.name


@pytest.mark.parametrize("config", sorted(CONFIGURATIONS))
def test_an_honest_candidate_is_green_and_a_planted_fault_is_caught(config):
    caps, ops, fault = CONFIGURATIONS[config]
    backend = honest(config.replace("-", "_"), caps, ops)
    verdicts = {name: decide(execute.run(prop, (backend,), "cpu", FEW))
                for name, prop in properties().items() if _gated(prop)}
    failed = [f"{name}: {v.message}" for name, v in verdicts.items() if v.status != "passed" and v.status != "skipped"]
    assert not failed, "\n".join(failed)
    counts = count([{"kind": v.kind, "status": v.status, "skip": v.skip and v.skip.value} for v in verdicts.values()])
    c = counts["properties"]
    judged = [name for name, v in verdicts.items() if v.status == "passed"]
    print(f"{config}: {c['judged']} properties judged (0 failing) of {c['applicable']} its ops allow "
          f"({c['judged_fraction']:.0%}); skipped by reason: {c['skipped_by_reason'] or 'none'}")
    assert c["judged"] == len(judged) and c["judged_fraction"] >= TARGET_SHARE, c
    assert "paged_attention_matches_fp64_dense_reference" in judged
    if "write_kv" in ops:
        assert "write_kv_lands_at_slot_mapping_and_skips_negative_slots" in judged
    if caps.page_table == "csr":
        assert "paged_attention_rejects_bad_csr_page_metadata" in judged

    rejected = _fixed_invalid_calls(backend, caps)
    assert not rejected["failed"], "\n".join(rejected["failed"])
    print(f"{config}: fixed invalid calls judged {rejected['judged']}, not applicable {rejected['skipped']}")
    assert rejected["judged"] > 0

    planted = with_fault(backend, fault)
    catcher = properties()[CATCHES[fault]]
    outcome = execute.run(catcher, (planted,), "cpu", settings(FEW, max_examples=20))
    assert outcome.failed, f"{fault} planted in {config} passed {catcher.name}"


def _fixed_invalid_calls(backend, caps) -> dict:
    """``test_limits``' fixed invalid calls (every fault kind once, on the case that carries them all) as
    the gate runs them: moved into the declared space, the page-table faults of a CSR candidate left to its
    own property; ``{"judged": n, "skipped": n, "failed": [lines]}``."""
    from pagedkv.testing.cases.case import Case, Geometry, SeqSpec
    from pagedkv.testing.cases.invalid_call import FAULTS, InvalidCall, fault_sites, inexpressible
    from pagedkv.testing.cases.translate import as_written_by, into_space

    fixed = Case(Geometry(num_blocks=6, block_size=2, num_kv_heads=2, num_queries_per_kv=2),
                 (SeqSpec((4, 1), 3, 2, 1), SeqSpec((0, 3, 5), 5, 1, 0)), values="identity", poison="nan")
    case, _ = into_space(fixed, caps)
    tally = {"judged": 0, "skipped": 0, "failed": []}
    for (op, fault), spec in sorted(FAULTS.items()):
        if not callable(getattr(backend, op, None)) or inexpressible(op, fault, caps) or (
                caps.page_table == "csr" and spec.argument in ("block_tables", "seq_lens")):
            tally["skipped"] += 1
            continue
        prop = properties()[f"{op}_rejects_bad_arguments_and_writes_nothing"]
        written = as_written_by(op, case)
        verdict = decide(execute.run_case(prop, (backend,), InvalidCall(op, fault, written,
                                                                          fault_sites(op, fault, written)[-1]), "cpu"))
        if verdict.status == "failed":
            tally["failed"].append(f"{op}/{fault}: {verdict.message}")
        else:  # a call the gate could not run (the case rejected, an op missing) is not judged
            tally["judged" if verdict.status == "passed" else "skipped"] += 1
    return tally
