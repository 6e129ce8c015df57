"""Plain-data cases the properties run on: a :class:`Case` (geometry, block tables, lengths, value
pattern, poison, features, seed), a :class:`CacheScenario` (operations on a real cache), an
:class:`InvalidCall` (one argument broken on purpose). Each has a ``repr`` that is valid Python and a
JSON round trip; tensors are built from the seed, on any device, without Hypothesis.

- :mod:`.case`: the dataclasses and the reference gather/write;
- :mod:`.invalid_call`: the faults table (what each broken argument must raise);
- :mod:`.known`: the cases ``shared/cases.md`` names (C1-C15), used as explicit examples;
- :mod:`.notation`: the one-line form of tables and reports.
"""

from pagedkv.testing.cases.case import CacheScenario, Case, Geometry, SeqSpec
from pagedkv.testing.cases.invalid_call import InvalidCall
from pagedkv.testing.cases.notation import brief

__all__ = ["CacheScenario", "Case", "Geometry", "InvalidCall", "SeqSpec", "brief"]
