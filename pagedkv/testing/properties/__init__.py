"""The check functions behind the registered properties (:mod:`pagedkv.testing.registry`); each
raises :class:`~pagedkv.testing.compare.Mismatch` when its property fails. Run them through
:mod:`pagedkv.testing.execute`, never directly (``tests/repo/test_architecture.py`` keeps it so).

- :mod:`.definitions`: gather, scatter, ``write_kv`` and attention against their definitions, pairs of backends;
- :mod:`.features`: the identities of the optional attention features (window, soft-cap, ALiBi, sinks, fp8);
- :mod:`.invariances`: outputs unchanged under renumbering, padding, poison, dtypes, layouts, batch order;
- :mod:`.scenarios`: forks, copy-on-write and prefix caching never leak one sequence into another;
- :mod:`.rejection`: bad input raises the contract's error and writes nothing;
- :mod:`.machine` and :mod:`.cache_model`: the cache as a Hypothesis state machine against a shadow model.
"""
