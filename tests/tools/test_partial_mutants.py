"""The partial-attention mutants' base passes every partial-attention property: each kill comes from its
planted fault (the kills themselves: tests/tools/test_mutants.py, which runs every shipped mutant)."""

import pytest

from pagedkv.testing.registry import properties
from pagedkv.tools.mutants import kill_table as runner
from pagedkv.tools.mutants.partial import PARTIAL_MUTANTS, PARTIAL_TARGETS, PartialBackend

PARTIAL_PROPERTIES = sorted({p for targets in PARTIAL_TARGETS.values() for p in targets}
                            | {"merged_parts_of_any_cut_equal_attention_over_the_whole",
                               "merge_attn_states_of_any_cut_equals_attention_over_the_whole"})


@pytest.mark.parametrize("name", PARTIAL_PROPERTIES)
def test_the_unmutated_partial_base_passes(name):
    outcome = runner.run_property(PartialBackend(), properties()[name], "dev", shrink=False)
    assert not outcome.failed, f"{name}: {outcome.first_line} on {runner.case_summary(outcome)}"


def test_every_partial_mutant_is_registered_with_a_target():
    from pagedkv.tools import mutants

    assert set(PARTIAL_MUTANTS) <= set(mutants.MUTANTS) and set(PARTIAL_MUTANTS) == set(PARTIAL_TARGETS)
