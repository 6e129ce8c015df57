"""Programs of the manager machine as data: record a run's steps, save a failing one as a case file,
replay it (``python -m pagedkv replay FILE`` dispatches here on the file's ``kind``).

A case file (JSON)::

    {"kind": "pagedkv-manager-program", "version": 1, "manager": "pkg.module[:factory]",
     "block_sizes": [1, 2, 4], "windows": [null], "layouts": ["one-group"],
     "steps": [["start", {...}], ["add", {...}], ...], "error": "the failure's first line"}

(``layouts``: the hybrid layouts the machine drew from, ``protocol.HYBRID_LAYOUTS`` names; absent in
files written before groups, which ran one group.)

Each step is a rule of :class:`~.machine.ManagerMachine` and its arguments (request ids are the
machine's own counters, so the same program reaches the same ids); the checks run after every step.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

from hypothesis import settings
from hypothesis.errors import Flaky
from hypothesis.stateful import invariant, run_state_machine_as_test

from pagedkv.testing.managers.casefile import KIND, MAX_STEPS, is_program_file  # noqa: F401 - re-exported
from pagedkv.testing.managers.machine import ManagerMachine, machine_for
from pagedkv.testing.managers.protocol import ONE_GROUP


def load_manager(spec: str) -> Callable:
    """The manager factory ``spec`` names: a backend spec a case file may name (a shipped peer such as
    ``pagedkv.tools.peers:vllm_cache_manager``: its ``cache_manager``), ``pkg.module`` (its
    ``cache_manager``), ``pkg.module:attr`` (a factory, or an object with a ``cache_manager``).

    Raises:
        ValueError: the spec names nothing callable.
    """
    from pagedkv.testing.casefiles.reading import canonical_backend_spec

    canonical = canonical_backend_spec(spec)
    if canonical is not None:
        from pagedkv.backends import load_backend

        factory = getattr(load_backend(canonical), "cache_manager", None)
        if not callable(factory):
            raise ValueError(f"backend {spec!r} provides no cache_manager factory")
        return factory
    module_name, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    factory = getattr(obj, "cache_manager", obj)
    if not callable(factory):
        raise ValueError(f"manager spec {spec!r} names no cache_manager factory")
    return factory


def _tuples(value):
    """JSON lists back to the tuples a namespace or extra key was (system prompts and suffixes stay lists)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _arguments(kwargs: dict) -> dict:
    return {k: (_tuples(v) if k in ("namespace", "extra") else v) for k, v in kwargs.items()}


#: What a search counts over its programs (class attributes of the machine): steps judged, tokens read back,
#: admissions served a hit, admissions the hit promise gave one.
COUNTERS = ("checks_run", "tokens_read", "prefix_hits", "hits_due")


def run_program(machine_class: type[ManagerMachine], steps: list, trace=None) -> None:
    """Run ``steps`` on a fresh machine, its invariants after each; raises what the machine raises.
    ``trace``: a text stream each step is printed to before it runs."""
    machine = machine_class()
    machine.record = None
    try:
        for name, kwargs in steps:
            if trace is not None:
                print(_step_line(name, kwargs), file=trace)
            getattr(machine, name)(**_arguments(kwargs))
            machine.judge_now()  # check() and any rule set's
    finally:
        machine.teardown()


