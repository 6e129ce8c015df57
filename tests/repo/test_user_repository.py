"""The gate in a new user's repository: the built wheel gates a kernel of a project of its own.

The project ("tinyserve", written into a temporary directory) is laid out as an inference engine's
repository is: a ``src/`` layout (``src/tinyserve/...``), a top-level ``strategies`` package of its own
(with a ``strategies.profiles`` that is not pagedkv's), a ``tests/conftest.py`` that registers and
loads its own Hypothesis profile, ``testpaths = ["tests"]``, its own tests, and a ``tox.ini`` whose
``[testenv] commands`` are the documented gate commands, one per kernel:

    pytest --pyargs pagedkv.testing.suite tests --pagedkv-impl tinyserve.kv:backend -n 2 {posargs}
    pytest --pyargs pagedkv.testing.suite tests --pagedkv-impl tinyserve.hnd_csr:backend -n 2 {posargs}

tox itself is not installed: the test reads ``tox.ini``'s commands and runs each in the environment
(``pytest`` as ``python -m pytest``, ``{posargs}`` filled in), so the project's own CI command is what
goes green.

The first kernel reads pagedkv's NHD pools through head-major ``[num_blocks, num_kv_heads, block_size,
head_dim]`` views, provides only ``write_kv`` and ``paged_attention``, and declares block sizes
{16, 32} and head dims {64, 128}. It passes, the summary line says how many properties were judged
(at least the target share of those its ops allow), and the user's own tests pass under the user's
own profile; the command that names a candidate and collects no property is a usage error; each
planted bug (a read of the unused tail of the last block, GQA by ``h % num_kv_heads``, float32 slot
arithmetic and int32 element offsets in ``write_kv``) fails the gate with a case file that
``python -m pagedkv replay`` fails on again.

The second kernel is plain PyTorch over head-major pools ``[num_blocks, num_kv_heads, block_size,
head_dim]`` with FlashInfer CSR page tables (``Capabilities(layout="HND", page_table="csr")``, GQA,
causal prefill and decode, float32 accumulation, block sizes {1, 16}, head dims {64, 128}, float16
and bfloat16 only, ``write_kv``): its tox command goes green, and its copy that reads the page size
from the storage's dim 1 (the kv-head count of an HND pool) fails with a case file that replays to
the failure.

The gate runs without ``$PAGEDKV_PROFILE``: the project's own profile (``max_examples=30``) stays
loaded, the suite runs under it, and the project's own test of it passes in the same session (a
``$PAGEDKV_PROFILE`` asks for pagedkv's profile instead, which then governs the project's tests too).
A planted bug runs with ``-x -n 0`` (stop at the first failure; under xdist ``-x`` ends in exit 2):
the first failure must be the bug's, with its case file.

The environment reuses this one's torch, Hypothesis, pytest and xdist (``--system-site-packages``);
pagedkv itself comes from the wheel (``pip install --no-deps``), which shadows the checkout's
editable install there. About five to seven minutes on two cores, most of it the two kernels' full
runs.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import subprocess
import textwrap
import time
from pathlib import Path
from xml.etree import ElementTree

import pytest

#: a user's repository gated from the wheel: about 1.5 minutes on 2 cores (the nightly tier; the wheel's
#: packaging is pinned on every run by tests/repo/test_architecture.py)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(r"pagedkv (?P<name>\S+): (?P<judged>\d+) propert(?:y|ies) judged \((?P<failed>\d+) failing\) "
                     r"of (?P<applicable>\d+) its ops allow(?: \((?P<pct>\d+)%\))?[^\n]*")
#: The issue's target: of the properties a kernel's ops allow, the share the gate judges.
TARGET_FRACTION = 0.9
KERNEL = '''\
"""tinyserve's paged KV kernel: head-major reads of pagedkv's NHD pools, ``write_kv`` and attention only.

Pools are pagedkv's ``[num_blocks, block_size, num_kv_heads, head_dim]``; the kernel works on
``pool.permute(0, 2, 1, 3)``, a ``[num_blocks, num_kv_heads, block_size, head_dim]`` view of the same
storage (no copy), as a head-major kernel indexes its pool. Arguments are checked with pagedkv's
validation (so bad input raises before anything is written); the math is plain torch in float32.
"""

import torch

from pagedkv.backends.capabilities import Capabilities, Sizes
from pagedkv.validation.calls import check_paged_attention, check_write_kv


def _head_major(pool: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, H, D]`` -> a ``[num_blocks, H, block_size, D]`` view of the same storage."""
    return pool.permute(0, 2, 1, 3)


