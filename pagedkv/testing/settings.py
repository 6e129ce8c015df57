"""The suite's Hypothesis profiles and every settings object the gate and its tools run under.

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

Every other settings object the kit and its tools run under is built here too, from one
health-check policy (:data:`SUPPRESSED_HEALTH_CHECKS`): :func:`suite_settings` (the pytest suite),
:func:`mutant_settings` (the kill table), :func:`kill_rate_settings`, :func:`fuzz_settings`,
:func:`machine_settings` (the cache state machine), :func:`manager_suite_settings` (the suite's cache-manager
machine), :func:`manager_settings` (cache-manager programs in the kit's own tests) and
:func:`drawing_settings` (the specialisation plan, which draws without running).

Each profile is registered as ``pagedkv-<name>`` and, where the project under test has not registered that
name itself, also as ``<name>``: a user's own profiles are never replaced. Hypothesis ships a ``ci``
profile of its own (loaded silently when ``CI`` is set), which :func:`choose_profile` treats like no
choice at all.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.errors import InvalidArgument

from pagedkv.testing.hypothesis_internals import registered_profiles

#: The one health-check policy of every settings object built here: none is run. Each check judges the
#: run, never the backend's outputs, and each depends on what a gate must not turn on: ``too_slow`` on
#: the backend's speed (Triton's interpreter), ``data_too_large`` and ``large_base_example`` on the pools
#: a case builds, ``filter_too_much`` on the space the backend declares (a narrow one rejects most
#: draws) and on the state machines' bundles; the others do not apply to a test the kit builds itself.
#: With one policy a property cannot pass one entry point and fail another on a health check; the
#: strategies' own health is the kit's tests' business (tests/gate).
SUPPRESSED_HEALTH_CHECKS: tuple[HealthCheck, ...] = tuple(HealthCheck)

PROFILES: dict[str, dict] = {
    "smoke": dict(max_examples=5, derandomize=True, database=None),
    "dev": dict(max_examples=25),
    "ci": dict(max_examples=100, derandomize=True, database=None),
    "gpu": dict(max_examples=200),
    "nightly": dict(max_examples=2000),
    "repro": dict(max_examples=200, verbosity=Verbosity.verbose,
                  phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink, Phase.explain]),
}
#: What every profile sets. A loaded profile applies to the whole pytest session, a project's own tests
#: included, so it suppresses only the checks a case trips by its size; the kit's own runs add
#: :data:`SUPPRESSED_HEALTH_CHECKS` on top (:func:`suite_settings`).
COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


#: Profiles Hypothesis itself registers and loads without being asked (``ci`` when ``$CI`` is set).
_HYPOTHESIS_OWN = (None, "default", "ci")
_BARE: set[str] = set()  # bare names pagedkv registered (free when it did)


def _registered(name: str) -> bool:
    try:
        settings.get_profile(name)
    except InvalidArgument:
        return False
    return True


def register_profiles() -> None:
    """Register every profile of :data:`PROFILES` as ``pagedkv-<name>``, and as ``<name>`` where that
    name is free (idempotent)."""
    for name, values in PROFILES.items():
        chosen = {**COMMON, **values}
        settings.register_profile(f"pagedkv-{name}", **chosen)
        if not _registered(name) or name in _BARE:
            settings.register_profile(name, **chosen)
            _BARE.add(name)


#: The profile :func:`choose_profile` chose for this process (what the report names): the suite runs under it
#: even where another profile is loaded later (a plugin's or a conftest's ``pytest_configure`` after pagedkv's).
_chosen: str | None = None


def chosen_profile() -> str | None:
    """The profile name :func:`choose_profile` chose in this process, or ``None`` (not called)."""
    return _chosen


def choose_profile(requested: str | None = None) -> str:
    """Register the profiles and load the one this run uses; returns its name as the report header says it.
    The suite's settings (:func:`suite_settings`) are that profile's from then on, whatever is loaded later.

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
    known = registered_profiles()
    env = os.environ.get("PAGEDKV_PROFILE")
    env_name = (f"pagedkv-{env}" if env in PROFILES else env) if env else None
    if env_name and not _registered(env_name):
        raise ValueError(f"PAGEDKV_PROFILE={env!r} names no profile; choose one of {sorted(PROFILES)} "
                         f"or a registered one ({', '.join(known)})")
    global _chosen
    own = settings.get_current_profile_name()
    if requested:
        if not _registered(requested):
            raise ValueError(f"unknown Hypothesis profile {requested!r}; registered: {', '.join(known)}")
        name = requested
    elif own not in _HYPOTHESIS_OWN:
        ignored = (f"; PAGEDKV_PROFILE={env} not applied: pass --hypothesis-profile={env_name} to replace it"
                   if env_name and env_name != own else "")
        _chosen = own
        return f"{own} (the project's own, left as it is{ignored})"
    elif env_name:
        name = env_name
        settings.load_profile(name)
    else:
        name = "pagedkv-ci" if os.environ.get("CI") else "pagedkv-dev"
        settings.load_profile(name)
    _chosen = name
    from pagedkv.testing.databases import DatabaseError, load_env_database

    try:  # $PAGEDKV_DATABASE: the gpu and nightly profiles share that example database (docs/scale.md)
        shared = load_env_database(name)
    except DatabaseError as exc:
        raise ValueError(f"PAGEDKV_DATABASE: {exc}") from exc
    return name + (f" (example database: {shared})" if shared else "")