def run_recorded(machine_class: type[ManagerMachine], settings_: settings, database_key: bytes | None = None
                 ) -> list | None:
    """Run the machine under Hypothesis; ``None`` when it passes, else the shrunk program's steps
    (the last example Hypothesis runs is the shrunk failure) with the error attached as ``.error`` and
    the example at which the search first failed as ``.first_failing_example`` (1-based) and the exception
    as ``.exception``. Either way
    ``machine_class.checks_run`` grows by the steps judged and ``machine_class.examples_run`` is the
    number of examples this call ran. ``database_key``: the example database key of the run (the
    settings' database keeps a failing program and replays it first next time; see
    :func:`pagedkv.testing.databases.property_key`), else Hypothesis's digest of the machine class."""
    from pagedkv.testing.hypothesis_internals import salted_search, state_machine_test, without_local_constants

    programs: list[list] = []
    failed_at: list[int] = []

    class Recorded(machine_class):
        checks_run = tokens_read = prefix_hits = 0

        def __init__(self):
            super().__init__()
            self.record = []
            self.step_open = False  # a rule logged its step and no invariant check has passed since
            programs.append(self.record)

        def log(self, name: str, **kwargs) -> None:
            self.step_open = True
            super().log(name, **kwargs)

        @invariant()
        def check(self):
            try:
                super().check()
            except Exception:
                failed_at.append(len(programs))
                raise
            self.step_open = False

        def teardown(self):
            # Hypothesis tears a program down whether or not it failed: a step still open here raised inside
            # its rule (the machine's own assertions and the manager's exceptions fail there, not in check)
            if self.step_open and not failed_at:
                failed_at.append(len(programs))
            try:
                super().teardown()
            except Exception:
                failed_at.append(len(programs))
                raise

    Recorded.__name__ = machine_class.__name__
    Recorded.hits_due = 0  # set here, not in the class body: the body's source seeds derandomized searches
    try:
        # one search whatever the process imported before, and each layout's its own (jamba and qwen3-next, or
        # gemma3 and its sparse variants, would otherwise run the same programs)
        with without_local_constants(), salted_search(Recorded, "/".join(machine_class.layouts)):
            if database_key is None:
                run_state_machine_as_test(Recorded, settings=settings_)
            else:
                state_machine_test(Recorded, settings_, database_key)()
    except Exception as exc:  # noqa: BLE001 - any failure of the manager is the finding
        steps = _Program(programs[-1] if programs else [])
        steps.error = _failure_line(exc, failed_at[0] if failed_at else None)
        steps.first_failing_example = failed_at[0] if failed_at else len(programs)
        steps.exception = exc
        return steps
    finally:
        for counter in COUNTERS:
            setattr(machine_class, counter, getattr(machine_class, counter) + getattr(Recorded, counter))
        machine_class.examples_run = len(programs)
    return None


def _failure_line(exc: BaseException, failed_at: int | None) -> str:
    """The one line a failed search reports: the exception's first line, or for Hypothesis's ``Flaky`` (a
    failure it could not make again from the same draws) what that means for a manager."""
    if isinstance(exc, Flaky):
        return (f"{type(exc).__name__}: a program failed (program {'?' if failed_at is None else failed_at}) "
                f"and went another way when run again from the same draws: the managers the factory "
                f"builds share state (a module or class attribute), so no program reproduces the "
                f"failure; the program below is the last one run, not a shrunk failure")
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


#: The one-group layout's programs, as a multiple of the profile's and up to a floor of :data:`ONE_GROUP_PROGRAMS`
#: (:func:`one_group_programs`).
ONE_GROUP_FACTOR = 4
ONE_GROUP_PROGRAMS = 400


def one_group_programs(max_examples: int) -> int:
    """The one-group layout's programs: ``ONE_GROUP_FACTOR`` times the profile's, up to ``ONE_GROUP_PROGRAMS``
    where the profile asks for fewer (``ci`` 400, ``nightly`` its 2000; a test's 10 programs 40). Its faults
    (a hit block still in the free queue not counted at admission, a hash index losing a block's duplicate,
    a window releasing a run of blocks) need a chain of three draws each (a pool under pressure, two blocks
    under one hash, one evicted, the other looked up), which 100 programs reach in one search of two or three;
    its programs are the cheapest (one group: 400 take 9-14 s on one quiet core; 18 s for vLLM's peer, its longest
    layout under ``ci``)."""
    return max(max_examples, min(ONE_GROUP_FACTOR * max_examples, ONE_GROUP_PROGRAMS))