class TinyServeKV:
    """tinyserve's backend object (``tinyserve.kv:backend``)."""

    name = "NAME"
    capabilities = Capabilities(block_sizes=Sizes(values={16, 32}), head_dims=Sizes(values={64, 128}),
                                dtypes={"float32", "float16", "bfloat16"})

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):
        """Token ``i`` to slot ``slot_mapping[i]`` of both pools (negative slots skipped)."""
        slots = check_write_kv(k_cache, v_cache, key, value, slot_mapping)
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
        block_size = k_cache.shape[1]
        block, offset = slots // block_size, slots % block_size
        for pool, rows in ((k_cache, key), (v_cache, value)):
            _head_major(pool)[block, :, offset] = rows

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        """Causal varlen attention over each sequence's blocks, read head-major."""
        args = check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        num_q_heads = query.shape[1]
        group = num_q_heads // num_kv_heads
        kv_head = torch.arange(num_q_heads, device=query.device) // group
        k_pool, v_pool = _head_major(k_cache), _head_major(v_cache)
        out = torch.empty_like(query)
        starts = args.q_starts
        for b, seq_len in enumerate(args.seq_lens):
            lo, hi = starts[b], starts[b + 1]
            if hi == lo:
                continue
            ids = args.block_tables[b, : -(-seq_len // block_size)]
            k, v = (pool.index_select(0, ids).to(torch.float32).permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
                    for pool in (k_pool, v_pool))
            k, v = k[:, :seq_len], v[:, :seq_len]
            k, v = k.index_select(0, kv_head), v.index_select(0, kv_head)  # [num_q_heads, context, head_dim]
            q = query[lo:hi].to(torch.float32).permute(1, 0, 2).contiguous()  # [num_q_heads, q_len, head_dim]
            logits = torch.matmul(q, k.transpose(1, 2)) * args.scale
            q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=query.device)
            k_pos = torch.arange(k.shape[1], device=query.device)
            logits = logits.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            out[lo:hi] = torch.matmul(torch.softmax(logits, dim=-1), v).permute(1, 0, 2).to(query.dtype)
        return out


backend = TinyServeKV()
'''

HND_CSR_KERNEL = '''\
"""tinyserve's head-major kernel: HND pools ``[num_blocks, num_kv_heads, block_size, head_dim]`` and
FlashInfer CSR page tables, float16/bfloat16 only, block sizes {1, 16}, head dims {64, 128}.

Arguments are checked with pagedkv's validation on NHD views of the pools (so bad input raises
before anything is written); the math is plain torch, accumulated in float32, on the HND storage.
"""

import torch

from pagedkv.backends.capabilities import Capabilities, Sizes
from pagedkv.csr import csr_to_padded
from pagedkv.validation.calls import check_paged_attention, check_write_kv

SUPPORTED = (torch.float16, torch.bfloat16)


def _nhd(pool):
    """``[num_blocks, H, block_size, D]`` storage -> the ``[num_blocks, block_size, H, D]`` view pagedkv checks."""
    return pool.permute(0, 2, 1, 3) if isinstance(pool, torch.Tensor) and pool.dim() == 4 else pool


def _supported(pool, what):
    if isinstance(pool, torch.Tensor) and pool.dtype not in SUPPORTED:
        raise TypeError(f"{what}: dtype {pool.dtype} is not supported (float16, bfloat16)")


class HeadMajorCsr:
    name = "NAME"
    capabilities = Capabilities(layout="HND", page_table="csr", block_sizes=Sizes(values={1, 16}),
                                head_dims=Sizes(values={64, 128}), dtypes={"float16", "bfloat16"})

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):
        """Token ``i`` to slot ``slot_mapping[i]`` of both pools (negative slots skipped)."""
        _supported(k_cache, "k_cache")
        slots = check_write_kv(_nhd(k_cache), _nhd(v_cache), key, value, slot_mapping)
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
        block_size = k_cache.shape[2]
        block, offset = slots // block_size, slots % block_size
        for pool, rows in ((k_cache, key), (v_cache, value)):
            pool[block, :, offset] = rows

    def paged_attention(self, query, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, query_start_loc,
                        scale=None):
        """Causal varlen attention over each sequence's pages, GQA, read head-major."""
        _supported(k_cache, "k_cache")
        block_size = k_cache.shape[2]
        tables, seq_lens = csr_to_padded(kv_indptr, kv_indices, kv_last_page_len, block_size, k_cache.shape[0])
        args = check_paged_attention(query, _nhd(k_cache), _nhd(v_cache), tables, seq_lens, query_start_loc, scale)
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
        num_q_heads = query.shape[1]
        kv_head = torch.arange(num_q_heads, device=query.device) // (num_q_heads // num_kv_heads)
        out = torch.empty_like(query)
        starts = args.q_starts
        for b, seq_len in enumerate(args.seq_lens):
            lo, hi = starts[b], starts[b + 1]
            if hi == lo:
                continue
            ids = kv_indices[kv_indptr[b]: kv_indptr[b + 1]].long()
            k, v = (pool.index_select(0, ids).to(torch.float32).permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
                    for pool in (k_cache, v_cache))
            k, v = k[:, :seq_len].index_select(0, kv_head), v[:, :seq_len].index_select(0, kv_head)
            q = query[lo:hi].to(torch.float32).permute(1, 0, 2)
            logits = torch.matmul(q, k.transpose(1, 2)) * args.scale
            q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            logits = logits.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            out[lo:hi] = torch.matmul(torch.softmax(logits, dim=-1), v).permute(1, 0, 2).to(query.dtype)
        return out


