"""Which states reach the lines of vLLM's external-token allocation that the connector mutants change, in vLLM's
own tests and in the gate: a pytest plugin that counts them, and a runner that tallies both.

    cd /tmp && python /work/main/bench/external_alloc_probe.py --tests /tmp/core --deselect /tmp/core/deselect_all.txt

``SingleTypeKVCacheManager.allocate_external_computed_blocks`` asks the pool for ``cdiv(total, block_size) -
len(req_blocks)`` blocks, floored at 0 (``single_type_kv_cache_manager-0048`` drops the floor, ``-0049`` makes it
1): the mutants differ from vLLM only where that count is 0 or below. ``KVCacheCoordinator.
allocate_new_computed_blocks`` asserts that a request it already tracks adopts no computed blocks
(``kv_cache_coordinator-0043`` asserts one block per group): the mutant differs wherever that branch runs. The
plugin wraps both (the installed package is not edited) and appends one line per reaching call to
``$PAGEDKV_PROBE_LOG``: the test, the manager class and the count (and one line per external allocation, so
that a run reaching none of them still shows the probe ran). The runner runs vLLM's ``tests/v1/core`` and the
vLLM peer's cache-manager gate under it and prints what each reached.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _log(kind: str, detail: str) -> None:
    with open(os.environ["PAGEDKV_PROBE_LOG"], "a") as out:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        out.write(f"{kind}\t{detail}\t{test}\n")


def pytest_configure(config) -> None:
    """Wrap the two methods once vLLM imports (a plugin loaded with ``-p``, in every xdist worker too)."""
    if "PAGEDKV_PROBE_LOG" not in os.environ:
        return
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    allocate_external = SingleTypeKVCacheManager.allocate_external_computed_blocks
    allocate_computed = KVCacheCoordinator.allocate_new_computed_blocks

    def probed_external(self, request_id, num_local_computed_tokens, num_external_computed_tokens, *args, **kw):
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.get_num_skipped_tokens(total)
        external = min(total - skipped, num_external_computed_tokens) if skipped > 0 else num_external_computed_tokens
        if external > 0:
            _log("external_load", type(self).__name__)  # every reaching load, so a run that reached none shows it
            wanted = cdiv(total, self.block_size) - len(self.req_to_blocks[request_id])
            if wanted <= 0:
                _log("external_blocks_wanted<=0", f"{type(self).__name__} wanted={wanted}")
        return allocate_external(self, request_id, num_local_computed_tokens, num_external_computed_tokens,
                                 *args, **kw)

    def probed_computed(self, request_id, *args, **kw):
        if any(request_id in m.num_cached_block for m in self.single_type_managers):
            _log("tracked_request_adopts", type(self).__name__)
        return allocate_computed(self, request_id, *args, **kw)

    SingleTypeKVCacheManager.allocate_external_computed_blocks = probed_external
    KVCacheCoordinator.allocate_new_computed_blocks = probed_computed


def _run(args: list[str], cwd: Path, log: Path) -> int:
    env = {**os.environ, "PAGEDKV_PROBE_LOG": str(log), "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "external_alloc_probe", *args], cwd=cwd, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, required=True,
                        help="a scratch copy of vLLM's tests (holds tests/v1/core)")
    parser.add_argument("--deselect", type=Path, help="node ids to leave out of vLLM's tests, one a line")
    parser.add_argument("--workers", default="2", help="pytest -n for both runs (default 2)")
    args = parser.parse_args(argv)
    deselect = [f"--deselect={line.strip()}" for line in (args.deselect.read_text().splitlines()
                                                          if args.deselect else [])
                if line.strip() and not line.startswith("#")]
    with tempfile.TemporaryDirectory() as scratch:
        runs = {"vLLM tests/v1/core": (["-n", args.workers, "tests/v1/core", "--ignore-glob=*_e2e.py", *deselect],
                                       args.tests),
                "the gate (ci)": (["-n", args.workers, "--pyargs", "pagedkv.testing.suite",
                                   "--pagedkv-impl=pagedkv.tools.peers:vllm_cache_manager", "-k", "test_cache_manager"],
                                  Path(scratch))}
        for name, (pytest_args, cwd) in runs.items():
            log = Path(scratch) / f"{len(name)}.log"
            log.touch()
            rc = _run(pytest_args, cwd, log)
            tally = collections.Counter((kind, detail) for kind, detail, _ in
                                        (line.split("\t") for line in log.read_text().splitlines()))
            tests = {line.split("\t")[2] for line in log.read_text().splitlines()}
            print(f"{name}: pytest exit {rc}; {sum(tally.values())} reaching calls in {len(tests)} tests")
            for (kind, detail), count in sorted(tally.items()):
                print(f"  {kind:28} {detail:40} {count}")
            for test in sorted(tests):
                print(f"    {test}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
