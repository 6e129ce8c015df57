"""The conformance kit: cases, properties, the one execution core, and the tools around it.

A map (each folder is one concept; arrows point the way imports go)::

    cases/        plain-data cases: Case, CacheScenario, InvalidCall, known cases, the one-line notation
    strategies/   Hypothesis strategies drawing those cases inside a declared space, and the profiles
    properties/   the check functions: data movement, attention, features, invariances, cache scenarios,
                  rejection of bad input, the cache state machine and its shadow model
    compare.py    bits, Mismatch, MissingOp, bit-for-bit assertions and the tolerance policy
    registry.py   Property (one entry per property: sentence, ops, check, strategy, examples, skip rules)
    space.py      what is under test: candidates, declared capabilities, device, Triton's interpreter
    execute.py    the one runner: every entry point below runs a property through it
    casefiles/    the case-file schema, reading untrusted files, writing, names, shipped regressions
    plugin.py     the pytest hooks and fixtures (glue only), suite/ the generated pytest modules
    mutants/      shipped faulty backends and caches, their kill table; generated source mutants, kill rates
    peers/        other projects' kernels adapted to the contract (PyTorch, vLLM, ...)
    fuzz/         long-running search workers sharing an example database
    baseline/     the code a refactor replaces as a second oracle: loaded in a worker, drift measured

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
