"""Shipped faulty implementations the suite must kill, and the kill table.

- :mod:`.backends`: faulty backends (an off-by-one at a block boundary, GQA by ``h % num_kv_heads``, ...);
- :mod:`.features`: faulty optional attention features (a window one key too wide, ...);
- :mod:`.partial`: faulty partial attention (an LSE in base 2 declared natural, a merge that makes NaN, ...);
- :mod:`.caches`: faulty cache managers, served by the ``indexed`` backend (blocks cached before written, ...);
- :mod:`.kill_table`: every property against every mutant (``python -m pagedkv mutate --kill-table``).

``pagedkv.tools.mutants:NAME`` loads any shipped mutant (case files and docs name them so).
"""

from pagedkv.tools.mutants.backends import MUTANTS as BACKEND_MUTANTS, TARGETS as BACKEND_TARGETS, IndexedBackend
from pagedkv.tools.mutants.caches import CACHE_MUTANT_BACKENDS, CACHE_TARGETS
from pagedkv.tools.mutants.features import FEATURE_MUTANTS, FEATURE_TARGETS
from pagedkv.tools.mutants.partial import PARTIAL_MUTANTS, PARTIAL_TARGETS

__all__ = ["IndexedBackend", "MUTANTS", "TARGETS"]

#: name -> mutant backend class, every shipped mutant.
MUTANTS: dict[str, type] = {**BACKEND_MUTANTS, **FEATURE_MUTANTS, **PARTIAL_MUTANTS, **CACHE_MUTANT_BACKENDS}
#: name -> the properties that should kill it first (the kill table tries these, then all the others).
TARGETS: dict[str, tuple[str, ...]] = {**BACKEND_TARGETS, **FEATURE_TARGETS, **PARTIAL_TARGETS, **CACHE_TARGETS}

for _name, _cls in MUTANTS.items():
    globals()[_name] = _cls()  # module-level instances: --pagedkv-impl=pagedkv.tools.mutants:gqa_modulo
