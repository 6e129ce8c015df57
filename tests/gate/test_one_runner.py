"""Every entry point runs a property through the one execution core and gets its one ``Outcome``, so
they agree: the same skip, with the same reason, for a backend that lacks an op; the same verdict on a
faulty and a correct backend (the suite's test, the mutants' kill table, a fuzz batch, the kill-rate
runner, a case file)."""

from __future__ import annotations

from hypothesis import Phase, settings

from pagedkv import get_backend
from pagedkv.testing import execute
from pagedkv.testing.casefiles.reading import load_case_file
from pagedkv.tools.fuzz.workers import run_batch
from pagedkv.tools.mutants import MUTANTS
from pagedkv.tools.mutants.kill_rates import _run_one
from pagedkv.tools.mutants.kill_table import run_property
from pagedkv.testing.registry import properties
from pagedkv.testing.settings import suite_settings
from pagedkv.testing.space import capabilities_under_test

PROP = "paged_attention_matches_fp64_dense_reference"


class AttentionOnly:
    """The indexed backend's attention alone (no gather, no write_kv)."""

    name = "attention_only"
    paged_attention = staticmethod(get_backend("indexed").paged_attention)


def _entry_points(backend, tmp_path):
    prop = properties()[PROP]
    caps = capabilities_under_test(backend, for_drawing=True)
    quick = suite_settings(settings(max_examples=20, derandomize=True, database=None, phases=list(Phase)))
    core = execute.run(prop, (backend,), "cpu", quick, case_file=tmp_path / "core.json")
    # every entry point draws reproducibly (the kill table under the derandomized `ci` profile, the fuzz
    # batch and the kill-rate run seeded), so the verdicts compared are the same on every run
    table = run_property(backend, prop, "ci", "cpu", shrink=False)
    fuzz = run_batch(prop, backend, None, "spec", "cpu", None, 100, tmp_path, seed=1234)
    rate = _run_one(prop, backend, "cpu", 1234, 20, True, caps=caps)
    return core, table, fuzz, rate


def test_a_missing_op_is_the_same_skip_everywhere(tmp_path):
    prop = properties()["gather_returns_exactly_what_each_slot_holds"]
    backend = AttentionOnly()
    reason = execute.run(prop, (backend,)).reason
    assert reason == "attention_only does not provide 'gather'"
    outcomes = [run_property(backend, prop, "dev"), run_batch(prop, backend, None, "spec", "cpu", None, 5, tmp_path),
                _run_one(prop, backend, "cpu", 1, 5, True, caps=capabilities_under_test(backend))]
    assert all(isinstance(o, execute.Outcome) for o in outcomes)
    assert [(o.status, o.reason, o.examples_judged) for o in outcomes] == [("skipped", reason, 0)] * 3


def test_a_faulty_backend_fails_and_a_correct_one_passes_at_every_entry_point(tmp_path):
    faulty = MUTANTS["gqa_modulo"]()
    outcomes = _entry_points(faulty, tmp_path)
    core = outcomes[0]
    assert all(o.failed for o in outcomes), [o.first_line for o in outcomes]
    record = load_case_file(core.failures[0].case_file, check_backend=False)
    assert execute.run_record(record, faulty).failed  # the case file replays to the failure
    assert execute.run_record(record, get_backend("indexed")).status == "passed"
    outcomes = _entry_points(get_backend("indexed"), tmp_path)
    assert [o.status for o in outcomes] == ["passed"] * 4, [o.first_line for o in outcomes]


def test_properties_sharing_a_strategy_draw_their_own_cases_in_one_kill_rate_run(monkeypatch):
    """One run's seed gives each property its own Hypothesis seed (the same in every process), and the
    kill-rate runner passes it on: properties sharing a strategy draw different cases in one run."""
    import os
    import subprocess
    import sys

    from pagedkv.tools.mutants.kill_rates import property_seed
    from pagedkv.testing.space import capabilities_under_test

    names = ("paged_attention_matches_fp64_dense_reference", "backends_agree_on_every_op_both_provide")
    code = f"from pagedkv.tools.mutants.kill_rates import property_seed; print(property_seed(7, {names[0]!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert int(other.stdout) == property_seed(7, names[0]) != property_seed(8, names[0])
    real, drawn = execute.run, {}

    def recording(prop, *args, **kwargs):
        drawn[prop.name] = []
        return real(prop, *args, **kwargs, after_pass=lambda backends, case: drawn[prop.name].append(repr(case)))
    monkeypatch.setattr(execute, "run", recording)
    backend = get_backend("indexed")
    caps = capabilities_under_test(backend, for_drawing=True)
    for name in names:
        assert not _run_one(properties()[name], backend, "cpu", 7, 3, False, caps=caps).failed
    assert len(drawn[names[0]]) == 3 and drawn[names[0]] != drawn[names[1]]


def test_an_undeclared_feature_is_named_before_a_missing_op():
    """A kernel without ``gather`` that declares no fp8: the fp8 write-then-gather property is skipped for the
    fp8 it never declared; declaring fp8 without ``gather`` is then the missing op. Both leave the judged share's
    denominator alike, so only the reason a user reads changes."""
    import dataclasses

    from pagedkv.testing.verdict import SkipReason, skip_reason

    prop = properties()["fp8_write_then_gather_returns_exactly_the_quantized_values"]
    backend = AttentionOnly()
    caps = capabilities_under_test(backend)
    assert "fp8" not in caps.features
    undeclared = prop.cannot_run((backend,), caps)
    assert skip_reason(undeclared) is SkipReason.FEATURE_NOT_DECLARED and "'fp8' not declared" in undeclared
    declared = prop.cannot_run((backend,), dataclasses.replace(caps, features=caps.features | {"fp8"}))
    assert skip_reason(declared) is SkipReason.MISSING_OP and "does not provide 'write_kv'" in declared
