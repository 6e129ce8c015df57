"""The conformance suite: the registered properties, the regression case files and the limits, run
against the implementation under test.

    pytest --pyargs pagedkv.testing.suite --pagedkv-impl my_engine.kv:backend -n auto

Every test here exercises the candidate (nothing tests pagedkv itself); the plugin
(:mod:`pagedkv.testing.plugin`) supplies ``backend``, ``backend_pair``, ``device`` and ``check``.
"""
