"""The pagedkv pytest plugin: gate any paged-KV implementation with the conformance suite.

Installed with ``pip install "pagedkv[testing]"`` (a ``pytest11`` entry point), it adds to any
project, without copying a ``conftest.py``:

- ``--pagedkv-impl SPEC`` (or ``$PAGEDKV_IMPL``): the implementation under test, ``pkg.module`` or
  ``pkg.module:attr`` (see :func:`pagedkv.load_backend`); unset, every built-in backend usable here;
- the Hypothesis profiles ``dev``, ``ci``, ``gpu``, ``nightly``, ``repro`` (``--hypothesis-profile NAME``
  or ``$PAGEDKV_PROFILE``; ``ci`` when ``$CI`` is set, else ``dev``);
- the device: ``--pagedkv-device`` or ``$PAGEDKV_DEVICE``, else CUDA when present (xdist worker
  ``gwN`` takes GPU ``N % device_count``), else the CPU;
- a report header naming the implementation, device, profile and versions;
- a case file for every failing property, crashes included: the case is written before the backend
  is called and removed when it passes, so an exception, an out-of-memory kill or a device fault
  leaves it on disk with ``python -m pagedkv replay FILE``.

Run the conformance suite from any directory::

    pytest --pyargs pagedkv.testing.suite --pagedkv-impl my_engine.kv:backend -n auto

The plugin imports nothing heavy at load time and changes nothing unless it is *active*: an
implementation is named, the ini option ``pagedkv_builtin = true`` is set (this repository), or the
conformance suite is among the collected paths.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

SUITE_PACKAGE = "pagedkv.testing.suite"
pytest_plugins = ["pagedkv.testing.baseline_gate"]  # --pagedkv-baseline: drift against the code a refactor replaces
_ACTIVE = pytest.StashKey[bool]()
_PROFILE = pytest.StashKey[str]()
_CANDIDATE = pytest.StashKey[object]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagedkv", "pagedkv conformance suite")
    group.addoption("--pagedkv-impl", default=None, metavar="SPEC",
                    help="implementation under test: pkg.module, pkg.module:attr or file.py[:attr] "
                         "(default: $PAGEDKV_IMPL, else every built-in backend usable here)")
    group.addoption("--pagedkv-device", default=None, metavar="DEVICE",
                    help="device for the suite's tensors (default: $PAGEDKV_DEVICE, else cuda:N per xdist worker, "
                         "else cpu)")
    parser.addini("pagedkv_builtin", type="bool", default=False,
                  help="activate the pagedkv plugin for this project's own tests (the built-in backends)")


def impl_spec(config: pytest.Config) -> str | None:
    """The ``--pagedkv-impl`` option, else ``$PAGEDKV_IMPL``, else ``None``."""
    return config.getoption("pagedkv_impl", None) or os.environ.get("PAGEDKV_IMPL") or None


def is_active(config: pytest.Config) -> bool:
    """Whether the plugin acts in this run (see the module docstring)."""
    return config.stash.get(_ACTIVE, False)


def _names_suite(config: pytest.Config) -> bool:
    here = str(Path(__file__).resolve().parent / "suite")
    return any(SUITE_PACKAGE in str(a) or str(Path(str(a).split("::")[0]).resolve()).startswith(here)
               for a in config.args)


@pytest.hookimpl(tryfirst=True)  # before Hypothesis' own plugin loads --hypothesis-profile: ours must be registered
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pagedkv: a conformance property of the implementation under test")
    active = bool(impl_spec(config)) or config.getini("pagedkv_builtin") or _names_suite(config)
    config.stash[_ACTIVE] = active
    if not active:
        return
    from hypothesis import settings

    from strategies.profiles import PROFILES, register_profiles

    register_profiles()
    profile = config.getoption("hypothesis_profile", None) or os.environ.get("PAGEDKV_PROFILE") \
        or ("ci" if os.environ.get("CI") else "dev")
    if profile not in PROFILES:
        raise pytest.UsageError(f"unknown Hypothesis profile {profile!r}; choose one of {sorted(PROFILES)}")
    settings.load_profile(profile)
    from pagedkv.testing.databases import DatabaseError, load_env_database

    try:  # $PAGEDKV_DATABASE: the gpu and nightly profiles share that example database (docs/scale.md)
        shared = load_env_database(profile)
    except DatabaseError as exc:
        raise pytest.UsageError(f"PAGEDKV_DATABASE: {exc}") from exc
    config.stash[_PROFILE] = profile + (f" (example database: {shared})" if shared else "")
    if impl_spec(config):
        backends_under_test(config)  # a candidate that cannot load is a usage error now (exit 4), not at collection


def backends_under_test(config: pytest.Config) -> list:
    """The candidate (``--pagedkv-impl``), else every built-in backend usable here.

    Raises:
        pytest.UsageError: the candidate cannot be loaded (the message says why).
    """
    import pagedkv

    spec = impl_spec(config)
    if spec:
        if config.stash.get(_CANDIDATE, None) is not None:
            return [config.stash[_CANDIDATE]]
        try:
            config.stash[_CANDIDATE] = pagedkv.load_backend(spec)
            return [config.stash[_CANDIDATE]]
        except pagedkv.BackendError as exc:
            raise pytest.UsageError(f"--pagedkv-impl / PAGEDKV_IMPL: {exc}") from exc
    return [pagedkv.get_backend(name) for name in pagedkv.available_backends()]


def _runs_triton_in_interpreter(backend) -> bool:
    """Whether ``backend`` (not pagedkv's own Triton backend) launches Triton kernels and Triton runs
    them in its interpreter here."""
    import inspect
    import sys

    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" not in sys.modules:
        return False
    module = inspect.getmodule(backend) if not inspect.ismodule(backend) else backend
    if module is None or module.__name__ == "pagedkv.backends.triton":
        return False
    return any(getattr(v, "__module__", "").startswith("triton") or getattr(v, "__name__", "") == "triton"
               for v in vars(module).values())


#: Examples a property draws for a backend whose kernels Triton interprets on the CPU (100-1000x slower
#: than the other backends): enough to reach the edges of the small geometries, not the profile's count.
INTERPRETED_MAX_EXAMPLES = 25


def interpreted(backend) -> bool:
    """Whether Triton interprets ``backend``'s kernels here (pagedkv's own Triton backend included)."""
    import inspect

    module = inspect.getmodule(backend) if not inspect.ismodule(backend) else backend
    if module is not None and module.__name__ == "pagedkv.backends.triton":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return _runs_triton_in_interpreter(backend)


def capabilities_under_test(backend, *, for_drawing: bool = False):
    """The backend's declared :class:`~pagedkv.backends.capabilities.Capabilities`, less ``bfloat16``
    for a Triton candidate run by the interpreter (there ``tl.dot`` on bfloat16 multiplies bit
    patterns as integers, a Triton bug; pagedkv's own kernel upcasts first). With ``for_drawing``,
    pagedkv's own Triton backend under the interpreter draws from the small geometries (block_size
    <= 16, head_dim <= 8, GQA group <= 7): its production sizes run compiled on a GPU, and here in
    ``tests/test_triton.py``'s shapes, the fixed limits and the regression files."""
    import dataclasses

    from pagedkv.backends.capabilities import Sizes, capabilities_of

    caps = capabilities_of(backend)
    if "bfloat16" in caps.dtypes and len(caps.dtypes) > 1 and _runs_triton_in_interpreter(backend):
        caps = dataclasses.replace(caps, dtypes=caps.dtypes - {"bfloat16"})
    if for_drawing and interpreted(backend) and not _runs_triton_in_interpreter(backend):
        caps = dataclasses.replace(caps, block_sizes=Sizes(max=16), head_dims=Sizes(max=8), gqa_groups=Sizes(max=7))
    return caps


