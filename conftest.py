"""pytest set-up for the pagedkv suite: Hypothesis profiles, the implementation under test, the device.

- Profiles ``dev``, ``ci``, ``gpu``, ``nightly``, ``repro`` (``strategies/profiles.py``) are registered
  here and one is loaded explicitly: ``--hypothesis-profile NAME``, else ``$PAGEDKV_PROFILE``, else ``ci`` when ``$CI`` is
  set (Hypothesis would otherwise load its own ``ci`` profile silently), else ``dev``.
- The implementation under test: ``--pagedkv-impl SPEC`` or ``$PAGEDKV_IMPL`` (the option wins),
  ``pkg.module`` or ``pkg.module:attr``; unset, every built-in backend usable here is tested.
- The device: ``$PAGEDKV_DEVICE``, else CUDA when present (xdist worker ``gwN`` takes GPU
  ``N % device_count``), else CPU. Without CUDA, Triton kernels run under ``TRITON_INTERPRET=1``,
  set here before anything imports Triton.
"""

from __future__ import annotations

import os
import re

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.testing import checks  # noqa: E402
from pagedkv.backends import backend_name, load_backend, missing_ops  # noqa: E402
from strategies.profiles import PROFILES, register_profiles  # noqa: E402

register_profiles()


def pytest_addoption(parser):
    group = parser.getgroup("pagedkv")
    group.addoption("--pagedkv-impl", default=None, metavar="SPEC",
                    help="implementation under test: pkg.module or pkg.module:attr (default: $PAGEDKV_IMPL, "
                         "else every built-in backend usable here)")


def pytest_configure(config):
    profile = config.getoption("hypothesis_profile", None) or os.environ.get("PAGEDKV_PROFILE") \
        or ("ci" if os.environ.get("CI") else "dev")
    if profile not in PROFILES:
        raise pytest.UsageError(f"unknown Hypothesis profile {profile!r}; choose one of {sorted(PROFILES)}")
    settings.load_profile(profile)
    config._pagedkv_profile = profile


def impl_spec(config) -> str | None:
    return config.getoption("pagedkv_impl") or os.environ.get("PAGEDKV_IMPL") or None


def _backends_under_test(config) -> list:
    spec = impl_spec(config)
    if spec:
        try:
            return [load_backend(spec)]
        except pagedkv.BackendError as exc:
            raise pytest.UsageError(f"--pagedkv-impl / PAGEDKV_IMPL: {exc}") from exc
    return [pagedkv.get_backend(name) for name in pagedkv.available_backends()]


def pick_device() -> str:
    """``$PAGEDKV_DEVICE``, else ``cuda:N`` (xdist worker ``gwK`` takes ``K % device_count``), else ``cpu``."""
    if os.environ.get("PAGEDKV_DEVICE"):
        return os.environ["PAGEDKV_DEVICE"]
    if torch.cuda.is_available():
        worker = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", "gw0"))
        return f"cuda:{int(worker.group(1)) % torch.cuda.device_count() if worker else 0}"
    return "cpu"


def pytest_report_header(config):
    import hypothesis

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    spec = impl_spec(config)
    device = pick_device()
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    interp = " (TRITON_INTERPRET=1)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return [
        f"pagedkv {pagedkv.__version__}: implementation under test: "
        f"{spec or ', '.join(pagedkv.available_backends()) + ' (built-in)'}",
        f"pagedkv device: {device} [{name}]; Hypothesis profile: {config._pagedkv_profile}",
        f"versions: torch {torch.__version__}, triton {triton_version}{interp}, hypothesis {hypothesis.__version__}",
    ]


def pytest_generate_tests(metafunc):
    """Parametrize ``backend`` over the implementations under test (ids are their names)."""
    if "backend" in metafunc.fixturenames:
        impls = _backends_under_test(metafunc.config)
        metafunc.parametrize("backend", impls, ids=[backend_name(b) for b in impls], scope="session")
    if "backend_pair" in metafunc.fixturenames:
        impls = _backends_under_test(metafunc.config)
        if len(impls) == 1 and impl_spec(metafunc.config):  # a candidate is compared with our indexed backend
            impls = [pagedkv.get_backend("indexed"), impls[0]]
        pairs = [(a, b) for i, a in enumerate(impls) for b in impls[i + 1:]]
        metafunc.parametrize("backend_pair", pairs, ids=[f"{backend_name(a)}-{backend_name(b)}" for a, b in pairs],
                             scope="session")


@pytest.fixture(scope="session")
def device() -> str:
    return pick_device()


@pytest.fixture(scope="session")
def check(request):
    """``check(fn, backend, ...)``: run a :mod:`pagedkv.testing.checks` property with the given arguments.

    A missing op skips the test with the reason; a failure writes the case file (the last one
    written per test is the shrunk example) and adds the replay command to the error.
    """

    def run(fn, backend, *args):
        try:
            return fn(backend, *args)
        except checks.MissingOp as exc:
            pytest.skip(str(exc))
        except AssertionError as exc:
            case = next(a for a in args if hasattr(a, "to_dict"))  # a Case, CacheScenario or InvalidCall
            other = args[0] if fn is checks.backends_agree else None
            transform = next((a for a in args if isinstance(a, str) and a in checks.TRANSFORMS), None)
            spec = impl_spec(request.config) or backend_name(backend)
            path = checks.save_failure(fn.__name__, spec, case, other=backend_name(other) if other else None,
                                       transform=transform, test_id=_current_test_id(), error=str(exc))
            raise AssertionError(f"{exc}\nreplay: python -m pagedkv replay {path}") from exc

    return run


def _current_test_id() -> str:
    """The running test's node id (``$PYTEST_CURRENT_TEST`` without the phase)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "pagedkv-test").rsplit(" ", 1)[0]
