"""Case files are untrusted input: replay refuses every malformed, oversized or foreign one cleanly.

Hypothesis corrupts valid case files (the committed regression files and records drawn from the
suite's own strategies): wrong types, missing and extra keys, negative and enormous sizes,
inconsistent tables, bad names, non-UTF-8 bytes, deep nesting, oversized files, terminal escapes and
backend specs a file may not name. For every one, ``python -m pagedkv replay FILE`` (run in-process
through :func:`pagedkv.cli.main`) must exit 2 with one line naming the offending field, print no
traceback, import no module (a marker module on ``sys.path`` would leave a file behind) and call no
torch allocator. The three files of issue 17 are explicit tests, one of them through a subprocess.
Valid files, drawn the same way, must still be accepted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedkv.testing
import pagedkv.tools.mutants.backends  # noqa: F401  (imported before the guards: replay's own modules)
import pagedkv.testing.managers.casefile  # noqa: F401
import pagedkv.tools.mutants.cheats  # noqa: F401
import pagedkv.tools.peers  # noqa: F401
import pagedkv.testing.strategies as s
from pagedkv import cli
from pagedkv.cli import replay as replay_cli  # noqa: F401
from pagedkv.errors import CaseFileError, PagedKVError
from pagedkv.testing.casefiles import reading as casefile, schema, writing
from pagedkv.testing.cases.case import CacheScenario, Case, Geometry, SeqSpec
from pagedkv.testing.cases.invalid_call import InvalidCall

# the properties these tests' case files name
GATHER = "gather_returns_exactly_what_each_slot_holds"
ATTENTION = "paged_attention_matches_fp64_dense_reference"
SHARING = "every_live_sequence_reads_only_its_own_tokens"
AGREE = "backends_agree_on_every_op_both_provide"

ROOT = Path(__file__).resolve().parents[2]
REGRESSIONS = casefile.shipped_regressions()
BASES = [json.loads(p.read_text()) for p in REGRESSIONS]
MARKER = "pkv_case_file_marker"  # a module a foreign spec would import; importing it leaves MARKER.ran
SETTINGS = settings(max_examples=int(os.environ.get("PAGEDKV_CASE_FILE_EXAMPLES", "150")), deadline=None,
                    database=None, suppress_health_check=list(HealthCheck))

# required keys of every object (the schema's contract; kept in step with the dataclasses below)
REQUIRED = {"record": ("check", "case"),
            "Case": ("geometry", "seqs", "values", "poison", "pad_value", "pad_columns", "table_dtype", "layout",
                     "scale", "seed"),
            "Geometry": ("num_blocks", "block_size", "num_kv_heads", "head_dim", "num_queries_per_kv", "dtype"),
            "SeqSpec": ("block_table", "seq_len", "q_len", "start"),
            "CacheScenario": ("geometry", "ops", "enable_prefix_caching", "constant_hash", "seed"),
            "InvalidCall": ("op", "fault", "case", "seq", "amount")}
OPTIONAL_CASE = ("window_left", "softcap", "alibi", "sinks", "kv_cache_dtype", "k_scale", "v_scale",
                 "num_splits", "cuts")  # off when absent
OPTIONAL_GEOMETRY = ("head_dim_v",)  # V as wide as K when absent
NULLABLE = {"backend", "other", "error", "case.scale", "case.case.scale", "case.num_splits",
            "case.case.num_splits"}
SIZE_FIELDS = ("num_blocks", "block_size", "num_kv_heads", "head_dim", "num_queries_per_kv", "seq_len", "q_len",
               "start", "pad_columns", "seed", "num_layers")
POOL_FIELDS = ("num_blocks", "block_size", "num_kv_heads", "head_dim")


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A directory on ``sys.path`` (and the cwd) holding the marker module, for the whole module."""
    root = tmp_path_factory.mktemp("case_files")
    cli.build_parser()  # every subcommand module imported once, before the guards compare sys.modules
    (root / f"{MARKER}.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_suffix('.ran').touch()\n"
        "name = 'marker'\ndef gather(cache, block_table, seq_len):\n    return cache\nbackend = gather\n")
    sys.path.insert(0, str(root))
    old = os.getcwd()
    os.chdir(root)
    yield root
    os.chdir(old)
    sys.path.remove(str(root))