def pick_device(config: pytest.Config | None = None) -> str:
    """``--pagedkv-device`` / ``$PAGEDKV_DEVICE``, else ``cuda:N`` (xdist worker ``gwK`` takes
    ``K % device_count``), else ``cpu``."""
    chosen = (config.getoption("pagedkv_device", None) if config else None) or os.environ.get("PAGEDKV_DEVICE")
    if chosen:
        return chosen
    import torch

    if torch.cuda.is_available():
        worker = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", "gw0"))
        return f"cuda:{int(worker.group(1)) % torch.cuda.device_count() if worker else 0}"
    return "cpu"


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if not is_active(config):
        return None
    import hypothesis
    import torch

    import pagedkv

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    device = pick_device(config)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    interp = " (TRITON_INTERPRET=1)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    spec = impl_spec(config)
    lines = [
        f"pagedkv {pagedkv.__version__}: implementation under test: "
        f"{spec or ', '.join(pagedkv.available_backends()) + ' (built-in)'}",
        f"pagedkv device: {device} [{name}]; Hypothesis profile: {config.stash.get(_PROFILE, '?')}",
        f"versions: torch {torch.__version__}, triton {triton_version}{interp}, hypothesis {hypothesis.__version__}",
    ]
    if spec:
        for backend in backends_under_test(config):
            lines.append(f"pagedkv declared space: {capabilities_under_test(backend).summary()}")
    left = _crashed_case_files()
    if left:
        lines.append(f"pagedkv: {len(left)} case file(s) left by a run that crashed mid-case (replay them): "
                     + ", ".join(str(p) for p in left[:3]))
    return lines


