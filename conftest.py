"""This repository's own test configuration and shared fixtures.

The pagedkv pytest plugin comes from the installed package's ``pytest11`` entry point; the ini key
``pagedkv_builtin = true`` (pyproject.toml) switches it on for this repository's tests and the
conformance suite over the built-in backends. Keeping this file at the root puts the root on
``sys.path``, so the tests import the repository's ``strategies`` face like any project's own package.

Shared fixtures:

- ``pytester`` (pytest's own): runs pytest inside a test. The gate's runs use
  ``pytester.runpytest_subprocess``: the plugin registers and loads Hypothesis profiles, which are
  process-wide, and a candidate may kill its process.
- ``write_candidate``: writes a backend module into a temporary folder that both this process and its
  subprocesses import from, and gives the ``--pagedkv-impl`` spec that names it.
- ``pagedkv_wheel`` and ``venv_with_wheel``: the checkout's wheel, built once per session, installed
  into fresh virtual environments that have no access to the checkout.

A test that uses ``pytester``, the wheel or a virtual environment is marked ``integration``
(``-m "not integration"`` deselects them all).

Two tiers: a test marked ``slow`` (the wheel in a fresh environment, a user's repository, the long
soak, the tools' own end-to-end runs: each says why it can wait) is skipped, saying how to run it,
unless ``PAGEDKV_SLOW=1`` or ``PAGEDKV_PROFILE=nightly`` asks for the nightly tier
(``.github/workflows/nightly.yml``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent

#: Fixtures whose tests run nested pytest or build a wheel or a virtual environment.
INTEGRATION_FIXTURES = {"pytester", "pagedkv_wheel", "venv_with_wheel"}

#: Not copied when the checkout is built: build outputs and local state (a stale ``build/lib`` would
#: put files that no longer exist into the wheel).
NOT_SOURCE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
                                    ".pagedkv-failures", ".pytest_cache", ".ruff_cache", "results", "gpu-results")


#: The nightly tier: every test, the ``slow`` ones included.
NIGHTLY_TIER = bool(os.environ.get("PAGEDKV_SLOW")) or os.environ.get("PAGEDKV_PROFILE") == "nightly"
_WAITS = pytest.mark.skip(reason="slow: runs in the nightly tier (PAGEDKV_SLOW=1 or PAGEDKV_PROFILE=nightly)")


def pytest_configure(config):
    # an xdist worker is one process per core: torch's own threads on top (here and in the subprocesses a
    # test starts) would oversubscribe the cores
    if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    for item in items:
        if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        if _is_loop_backend_run(item):
            item.add_marker(pytest.mark.slow)
        if not NIGHTLY_TIER and item.get_closest_marker("slow"):
            item.add_marker(_WAITS)


def _is_loop_backend_run(item) -> bool:
    """A property of the conformance suite run on the ``loop`` backend alone. The loop backend (a Python
    loop over blocks and ``torch.cat``) is the simplest read path: every push judges it through
    ``backends_agree_on_every_op_both_provide[loop-indexed]`` and ``[loop-triton]`` (each of its ops equal
    to the indexed and Triton backends' on 100 cases) and ``tests/backends``; each property on it alone
    waits for the nightly tier."""
    from pagedkv.backends import backend_name

    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get("backend") if callspec is not None else None  # pair tests take backend_pair
    return (backend is not None and item.nodeid.startswith("pagedkv/testing/suite/test_properties.py")
            and backend_name(backend) == "loop")


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    """``cmd`` (paths allowed) with its output captured as text; a hung build fails instead of hanging CI."""
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=kw.pop("timeout", 1500),
                          **kw)


# -- candidate modules --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """A backend module written for a test: its file and the spec ``--pagedkv-impl`` takes."""

    path: Path
    spec: str


@pytest.fixture
def write_candidate(tmp_path, monkeypatch):
    """``write_candidate(module, source, attr=None) -> Candidate``.

    Writes ``source`` (dedented) to ``<tmp>/candidates/<module>.py`` and puts that folder first on
    ``sys.path`` and ``$PYTHONPATH`` for the test's duration, so the module imports here, in
    ``pytester.runpytest_subprocess`` and in ``python -m pagedkv replay``. The spec is ``module`` or
    ``module:attr``."""
    folder = tmp_path / "candidates"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))

    def write(module: str, source: str, attr: str | None = None) -> Candidate:
        path = folder / f"{module}.py"
        path.write_text(textwrap.dedent(source))
        return Candidate(path, f"{module}:{attr}" if attr else module)

    return write


# -- the wheel in a virtual environment ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def pagedkv_wheel(tmp_path_factory) -> Path:
    """The checkout's wheel, built once per session from a copy of its source (no build outputs)."""
    base = tmp_path_factory.mktemp("pagedkv-wheel")
    source = base / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", base / "dist",
                 source])
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (base / "dist").glob("pagedkv-*.whl")
    return wheel


@pytest.fixture(scope="session")
def venv_with_wheel(pagedkv_wheel, tmp_path_factory):
    """``venv_with_wheel(name, *, system_site_packages=False, first=(), extra="") -> Path`` of its python.

    A fresh virtual environment with ``pagedkv_wheel`` installed. ``system_site_packages``: it sees this
    environment's packages (torch, Hypothesis, pytest) and has no pip of its own, and the wheel goes in
    with ``--no-deps``; otherwise it has its own pip, installs each requirement of ``first`` (the test
    is skipped, saying why, when one cannot be installed here) and then the wheel with its ``extra``
    and dependencies."""

    def make(name: str, *, system_site_packages: bool = False, first: tuple[str, ...] = (), extra: str = "") -> Path:
        env_dir = tmp_path_factory.mktemp(name) / "venv"
        python = env_dir / "bin" / "python"
        wheel = f"{pagedkv_wheel}[{extra}]" if extra else str(pagedkv_wheel)
        if system_site_packages:
            # the system's pip and setuptools: the venv's bundled setuptools cannot build a wheel
            made = _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", env_dir])
            assert made.returncode == 0, made.stdout + made.stderr
            done = _run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel])
            assert done.returncode == 0, done.stdout + done.stderr
            return python
        made = _run([sys.executable, "-m", "venv", env_dir])
        assert made.returncode == 0, made.stdout + made.stderr
        for requirement in first:
            done = _run([python, "-m", "pip", "install", "--quiet", requirement])
            if done.returncode != 0:
                pytest.skip(f"cannot install {requirement} into a fresh environment here: {done.stderr[-300:]}")
        done = _run([python, "-m", "pip", "install", "--quiet", wheel])
        assert done.returncode == 0, done.stdout + done.stderr
        return python

    return make
