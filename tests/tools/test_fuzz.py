"""``python -m pagedkv fuzz`` over a real Redis server: a failure one worker finds is replayed from the
shared example database by the next worker (no new search) and by the pytest suite, and all of them
write the same case file.

The Redis test starts ``redis-server`` (Debian package ``redis-server``) on 127.0.0.1 on a free port
with its data in a temporary directory, and stops it and removes the directory afterwards; it is
skipped, with the reason, where the binary or the ``redis`` client is missing or the server does
not start.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pagedkv.testing.databases import DatabaseError, describe, open_database, property_key

MUTANT = "pagedkv.tools.mutants:off_by_one_last_block"
PROPERTY = "gather_returns_exactly_what_each_slot_holds"
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url():
    """A fresh ``redis-server`` on 127.0.0.1 (no persistence), its data directory removed afterwards."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    redis = pytest.importorskip("redis", reason="the redis client is not installed (pip install 'pagedkv[fuzz]')")
    data = tempfile.mkdtemp(prefix="pagedkv-redis-")
    port = _free_port()
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", data, "--save", "",
                             "--appendonly", "no", "--protected-mode", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        for _ in range(50):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    pytest.skip(f"redis-server exited with status {proc.returncode} on port {port}")
                time.sleep(0.1)
        else:
            pytest.skip(f"redis-server did not answer on 127.0.0.1:{port} within 5 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(data, ignore_errors=True)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDKV_", "HYPOTHESIS"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def _fuzz(url: str, cwd: Path, failures: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pagedkv", "fuzz", "--impl", MUTANT, "--properties", PROPERTY, "--workers", "1",
           "--minutes", "0.3", "--database", url, "--failure-dir", failures, "--interval", "60"]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # two time-budgeted fleet runs (18 s each); one batch's verdict is pinned by test_one_runner
def test_a_failure_found_by_one_worker_is_replayed_by_the_next_from_redis(redis_url, tmp_path, pytester, monkeypatch):
    import redis

    from pagedkv.cli.replay import replay

    first = _fuzz(redis_url, tmp_path, "first")
    assert first.returncode == 1, first.stdout + first.stderr
    assert "found by search at example" in first.stdout, first.stdout
    assert "replayed from the database" not in first.stdout
    assert f"database: redis 127.0.0.1:{redis_url.split(':')[2].split('/')[0]}/0" in first.stdout

    key = b"hypothesis-example:" + property_key(PROPERTY, "off_by_one_last_block")
    assert redis.Redis.from_url(redis_url).exists(key), "the first worker saved nothing to Redis"

    second = _fuzz(redis_url, tmp_path, "second")
    assert second.returncode == 1, second.stdout + second.stderr
    assert "replayed from the database (example 1;" in second.stdout, second.stdout
    assert "found by search" not in second.stdout

    (a,), (b,) = sorted((tmp_path / "first").glob("*.json")), sorted((tmp_path / "second").glob("*.json"))
    assert a.name == b.name
    # the same failing case and record; only ``history`` (the cases each run judged before it) differs
    first_record, second_record = (json.loads(f.read_text()) for f in (a, b))
    assert isinstance(first_record.pop("history"), list) and isinstance(second_record.pop("history"), list)
    assert first_record == second_record
    record = json.loads(a.read_text())
    assert (record["check"], record["backend"], record["outcome"]) == (PROPERTY, MUTANT, "failed")
    assert f"python -m pagedkv replay {Path('first') / a.name}" in first.stdout
    assert replay(a, quiet=True, out=io.StringIO()) == 1  # the case file reproduces the failure

    # the pytest suite under the gpu profile with $PAGEDKV_DATABASE replays the same case
    for key in [k for k in os.environ if k.startswith(("PAGEDKV_", "HYPOTHESIS"))]:
        monkeypatch.delenv(key)
    for key, value in {"PYTHONPATH": _env()["PYTHONPATH"], "PAGEDKV_PROFILE": "gpu", "PAGEDKV_DATABASE": redis_url,
                       "PAGEDKV_FAILURE_DIR": str(tmp_path / "pytest")}.items():
        monkeypatch.setenv(key, value)
    suite = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--pyargs",
                                          "pagedkv.testing.suite", f"--pagedkv-impl={MUTANT}", "-k", f"test_{PROPERTY}",
                                          timeout=120)
    assert suite.ret == 1, str(suite.stdout)[-2000:] + str(suite.stderr)[-2000:]
    (c,) = sorted((tmp_path / "pytest").glob("*.json"))
    assert json.loads(c.read_text())["case"] == record["case"]


def test_database_urls(tmp_path):
    from hypothesis.database import DirectoryBasedExampleDatabase, MultiplexedDatabase, ReadOnlyDatabase

    local = open_database(str(tmp_path / "examples"))
    assert isinstance(local, DirectoryBasedExampleDatabase)
    assert open_database("none") is None
    default = open_database(None)
    assert isinstance(default, DirectoryBasedExampleDatabase) and str(default.path).endswith(".hypothesis/examples")
    ro = open_database(f"ro:{tmp_path / 'examples'}")
    assert isinstance(ro, ReadOnlyDatabase)
    ro.save(b"k", b"v")
    assert list(local.fetch(b"k")) == []
    github = open_database("github://octo-org/kv-engine/fuzz-db")
    assert isinstance(github, ReadOnlyDatabase)
    assert describe(github) == "read-only github artifact octo-org/kv-engine:fuzz-db"
    multi = open_database(f"multi:{tmp_path / 'examples'},ro:{tmp_path / 'shared'}")
    assert isinstance(multi, MultiplexedDatabase)
    multi.save(b"k", b"v")  # written locally, not to the read-only shared one
    assert list(local.fetch(b"k")) == [b"v"]
    assert list(open_database(str(tmp_path / "shared")).fetch(b"k")) == []
    for bad in ("ftp://host/db", "multi:only-one", "github://owner", "multi:a,none"):
        with pytest.raises(DatabaseError):
            open_database(bad)


def test_fuzz_refuses_bad_arguments_before_starting_workers(tmp_path):
    from pagedkv.cli import main

    assert main(["fuzz", "--impl", MUTANT, "--properties", "gather_returns_exactly", "--minutes", "0.1",
                 "--database", str(tmp_path / "db")]) == 2
    assert main(["fuzz", "--impl", "no_such_module_xyz:backend", "--minutes", "0.1",
                 "--database", str(tmp_path / "db")]) == 2
    assert main(["fuzz", "--impl", MUTANT, "--minutes", "0.1", "--database", "redis://127.0.0.1:1/0"]) == 2