def layout_shares(layouts, max_examples: int) -> list[tuple[str, int]]:
    """Each layout's programs: the profile's whole ``max_examples`` for every declared layout (``ci`` 100
    programs each, ``nightly`` 2000), as a kernel property gets the profile's examples for each backend it
    gates, and the one-group layout more (:func:`one_group_programs`). A fault living in one layout gets a
    whole search there, whatever else the manager declares: a share of one budget left each of nine layouts
    9-14 programs, too few for the faults only a pool under pressure, a connector load beside a local hit or a
    third group's meeting reaches."""
    return [(name, one_group_programs(max(1, max_examples)) if name == ONE_GROUP else max(1, max_examples))
            for name in layouts]


def run_per_layout(machine_class: type[ManagerMachine], settings_: settings, database_key: bytes | None = None
                   ) -> list | None:
    """:func:`run_recorded`, one search per layout of ``machine_class.layouts`` with the settings' programs
    each (:func:`layout_shares`: the one-group layout more), in declared order, stopping at the first failure.
    One search over every layout spends most programs where its draws happen to fall (Hypothesis favours small
    indices), so a layout drawn rarely is barely searched. A failure is returned as :func:`run_recorded`
    returns it, with ``.machine_class`` the one-layout machine it ran on (what a case file records) and
    ``.first_failing_example`` counted over every search so far. ``machine_class``'s counters (steps,
    ``examples_run``) add up every search's."""
    layouts = tuple(machine_class.layouts)
    if len(layouts) < 2:
        ((_, share),) = layout_shares(layouts, settings_.max_examples)
        steps = run_recorded(machine_class, settings(settings_, max_examples=share), database_key)
        if steps is not None:
            steps.machine_class = machine_class
        return steps
    examples = 0
    try:
        for name, share in layout_shares(layouts, settings_.max_examples):
            one = type(f"{machine_class.__name__}[{name}]", (machine_class,),
                       {"layouts": (name,), **{c: 0 for c in COUNTERS}})
            key = None if database_key is None else database_key + b"/" + name.encode()
            steps = run_recorded(one, settings(settings_, max_examples=share), key)
            for counter in COUNTERS:
                setattr(machine_class, counter, getattr(machine_class, counter) + getattr(one, counter))
            examples += one.examples_run
            if steps is not None:
                steps.machine_class = one
                steps.first_failing_example += examples - one.examples_run
                return steps
        return None
    finally:
        machine_class.examples_run = examples


def _is_rule(name: str) -> bool:
    """Whether ``name`` is a step the machine logs: a public method of the manager machine's own (its rules
    and their replayable forms), not one of Hypothesis's state machine."""
    from hypothesis.stateful import RuleBasedStateMachine

    from pagedkv.testing.managers.api_rules import ApiRules

    return not name.startswith("_") and any(callable(getattr(c, name, None)) for c in (ManagerMachine, ApiRules)) \
        and not hasattr(RuleBasedStateMachine, name) and name != "log"


class _Program(list):
    error = ""
    machine_class: type | None = None  # the machine it failed on (run_per_layout: one layout's)
    first_failing_example = 0
    exception: BaseException | None = None  # what the shrunk program raised


def save(path: Path | str, spec: str, machine_class: type[ManagerMachine], steps: list, error: str = "",
         **measured: Any) -> Path:
    """Write a case file for ``steps`` on the manager ``spec`` (atomically: a temporary file renamed);
    ``measured``: ``test_id``, ``examples``, ``first_failing_example`` as the run measured them."""
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"kind": KIND, "version": 1, "manager": spec, "block_sizes": list(machine_class.block_sizes),
            "windows": list(machine_class.windows), "layouts": list(machine_class.layouts),
            "steps": [[n, k] for n, k in steps], "error": error[:4096],
            **{k: v for k, v in measured.items() if v is not None}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def replay_line(path: Path | str, spec: str) -> str:
    """The command that replays a program file: ``--impl`` when the file may not name ``spec`` itself."""
    from pagedkv.testing.managers.casefile import trusted_manager_spec

    return f"python -m pagedkv replay {path}" + ("" if trusted_manager_spec(spec) else f" --impl {spec}")


