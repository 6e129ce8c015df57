"""The property registry is the one list: every check function is registered, every registered
property is collected by pytest, and every case file names a registered property."""

from __future__ import annotations

import inspect

import pytest

from pagedkv.testing import registry
from pagedkv.testing.properties import definitions as checks, invariances, rejection, scenarios
from pagedkv.testing.casefiles.reading import load_case_file
from pagedkv.testing.casefiles.reading import shipped_regressions

FILES = shipped_regressions()

# Functions of the check modules that take a backend and a case but are helpers, not properties.
HELPERS = {"run_attention", "run_scenario", "check_live_sequences", "outputs", "inputs", "reference_output",
           "write_slot_mapping", "locate_attention", "describe_attention",
           "machine_for_backend"}  # builds the state machine the registered cache_state_machine runs


def _check_functions(module) -> set:
    out = set()
    for name, fn in vars(module).items():
        if name.startswith("_") or name in HELPERS or not inspect.isfunction(fn) or fn.__module__ != module.__name__:
            continue
        params = list(inspect.signature(fn).parameters)
        if params[:1] == ["backend"] and "device" in params:
            out.add(fn)
    return out


def _check_modules() -> list:
    """Every module of :mod:`pagedkv.testing.properties`, whatever is added later."""
    import importlib
    import pkgutil

    import pagedkv.testing.properties as package

    return [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)] \
        + [importlib.import_module("pagedkv.testing.managers.kernel_property")]


def test_the_scan_covers_every_check_module():
    names = {m.__name__.rsplit(".", 1)[-1] for m in _check_modules()}
    assert {checks.__name__, rejection.__name__, invariances.__name__, scenarios.__name__} <= \
        {f"pagedkv.testing.properties.{n}" for n in names}
    assert {"features", "large_pools", "aliased_pools", "window_rules"} <= names


def test_every_check_function_is_registered():
    unregistered = set().union(*map(_check_functions, _check_modules())) - registry.check_functions()
    assert not unregistered, f"check functions no property registers: {sorted(f.__name__ for f in unregistered)}"


def test_every_registered_property_is_collected_by_pytest(pytester):
    result = pytester.runpytest_subprocess("--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                                           "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", "indexed",
                                           timeout=300)
    assert result.ret == 0, str(result.stdout) + str(result.stderr)
    collected = {line.split("::")[1].split("[")[0] for line in result.outlines if "::" in line}
    missing = {f"test_{name}" for name in registry.properties()} - collected
    assert not missing, f"registered properties pytest does not collect: {sorted(missing)}"


def test_property_names_are_unique_and_each_finds_its_property():
    props = registry.properties()
    for p in props.values():
        assert registry.property_for_record(p.name) is p
        assert p.sentence and p.name.isidentifier()


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_every_shipped_case_file_names_a_registered_property(path):
    record = load_case_file(path)
    registry.property_for_record(record["check"])


def test_an_unknown_check_is_a_key_error_naming_it():
    with pytest.raises(KeyError, match="no_such_property"):
        registry.property_for_record("no_such_property")