def _in_suite(metafunc) -> bool:
    return metafunc.module.__name__.startswith(SUITE_PACKAGE)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``backend`` over the implementations under test, ``backend_pair`` over pairs (a
    candidate is paired with the ``indexed`` backend)."""
    if not (is_active(metafunc.config) or _in_suite(metafunc)):
        return
    from pagedkv.backends import backend_name

    if "backend" in metafunc.fixturenames:
        impls = backends_under_test(metafunc.config)
        metafunc.parametrize("backend", impls, ids=[backend_name(b) for b in impls], scope="session")
    if "backend_pair" in metafunc.fixturenames:
        import pagedkv

        impls = backends_under_test(metafunc.config)
        if len(impls) == 1 and impl_spec(metafunc.config):
            impls = [pagedkv.get_backend("indexed"), impls[0]]
        pairs = [(a, b) for i, a in enumerate(impls) for b in impls[i + 1:]]
        metafunc.parametrize("backend_pair", pairs, ids=[f"{backend_name(a)}-{backend_name(b)}" for a, b in pairs],
                             scope="session")


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """A property that needs an op the backend lacks is skipped with the reason, never failed."""
    from pagedkv.testing.compare import MissingOp

    try:
        return (yield)
    except MissingOp as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def device(request) -> str:
    """The device the suite's tensors live on (see :func:`pick_device`)."""
    return pick_device(request.config)


def failure_dir() -> Path:
    """Where case files go: ``$PAGEDKV_FAILURE_DIR``, else ``.pagedkv-failures`` in the working directory."""
    return Path(os.environ.get("PAGEDKV_FAILURE_DIR", ".pagedkv-failures"))


def case_file_path(test_id: str) -> Path:
    """The case file of one test (one file per test id: Hypothesis runs the shrunk example last)."""
    return failure_dir() / (re.sub(r"[^A-Za-z0-9_.-]+", "_", test_id).strip("_")[:150] + ".json")


def _crashed_case_files() -> list[Path]:
    folder = failure_dir()
    if not folder.is_dir():
        return []
    left = []
    for path in sorted(folder.glob("*.json")):
        try:
            if json.loads(path.read_text()).get("outcome") == "running":
                left.append(path)
        except (OSError, ValueError):
            continue
    return left


def _current_test_id() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "pagedkv-test").rsplit(" ", 1)[0]


