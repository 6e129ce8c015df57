"""The check functions behind the registered properties (:mod:`pagedkv.testing.registry`); each
raises :class:`~pagedkv.testing.compare.Mismatch` when its property fails. Run them through
:mod:`pagedkv.testing.execute`, never directly (``tests/repo/test_architecture.py`` keeps it so).

- :mod:`.definitions`: gather, scatter, ``write_kv`` and attention against their definitions, pairs of backends;
- :mod:`.features`: the identities of the optional attention features (window, soft-cap, ALiBi, sinks, fp8);
- :mod:`.invariances`: outputs unchanged under renumbering, padding, poison, dtypes, layouts, batch order;
- :mod:`.scenarios`: forks, copy-on-write and prefix caching never leak one sequence into another;
- :mod:`.rejection`: bad input raises the contract's error and writes nothing;
- :mod:`.cache_model` and :mod:`.window_rules`: the shadow model the scenarios replay through, and its window rules.

The cache as a Hypothesis state machine is the cache-manager machine (:mod:`pagedkv.testing.managers`; the
property ``cache_state_machine_holds_its_invariants`` runs it with a candidate's ops:
:mod:`pagedkv.testing.managers.kernel_property`).
"""