def foreign_specs(root: Path) -> list[str]:
    """Backend specs a case file may not name (the first four would import the marker)."""
    return [f"{MARKER}:backend", MARKER, str(root / f"{MARKER}.py"), f"{root / MARKER}.py:gather",
            "os:system", "subprocess", "pagedkv.backends:get_backend", "pagedkv.backends.indexed",
            "pagedkv.tools.mutants:MUTANTS", "pagedkv.tools.mutants:IndexedBackend",
            "pagedkv.tools.mutants:gqa_modulo.__class__", "pagedkv.tools.mutants:",
            "pagedkv.tools.peers:PEERS", "pagedkv.tools.peers:torch_paged_attention:x", "INDEXED", " indexed",
            "indexed.py", "../loop"]


# -- the guard: what replay may not do on a refused file ------------------------------------------------
ALLOCATORS = ("empty", "zeros", "ones", "full", "randn", "rand", "arange", "tensor", "empty_like", "zeros_like",
              "full_like", "empty_strided", "randperm", "as_tensor", "from_numpy")


@contextlib.contextmanager
def guard(root: Path):
    """Record torch allocations, new modules, Python heap peak and the marker's trace during the block."""
    seen: dict = {"allocations": [], "new_modules": set(), "python_peak": 0}
    originals = {name: getattr(torch, name) for name in ALLOCATORS}

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            seen["allocations"].append((name, args[:3]))
            return fn(*args, **kwargs)
        return wrapper

    before = set(sys.modules)
    for name, fn in originals.items():
        setattr(torch, name, recording(name, fn))
    tracemalloc.start()
    try:
        yield seen
    finally:
        seen["python_peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        for name, fn in originals.items():
            setattr(torch, name, fn)
        seen["new_modules"] = set(sys.modules) - before
        seen["marker_ran"] = (root / f"{MARKER}.ran").exists()


def replay_refuses(root: Path, data: bytes, fields, *extra: str) -> str:
    """Replay ``data`` in-process; assert exit 2, one line naming one of ``fields``, and no side effect."""
    path = root / "case.json"
    path.write_bytes(data)
    out, err = io.StringIO(), io.StringIO()
    with guard(root) as seen, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["replay", str(path), *extra])
    text = out.getvalue() + err.getvalue()
    assert code == 2, text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"replay: refused case file {path}: "), text
    named = lines[0][len(f"replay: refused case file {path}: "):].split(": ", 1)[0]
    assert named in set(fields), f"names {named!r}, expected one of {sorted(set(fields))}: {text}"
    assert "Traceback" not in text
    assert not seen["allocations"], seen["allocations"]
    assert not seen["new_modules"], seen["new_modules"]
    assert not seen["marker_ran"] and MARKER not in sys.modules
    assert seen["python_peak"] < 64 << 20, seen["python_peak"]  # reading a <= 1 MiB file, nothing more
    return lines[0]


# -- valid records ----------------------------------------------------------------------------------------
def record_of(case, check: str) -> dict:
    return json.loads(json.dumps({"version": 1, "check": check, "backend": "indexed", "other": None,
                                  "kind": type(case).__name__, "case": case.to_dict(),
                                  "error": ""}))


drawn_records = st.one_of(
    s.cases(max_seqs=3, max_len=12).map(lambda c: record_of(c, GATHER)),
    s.fragmented_cases(max_seqs=3, max_len=12).map(lambda c: record_of(c, ATTENTION)),
    s.scenarios(max_ops=6).map(lambda c: record_of(c, SHARING)),
    s.invalid_calls().map(lambda c: record_of(c, f"{c.op}_rejects_bad_arguments_and_writes_nothing")),
)
valid_records = st.one_of(st.sampled_from(BASES), drawn_records)


