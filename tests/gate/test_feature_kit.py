"""The kit's side of the optional attention features: cases carry them as plain data (off by default,
so older case files and reprs stay valid), strategies draw only what a backend declares, undeclared
features are reported as not covered, and the case-file schema checks the new fields."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings

from pagedkv.testing import strategies
from pagedkv.backends.capabilities import FEATURE_NAMES, Capabilities
from pagedkv.errors import CaseFileError
from pagedkv.testing import registry
from pagedkv.testing.cases import known as kc
from pagedkv.tools.mutants import kill_table as runner
from pagedkv.testing.cases.case import Case, Geometry, SeqSpec
from pagedkv.testing.casefiles.schema import validate_record

FAST = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@FAST
@given(strategies.cases(caps=Capabilities()))
def test_a_backend_that_declares_no_feature_gets_only_plain_cases(case):
    assert case.features == frozenset() and case == Case.from_json(case.to_json())


@FAST
@given(strategies.cases(caps=Capabilities(features={"window", "fp8"}), force=("window", "softcap")))
def test_only_declared_features_are_drawn_and_forcing_one_turns_it_on(case):
    assert "window" in case.features and case.features <= {"window", "fp8"}
    assert case == Case.from_json(case.to_json())
    if "fp8" in case.features:
        assert case.caches()[0].dtype.itemsize == 1 and set(case.kv_scales()) == {"k_scale", "v_scale"}


def test_feature_properties_skip_as_not_covered_when_undeclared():
    props = [p for p in registry.properties().values() if p.requires is not None]
    skipped = {p.name: p.requires(Capabilities()) for p in props}
    feature_props = {n: r for n, r in skipped.items() if r and "not covered" in r}
    assert len(feature_props) == 7
    assert all(r.startswith("feature '") and r.split("'")[1] in FEATURE_NAMES for r in feature_props.values())
    assert not any(p.requires(Capabilities(features=FEATURE_NAMES)) for p in registry.properties().values()
                   if p.name in feature_props)


def test_an_old_case_without_feature_fields_loads_and_brief_shows_non_default_features():
    old = json.loads(kc.C8.to_json())
    for key in ("window_left", "softcap", "alibi", "sinks", "kv_cache_dtype", "k_scale", "v_scale"):
        del old[key]
    assert validate_record({"check": "attention_matches_reference", "case": old})
    assert Case.from_dict(old) == kc.C8 and "window_left" not in runner.brief(kc.C8)
    text = runner.brief(kc.F_ALL) + " " + runner.brief(kc.F_FP8)
    for part in ("window_left=4", "softcap=5.0", "alibi=True", "sinks=True", "kv_cache_dtype='fp8_e4m3'",
                 "k_scale=(0.0625, 0.5)", "v_scale=0.03"):
        assert part in text


@pytest.mark.parametrize("field, value", [
    ("window_left", -2), ("window_left", 1.5), ("softcap", -1.0), ("softcap", True), ("alibi", 1),
    ("kv_cache_dtype", "fp8"), ("k_scale", 0), ("k_scale", [0.5]), ("v_scale", [0.5, "x"]), ("v_scale", -0.1)])
def test_the_schema_refuses_bad_feature_fields_naming_them(field, value):
    case = json.loads(Case(Geometry(4, 2, 2, 2), (SeqSpec((0, 1), 3, 1),)).to_json())
    case[field] = value
    with pytest.raises(CaseFileError) as info:
        validate_record({"check": "attention_matches_reference", "case": case})
    assert info.value.field.startswith(f"case.{field}")
