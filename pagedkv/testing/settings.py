"""The suite's Hypothesis profiles, in one place for pytest (``conftest.py``) and ``python -m pagedkv mutants``.

=========  ========  ===========  ==========================================================
profile    examples  derandomize  use
=========  ========  ===========  ==========================================================
smoke      5         yes          a gate is wired up: every property runs a few examples (minutes, not a gate)
dev        25        no           local runs (the default)
ci         100       yes          a gate must not flip on a rerun; no example database
gpu        200       no           GPU runners; the example database (kept between runs) replays past failures
nightly    2000      no           long random search
repro      200       no           verbose, with Hypothesis's explain phase, to study a failure
=========  ========  ===========  ==========================================================

**Example databases** (where a failing example is kept and replayed first on the next run): ``ci`` and
``smoke`` have none; the others use Hypothesis's default, ``.hypothesis/examples`` in the working directory. For the
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

Each is registered as ``pagedkv-<name>`` and, where the project under test has not registered that
name itself, also as ``<name>``: a user's own profiles are never replaced. Hypothesis ships a ``ci``
profile of its own (loaded silently when ``CI`` is set), which :func:`choose_profile` treats like no
choice at all.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, Verbosity, settings

PROFILES: dict[str, dict] = {
    "smoke": dict(max_examples=5, derandomize=True, database=None),
    "dev": dict(max_examples=25),
    "ci": dict(max_examples=100, derandomize=True, database=None),
    "gpu": dict(max_examples=200),
    "nightly": dict(max_examples=2000),
    "repro": dict(max_examples=200, verbosity=Verbosity.verbose,
                  phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink, Phase.explain]),
}
COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


#: Profiles Hypothesis itself registers and loads without being asked (``ci`` when ``$CI`` is set).
_HYPOTHESIS_OWN = (None, "default", "ci")
_BARE: set[str] = set()  # bare names pagedkv registered (free when it did)


def register_profiles() -> None:
    """Register every profile of :data:`PROFILES` as ``pagedkv-<name>``, and as ``<name>`` where that
    name is free (idempotent)."""
    for name, values in PROFILES.items():
        chosen = {**COMMON, **values}
        settings.register_profile(f"pagedkv-{name}", **chosen)
        if name not in settings._profiles or name in _BARE:
            settings.register_profile(name, **chosen)
            _BARE.add(name)


def choose_profile(requested: str | None = None) -> str:
    """Register the profiles and load the one this run uses; returns its name as the report header says it.

    Precedence: ``requested`` (``--hypothesis-profile``, loaded by Hypothesis' own plugin: the one
    explicit ask on the command line) wins; then a profile the project under test loaded itself (left
    alone: ``$PAGEDKV_PROFILE`` does not replace it, and the returned name says it was not applied);
    then ``$PAGEDKV_PROFILE`` (a pagedkv profile name, or any registered one); else ``pagedkv-ci`` when
    ``$CI`` is set, ``pagedkv-dev`` otherwise.
    A ``$PAGEDKV_DATABASE`` applies to the ``gpu`` and ``nightly`` profiles (:mod:`pagedkv.testing.databases`).

    Raises:
        ValueError: the requested profile is registered nowhere, or ``$PAGEDKV_DATABASE`` is malformed.
    """
    import os

    register_profiles()
    known = sorted(settings._profiles)
    env = os.environ.get("PAGEDKV_PROFILE")
    env_name = (f"pagedkv-{env}" if env in PROFILES else env) if env else None
    if env_name and env_name not in settings._profiles:
        raise ValueError(f"PAGEDKV_PROFILE={env!r} names no profile; choose one of {sorted(PROFILES)} "
                         f"or a registered one ({', '.join(known)})")
    own = settings.get_current_profile_name()
    if requested:
        if requested not in settings._profiles:
            raise ValueError(f"unknown Hypothesis profile {requested!r}; registered: {', '.join(known)}")
        name = requested
    elif own not in _HYPOTHESIS_OWN:
        ignored = (f"; PAGEDKV_PROFILE={env} not applied: pass --hypothesis-profile={env_name} to replace it"
                   if env_name and env_name != own else "")
        return f"{own} (the project's own, left as it is{ignored})"
    elif env_name:
        name = env_name
        settings.load_profile(name)
    else:
        name = "pagedkv-ci" if os.environ.get("CI") else "pagedkv-dev"
        settings.load_profile(name)
    from pagedkv.testing.databases import DatabaseError, load_env_database

    try:  # $PAGEDKV_DATABASE: the gpu and nightly profiles share that example database (docs/scale.md)
        shared = load_env_database(name)
    except DatabaseError as exc:
        raise ValueError(f"PAGEDKV_DATABASE: {exc}") from exc
    return name + (f" (example database: {shared})" if shared else "")
