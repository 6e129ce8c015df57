"""An engine's own tests against the mutants ``python -m pagedkv mutate`` generates, for the side-by-side table.

    python bench/engine_tests_vs_mutants.py --tests DIR --source FILE... --only ID... --json OUT.json

Each mutant is loaded in a child process with pagedkv's mutant finder (the installed package is never
edited), then ``pytest DIR`` runs there with only the tests that pass on the unmutated package (a test
that already fails cannot kill anything). A mutant is killed when any of them fails or errors. Mutant ids
are the ones ``mutate --list`` prints for the same ``--source`` files (same generator, same order).
``--deselect FILE`` leaves out the node ids it lists (one a line, ``#`` comments): tests that cannot see a
mutant (vLLM's ``test_is_kv_cache_spec_uniform`` imports the installed package afresh in a subprocess) and
whose result depends on the machine's load (that subprocess has 60 s). A pytest usage error (exit 4 or 5: a
node id not found, nothing collected) stops the run: it is the harness's fault, never a kill.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pagedkv.tools.mutants.generate import BOOTSTRAP, generate, module_name_for, write_mutant

_CHILD = r'''
import sys, pytest
if sys.argv[1] != "-":
    install_mutant(sys.argv[1], sys.argv[2], sys.argv[3])
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-x", "--rootdir", sys.argv[4], *sys.argv[5:]]))
'''


#: pytest's exit codes for a usage error and for no tests collected.
_USAGE_ERRORS = (4, 5)


def _pytest(tests: Path, node_ids: list[str], mutant=None, path=None, timeout=300) -> tuple[int, float, str]:
    args = [mutant.module, str(path), mutant.file] if mutant is not None else ["-", "-", "-"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", BOOTSTRAP + _CHILD, *args, str(tests), *node_ids],
                              cwd=tests, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        rc, out = -9, "timed out"
    if rc in _USAGE_ERRORS:
        raise SystemExit(f"pytest exited {rc} (a usage error, not a kill):\n{out[-2000:]}")
    return rc, time.monotonic() - t0, out


def passing_tests(tests: Path, deselect: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """``(passing, failing)`` node ids of ``tests`` on the unmutated package, ``deselect`` left out. A node id
    may hold spaces (a parametrize id): a ``PASSED`` line is the whole id, a ``FAILED`` one ends at `` - ``."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tests),
                           *(f"--deselect={node}" for node in deselect)],
                          cwd=tests, env=env, capture_output=True, text=True, timeout=600)
    return parse_report(done.stdout)


def parse_report(stdout: str) -> tuple[list[str], list[str]]:
    """``(passed, failed)`` node ids of a ``pytest -rA`` report: a ``PASSED`` line is the whole id (a
    parametrize id may hold spaces), a ``FAILED`` or ``ERROR`` one ends at `` - ``; an ``ERROR ...`` line
    the engine's logger printed (no ``::``, no ``.py``) is not a test."""
    passed, failed = [], []
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "PASSED":
            passed.append(rest.strip())
        elif word in ("FAILED", "ERROR"):
            node = rest.split(" - ")[0].strip()
            if "::" in node or node.endswith(".py"):
                failed.append(node)
    return passed, failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", required=True, type=Path, help="directory of the engine's tests (a scratch copy)")
    parser.add_argument("--source", nargs="+", required=True, help="the mutated source files, as for mutate")
    parser.add_argument("--only", nargs="+", required=True, help="mutant ids (as mutate --list prints them)")
    parser.add_argument("--json", required=True, help="where to write the per-mutant results")
    parser.add_argument("--deselect", type=Path, help="node ids to leave out, one a line (# comments)")
    args = parser.parse_args(argv)
    mutants = [m for path in args.source for m in generate(path, module=module_name_for(path)) if m.id in args.only]
    deselect = [] if args.deselect is None else [
        line.strip() for line in args.deselect.read_text().splitlines() if line.strip() and not line.startswith("#")]
    passed, failed = passing_tests(args.tests.resolve(), deselect)
    print(f"baseline: {len(passed)} tests pass, {len(failed)} fail or error on the unmutated package (left out)")
    rows = []

    def write() -> None:  # after every mutant too: a run stopped early keeps its rows
        Path(args.json).write_text(json.dumps({"tests": str(args.tests), "passing_tests": passed,
                                               "left_out_tests": failed, "deselected": deselect, "rows": rows},
                                              indent=1))

    with tempfile.TemporaryDirectory(prefix="engine-tests-") as work:
        for m in mutants:
            path = write_mutant(m, Path(work) / "src")
            rc, seconds, out = _pytest(args.tests.resolve(), passed, m, path)
            killed = rc != 0
            first = next((ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))), "")
            rows.append({"id": m.id, "killed": killed, "seconds": round(seconds, 2), "returncode": rc,
                         "first_failure": first[:200]})
            print(f"{m.id:34} {'killed' if killed else 'survived':8} {seconds:6.1f}s {first[:100]}", flush=True)
            write()
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
