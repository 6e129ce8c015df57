"""Hypothesis example databases chosen by configuration, and the key each property is stored under.

A failing example that Hypothesis found is saved in an *example database* and replayed first on every
later run that uses the same database and key. Sharing one database is how a failure found by one fuzz
worker, machine or CI runner replays on all the others. :func:`open_database` turns one string (the
``--database`` option of ``python -m pagedkv fuzz``, or ``$PAGEDKV_DATABASE`` for the pytest plugin's
``gpu`` and ``nightly`` profiles) into a database:

==========================================  ======================================================
``URL``                                     database
==========================================  ======================================================
``PATH`` (default ``.hypothesis/examples``)  ``DirectoryBasedExampleDatabase(PATH)``: this machine
``redis://HOST:PORT/DB`` (``rediss://``)    ``hypothesis.extra.redis.RedisExampleDatabase``: a fleet
                                            (needs the ``redis`` client: ``pip install "pagedkv[fuzz]"``)
``github://OWNER/REPO[/ARTIFACT]``          ``ReadOnlyDatabase(GitHubArtifactDatabase(...))``: the
                                            ``hypothesis-example-db`` artifact a workflow uploaded
                                            (``$GITHUB_TOKEN`` for a private repository); read-only
``ro:URL``                                  ``ReadOnlyDatabase`` of ``URL``: replays, never writes
``multi:URL,URL,...``                       ``MultiplexedDatabase``: reads all, writes each writable
                                            one, e.g. ``multi:.hypothesis/examples,ro:redis://fleet:6379/0``
``none``                                    no database (nothing saved or replayed)
==========================================  ======================================================

:func:`property_key` is the key of one property run against one backend. The conformance suite
(:mod:`pagedkv.testing.suite`) and the fuzz workers (:mod:`pagedkv.tools.fuzz.workers`) both use it, so a
case found by fuzzing replays in ``pytest`` on a database they share, and a mutant's failures never
replay against (nor get deleted by) another backend.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

#: Where Hypothesis keeps its examples by default (the same folder pytest runs use).
DEFAULT_PATH = ".hypothesis/examples"
#: The environment variable the pytest plugin reads for the ``gpu`` and ``nightly`` profiles.
ENV_VAR = "PAGEDKV_DATABASE"
#: The profiles that use ``$PAGEDKV_DATABASE`` (``ci`` is derandomized and keeps no database).
PROFILES_WITH_SHARED_DATABASE = ("gpu", "nightly")


class DatabaseError(ValueError):
    """A database URL that cannot be parsed or opened (the message says why)."""


def property_key(prop_name: str, *backend_names: str) -> bytes:
    """The example-database key of property ``prop_name`` run against ``backend_names`` (one backend,
    or the two of a pair property, in the suite's order: reference first)."""
    return ("pagedkv-property:" + prop_name + ":" + "-".join(backend_names)).encode()


def open_database(url: str | None = None) -> Any:
    """The Hypothesis example database ``url`` names (see the module docstring); ``None`` or ``""``
    give the local default ``.hypothesis/examples``. Returns ``None`` for ``"none"``.

    Raises:
        DatabaseError: an unknown scheme, a malformed URL, the ``redis`` client missing, or a Redis
            server that does not answer.
    """
    from hypothesis.database import (DirectoryBasedExampleDatabase, InMemoryExampleDatabase,
                                     MultiplexedDatabase, ReadOnlyDatabase)

    text = (url or DEFAULT_PATH).strip()
    if text.lower() == "none":
        return None
    if text == "memory:":
        return InMemoryExampleDatabase()
    if text.startswith("multi:"):
        parts = [p.strip() for p in text[len("multi:"):].split(",") if p.strip()]
        if len(parts) < 2:
            raise DatabaseError(f"{url!r}: multi: needs two or more databases separated by commas, "
                                "e.g. multi:.hypothesis/examples,ro:redis://fleet:6379/0")
        dbs = [open_database(p) for p in parts]
        if any(db is None for db in dbs):
            raise DatabaseError(f"{url!r}: 'none' cannot be part of multi:")
        return MultiplexedDatabase(*dbs)
    if text.startswith("ro:"):
        inner = open_database(text[len("ro:"):])
        if inner is None:
            raise DatabaseError(f"{url!r}: ro: needs a database")
        return inner if isinstance(inner, ReadOnlyDatabase) else ReadOnlyDatabase(inner)
    if text.startswith(("redis://", "rediss://", "unix://")):
        return _redis(text)
    if text.startswith("github://"):
        m = re.fullmatch(r"github://([A-Za-z0-9][A-Za-z0-9-]*)/([A-Za-z0-9._-]+)(?:/([A-Za-z0-9._-]+))?/?", text)
        if not m:
            raise DatabaseError(f"{url!r}: expected github://OWNER/REPO or github://OWNER/REPO/ARTIFACT")
        from hypothesis.database import GitHubArtifactDatabase

        owner, repo, artifact = m.groups()
        return ReadOnlyDatabase(GitHubArtifactDatabase(owner, repo, artifact_name=artifact or "hypothesis-example-db"))
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", text):
        raise DatabaseError(f"{url!r}: unknown scheme; use a directory path, redis://HOST:PORT/DB, "
                            "github://OWNER/REPO, ro:URL, multi:URL,URL or none")
    return DirectoryBasedExampleDatabase(Path(text).expanduser())


def _redis(url: str) -> Any:
    try:
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase
    except ImportError as exc:
        raise DatabaseError(f"{url!r} needs the redis client: pip install \"pagedkv[fuzz]\" ({exc})") from exc
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5)
        client.ping()
    except (ValueError, redis.RedisError) as exc:
        raise DatabaseError(f"cannot use the Redis example database {url!r}: {type(exc).__name__}: {exc}") from exc
    return RedisExampleDatabase(client)


