"""The pagedkv pytest plugin: hooks and fixtures that put the conformance suite in front of any backend.

Installed with ``pip install "pagedkv[testing]"`` (a ``pytest11`` entry point). Run the suite from
any repository::

    pytest --pyargs pagedkv.testing.suite --pagedkv-impl my_engine.kv:backend -n auto

Options (each also an environment variable or ini key): ``--pagedkv-impl SPEC`` (``$PAGEDKV_IMPL``),
``--pagedkv-device`` (``$PAGEDKV_DEVICE``), ``--pagedkv-regressions DIR`` (ini ``pagedkv_regressions``:
your own case files, run like the shipped ones), ``--pagedkv-min-judged FRACTION`` (ini
``pagedkv_min_judged``: fail when fewer of the properties the candidate's ops allow were judged; default
:data:`pagedkv.testing.verdict.DEFAULT_MIN_JUDGED` when a candidate is named or under the ``ci``
profile, else 0),
``--pagedkv-report-json PATH`` (ini ``pagedkv_report_json``: the verdict as JSON, for CI jobs and agents),
``--pagedkv-failure-dir DIR`` (ini ``pagedkv_failure_dir``, ``$PAGEDKV_FAILURE_DIR``: where failing cases' files
go, default ``.pagedkv-failures``).

Profiles: pagedkv registers ``pagedkv-dev``, ``pagedkv-ci``, ``pagedkv-gpu``, ``pagedkv-nightly`` and
``pagedkv-repro`` (also under the bare names where your project has not registered them). A profile
your project loads is left alone; ``$PAGEDKV_PROFILE`` or ``--hypothesis-profile`` picks one; with
neither, ``ci`` when ``$CI`` is set, else ``dev``.

The plugin changes nothing unless it is active: a candidate is named, the conformance suite is among
the collected paths, or the ini key ``pagedkv_builtin = true`` is set. The logic lives elsewhere:
:mod:`pagedkv.testing.space` (what is under test), :mod:`pagedkv.testing.execute` (running a property),
:mod:`pagedkv.testing.report` (the judged / skipped summary).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SUITE_PACKAGE = "pagedkv.testing.suite"
SUITE_COMMAND = "pytest --pyargs pagedkv.testing.suite --pagedkv-impl {spec} -n auto"
_ACTIVE = pytest.StashKey[bool]()
_PROFILE = pytest.StashKey[str]()
_CANDIDATES = pytest.StashKey[list]()
_FAILURE_DIR_EXISTED = pytest.StashKey[bool]()
_DESELECTED = pytest.StashKey[list]()  # node ids of conformance tests deselected (this process, or every worker)
_DECLARED = pytest.StashKey[dict]()  # each candidate's declared space as this process first read it
_DECLARED_ELSEWHERE = pytest.StashKey[list]()  # (who, declared spaces): the workers' reads, gathered
_MISMATCHES = pytest.StashKey[list]()  # lines naming where those reads differ from the first
_SPECIALISATIONS = "pagedkv-specialisations"  # per-process tallies, under the run's shared directory


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pagedkv.testing import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagedkv", "pagedkv conformance suite")
    group.addoption("--pagedkv-impl", default=None, metavar="SPEC",
                    help="implementation under test: pkg.module, pkg.module:attr or file.py[:attr] "
                         "(default: $PAGEDKV_IMPL, else every built-in backend usable here)")
    group.addoption("--pagedkv-device", default=None, metavar="DEVICE",
                    help="device for the suite's tensors (default: $PAGEDKV_DEVICE, else cuda:N per xdist worker, "
                         "else cpu)")
    group.addoption("--pagedkv-regressions", default=None, metavar="DIR",
                    help="a directory of your own case files, replayed like the shipped regressions "
                         "(default: ini pagedkv_regressions)")
    group.addoption("--pagedkv-report-json", default=None, metavar="PATH",
                    help="write the verdict as JSON to PATH: per candidate its declared space, the properties "
                         "judged / skipped by reason / failed / findings, each failure's case file, replay command "
                         "and whether it reproduced (default: ini pagedkv_report_json)")
    group.addoption("--pagedkv-min-judged", default=None, type=float, metavar="FRACTION",
                    help="fail the run when fewer than FRACTION of the properties the candidate's ops allow were "
                         "judged (default: ini pagedkv_min_judged, else 2/3 when a candidate is named or under the "
                         "ci profile, else 0; 0 turns it off)")
    group.addoption("--pagedkv-device-memory", default=None, metavar="SIZE",
                    help="device-memory budget shared by every xdist worker for the large-pool tests, e.g. 141GiB "
                         "(default: ini pagedkv_device_memory, $PAGEDKV_DEVICE_MEMORY, else the device's total "
                         "less ini pagedkv_device_headroom); on the CPU a declared budget is simulated")
    group.addoption("--pagedkv-failure-dir", default=None, metavar="DIR",
                    help="where failing cases' files go, one JSON file each, replayable with python -m pagedkv "
                         "replay FILE (default: ini pagedkv_failure_dir, else $PAGEDKV_FAILURE_DIR, else "
                         ".pagedkv-failures)")
    parser.addini("pagedkv_failure_dir", default="", help="directory of failing cases' files (--pagedkv-failure-dir)")
    parser.addini("pagedkv_device_memory", default="", help="device-memory budget of the large-pool leases")
    parser.addini("pagedkv_device_headroom", default="", help="device memory kept out of the lease budget (16GiB)")
    parser.addini("pagedkv_builtin", type="bool", default=False,
                  help="activate the pagedkv plugin for this project's own tests (the built-in backends)")
    parser.addini("pagedkv_regressions", default="", help="directory of your own pagedkv case files")
    parser.addini("pagedkv_min_judged", default="", help="minimum judged fraction of the applicable properties")
    parser.addini("pagedkv_report_json", default="", help="path of the JSON verdict (see --pagedkv-report-json)")


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


@pytest.hookimpl(tryfirst=True)  # before Hypothesis' own plugin loads --hypothesis-profile: ours must exist
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pagedkv: a conformance property of the implementation under test")
    active = bool(impl_spec(config)) or config.getini("pagedkv_builtin") or _names_suite(config)
    config.stash[_ACTIVE] = active
    if not active:
        return
    _set_failure_dir(config)
    if not hasattr(config, "workerinput"):
        from pagedkv.testing.casefiles.writing import failure_dir

        config.stash[_FAILURE_DIR_EXISTED] = failure_dir().exists()
    from pagedkv.testing.settings import choose_profile

    try:
        config.stash[_PROFILE] = choose_profile(config.getoption("hypothesis_profile", None))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    report = None  # the JSON verdict's path, where this process writes it
    if not hasattr(config, "workerinput"):  # one palette seed for every xdist worker of the run
        from pagedkv.testing.strategies.palette import palette_seed

        os.environ.setdefault("PAGEDKV_PALETTE_SEED", str(palette_seed(config.stash[_PROFILE].split(" ")[0]
                                                                       .removeprefix("pagedkv-"))))
        report = None if config.option.collectonly else _report_path(config)
    if report:  # replaced at the end; left as not passed if the process dies
        from pagedkv.testing.report import write_unfinished

        write_unfinished(Path(report), impl_spec(config), profile=config.stash[_PROFILE])
    if impl_spec(config):
        try:
            candidates(config)  # a candidate that cannot load is a usage error now (exit 4), not at collection
        except pytest.UsageError as exc:
            if report:  # the verdict says why, not "unfinished"
                write_unfinished(Path(report), impl_spec(config), profile=config.stash[_PROFILE],
                                 usage_error=str(exc))
            raise
    config.hook.pytest_pagedkv_activated(config=config, spec=impl_spec(config))


def _set_failure_dir(config: pytest.Config) -> None:
    """``--pagedkv-failure-dir`` (relative to the invocation directory), else ini ``pagedkv_failure_dir``
    (relative to the rootdir), as ``$PAGEDKV_FAILURE_DIR``, which every writer of case files reads and xdist
    workers inherit; neither given: the variable is left as it is."""
    option, ini = config.getoption("pagedkv_failure_dir", None), config.getini("pagedkv_failure_dir")
    if option:
        os.environ["PAGEDKV_FAILURE_DIR"] = str(config.invocation_params.dir / option)
    elif ini:
        os.environ["PAGEDKV_FAILURE_DIR"] = str(config.rootpath / ini)


def _drop_empty_failure_dir(config: pytest.Config) -> None:
    """The failure directory this run created, removed where every case written there was removed again (each
    property writes its case before calling the backend and removes it when the case passes): a green run leaves
    no empty directory behind."""
    from pagedkv.testing.casefiles.writing import failure_dir

    directory = failure_dir()
    if config.stash.get(_FAILURE_DIR_EXISTED, True) or not directory.is_dir():
        return
    try:
        directory.rmdir()  # only when empty
    except OSError:
        pass


def _rootdir_hint(config: pytest.Config, exc: Exception) -> str:
    """Where a candidate does not import and the working directory holds a pytest configuration that pytest did
    not choose: why that happens (pytest chooses its rootdir, and with it ``pythonpath``, before it knows a
    plugin's options, so an existing file after ``--pagedkv-report-json`` is read as a test path) and the fix."""
    if not isinstance(exc.__cause__, ModuleNotFoundError):
        return ""
    here = Path.cwd()
    sections = {"pytest.ini": "", ".pytest.ini": "", "pyproject.toml": "[tool.pytest", "tox.ini": "[pytest]",
                "setup.cfg": "[tool:pytest]"}
    own = [here / name for name, section in sections.items()
           if (here / name).is_file() and section in (here / name).read_text(errors="replace")]
    if not own or config.inipath in own:
        return ""
    chose = f"{config.inipath} as its configuration" if config.inipath else "no configuration file"
    return (f"; pytest chose {chose} (rootdir {config.rootpath}), not {own[0]}: a path given after one of "
            f"pagedkv's options with a space (--pagedkv-report-json FILE) is read as a test path before the option "
            f"is known; write it with '=' (--pagedkv-report-json=FILE)")


def candidates(config: pytest.Config) -> list:
    """The backends under test (see :func:`pagedkv.testing.space.load_candidates`), loaded once.

    Raises:
        pytest.UsageError: the candidate cannot be loaded or declares malformed capabilities.
    """
    if _CANDIDATES not in config.stash:
        import pagedkv
        from pagedkv.backends.capabilities import misspelled_capabilities
        from pagedkv.testing.non_promises import check_non_promises
        from pagedkv.testing.space import capabilities_under_test, load_candidates

        try:
            loaded = load_candidates(impl_spec(config))
            for backend in loaded:
                check_non_promises(capabilities_under_test(backend))
        except (pagedkv.BackendError, TypeError, ValueError) as exc:
            raise pytest.UsageError(f"--pagedkv-impl / PAGEDKV_IMPL: {exc}{_rootdir_hint(config, exc)}") from exc
        for message in filter(None, map(misspelled_capabilities, loaded)):  # once, in the warnings summary
            config.issue_config_time_warning(pytest.PytestWarning(f"pagedkv: {message}"), stacklevel=2)
        config.stash[_CANDIDATES] = loaded
        config.stash[_DECLARED] = _declared_now(loaded)
    return config.stash[_CANDIDATES]


def _declared_now(backends: list) -> dict:
    """:func:`pagedkv.testing.report.declared_spaces`, or ``{}`` where a capabilities read raises (the tests
    that read them report it)."""
    from pagedkv.testing.report import declared_spaces

    try:
        return declared_spaces(backends)
    except Exception:  # noqa: BLE001 - a candidate's own code: its tests fail with the error
        return {}


def regression_files(config: pytest.Config) -> list[Path]:
    """The shipped regression case files, then those of the user's own directory (option, else ini key).

    Raises:
        pytest.UsageError: the user's directory does not exist.
    """
    from pagedkv.testing.casefiles.reading import shipped_regressions

    own = config.getoption("pagedkv_regressions", None) or config.getini("pagedkv_regressions") or ""
    if own and not Path(own).is_dir():
        raise pytest.UsageError(f"--pagedkv-regressions / pagedkv_regressions: {own!r} is not a directory")
    return shipped_regressions() + (sorted(Path(own).glob("*.json")) if own else [])


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if not is_active(config):
        return None
    from pagedkv.testing.report import header_lines

    return header_lines(impl_spec(config), candidates(config), config.getoption("pagedkv_device", None),
                        config.stash.get(_PROFILE, "?"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``backend`` over the backends under test and ``backend_pair`` over pairs (a
    candidate is paired with pagedkv's ``indexed`` backend)."""
    if not (is_active(metafunc.config) or metafunc.module.__name__.startswith(SUITE_PACKAGE)):
        return
    from pagedkv.backends import backend_name

    impls = candidates(metafunc.config)
    if "manager_layout" in metafunc.fixturenames:
        params = manager_layout_params(impls)
        metafunc.parametrize(("backend", "manager_layout"), params,
                             ids=[backend_name(b) + (f"-{layout}" if layout else "") for b, layout in params],
                             scope="session")
    elif "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", impls, ids=[backend_name(b) for b in impls], scope="session")
    if "backend_pair" in metafunc.fixturenames:
        import pagedkv

        if len(impls) == 1 and impl_spec(metafunc.config):
            impls = [pagedkv.get_backend("indexed"), impls[0]]
        pairs = [(a, b) for i, a in enumerate(impls) for b in impls[i + 1:]]
        metafunc.parametrize("backend_pair", pairs, ids=[f"{backend_name(a)}-{backend_name(b)}" for a, b in pairs],
                             scope="session")
    if "regression_file" in metafunc.fixturenames:
        files = regression_files(metafunc.config)
        metafunc.parametrize("regression_file", files, ids=[f.stem for f in files])
    if "finding" in metafunc.fixturenames:
        _parametrize_findings(metafunc, candidates(metafunc.config))


def manager_layout_params(impls: list) -> list[tuple]:
    """``(backend, layout)`` for every layout each backend's cache manager declares
    (:func:`~pagedkv.testing.managers.protocol.manager_layouts`), ``(backend, None)`` for a backend without one
    (its test skips, saying so).

    Raises:
        ValueError: a backend declares an unknown layout name (a collection error naming it).
    """
    from pagedkv.testing.managers.protocol import manager_factory, manager_layouts

    return [(backend, layout) for backend in impls
            for layout in (manager_layouts(backend) if manager_factory(backend) is not None else (None,))]


def _parametrize_findings(metafunc: pytest.Metafunc, impls: list) -> None:
    """``finding``: ``(backend, precondition, property)`` for every precondition a backend declares and
    every single-backend case property; one skipped parameter when no backend declares any."""
    from pagedkv.backends import backend_name
    from pagedkv.testing.registry import properties
    from pagedkv.testing.space import capabilities_under_test

    params, ids = [], []
    for backend in impls:
        for precondition in sorted(capabilities_under_test(backend).preconditions):
            for prop in properties().values():
                if prop.kind == "case" and not prop.pair:
                    params.append((backend, precondition, prop))
                    ids.append(f"{backend_name(backend)}-{precondition}-{prop.name}")
    if not params:
        metafunc.parametrize("finding", [pytest.param(None, marks=pytest.mark.skip(
            reason="no backend under test declares a precondition"))], ids=["none"])
    else:
        metafunc.parametrize("finding", params, ids=ids)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """A fixed suite test that needs an op the backend lacks (the gate's :func:`~pagedkv.testing.compare.
    require`) is skipped with the reason; a ``MissingOp`` the candidate raised from inside an op call fails."""
    from pagedkv.testing.compare import MissingOp, raised_by_gate

    try:
        return (yield)
    except MissingOp as exc:
        if pyfuncitem.module.__name__.startswith(SUITE_PACKAGE) and raised_by_gate(exc):
            pytest.skip(str(exc))
        raise


@pytest.fixture(scope="session")
def device(request) -> str:
    """The device the suite's tensors live on (see :func:`pagedkv.testing.space.pick_device`), made the
    worker's current CUDA device (:func:`pagedkv.testing.space.select_device`)."""
    from pagedkv.testing.space import select_device

    return select_device(request.config.getoption("pagedkv_device", None))


def _declared_device_memory(config: pytest.Config) -> str | None:
    return (config.getoption("pagedkv_device_memory", None) or config.getini("pagedkv_device_memory")
            or os.environ.get("PAGEDKV_DEVICE_MEMORY") or None)


@pytest.fixture(scope="session", autouse=True)
def pagedkv_device_memory(request):
    """The run's shared device-memory budget (:mod:`pagedkv.testing.device_lease`; ``None`` on a CPU
    without a declared budget), configured for the properties that allocate large pools."""
    from pagedkv.testing import device_lease

    if not is_active(request.config):
        yield None
        return
    config = request.config
    try:
        budget = device_lease.budget_for(device_lease.shared_directory(config), _declared_device_memory(config),
                                         request.getfixturevalue("device"), config.getini("pagedkv_device_headroom"))
    except ValueError as exc:
        raise pytest.UsageError(f"--pagedkv-device-memory / pagedkv_device_headroom: {exc}") from exc
    device_lease.configure(budget)
    yield budget
    device_lease.configure(None)


@pytest.fixture
def pagedkv_run(request):
    """The suite's handle on the current test: its spec, case-file name and a place to record what the
    test judged (read back by the terminal summary, across xdist workers)."""
    from pagedkv.testing.report import TestRun

    return TestRun(request.node, impl_spec(request.config))


def pytest_deselected(items: list) -> None:
    """Keep the conformance tests a ``-k`` / ``-m`` / ``--deselect`` leaves out, for the verdict to name."""
    if items and is_active(items[0].config):
        from pagedkv.testing.report import is_conformance_test

        items[0].config.stash.setdefault(_DESELECTED, []).extend(i.nodeid for i in items if is_conformance_test(i))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """xdist: a worker's deselected conformance tests, gathered on the controller."""
    output = getattr(node, "workeroutput", {})
    node.config.stash.setdefault(_DESELECTED, []).extend(output.get("pagedkv_deselected", []))
    if "pagedkv_declared" in output:
        import json

        worker = getattr(node, "workerinput", {}).get("workerid") or getattr(getattr(node, "gateway", None), "id", "?")
        for when, spaces in json.loads(output["pagedkv_declared"]).items():
            node.config.stash.setdefault(_DECLARED_ELSEWHERE, []).append((f"xdist worker {worker} ({when})", spaces))


def _stats(config: pytest.Config, stats: dict) -> dict:
    """The terminal reporter's ``stats`` with the deselected conformance tests of every process."""
    return {**stats, "pagedkv_deselected": sorted(set(config.stash.get(_DESELECTED, [])))}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Point a test whose xdist worker crashed at the case file it left (the judged records travel in
    each report's ``user_properties`` and are read back by the terminal summary)."""
    from pagedkv.testing.report import crash_section

    section = crash_section(report)
    if section:
        report.sections.append(("pagedkv", section))


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    """Per candidate: properties judged / skipped by reason / findings, regression cases run, the declared space."""
    if not is_active(config) or hasattr(config, "workerinput"):
        return
    from pagedkv.testing.report import summary_lines

    for line in summary_lines(_stats(config, terminalreporter.stats), candidates(config), impl_spec(config)):
        terminalreporter.write_line(line)
    from pagedkv.testing.report import failed_tests

    failing = failed_tests(terminalreporter.stats)
    if failing:  # some record no property verdict (a crashed worker, a fixed case): the counts above miss them
        shown = ", ".join(f["nodeid"] for f in failing[:3]) + (", ..." if len(failing) > 3 else "")
        terminalreporter.write_line(f"pagedkv: {len(failing)} failing test(s), each in the JSON verdict's "
                                    f"failed_tests: {shown}")
    from pagedkv.testing.device_lease import shared_directory, summary_line

    from pagedkv.testing import specialisations

    for line in (summary_line(shared_directory(config)),
                 specialisations.summary_line(specialisations.read_all(shared_directory(config, _SPECIALISATIONS)))):
        if line:
            terminalreporter.write_line(line)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No false green: a named candidate with no conformance property run is a usage error, and so is a
    judged fraction under ``--pagedkv-min-judged``."""
    config = session.config
    if is_active(config) and hasattr(config, "workerinput"):  # the controller's summary counts them
        from pagedkv.testing import specialisations
        from pagedkv.testing.device_lease import shared_directory

        specialisations.write(shared_directory(config, _SPECIALISATIONS), config.workerinput["workerid"])
        config.workeroutput["pagedkv_deselected"] = config.stash.get(_DESELECTED, [])
        if _CANDIDATES in config.stash:  # the declared space this worker drew its cases from, first and last
            import json

            config.workeroutput["pagedkv_declared"] = json.dumps(
                {"first read": config.stash.get(_DECLARED, {}), "at its end": _declared_now(candidates(config))})
    if not is_active(config) or hasattr(config, "workerinput") or config.option.collectonly:
        return
    try:
        _gate_judged(session, exitstatus)
        _gate_declared_once(session)
    finally:
        _write_verdict(session)
        _drop_empty_failure_dir(config)


def _gate_declared_once(session: pytest.Session) -> None:
    """Fail the run where a candidate's declared space differs between processes or over the run: each process
    draws its cases from its own read, and the header and the JSON verdict print the controller's first one."""
    config = session.config
    if _CANDIDATES not in config.stash:
        return
    from pagedkv.testing.report import declaration_mismatches

    reads = [*config.stash.get(_DECLARED_ELSEWHERE, []), ("the run's end", _declared_now(candidates(config)))]
    mismatches = declaration_mismatches(config.stash.get(_DECLARED, {}), reads)
    config.stash[_MISMATCHES] = mismatches
    if mismatches:
        _error(config, "pagedkv: the candidate's declared capabilities differ between reads; the cases were drawn "
                       "from a space the verdict does not describe:", mismatches)
        if session.exitstatus in (0, 5):  # an interruption or a usage error keeps its own status
            session.exitstatus = 1


def _error(config: pytest.Config, first: str, details: list[str] = ()) -> None:
    """An ``ERROR:`` line on the terminal, in red, with indented ``details`` below it."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    reporter.line("")  # the cursor may sit after the progress line's "[100%]"
    reporter.write_line(f"ERROR: {first}", red=True, bold=True)
    for line in details:
        reporter.write_line(f"  {line}", red=True)


def _gate_judged(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if exitstatus not in (0, 5):
        return
    from pagedkv.testing.report import judged_problem

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter else {}
    problem = judged_problem(stats, impl_spec(config), min_judged(config), SUITE_COMMAND)
    if problem:
        _error(config, problem)
        session.exitstatus = pytest.ExitCode.USAGE_ERROR if "no pagedkv conformance property" in problem else 1


def min_judged(config: pytest.Config) -> float:
    """The judged share the run must reach: ``--pagedkv-min-judged``, else ini ``pagedkv_min_judged``, else
    :data:`~pagedkv.testing.verdict.DEFAULT_MIN_JUDGED` when a candidate is named (the quick start) or the
    profile is ``ci``, else 0."""
    from pagedkv.testing.verdict import DEFAULT_MIN_JUDGED

    minimum = config.getoption("pagedkv_min_judged", None)
    if minimum is None and config.getini("pagedkv_min_judged"):
        minimum = float(config.getini("pagedkv_min_judged"))
    if minimum is not None:
        return minimum
    profile = config.stash.get(_PROFILE, "").split(" ")[0]
    return DEFAULT_MIN_JUDGED if impl_spec(config) or profile in ("pagedkv-ci", "ci") else 0.0


def _write_verdict(session: pytest.Session) -> None:
    """``--pagedkv-report-json`` / ini ``pagedkv_report_json``: the verdict as JSON
    (:func:`pagedkv.testing.report.verdict`)."""
    config = session.config
    path = _report_path(config)
    if not path:
        return
    from pagedkv.testing.report import write_verdict

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    write_verdict(Path(path), _stats(config, reporter.stats if reporter else {}), candidates(config), impl_spec(config),
                  profile=config.stash.get(_PROFILE, "?"), exit_status=int(session.exitstatus),
                  declaration_mismatch=config.stash.get(_MISMATCHES, []))


def _report_path(config: pytest.Config) -> str:
    """``--pagedkv-report-json``, else ini ``pagedkv_report_json``, else ``""`` (no JSON verdict)."""
    return config.getoption("pagedkv_report_json", None) or config.getini("pagedkv_report_json") or ""
