"""The suite's Hypothesis profiles, in one place for pytest (``conftest.py``) and ``python -m pagedkv mutants``.

=========  ========  ===========  ==========================================================
profile    examples  derandomize  use
=========  ========  ===========  ==========================================================
dev        25        no           local runs (the default)
ci         100       yes          a gate must not flip on a rerun; no example database
gpu        200       no           GPU runners; the example database (kept between runs) replays past failures
nightly    2000      no           long random search
repro      200       no           verbose, with Hypothesis's explain phase, to study a failure
=========  ========  ===========  ==========================================================

**Example databases** (where a failing example is kept and replayed first on the next run): ``ci`` has
none; the others use Hypothesis's default, ``.hypothesis/examples`` in the working directory. For the
``gpu`` and ``nightly`` profiles, ``$PAGEDKV_DATABASE`` picks another one, read by the pytest plugin
(:func:`pagedkv.testing.databases.load_env_database`) and, as ``--database``'s default, by
``python -m pagedkv fuzz``::

    PAGEDKV_DATABASE=redis://fuzz-db:6379/0                        # a fleet shares one Redis
    PAGEDKV_DATABASE=multi:.hypothesis/examples,ro:redis://fuzz-db:6379/0   # a laptop replays the fleet's finds
    PAGEDKV_DATABASE=multi:.hypothesis/examples,github://OWNER/REPO         # ... or the nightly job's artifact
    PAGEDKV_DATABASE=/shared/nfs/pagedkv-examples                  # any directory

(``pip install "pagedkv[fuzz]"`` for Redis; every form is in :mod:`pagedkv.testing.databases`; running
at scale: ``docs/scale.md``.) Examples are keyed per property and backend, so the fuzz workers and
the suite replay each other's finds, and a mutant's never reach another backend.

Hypothesis ships a ``ci`` profile of its own (loaded silently when ``CI`` is set): call
:func:`register_profiles` and load one of these explicitly.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, Verbosity, settings

PROFILES: dict[str, dict] = {
    "dev": dict(max_examples=25),
    "ci": dict(max_examples=100, derandomize=True, database=None),
    "gpu": dict(max_examples=200),
    "nightly": dict(max_examples=2000),
    "repro": dict(max_examples=200, verbosity=Verbosity.verbose,
                  phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink, Phase.explain]),
}
COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def register_profiles() -> None:
    """Register every profile of :data:`PROFILES` with Hypothesis (idempotent)."""
    for name, values in PROFILES.items():
        settings.register_profile(name, **{**COMMON, **values})
