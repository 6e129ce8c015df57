"""Limits every implementation must respect, checked on fixed inputs: each fault kind rejected on a
case that carries them all, in the declared space (C9, a table too short for its tokens, among them: the
builtin error type, a message naming the argument, nothing written; the wording is the candidate's own).

C10, slot arithmetic past 2**31 slots on an aliased pool (no such pool is allocated), is checked by
registered properties (:mod:`pagedkv.testing.properties.aliased_pools`, ``test_gather_reads_the_right_
block_past_2_31_slots`` and its siblings in ``test_properties``), so a failure there leaves a case file
and a located message like every property.
"""

from __future__ import annotations

import pytest

from pagedkv.testing.cases.case import Case, Geometry, SeqSpec
from pagedkv.testing import execute
from pagedkv.testing.cases.invalid_call import FAULTS, InvalidCall, fault_sites, inexpressible
from pagedkv.testing.cases.translate import as_written_by, into_space
from pagedkv.testing.registry import properties
from pagedkv.testing.report import failure_text
from pagedkv.testing.space import capabilities_under_test

pytestmark = pytest.mark.pagedkv


@pytest.mark.parametrize("op,fault", sorted(FAULTS))
def test_every_fault_is_rejected_on_a_fixed_case(pagedkv_run, backend, device, op, fault):
    """Each fault kind at least once, on a case that can carry every fault, moved into the declared sizes
    and dtypes (an undeclared dtype or block size is not the invalid argument under test)."""
    case = Case(Geometry(num_blocks=6, block_size=2, num_kv_heads=2, num_queries_per_kv=2),
                (SeqSpec((4, 1), 3, 2, 1), SeqSpec((0, 3, 5), 5, 1, 0)), values="identity", poison="nan")
    caps = capabilities_under_test(backend)
    why = inexpressible(op, fault, caps)
    if why:
        pytest.skip(f"not applicable: {why}")
    if caps.page_table == "csr" and FAULTS[(op, fault)].argument in ("block_tables", "seq_lens"):
        pytest.skip("not applicable: the backend takes CSR page tables, whose faults "
                    "paged_attention_rejects_bad_csr_page_metadata judges")
    case, how = into_space(case, caps)
    if case is None:
        pytest.skip(f"not applicable: the fixed case has no form inside the declared space: {how}")
    case = as_written_by(op, case)  # a latent case (shared_kv_storage) reaches a write as two pools
    sites = fault_sites(op, fault, case)
    assert sites, f"the fixed case cannot carry {op}/{fault}"
    prop = properties()[f"{op}_rejects_bad_arguments_and_writes_nothing"]
    outcome = execute.run_case(prop, (backend,), InvalidCall(op, fault, case, sites[-1]), device,
                               spec=pagedkv_run.spec, case_file=pagedkv_run.case_file)
    if outcome.status == "skipped":
        pytest.skip(outcome.reason)
    if outcome.failed:
        pytest.fail(failure_text(prop.sentence, outcome, backend), pytrace=False)