def walk(value, path: str = ""):
    """``(path, parent, key, value)`` of every node below ``value``, paths as the schema names them."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        p = (f"{path}.{key}" if path else key) if isinstance(value, dict) else f"{path}[{key}]"
        yield p, value, key, child
        yield from walk(child, p)


def case_prefix(record: dict) -> str:
    return "case.case" if record.get("kind") == "InvalidCall" else "case"


def object_kind(record: dict, path: str) -> str | None:
    """Which schema object lives at ``path`` (``None``: not an object of the schema)."""
    c = case_prefix(record)
    if path == "":
        return "record"
    if path == c:
        return record.get("kind", "Case") if c == "case" else "Case"
    if path == "case" and c == "case.case":
        return "InvalidCall"
    if path == f"{c}.geometry":
        return "Geometry"
    if re.fullmatch(re.escape(c) + r"\.seqs\[\d+\]", path):
        return "SeqSpec"
    return None


def is_scenario_extra(path: str, record: dict) -> bool:
    """A cache_key (``ops[i][3]``) or a write count (``ops[i][2]`` of a write): nullable, any scalar."""
    m = re.fullmatch(r"case\.ops\[(\d+)\]\[(\d+)\]", path)
    if not m or record.get("kind") != "CacheScenario":
        return False
    op = record["case"]["ops"][int(m.group(1))]
    return m.group(2) == "3" or (op[0] == "write" and m.group(2) == "2")


def set_at(record: dict, path: str, value) -> dict:
    out = json.loads(json.dumps(record))
    for p, parent, key, _ in walk(out):
        if p == path:
            parent[key] = value
            return out
    raise KeyError(path)


# -- corruptions: (bytes, fields any of which the refusal may name) ----------------------------------------
HOWS = ("type", "missing", "extra", "negative", "enormous", "huge_pool", "table", "name", "utf8", "nesting",
        "oversized", "control", "version", "foreign")


@st.composite
def corrupted(draw, root: Path, how: str):
    record = draw(valid_records)
    record = json.loads(json.dumps(record))
    c = case_prefix(record)
    nodes = list(walk(record))
    leaves = [(p, v) for p, _, _, v in nodes if not isinstance(v, (dict, list))]
    enc = lambda r: json.dumps(r, indent=1).encode()  # noqa: E731
    if how == "type":
        choices = [(p, v) for p, v in leaves if not is_scenario_extra(p, record)]
        path, value = draw(st.sampled_from(choices))
        bad: list = [[], {"x": 1}, [[1]]]
        if isinstance(value, bool):
            bad += [1, 0, "true", None]
        elif isinstance(value, int):
            bad += ["12", 1.5, True, None]
        elif isinstance(value, float):
            bad += ["12", True]
        elif isinstance(value, str):
            bad += [7, 1.5, True] + ([] if path in NULLABLE else [None])
        else:  # null in a nullable field
            bad += ["12", True] if path.endswith("scale") else [7, True]
        return enc(set_at(record, path, draw(st.sampled_from(bad)))), {path}
    if how == "missing":
        choices = [(p, k) for p in ["", *(p for p, *_ in nodes)] if (kind := object_kind(record, p))
                   for k in REQUIRED[kind]]
        path, key = draw(st.sampled_from(choices))
        target = record if path == "" else next(v for p, _, _, v in nodes if p == path)
        del target[key]
        return enc(record), {f"{path}.{key}" if path else key}
    if how == "extra":
        path = draw(st.sampled_from(["", *(p for p, *_ in nodes if object_kind(record, p))]))
        key = draw(st.sampled_from(("extra", "note", "seq_lens", "Backend", "__class__", "zzz")))
        target = record if path == "" else next(v for p, _, _, v in nodes if p == path)
        target[key] = draw(st.sampled_from((1, "x", None, [], {})))
        return enc(record), {f"{path}.{key}" if path else key}
    if how in ("negative", "enormous", "huge_pool"):
        size = re.compile(r"(^|\.)(" + "|".join(SIZE_FIELDS) + r")$|\.block_table\[\d+\]$|^case\.(seq|amount)$"
                          r"|^case\.ops\[\d+\]\[1\]$|^case\.ops\[\d+\]\[2\]\[\d+\]$")
        choices = [p for p, v in leaves if size.search(p) and not is_scenario_extra(p, record)]
        if how == "huge_pool":  # under every per-field cap, over any machine's budget
            choices = [p for p in choices if p.rsplit(".", 1)[-1] in POOL_FIELDS and ".geometry." in p]
            path = draw(st.sampled_from(choices))
            fields = {path, path.rsplit(".", 1)[0]}
            if path.endswith(".num_kv_heads"):  # per-head scales no longer match the head count: also a refusal
                owner = path.rsplit(".geometry.", 1)[0]
                case = record["case"]["case"] if owner == "case.case" else record["case"]
                if sum(isinstance(case.get(k), list) for k in ("k_scale", "v_scale")) < 2:  # two agree: the count
                    fields |= {f"{owner}.{k}" for k in ("k_scale", "v_scale")}
            return enc(set_at(record, path, draw(st.integers(2**36, 2**40 - 1)))), fields
        path = draw(st.sampled_from(choices))
        value = draw(st.integers(-2**70, -1) if how == "negative" else st.integers(2**44, 2**70) | st.just(10**30))
        return enc(set_at(record, path, value)), {path}
    if how == "table":
        if record.get("kind") == "CacheScenario":
            i = draw(st.integers(0, len(record["case"]["ops"]) - 1))
            op = record["case"]["ops"][i]
            p = f"case.ops[{i}]"
            if draw(st.booleans()):
                op[0] = draw(st.sampled_from(("evict", "ADD", "", "fork2")))
                return enc(record), {f"{p}[0]"}
            op.extend([0, 0, 0])  # more items than any operation takes
            return enc(record), {p}
        case = record["case"]["case"] if c == "case.case" else record["case"]
        i = draw(st.integers(0, len(case["seqs"]) - 1))
        seq, p, g = case["seqs"][i], f"{c}.seqs[{i}]", case["geometry"]
        need = -(-seq["seq_len"] // g["block_size"])
        fault = draw(st.sampled_from(("short", "outside", "q_len", "start")))
        if fault == "short" and need >= 1:
            seq["block_table"] = seq["block_table"][:need - 1]
            return enc(record), {f"{p}.block_table", f"{p}.seq_len"}
        if fault == "outside" and seq["block_table"]:
            j = draw(st.integers(0, len(seq["block_table"]) - 1))
            seq["block_table"][j] = g["num_blocks"] + draw(st.integers(0, 3))
            return enc(record), {f"{p}.block_table[{j}]"}
        if fault == "start":
            seq["start"] = seq["seq_len"] + draw(st.integers(1, 5))
            return enc(record), {f"{p}.start"}
        seq["q_len"] = seq["seq_len"] + draw(st.integers(1, 5))
        return enc(record), {f"{p}.q_len"}
    if how == "name":
        names = [p for p, v in leaves if re.search(r"(\.dtype|\.values|\.poison|\.layout|\.table_dtype|^kind"
                                                   r"|^case\.op|^case\.fault)$", p)]
        path = draw(st.sampled_from(names))
        return enc(set_at(record, path, draw(st.sampled_from(("float64", "int8", "Case ", "", "nan ", "x"))))), {path}
    if how == "utf8":
        data = enc(record)
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.sampled_from((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80abc"))) + data[at:], \
            {"file"}
    if how == "nesting":
        path, _ = draw(st.sampled_from(leaves))
        depth = draw(st.integers(1, 40) | st.integers(17, 100_000))
        data = enc(set_at(record, path, "@@NEST@@")).replace(b'"@@NEST@@"', b"[" * depth + b"1" + b"]" * depth)
        return data, {path, "file"}
    if how == "oversized":
        record["error"] = "x" * (casefile.MAX_FILE_BYTES + draw(st.integers(1, 1000)))
        return enc(record), {"file"}
    if how == "control":
        key = draw(st.sampled_from(("title", "error", "backend", "id")))
        record[key] = "pwned " + draw(st.sampled_from(("\x1b[2J", "\x1b]0;x\x07", "\r", "\u202e", "\x00")))
        return enc(record), {key}
    if how == "version":
        record["version"] = draw(st.sampled_from((0, 2, 99, -1)))
        return enc(record), {"version"}
    key = draw(st.sampled_from(("backend", "other")))
    record[key] = draw(st.sampled_from(foreign_specs(root)))
    return enc(record), {key}


@pytest.mark.parametrize("how", HOWS)
@settings(SETTINGS, max_examples=max(1, SETTINGS.max_examples // 8))  # PAGEDKV_CASE_FILE_EXAMPLES raises it
@given(data=st.data())
def test_corrupted_case_files_are_refused_cleanly(sandbox, how, data):
    """Each kind of corruption, on committed and drawn records: exit 2 naming the field, no side effect."""
    blob, fields = data.draw(corrupted(sandbox, how), label=f"{how} corruption")
    replay_refuses(sandbox, blob, fields)


# -- the three files of issue 17 -------------------------------------------------------------------------
def issue_files(root: Path) -> dict[str, tuple[dict, str]]:
    base = record_of(
        Case(Geometry(8, 4, 1, 2), (SeqSpec((2, 3, 6), 9, 1, 5), SeqSpec((0, 1), 8, 1, 0))),
        GATHER)
    huge = json.loads(json.dumps(base))
    huge["case"]["geometry"].update(num_blocks=2**22, block_size=64, head_dim=4096)  # float32: 8 TiB of pools
    huge["case"]["seqs"] = [{"block_table": [0], "seq_len": 1, "q_len": 1, "start": 0}]
    string = json.loads(json.dumps(base))
    string["case"]["seqs"][0]["seq_len"] = "9"
    return {"foreign_backend": ({**base, "backend": f"{root / MARKER}.py:backend"}, "backend"),
            "huge_geometry": (huge, "case.geometry"),
            "string_seq_len": (string, "case.seqs[0].seq_len")}


@pytest.mark.parametrize("name", ["foreign_backend", "huge_geometry", "string_seq_len"])
def test_the_issue_files_exit_2_naming_the_field(sandbox, name):
    record, field = issue_files(sandbox)[name]
    line = replay_refuses(sandbox, json.dumps(record).encode(), {field})
    if name == "foreign_backend":
        assert repr(record["backend"]) in line and f"--impl {record['backend']}" in line
    if name == "huge_geometry":  # the estimate names the 8 TiB of pools before anything is allocated
        assert "8.0 TiB" in line and "--max-bytes" in line
    if name == "string_seq_len":
        assert "expected an integer, got '9' (string)" in line


def test_the_cli_refuses_a_foreign_backend_in_a_fresh_process(sandbox):
    record, _ = issue_files(sandbox)["foreign_backend"]
    record["backend"] = f"{MARKER}:backend"  # importable from the cwd, where replay runs
    path = sandbox / "foreign.json"
    path.write_text(json.dumps(record))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(path)], cwd=sandbox, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "backend: the case file names backend 'pkv_case_file_marker:backend'" in proc.stdout
    assert f"--impl {MARKER}:backend" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    assert not (sandbox / f"{MARKER}.ran").exists()


def test_an_explicit_impl_runs_what_the_file_could_not_name(sandbox):
    record, _ = issue_files(sandbox)["foreign_backend"]
    path = sandbox / "named.json"
    path.write_text(json.dumps({**record, "backend": "indexed", "other": f"{MARKER}:backend",
                                "check": AGREE}))
    assert replay_refuses(sandbox, path.read_bytes(), {"other"}).endswith(f"--other {MARKER}:backend explicitly")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["replay", str(path), "--other", "loop"]) == 0, out.getvalue()
    assert "PASSES: backends_agree" in out.getvalue()


# -- valid files stay valid --------------------------------------------------------------------------------
@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_every_committed_regression_file_passes_the_check(path):
    record = casefile.load_case_file(path)
    raw = json.loads(path.read_text())
    kinds = {"Case": Case, "CacheScenario": CacheScenario, "InvalidCall": InvalidCall}
    assert record["case"] == kinds[raw.get("kind", "Case")].from_dict(raw["case"])
    assert record["version"] == 1 and record["backend"] == raw["backend"]


@SETTINGS
@given(drawn_records)
def test_records_drawn_from_the_suites_strategies_are_accepted(record):
    out = schema.validate_record(record)
    assert json.loads(json.dumps(casefile.build_case(out).to_dict())) == record["case"]


def test_a_file_without_version_is_version_1_and_a_newer_one_is_refused(tmp_path):
    record = json.loads(REGRESSIONS[0].read_text())
    record.pop("version", None)
    assert schema.validate_record(record)["version"] == 1
    with pytest.raises(CaseFileError, match=r"^version: format version 2 is newer") as info:
        schema.validate_record({**record, "version": 2})
    assert info.value.field == "version" and isinstance(info.value, (PagedKVError, ValueError))


def test_save_failure_writes_version_1_and_load_failure_checks_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(tmp_path))
    path = writing.save_failure(GATHER, "pagedkv.tools.mutants:gqa_modulo",
                               Case(Geometry(4, 2), (SeqSpec((0, 1), 3),)))
    assert json.loads(path.read_text())["version"] == 1
    assert casefile.load_case_file(path)["backend"] == "pagedkv.tools.mutants:gqa_modulo"
    path.write_text(path.read_text().replace('"seq_len": 3', '"seq_len": -3'))
    with pytest.raises(CaseFileError) as info:
        casefile.load_case_file(path)
    assert info.value.field == "case.seqs[0].seq_len"


def test_the_memory_budget_is_a_quarter_of_memory_and_max_bytes_moves_it(sandbox):
    total = schema.physical_memory_bytes()
    assert total is None or schema.default_max_bytes() == total // 4
    c10 = next(p for p in REGRESSIONS if p.name.startswith("c10_") and "gather" in p.name)
    pools, estimate = schema.estimate_bytes(schema.validate_record(json.loads(c10.read_text())))
    assert pools == 2 * 1048578 * 16 * 1 * 1 * 2 and estimate >= schema.POOL_COPIES * pools
    line = replay_refuses(sandbox, c10.read_bytes(), {"case.geometry"}, "--max-bytes", "64M")
    assert "64.0 MiB" in line
    assert schema.validate_record(json.loads(c10.read_text()), max_bytes=estimate)["case"]
    assert schema.parse_bytes("8GiB") == 8 << 30 and schema.parse_bytes("1.5K") == 1536
    with pytest.raises(SystemExit) as info, contextlib.redirect_stderr(io.StringIO()):
        cli.main(["replay", str(c10), "--max-bytes", "lots"])
    assert info.value.code == 2


# -- the trust rule ---------------------------------------------------------------------------------------
def test_only_built_in_shipped_mutant_and_shipped_peer_backends_are_trusted(sandbox):
    from pagedkv.backends import BUILTIN
    from pagedkv.tools.mutants.backends import MUTANTS
    from pagedkv.tools.peers import PEERS

    for name in BUILTIN:
        assert casefile.canonical_backend_spec(name) == name
    for name in MUTANTS:
        assert casefile.canonical_backend_spec(name) == f"pagedkv.tools.mutants:{name}"
        assert casefile.trusted_backend_spec(f"pagedkv.tools.mutants:{name}")
    for name in PEERS:
        assert casefile.canonical_backend_spec(name) == f"pagedkv.tools.peers:{name}"
    for spec in [*foreign_specs(sandbox), None, 3, ["indexed"]]:
        assert not casefile.trusted_backend_spec(spec), spec


def test_a_runner_with_its_own_backend_ignores_an_untrusted_recorded_one():
    record = schema.validate_record({**json.loads(REGRESSIONS[0].read_text()), "backend": "mypkg.kv:backend"})
    with pytest.raises(CaseFileError, match="--impl mypkg.kv:backend"):
        casefile.require_trusted_backends(record)
    out = casefile.require_trusted_backends(record, check_backend=False)
    assert out["backend"] is None and out["recorded_backend"] == "mypkg.kv:backend"
    with pytest.raises(CaseFileError, match="^other: "):  # the second backend is loaded from the file: checked
        casefile.require_trusted_backends({**record, "other": "mypkg.kv:other"}, check_backend=False)


def test_the_schema_matches_the_dataclasses_and_the_librarys_names():
    from pagedkv.backends import BUILTIN
    from pagedkv.cache.config import DTYPES
    from pagedkv.testing.cases import case as cases, invalid_call as invalid

    fields = lambda cls: tuple(f.name for f in dataclasses.fields(cls))  # noqa: E731
    assert fields(Case) == REQUIRED["Case"] + OPTIONAL_CASE == schema._CASE_KEYS
    assert tuple(cases.KV_CACHE_DTYPES) == schema.KV_CACHE_DTYPES
    assert fields(Geometry) == REQUIRED["Geometry"] + OPTIONAL_GEOMETRY == schema._GEOMETRY_KEYS
    assert fields(SeqSpec) == REQUIRED["SeqSpec"] == schema._SEQ_KEYS
    assert set(fields(CacheScenario)) == set(schema._SCENARIO_KEYS) >= set(REQUIRED["CacheScenario"])
    assert fields(InvalidCall) == REQUIRED["InvalidCall"] == schema._INVALID_KEYS
    assert set(DTYPES) == set(schema.DTYPE_BYTES)
    assert all(torch.empty(0, dtype=DTYPES[n]).element_size() == b for n, b in schema.DTYPE_BYTES.items())
    assert cases.VALUE_PATTERNS == schema.VALUE_PATTERNS and cases.POISONS == schema.POISONS
    assert cases.ALL_LAYOUTS == schema.ALL_LAYOUTS and tuple(BUILTIN) == casefile.BUILTIN_BACKENDS
    assert invalid.OPS == schema.INVALID_OPS


def test_a_corrupted_head_count_is_refused_at_the_geometry_when_both_scale_lists_disagree_with_it():
    from pagedkv.errors import CaseFileError
    from pagedkv.testing.casefiles.schema import validate_record

    record = json.loads(next(p for p in REGRESSIONS if json.loads(p.read_text()).get("kind", "Case") == "Case")
                        .read_text())
    case = record["case"]
    heads = case["geometry"]["num_kv_heads"]
    case.update(kv_cache_dtype="fp8_e4m3", k_scale=[0.5] * heads, v_scale=[0.25] * heads)
    validate_record(record)
    case["geometry"]["num_kv_heads"] = heads + 1
    with pytest.raises(CaseFileError) as refused:
        validate_record(record)
    assert refused.value.field == "case.geometry.num_kv_heads", str(refused.value)
    case["v_scale"] = 0.25  # one list left: it is the scales that do not fit
    with pytest.raises(CaseFileError) as refused:
        validate_record(record)
    assert refused.value.field == "case.k_scale", str(refused.value)


def test_two_long_test_ids_never_share_a_case_file(tmp_path, monkeypatch):
    # Fails before names carried a hash of the full id: both were cut to the same 150 characters, and the
    # passing test's cleanup deleted the failing test's case file.
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(tmp_path))
    head = "site-packages/pagedkv/testing/suite/test_regressions.py::test_regression_case_replays_clean[" + "x" * 80
    ids = [head + "alone_in_batch_decode_65_tokens]", head + "alone_in_batch_prefill_9_tokens]",
           "suite/test_a.py::test[a b]", "suite/test_a.py::test[a/b]"]
    paths = [writing.case_file_path(i) for i in ids]
    assert len(set(paths)) == len(ids), paths
    assert all(len(p.name) <= 150 + len(".json") and p.parent == tmp_path for p in paths)
    assert writing.case_file_path(ids[0]) == paths[0]  # stable: the replay line and the cleanup find it
    assert writing.safe_name("test_plain-name.1") == "test_plain-name.1"
