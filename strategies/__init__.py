"""Hypothesis strategies for paged KV caches: draw structure, not tensors.

Every strategy draws small plain-data cases from :mod:`pagedkv.testing.cases.case` (a readable ``repr`` that is
valid Python, a JSON round trip); tensors are built from the drawn seed, so a shrunk failure is
short and replays on any device. Import them in your own suite::

    from hypothesis import given
    from pagedkv.testing.strategies import cases

    @given(cases())
    def test_my_gather(case): ...

Families: cache geometries; sequence lengths biased to block boundaries; block tables (unique and
permuted, or with repeated ids for reads); fragmented allocations (tables taken from a real
allocator after a random alloc/free history); batches of requests; sharing scenarios (forks,
forks mid-block, prefix-cache hits); value patterns and poison; invalid calls (one argument broken,
tagged with the error the contract requires).
"""

from .geometry import DTYPES, GROUP_SIZES, geometries, seq_lens
from .batches import cases, fragmented_cases, large_pool_cases
from .sharing import scenarios
from .invalid import invalid_calls

__all__ = ["DTYPES", "GROUP_SIZES", "cases", "fragmented_cases", "geometries", "invalid_calls", "large_pool_cases",
           "scenarios", "seq_lens"]

if __name__ != "pagedkv.testing.strategies":  # imported from a checkout's root as plain `strategies`
    # Be the very package the kit uses (one copy of every class and profile), not a second import.
    import importlib as _importlib
    import pkgutil as _pkgutil
    import sys as _sys

    _package = _sys.modules[__name__] = _importlib.import_module("pagedkv.testing.strategies")
    for _module in _pkgutil.iter_modules(_package.__path__):  # every module, the palette included
        _sys.modules[f"{__name__}.{_module.name}"] = _importlib.import_module(f"{_package.__name__}.{_module.name}")
