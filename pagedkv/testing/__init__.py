"""The gate: cases, strategies, properties, the one execution core, and the pytest plugin.

It imports the library and nothing above it: the tools that use it (:mod:`pagedkv.tools`: mutants,
peers, fuzzing, the refactor baseline, the run plan) and the command line import it, never the
reverse. A map (each folder is one concept; arrows point the way imports go)::

    cases/        plain-data cases: Case, CacheScenario, InvalidCall, known cases, the one-line notation,
                  ops (a case's ops run on a backend, for every caller)
    strategies/   Hypothesis strategies drawing those cases inside a declared space (source: the
                  repository's top-level strategies/), the run's palette of specialising parameters
    properties/   the check functions: data movement, attention, features, invariances, cache scenarios,
                  rejection of bad input, the shadow model the cache scenarios replay through
    managers/     the cache-manager protocol, its content oracle, the one cache state machine (any manager;
                  pagedkv's own cache with a candidate's kernels), its API rules, replayable programs
    compare.py    bits, Mismatch, MissingOp, bit-for-bit assertions and the tolerance policy
    guard.py      the output and input contract enforced on every op call; cases judged twice
    registry.py   Property (one entry per property: sentence, ops, check, strategy, examples, skip rules)
    space.py      what is under test: candidates, declared capabilities, device, Triton's interpreter
    settings.py   the profiles and every Hypothesis settings object (hypothesis_internals.py: the one
                  place Hypothesis's private API is used)
    execute.py    the one runner: every entry point runs a property through it
    casefiles/    the case-file schema, reading untrusted files, writing, names, shipped regressions
    report.py     failure text, the judged / skipped summary, the JSON verdict
    hookspecs.py  the plugin's own hooks (the refactor baseline implements them)
    plugin.py     the pytest hooks and fixtures (glue only), suite/ the generated pytest modules

Public names, imported lazily (importing :mod:`pagedkv.testing` needs neither Hypothesis nor pytest):
``Case``, ``CacheScenario``, ``InvalidCall``, ``Geometry``, ``SeqSpec``, ``Property``, ``properties``,
``run``, ``run_case``, ``run_record``, ``Outcome``, ``Mismatch``, ``MissingOp``, ``load_case_file``,
``save_failure``.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "Case": "pagedkv.testing.cases", "CacheScenario": "pagedkv.testing.cases", "Geometry": "pagedkv.testing.cases",
    "SeqSpec": "pagedkv.testing.cases", "InvalidCall": "pagedkv.testing.cases",
    "Property": "pagedkv.testing.registry", "properties": "pagedkv.testing.registry",
    "run": "pagedkv.testing.execute", "run_case": "pagedkv.testing.execute", "run_record": "pagedkv.testing.execute",
    "Outcome": "pagedkv.testing.execute",
    "Mismatch": "pagedkv.testing.compare", "MissingOp": "pagedkv.testing.compare",
    "load_case_file": "pagedkv.testing.casefiles.reading", "save_failure": "pagedkv.testing.casefiles.writing",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pagedkv.testing' has no attribute {name!r}")