# -- the settings each entry point runs under -----------------------------------------------------------
def suite_settings(base: Any = None) -> settings:
    """``base`` (default: the profile :func:`choose_profile` chose and the report names, else the loaded one)
    with what every property needs whatever the profile: no deadline (a first example compiles or warms
    caches) and the kit's health-check policy. A profile loaded after the choice (a plugin's or a conftest's
    ``pytest_configure``) does not weaken the run the report names: ``--hypothesis-profile`` chooses one."""
    if base is None:
        base = settings.get_profile(_chosen) if _chosen is not None else settings()
    return settings(base, deadline=None, suppress_health_check=SUPPRESSED_HEALTH_CHECKS)


def mutant_settings(profile: str, *, shrink: bool = True) -> settings:
    """Settings for running a property against a mutant under the suite's profile ``profile``.

    Example databases are off (a mutant's failures must not be replayed against the real backends),
    and only the first distinct failure is reported. ``shrink=False`` stops at the first failing example.

    Raises:
        ValueError: unknown profile.
    """
    if profile not in PROFILES:
        raise ValueError(f"unknown Hypothesis profile {profile!r}; choose one of {sorted(PROFILES)}")
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    values = {k: v for k, v in PROFILES[profile].items() if k not in ("database", "phases", "verbosity")}
    return settings(**values, deadline=None, database=None, print_blob=False, phases=phases,
                    report_multiple_bugs=False, suppress_health_check=SUPPRESSED_HEALTH_CHECKS)


def kill_rate_settings(max_examples: int, explicit: bool) -> settings:
    """One kill-rate run of a property: ``max_examples`` generated examples (after the explicit ones when
    ``explicit``), random (the run is seeded), no database, no shrinking, the first failure only."""
    return settings(max_examples=max_examples, derandomize=False, database=None, deadline=None,
                    phases=[Phase.explicit, Phase.generate] if explicit else [Phase.generate],
                    report_multiple_bugs=False, print_blob=False, suppress_health_check=SUPPRESSED_HEALTH_CHECKS)


def fuzz_settings(database: Any, max_examples: int) -> settings:
    """One fuzz batch: replay ``database``'s examples, search ``max_examples`` new random ones, target and
    shrink, quietly (a worker reports through its own events), the first failure only."""
    return settings(database=database, max_examples=max_examples, deadline=None, derandomize=False,
                    verbosity=Verbosity.quiet, phases=[Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
                    report_multiple_bugs=False, print_blob=False, suppress_health_check=SUPPRESSED_HEALTH_CHECKS)


def machine_settings(base: Any, steps: int) -> settings:
    """A state machine's run: ``base`` (``None``: the loaded profile) as :func:`suite_settings` makes it,
    ``steps`` rules per run."""
    return settings(suite_settings(base), stateful_step_count=steps)


def manager_settings(max_examples: int = 50, steps: int = 30, base: Any = None) -> settings:
    """A cache-manager program run: ``max_examples`` runs of ``steps`` steps (capped by ``base``'s example
    count when given: the suite's profile), no example database, the first failure only."""
    if base is not None:
        max_examples = min(base.max_examples, max_examples)
    return settings(machine_settings(base, steps), max_examples=max_examples, database=None,
                    report_multiple_bugs=False)


def manager_suite_settings(steps: int, base: Any = None) -> settings:
    """The suite's cache-manager machine, as a kernel property runs: ``base`` (``None``: the loaded profile,
    its examples, derandomisation and example database: ``ci`` 100 programs and none, ``nightly`` 2000
    and Hypothesis's or ``$PAGEDKV_DATABASE``) as :func:`suite_settings` makes it, ``steps`` rules per
    program, the first failure only."""
    return settings(machine_settings(base, steps), report_multiple_bugs=False)


def manager_kill_rate_settings(max_examples: int, steps: int = 30) -> settings:
    """One kill-rate run of the cache-manager state machine: ``max_examples`` random programs of
    ``steps`` steps, no database, no shrinking, the first failure only (as :func:`kill_rate_settings`)."""
    return settings(kill_rate_settings(max_examples, explicit=False), stateful_step_count=steps)


def timing_settings(max_examples: int) -> settings:
    """Timing a property's examples (the specialisation plan's cost estimate): the loaded profile as
    :func:`suite_settings` makes it, ``max_examples`` examples, no database."""
    return settings(suite_settings(settings()), max_examples=max_examples, database=None)


def drawing_settings(max_examples: int, derandomize: bool) -> settings:
    """Drawing cases without running them (the specialisation plan): explicit and generated, no database."""
    return settings(max_examples=max_examples, derandomize=derandomize, database=None, deadline=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=SUPPRESSED_HEALTH_CHECKS)