backend = HeadMajorCsr()
'''

#: A planted bug of the head-major CSR kernel: its page size read from the storage's dim 1 (num_kv_heads).
HND_CSR_PLANTED = ("page size read from k_cache.shape[1], the kv-head count of an HND pool",
                   "        block_size = k_cache.shape[2]\n        tables, seq_lens",
                   "        block_size = k_cache.shape[1]\n        tables, seq_lens")

#: Planted bugs: module -> (what it does wrong, the line of KERNEL it replaces, its replacement).
PLANTED = {
    "kv_tail": ("attention reads the unused tail of the last block (whole blocks, no length cut)",
                "            k, v = k[:, :seq_len], v[:, :seq_len]\n", ""),
    "kv_gqa": ("GQA maps query head h to kv head h % num_kv_heads",
               "kv_head = torch.arange(num_q_heads, device=query.device) // group",
               "kv_head = torch.arange(num_q_heads, device=query.device) % num_kv_heads"),
    "kv_float_slots": ("write_kv splits slots in float32 (exact only below 2**24)",
                       "block, offset = slots // block_size, slots % block_size",
                       "slots = slots.float().long()\n        block, offset = slots // block_size, slots % block_size"),
    "kv_int32_offsets": ("write_kv forms element offsets slot * num_kv_heads * head_dim in int32",
                         "block, offset = slots // block_size, slots % block_size",
                         "row = k_cache.shape[2] * k_cache.shape[3]\n"
                         "        slots = ((slots.int() * row) // row).long()  # wraps past 2**31 elements\n"
                         "        block, offset = slots // block_size, slots % block_size"),
}

USER_FILES = {
    "pyproject.toml": '''\
        [build-system]
        requires = ["setuptools>=77"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "tinyserve"
        version = "0.1.0"
        requires-python = ">=3.10"

        [tool.setuptools.packages.find]
        where = ["src"]
        include = ["tinyserve*", "strategies*"]

        [tool.pytest.ini_options]
        testpaths = ["tests"]
        ''',
    "tox.ini": '''\
        [tox]
        envlist = gate

        [testenv]
        deps = pagedkv[testing]
        commands =
            pytest --pyargs pagedkv.testing.suite tests --pagedkv-impl tinyserve.kv:backend -n 2 {posargs}
            pytest --pyargs pagedkv.testing.suite tests --pagedkv-impl tinyserve.hnd_csr:backend -n 2 {posargs}
        ''',
    "tests/conftest.py": '''\
        from hypothesis import settings

        settings.register_profile("tinyserve", max_examples=30)
        settings.load_profile("tinyserve")
        ''',
    "src/strategies/__init__.py": '''\
        """tinyserve's own Hypothesis strategies (not pagedkv's)."""
        from hypothesis import strategies as st

        from strategies.profiles import LIMITS


        def tokens():
            return st.lists(st.integers(0, LIMITS["vocab"] - 1), min_size=1, max_size=LIMITS["max_context"])
        ''',
    "src/strategies/profiles.py": '''\
        """tinyserve's serving limits (a module of the same name as pagedkv's profiles, nothing like it)."""
        LIMITS = {"vocab": 32000, "max_context": 48}
        ''',
    "src/tinyserve/__init__.py": '"""tinyserve: a tiny inference engine."""\n',
    "tests/test_own.py": '''\
        import hypothesis
        from hypothesis import given

        import strategies
        from strategies.profiles import LIMITS


        def test_the_projects_own_profile_is_in_force():
            assert hypothesis.settings().max_examples == 30


        def test_the_projects_own_strategies_are_imported():
            assert strategies.__file__.endswith("strategies/__init__.py") and not hasattr(strategies, "cases")


        @given(strategies.tokens())
        def test_token_ids_fit_the_context(ids):
            assert 0 < len(ids) <= LIMITS["max_context"] and all(0 <= i < LIMITS["vocab"] for i in ids)
        ''',
}


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1500, **kw)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _kernel(name: str, old: str = "", new: str = "", kernel: str = KERNEL) -> str:
    source = kernel.replace('name = "NAME"', f'name = "{name}"')
    if old:
        assert source.count(old) == 1, f"the planted line {old!r} is not in the kernel exactly once"
        source = source.replace(old, new)
    return source


@pytest.fixture(scope="module")
def venv(venv_with_wheel) -> Path:
    """A virtual environment over this one's site-packages with the wheel of the checkout installed."""
    return venv_with_wheel("user-repo", system_site_packages=True)


@pytest.fixture(scope="module")
def tinyserve(venv, tmp_path_factory) -> Path:
    """The user's repository, its package installed (editable) into the environment, with one module
    per planted bug next to the correct kernel."""
    repo = tmp_path_factory.mktemp("tinyserve")
    for rel, text in USER_FILES.items():
        _write(repo / rel, textwrap.dedent(text))
    package = repo / "src" / "tinyserve"
    _write(package / "kv.py", _kernel("tinyserve"))
    for module, (_, old, new) in PLANTED.items():
        _write(package / f"{module}.py", _kernel(f"tinyserve_{module}", old, new))
    _write(package / "hnd_csr.py", _kernel("tinyserve_hnd_csr", kernel=HND_CSR_KERNEL))
    _write(package / "hnd_csr_page_size.py",
           _kernel("tinyserve_hnd_csr_page_size", *HND_CSR_PLANTED[1:], kernel=HND_CSR_KERNEL))
    done = _run([venv, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", repo])
    assert done.returncode == 0, done.stdout + done.stderr
    return repo


def _env(repo: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDKV_", "PYTHON", "PYTEST_", "HYPOTHESIS"))
           and k != "CI"}
    return {**env, "PAGEDKV_FAILURE_DIR": str(repo / ".pagedkv-failures"), **extra}


def _tox_commands(repo: Path, *posargs: str) -> dict[str, list[str]]:
    """``tox.ini``'s ``[testenv] commands`` as tox would run them with ``posargs``: ``{--pagedkv-impl
    spec: argv}``, each ``pytest`` as ``-m pytest`` (the environment's interpreter runs it)."""
    ini = configparser.ConfigParser()
    ini.read(repo / "tox.ini")
    commands = {}
    for line in filter(None, (c.strip() for c in ini["testenv"]["commands"].splitlines())):
        argv = shlex.split(line.replace("{posargs}", shlex.join(posargs)))
        assert argv[0] == "pytest", f"tox.ini runs something other than pytest: {line}"
        commands[argv[argv.index("--pagedkv-impl") + 1]] = ["-m", *argv]
    return commands


def _tox(python: Path, repo: Path, spec: str, *posargs: str) -> tuple:
    """The project's own CI command for the kernel ``spec``, from its root: ``(process, output, wall s)``."""
    start = time.monotonic()
    proc = _run([python, *_tox_commands(repo, *posargs)[spec]], cwd=repo, env=_env(repo))
    return proc, proc.stdout + proc.stderr, time.monotonic() - start


def _gate(python: Path, repo: Path, spec: str, *args: str, env: dict | None = None) -> tuple:
    """The documented gate command from the user's root: ``(process, output, wall seconds)``."""
    start = time.monotonic()
    proc = _run([python, "-m", "pytest", "--pyargs", "pagedkv.testing.suite", *args, "--pagedkv-impl", spec,
                 "-p", "no:cacheprovider", "-rs"], cwd=repo, env=env or _env(repo))
    return proc, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.fixture(scope="module")
def good_run(venv, tinyserve) -> tuple:
    """The correct kernel through the project's tox command, with the project's own tests in the run:
    ``(process, output, {test id: outcome})`` (outcomes from the run's JUnit XML)."""
    junit = tinyserve / "good-run.xml"
    proc, out, wall = _tox(venv, tinyserve, "tinyserve.kv:backend", "-p", "no:cacheprovider", "-rs",
                           f"--junit-xml={junit}")
    lines = re.findall(r"^pagedkv tinyserve: .*$", out, re.MULTILINE) or ["(no summary line)"]
    print(f"\ngate run of the correct kernel: exit {proc.returncode}, {wall:.1f} s wall\n" + "\n".join(lines))
    outcomes = {}
    if junit.exists():
        for case in ElementTree.parse(junit).iter("testcase"):
            verdict = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes[f"{case.get('classname')}.{case.get('name')}"] = verdict[0] if verdict else "passed"
    return proc, out, outcomes


def test_the_wheel_ships_no_generic_top_level_name_and_the_users_strategies_win(venv, tinyserve):
    probe = ("import pagedkv, strategies, strategies.profiles as p; from importlib.metadata import distribution; "
             "print(pagedkv.__file__); print(strategies.__file__); print(sorted(vars(p)));"
             "print(distribution('pagedkv').read_text('top_level.txt').split())")
    for cwd in (tinyserve, tinyserve / "tests"):  # from the root, and from elsewhere (the installed package)
        proc = _run([venv, "-c", probe], cwd=cwd, env=_env(tinyserve))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        pagedkv_file, strategies_file, names, top_level = proc.stdout.splitlines()
        assert str(ROOT) not in pagedkv_file and "site-packages" in pagedkv_file, pagedkv_file
        assert strategies_file == str(tinyserve / "src" / "strategies" / "__init__.py")
        assert "LIMITS" in names and "choose_profile" not in names, names
        assert top_level == "['pagedkv']", top_level


def test_the_documented_gate_passes_the_correct_kernel(good_run):
    proc, out, outcomes = good_run
    assert proc.returncode == 0, out[-6000:]
    assert "implementation under test: tinyserve.kv:backend" in out, out[-3000:]
    # --pyargs names a suite test by its module alone in JUnit (``test_properties.test_...``)
    modules = {f.stem for f in (ROOT / "pagedkv" / "testing" / "suite").glob("test_*.py")}
    suite = {t: v for t, v in outcomes.items() if t.split(".")[-2] in modules}
    assert "passed" in suite.values() and not {"failure", "error"} & set(suite.values()), out[-3000:]
    lines = [m for m in SUMMARY.finditer(out) if m["name"] == "tinyserve"]
    assert len(lines) == 1, "no single judged summary line for tinyserve:\n" + out[-3000:]
    assert int(lines[0]["judged"]) > 0 and lines[0]["failed"] == "0", lines[0].group(0)


def test_the_users_own_tests_pass_in_the_same_run_under_their_own_profile(good_run):
    proc, out, outcomes = good_run
    own = {t: v for t, v in outcomes.items() if t.startswith("tests.test_own.")}
    assert own == {f"tests.test_own.test_{name}": "passed" for name in (
        "the_projects_own_profile_is_in_force", "the_projects_own_strategies_are_imported",
        "token_ids_fit_the_context")}, (own, out[-3000:])
    assert "tinyserve (the project's own, left as it is)" in out, out[:2000]


def test_the_gate_judges_most_of_what_the_kernels_ops_allow(good_run):
    """Of the properties the kernel's ops allow, the gate judges at least the target share."""
    _, out, _ = good_run
    line = next(m for m in SUMMARY.finditer(out) if m["name"] == "tinyserve")
    judged, applicable = int(line["judged"]), int(line["applicable"])
    assert judged >= TARGET_FRACTION * applicable, (
        f"{judged}/{applicable} = {judged / applicable:.0%} judged, under {TARGET_FRACTION:.0%}: {line.group(0)}")


def test_a_named_candidate_with_no_property_collected_is_a_usage_error(venv, tinyserve):
    proc = _run([venv, "-m", "pytest", "-p", "no:cacheprovider"], cwd=tinyserve,
                env=_env(tinyserve, PAGEDKV_IMPL="tinyserve.kv:backend"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out[-3000:]
    assert "pytest --pyargs pagedkv.testing.suite" in out and "tinyserve.kv:backend" in out, out[-3000:]


@pytest.mark.parametrize("module", sorted(PLANTED))
def test_a_planted_bug_fails_the_gate_with_a_case_file_that_replays_to_it(venv, tinyserve, module):
    failures = tinyserve / ".pagedkv-failures" / module
    spec = f"tinyserve.{module}:backend"
    proc, out, wall = _gate(venv, tinyserve, spec, "tests", "-x", "-n", "0",
                            env=_env(tinyserve, PAGEDKV_FAILURE_DIR=str(failures)))
    print(f"\n{module} ({PLANTED[module][0]}): gate exit {proc.returncode} in {wall:.1f} s wall")
    assert proc.returncode == 1, f"{PLANTED[module][0]}: not caught\n" + out[-4000:]
    files = sorted(failures.glob("*.json"))
    assert files, f"no case file under {failures}:\n" + out[-4000:]
    assert "replay: python -m pagedkv replay" in out, out[-4000:]
    for case_file in files:
        replay = _run([venv, "-m", "pagedkv", "replay", case_file, "--impl", spec], cwd=tinyserve, env=_env(tinyserve))
        said = replay.stdout + replay.stderr
        assert replay.returncode == 1 and "FAILS:" in replay.stdout, (
            f"{case_file.name} does not replay to a failure:\n{said[-3000:]}")


def test_a_head_major_csr_kernel_is_green_and_its_page_size_bug_is_caught(venv, tinyserve):
    """The project's tox command for a plain-PyTorch kernel over HND pools taking FlashInfer CSR page
    tables (GQA, causal prefill and decode, float32 accumulation, block sizes {1, 16}, head dims {64, 128},
    float16 and bfloat16 only, ``write_kv``), declared with ``Capabilities(layout="HND",
    page_table="csr")``: green, at least the target share of the properties its ops allow judged; the
    same kernel reading its page size from the storage's dim 1 fails with a case file that replays to
    the failure."""
    proc, out, wall = _tox(venv, tinyserve, "tinyserve.hnd_csr:backend", "-p", "no:cacheprovider", "-rs")
    lines = [m for m in SUMMARY.finditer(out) if m["name"] == "tinyserve_hnd_csr"]
    print(f"\nhead-major CSR kernel: gate exit {proc.returncode} in {wall:.1f} s wall\n"
          + "\n".join(m.group(0) for m in lines))
    failing = re.findall(r"^property: .*\n.*\n.*", out, re.MULTILINE)
    assert proc.returncode == 0, "\n".join(failing) + "\n" + out[-3000:]
    assert len(lines) == 1 and lines[0]["failed"] == "0", out[-3000:]
    assert int(lines[0]["judged"]) >= TARGET_FRACTION * int(lines[0]["applicable"]), lines[0].group(0)
    assert "layout HND" in out, out[-3000:]

    failures = tinyserve / ".pagedkv-failures" / "hnd_csr_page_size"
    spec = "tinyserve.hnd_csr_page_size:backend"
    proc, out, wall = _gate(venv, tinyserve, spec, "tests", "-x", "-n", "0", "-k", "paged_attention_matches",
                            env=_env(tinyserve, PAGEDKV_FAILURE_DIR=str(failures)))
    print(f"{HND_CSR_PLANTED[0]}: gate exit {proc.returncode} in {wall:.1f} s wall")
    assert proc.returncode == 1, f"{HND_CSR_PLANTED[0]}: not caught\n" + out[-4000:]
    (case_file, *_) = sorted(failures.glob("*.json"))
    replay = _run([venv, "-m", "pagedkv", "replay", case_file, "--impl", spec], cwd=tinyserve, env=_env(tinyserve))
    assert replay.returncode == 1 and "FAILS:" in replay.stdout, replay.stdout + replay.stderr