def describe(db: Any) -> str:
    """A short, credential-free description of a database for progress output and report headers."""
    from hypothesis.database import DirectoryBasedExampleDatabase, MultiplexedDatabase, ReadOnlyDatabase

    if db is None:
        return "none"
    if isinstance(db, MultiplexedDatabase):
        return "multi(" + ", ".join(describe(d) for d in db._wrapped) + ")"
    if isinstance(db, ReadOnlyDatabase):
        return "read-only " + describe(db._wrapped)
    if isinstance(db, DirectoryBasedExampleDatabase):
        return f"directory {db.path}"
    redis = getattr(db, "redis", None)
    if redis is not None:
        kw = redis.connection_pool.connection_kwargs
        where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"
        return f"redis {where}/{kw.get('db', 0)}"
    if type(db).__name__ == "GitHubArtifactDatabase":
        return f"github artifact {db.owner}/{db.repo}:{db.artifact_name}"
    return type(db).__name__


def load_env_database(profile: str) -> str | None:
    """Load ``profile`` with ``database=`` the database ``$PAGEDKV_DATABASE`` names, when the variable
    is set and ``profile`` is one of :data:`PROFILES_WITH_SHARED_DATABASE` (the profile must already be
    registered). Returns the database's description, or ``None`` when nothing changed.

    Raises:
        DatabaseError: as :func:`open_database`.
    """
    url = os.environ.get(ENV_VAR, "").strip()
    if not url or profile.removeprefix("pagedkv-") not in PROFILES_WITH_SHARED_DATABASE:
        return None
    from hypothesis import settings

    db = open_database(url)
    # re-registered under its own name, so Hypothesis's pytest plugin loading --hypothesis-profile gets it too
    settings.register_profile(profile, settings.get_profile(profile), database=db)
    settings.load_profile(profile)
    return describe(db)


def saved_examples(db: Any, key: bytes) -> int:
    """How many examples ``db`` holds under ``key`` (0 without a database)."""
    return 0 if db is None else sum(1 for _ in db.fetch(key))