def as_text(steps: list) -> str:
    """The program as Python lines, as Hypothesis prints a stateful failure."""
    return "\n".join(["state = Machine()", *(_step_line(name, kwargs) for name, kwargs in steps), "state.teardown()"])


def _step_line(name: str, kwargs: dict) -> str:
    """One step as a Python line, as Hypothesis prints a stateful failure."""
    args = ", ".join(f"{k}={v!r}" for k, v in _arguments(kwargs).items())
    return f"state.{name}({args})"


#: The manager's queries the machine makes after every step (its checks): not printed by a trace.
QUERIES = frozenset({"block_table", "counts", "holds", "reference_counts", "self_check", "snapshot", "kv_pools",
                     "take_events", "in_flight_pages", "misuses", "capabilities"})


class TracedManager:
    """``manager`` with every protocol call it answers printed to ``out`` as ``  call(args) -> result`` (the
    queries of :data:`QUERIES` passed through unprinted): what a program's rules asked and got."""

    def __init__(self, manager: Any, out) -> None:
        self._manager, self._out = manager, out

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._manager, name)
        if name in QUERIES or name.startswith("_") or not callable(value):
            return value

        def call(*args, **kwargs):
            shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
            try:
                result = value(*args, **kwargs)
            except BaseException as exc:
                print(f"  {name}({shown}) raised {type(exc).__name__}: {exc}", file=self._out)
                raise
            print(f"  {name}({shown}) -> {result!r}", file=self._out)
            return result
        return call


def replay_file(path: str, *, impl: str | None = None, quiet: bool = False, out=None,
                max_bytes: int | None = None, trace: bool = False) -> int:
    """Replay a manager program: 0 passes, 1 fails, 2 refused. The file passes the kernel case files'
    defences first (size, encoding, schema, memory budget ``max_bytes``, trust rule:
    :mod:`pagedkv.testing.managers.casefile`); a manager a file may not name runs only when named with
    ``impl``. ``trace``: print each step and the protocol calls it made (:class:`TracedManager`)."""
    from pagedkv.errors import CaseFileError
    from pagedkv.testing.managers.casefile import load_program_file

    out = out or sys.stdout
    try:
        data = load_program_file(path, max_bytes=max_bytes, impl=impl)
    except CaseFileError as exc:
        print(f"replay: refused case file {path}: {exc}", file=out)
        return 2
    steps, spec = data["steps"], data["manager"]
    unknown = next((name for name, _ in steps if not _is_rule(name)), None)
    if unknown is not None:
        print(f"replay: refused case file {path}: steps: {unknown!r} is not a rule of the manager machine", file=out)
        return 2
    try:
        from pagedkv.testing.managers.api_rules import ApiRules

        factory = load_manager(spec)
        if trace:
            factory = (lambda make: lambda config: TracedManager(make(config), out))(factory)
        machine_class = machine_for(factory, block_sizes=data["block_sizes"],
                                    windows=[w for w in data["windows"]],
                                    layouts=[str(name) for name in data.get("layouts", [ONE_GROUP])],
                                    rule_sets=(ApiRules,))  # a program of either machine replays
    except Exception as exc:  # noqa: BLE001 - one line, no traceback, for any backend that cannot load
        print(f"replay: cannot load manager {spec!r}: {type(exc).__name__}: {exc}", file=out)
        return 2
    if not quiet and not trace:
        print(f"manager {spec}, {len(steps)} steps:\n{as_text(steps)}", file=out)
    try:
        run_program(machine_class, steps, trace=out if trace else None)
    except Exception as exc:  # noqa: BLE001 - the manager's failure is the verdict
        print(f"FAIL {path}: {type(exc).__name__}: {exc}", file=out)
        return 1
    print(f"PASS {path}", file=out)
    return 0


def main(argv=None) -> int:  # pragma: no cover - python -m pagedkv.testing.managers.programs FILE
    argv = sys.argv[1:] if argv is None else argv
    return replay_file(argv[0], impl=argv[1] if len(argv) > 1 else None)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