@pytest.fixture(scope="session")
def check(request):
    """``check(prop, backend, case, device)`` or ``check(prop, first, second, case, device)``: run a
    registered property (or a plain check function) with its case file written first.

    The case file is written before the backend is called and removed when the check passes, so a
    crash leaves it behind (``"outcome": "running"``). A missing op skips the test; an assertion or
    any other exception from the backend fails it with the case file updated (``"failed"`` or
    ``"raised"``) and ``python -m pagedkv replay FILE`` added to the message.
    """
    import time

    from pagedkv.backends import backend_name
    from pagedkv.testing.baseline_gate import after_check
    from pagedkv.testing.casefile import save_failure
    from pagedkv.testing.compare import MissingOp

    budget = float(os.environ.get("PAGEDKV_TEST_BUDGET_S") or 0)
    spent = {"test": None, "start": 0.0, "passed": 0, "failed": False}

    def over_budget() -> None:
        """``$PAGEDKV_TEST_BUDGET_S``: once a test has run that long without a failure, skip its remaining
        examples, saying how many passed (a slow backend, e.g. Triton's interpreter, reports a partial run
        instead of hiding the test). A test that has failed is never cut short: its shrinking runs on."""
        test_id = _current_test_id()
        if spent["test"] != test_id:
            spent.update(test=test_id, start=time.monotonic(), passed=0, failed=False)
        elif not spent["failed"] and time.monotonic() - spent["start"] > budget:
            pytest.skip(f"time budget spent ($PAGEDKV_TEST_BUDGET_S={budget:g} s): {spent['passed']} examples "
                        f"passed, the remaining examples did not run")

    def run(prop, *args):
        if budget:
            over_budget()
        try:
            _run(prop, *args)
        except BaseException as exc:
            spent["failed"] = spent["failed"] or not isinstance(exc, (MissingOp, pytest.skip.Exception))
            raise
        spent["passed"] += 1

    def _run(prop, *args):
        fn = getattr(prop, "check", prop)
        name = getattr(prop, "name", getattr(fn, "__name__", "check"))
        pair = getattr(prop, "pair", False)
        backend, other = (args[1], args[0]) if pair else (args[0], None)
        case = args[-2]
        spec = impl_spec(request.config) or backend_name(backend)
        path = case_file_path(_current_test_id())
        fields = dict(other=backend_name(other) if other is not None else None, path=path)
        save_failure(name, spec, case, outcome="running", **fields)
        try:
            fn(*args)
        except MissingOp:
            path.unlink(missing_ok=True)
            raise
        except AssertionError as exc:
            save_failure(name, spec, case, outcome="failed", error=str(exc), **fields)
            raise AssertionError(f"{exc}\nreplay: python -m pagedkv replay {path}") from exc
        except Exception as exc:
            save_failure(name, spec, case, outcome="raised", error=f"{type(exc).__name__}: {exc}", **fields)
            raise AssertionError(f"{backend_name(backend)} raised {type(exc).__name__}: {exc}\n"
                                 f"replay: python -m pagedkv replay {path}") from exc
        path.unlink(missing_ok=True)
        after_check(request.config, prop, args, spec, path)  # the same case on the baseline, if one is named

    return run


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A worker that died mid-case (out of memory, a device fault) is reported by xdist as a crash:
    point at the case file it left."""
    if report.failed and "crashed while running" in str(report.longrepr)[:2000]:
        path = case_file_path(report.nodeid)
        if path.exists():
            report.sections.append(("pagedkv", f"crashed while running the case in {path}\n"
                                               f"replay: python -m pagedkv replay {path}"))


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    """Per backend under test, the optional attention features it declares (checked by every property)
    and those it does not (their properties skip: not covered, never passed)."""
    if not is_active(config) or hasattr(config, "workerinput"):
        return
    ran = {getattr(r, "nodeid", "").split("::")[0].rsplit("/", 1)[-1]
           for reports in terminalreporter.stats.values() for r in reports}
    if "test_properties.py" not in ran:  # no conformance property ran: nothing to say
        return
    from pagedkv.backends.capabilities import FEATURE_NAMES

    try:
        backends = backends_under_test(config)
    except pytest.UsageError:
        return
    for backend in backends:
        declared = capabilities_under_test(backend).features
        name = getattr(backend, "name", None) or type(backend).__name__
        missing = ", ".join(sorted(FEATURE_NAMES - declared)) or "none"
        terminalreporter.write_line(f"pagedkv optional features of {name}: declared (checked): "
                                    f"{', '.join(sorted(declared)) or 'none'}; not declared (not covered): {missing}")
