"""Case files round trip, and ``python -m pagedkv replay`` reruns one and shows where it fails."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.testing.casefiles import reading as casefile, writing
from pagedkv.testing.cases.case import CacheScenario, Case, Geometry, SeqSpec
from pagedkv.cli.replay import block_table_map, replay

# the properties these tests' case files name
GATHER = "gather_returns_exactly_what_each_slot_holds"
SCATTER = "scatter_then_gather_round_trips_and_touches_no_other_slot"
WRITE_KV = "write_kv_lands_at_slot_mapping_and_skips_negative_slots"
ATTENTION = "paged_attention_matches_fp64_dense_reference"
SHARING = "every_live_sequence_reads_only_its_own_tokens"
PREFIX_CACHING = "prefix_caching_changes_no_output"
GATHER_REJECTS = "gather_rejects_bad_arguments_and_writes_nothing"

ROOT = Path(__file__).resolve().parents[2]
CASE = Case(Geometry(8, 4, 1, 2), (SeqSpec((2, 3, 6), 9, 1, 5), SeqSpec((0, 1), 8, 1, 0)), values="identity",
            poison="inf", pad_columns=1, table_dtype="int64", layout="kv_interleaved", scale=0.5, seed=7)
SCENARIO = CacheScenario(Geometry(8, 4, 1, 4), (("add", 0, (1, 2, 3, 4, 5, 6)), ("fork", 0, 1),
                                               ("append", 0, (7, 7, 7)), ("append", 1, (9, 9, 9))), seed=3)


@pytest.fixture(autouse=True)
def _failures_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(tmp_path / "failures"))


@pytest.mark.parametrize("case", [CASE, SCENARIO], ids=["case", "scenario"])
def test_a_case_file_round_trips(case):
    check = SHARING if isinstance(case, CacheScenario) else GATHER
    path = writing.save_failure(check, "pagedkv.tools.mutants:gqa_modulo", case,
                               test_id="tests/x.py::test_y[z]", error="boom\nsecond line")
    record = casefile.load_case_file(path)
    assert record["case"] == case and type(record["case"]) is type(case)
    assert record["backend"] == "pagedkv.tools.mutants:gqa_modulo" and record["error"] == "boom"
    assert json.loads(path.read_text())["kind"] == type(case).__name__
    assert eval(repr(case), {"Case": Case, "Geometry": Geometry, "SeqSpec": SeqSpec,
                             "CacheScenario": CacheScenario}) == case


def _run(path, *args):
    out = io.StringIO()
    return replay(path, out=out, **dict(args)), out.getvalue()


def test_a_passing_case_exits_0_and_says_so():
    path = writing.save_failure(SCATTER, "indexed", CASE)
    code, out = _run(path)
    assert code == 0 and "PASSES: scatter_then_gather_round_trips_and_touches_no_other_slot on indexed (cpu)" in out


def test_a_planted_fault_exits_1_with_the_slot_and_a_marked_map():
    path = writing.save_failure(SCATTER, "pagedkv.tools.mutants:scatter_drops_start_offset",
                               CASE.replace(poison="nan", layout="contiguous"))
    code, out = _run(path)
    assert code == 1 and "FAILS: scatter_then_gather_round_trips_and_touches_no_other_slot" in out
    assert "sequence:         0" in out and "logical position: 4" in out
    assert "physical block:   3" in out and "slot:             12   (= 3 * 4 + 0)" in out
    assert "expected:         [5, 5, ...]" in out and "actual:" in out
    assert "  seq 0 | [2 ] [3*] [6 ]" in out and "  seq 1 | [0 ] [1 ]" in out
    assert "  block 3: | x . . . |   (x = offset 0)" in out


def test_impl_overrides_the_recorded_backend():
    path = writing.save_failure(SCATTER, "pagedkv.tools.mutants:scatter_drops_start_offset", CASE)
    assert _run(path, ("impl", "loop"))[0] == 0
    code, out = _run(path, ("impl", "pagedkv.tools.mutants:scatter_clobbers_block"))
    assert code == 1 and "pagedkv.tools.mutants:scatter_clobbers_block" in out


def test_a_sharing_failure_maps_the_live_tables_at_the_failing_step():
    path = writing.save_failure(SHARING, "pagedkv.tools.mutants:no_copy_on_write", SCENARIO)
    code, out = _run(path)
    assert code == 1 and "hands out slot 6 (position 6) in block 1" in out
    # the tables as they were when the append failed (block 2 already added to sequence 0); both still
    # share block 1, the partial block forked mid-way (no copy-on-write): the other entry shows "="
    assert "seq 0 | [0 ] [1*] [2 ]" in out and "seq 1 | [0 ] [1=]" in out
    assert "block 1: | . . x . |" in out


def test_a_missing_op_is_reported_as_skipped(tmp_path):
    (tmp_path / "gather_only.py").write_text(
        "from pagedkv.backends import indexed\nname = 'gather_only'\ngather = indexed.gather\n")
    path = writing.save_failure(WRITE_KV, str(tmp_path / "gather_only.py"), CASE)
    code, out = _run(path, ("impl", str(tmp_path / "gather_only.py")))  # a file's own spec runs only when named
    assert code == 0 and "SKIPPED" in out and "write_kv" in out


def test_an_unreadable_file_exits_2(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    assert _run(tmp_path / "bad.json")[0] == 2
    assert _run(tmp_path / "missing.json")[0] == 2


def test_the_map_marks_an_unowned_slot_and_cuts_long_rows():
    text = block_table_map({0: [1, 2], 1: [4]}, 4, block=7, offset=2)
    assert "block 7 is in no sequence's table" in text and "x = offset 2" in text
    text = block_table_map({0: list(range(100))}, 2, seq=0, position=150)
    assert "[75*]" in text and text.count("...") == 2


def test_the_cli_runs_as_a_module(tmp_path):
    path = writing.save_failure(GATHER, "pagedkv.tools.mutants:off_by_one_last_block", CASE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(path), "--device", "cpu"], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "first mismatch:" in proc.stdout and "block tables (block_size 4" in proc.stdout
    help_text = subprocess.run([sys.executable, "-m", "pagedkv", "replay", "--help"], env=env, capture_output=True,
                               text=True).stdout
    assert "--impl" in help_text and "--device" in help_text


def test_an_invalid_call_accepted_without_checks_replays_as_a_failure(tmp_path, monkeypatch):
    (tmp_path / "unchecked_backend.py").write_text(
        "from pagedkv.backends import loop\n"
        "name = 'unchecked'\n"
        "def gather(cache, block_table, seq_len):\n"
        "    return loop.gather(cache, block_table, seq_len, validate=False)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from pagedkv.testing.cases.invalid_call import InvalidCall

    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(tmp_path))
    call = InvalidCall("gather", "block_id_negative", Case(Geometry(3, 2), (SeqSpec((0, 1, 2), 5),)))
    path = writing.save_failure(GATHER_REJECTS, "unchecked_backend", call, test_id="invalid", error="")
    assert path.parent == tmp_path
    out = io.StringIO()
    assert replay(path, out=out) == 2 and "--impl unchecked_backend" in out.getvalue()  # not on the file's word
    out = io.StringIO()
    assert replay(path, impl="unchecked_backend", out=out) == 1
    text = out.getvalue()
    assert "raised nothing; the contract requires IndexError" in text and "seq 0 |" in text
    assert replay(path, impl="loop", out=io.StringIO()) == 0  # the real backend refuses it


SLOPPY_GATHER = ("from pagedkv.backends import indexed\n"
                 "name = 'sloppy_gather'\n"
                 "write_kv, paged_attention = indexed.write_kv, indexed.paged_attention\n"
                 "def gather(cache, block_table, seq_len, validate=True):\n"
                 "    out = indexed.gather(cache, block_table, seq_len, validate)\n"
                 "    if seq_len > 6:\n"
                 "        out[6] = 0.0\n"
                 "    return out\n")


def test_a_scenario_read_that_differs_prints_expected_and_actual_kv(tmp_path):
    (tmp_path / "sloppy_gather.py").write_text(SLOPPY_GATHER)
    path = writing.save_failure(SHARING, "indexed", SCENARIO)
    code, out = _run(path, ("impl", str(tmp_path / "sloppy_gather.py")))
    assert code == 1
    assert "sequence:         0" in out and "logical position: 6" in out
    expected = next(line for line in out.splitlines() if line.startswith("  expected:"))
    actual = next(line for line in out.splitlines() if line.startswith("  actual:"))
    assert "K [" in expected and "V [" in expected and "K [0, 0, 0, 0, ...]  V [0, 0, 0, 0, ...]" in actual
    assert "* = first bad block" in out and "*]" in out  # the marker the legend promises is drawn


SLOPPY_HND_GATHER = ("from pagedkv.backends import indexed\n"
                     "from pagedkv.adapter import Capabilities\n"
                     "name = 'sloppy_hnd_gather'\n"
                     "capabilities = Capabilities(layout='HND')\n"
                     "def _nhd(pool):  # [num_blocks, num_kv_heads, block_size, head_dim] seen as the contract's\n"
                     "    return pool.transpose(1, 2)\n"
                     "def write_kv(k_cache, v_cache, key, value, slot_mapping, **options):\n"
                     "    return indexed.write_kv(_nhd(k_cache), _nhd(v_cache), key, value, slot_mapping, **options)\n"
                     "def paged_attention(query, k_cache, v_cache, *args, **options):\n"
                     "    return indexed.paged_attention(query, _nhd(k_cache), _nhd(v_cache), *args, **options)\n"
                     "def gather(cache, block_table, seq_len, validate=True):\n"
                     "    out = indexed.gather(_nhd(cache), block_table, seq_len, validate)\n"
                     "    if seq_len > 6:\n"
                     "        out[6] = 0.0\n"
                     "    return out\n")


def test_a_head_major_kernels_differing_read_is_located_in_its_own_layout(tmp_path):
    """The read replay adds to a scenario's mismatch goes through the layout the kernel declares, as every call of
    the run does. Fails before: its gather got the NHD view and refused it ("... needs 5 blocks of block_size
    1"), which replay printed in place of the differing K/V."""
    (tmp_path / "sloppy_hnd_gather.py").write_text(SLOPPY_HND_GATHER)
    path = writing.save_failure(SHARING, "indexed", SCENARIO)
    code, out = _run(path, ("impl", str(tmp_path / "sloppy_hnd_gather.py")))
    assert code == 1 and "block_size 1" not in out
    assert "sequence:         0" in out and "logical position: 6" in out
    assert "K [0, 0, 0, 0, ...]  V [0, 0, 0, 0, ...]" in next(line for line in out.splitlines()
                                                            if line.startswith("  actual:"))


def test_an_attention_failure_prints_the_first_differing_rows_and_no_false_marker():
    case = Case(Geometry(8, 4, 2, 4, 2), (SeqSpec((2, 3, 6), 9, 3, 0), SeqSpec((0, 1), 8, 1, 0)), seed=7)
    path = writing.save_failure(ATTENTION, "pagedkv.tools.mutants:gqa_modulo", case)
    code, out = _run(path)
    assert code == 1 and "compare the outputs above" not in out
    rows = [line for line in out.splitlines() if line.startswith("  attention of sequence")]
    assert len(rows) <= 3 and all("expected [" in r and "actual [" in r for r in rows)
    assert rows or ("  expected:" in out and "  actual:" in out)  # located by replay, or by the check itself
    assert ("* = the failing query's block" in out) == ("*]" in out)  # the legend promises only the marker it draws


def test_the_legend_names_only_markers_it_draws():
    text = block_table_map({0: [1, 2], 1: [4]}, 4, seq=1)
    assert "*" not in text and "< = the failing sequence" in text and "seq 1 | [4 ]   < the failing sequence" in text
    text = block_table_map({0: [1, 2], 1: [2]}, 4, seq=0, position=5)
    assert "* = first bad block" in text and "[2*]" in text and "= = the same block in another table" in text


def test_a_scenario_failure_shows_the_tables_live_when_it_failed():
    path = writing.save_failure(PREFIX_CACHING, "pagedkv.tools.mutants:no_copy_on_write", SCENARIO)
    code, out = _run(path)
    assert code == 1 and "(none live)" not in out
    assert "seq 0 | [0 ] [1" in out and "seq 1 | [0 ] [1" in out


def test_an_unlocated_mismatch_gets_the_first_differences_from_the_backend():
    from pagedkv.cli.replay import _report_where
    from pagedkv.tools import mutants

    case = Case(Geometry(8, 4, 2, 4, 2), (SeqSpec((2, 3, 6), 9, 3, 0), SeqSpec((0, 1), 8, 1, 0)), seed=7)
    out = io.StringIO()
    _report_where({}, case, {}, out, backend=mutants.MUTANTS["gqa_modulo"](), device="cpu")
    text = out.getvalue()
    rows = [line for line in text.splitlines() if line.startswith("  attention of sequence")]
    assert 1 <= len(rows) <= 3 and all("expected [" in r and "actual [" in r for r in rows)
    assert "*" not in text  # nothing located at one block: no marker, and no legend promising one
    out = io.StringIO()
    _report_where({}, case, {}, out, backend=mutants.MUTANTS["off_by_one_last_block"](), device="cpu")
    assert "gather of sequence 1, position 4: expected" in out.getvalue() and "seq 1 | [0 ] [1*]" in out.getvalue()


@pytest.mark.parametrize("ending, verdict", [
    ("import ctypes\n    ctypes.string_at(0)", "CRASHED: the backend's process died of SIGSEGV"),
    # exit status 0 from the backend itself: before, the child's 0 was taken for "the case passes"
    ("import os\n    os._exit(0)", "CRASHED: the backend's process ended (exit status 0) before the case was judged"),
], ids=["segfault", "os._exit(0)"])
def test_a_case_whose_run_crashed_replays_in_a_child_and_reports_the_crash(tmp_path, ending, verdict):
    import os
    import subprocess
    import sys

    (tmp_path / "segv_kv.py").write_text(f"name = 'segv_kv'\n\n"
                                         f"def gather(cache, block_table, seq_len):\n    {ending}\n")
    path = writing.save_failure(GATHER, "segv_kv", CASE, outcome="running",
                                path=tmp_path / "crashed.json")
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(path), "--impl", "segv_kv"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and verdict in proc.stdout, proc.stdout


def test_a_tail_read_marks_the_unused_slots_it_read_not_the_querys_slot():
    """A decode kernel that attends to whole blocks reads the unused tail of sequence 0's last block
    (block 3, offsets 2 and 3): the map marks those slots ``r`` (refilling them changes the output), the
    query's own slot ``q``; sequence 1 fills its blocks and has no tail to read."""
    case = Case(Geometry(8, 4, 1, 4), (SeqSpec((2, 3), 6, 1), SeqSpec((0, 1), 8, 1)), poison="nan")
    path = writing.save_failure(ATTENTION, "pagedkv.tools.mutants:tail_unmasked", case)
    code, out = _run(path)
    assert code == 1, out
    assert "unused slots read: block 3 offsets 2..3" in out, out
    assert "  block 3: | . q r r |" in out and "r = an unused slot the kernel read" in out, out
    assert "| x" not in out and " x " not in out.split("block tables")[-1]  # no slot claimed wrong that is not
    assert "  seq 1 | [0 ] [1 ]" in out  # nothing read there: unmarked


def test_a_kernel_that_masks_its_tail_has_no_read_marks():
    from pagedkv.backends import get_backend
    from pagedkv.cli.replay.reads import unused_slots_read, unused_tails

    case = Case(Geometry(8, 4, 1, 4), (SeqSpec((2, 3), 6, 1), SeqSpec((0, 1), 8, 1)), poison="nan")
    assert unused_tails(case) == {3: [2, 3]}
    assert unused_slots_read(get_backend("indexed"), case) == {}


def _recorded_failure(tmp_path, spec: str, **extra):
    """A case file as a failing gate run writes it (outcome failed, a history), for a case that passes now."""
    return writing.save_failure(SCATTER, spec, CASE, outcome="failed", error="recorded", path=tmp_path / "f.json",
                                extra={"history": [], "calls_before": 0, "history_calls": 0, **extra})


def test_impl_naming_the_recorded_backend_is_the_recorded_backend(tmp_path):
    # the gate prints --impl SPEC for a user's kernel: a failure of it that does not come back is no pass
    path = _recorded_failure(tmp_path, "indexed")
    for impl in (None, "indexed"):
        code, out = _run(path, ("impl", impl))
        assert code == 3 and "PASSES" not in out and "did not reproduce" in out, out
    code, out = _run(path, ("impl", "loop"))  # another backend: judged as itself
    assert code == 0 and "PASSES" in out and "is not the recorded backend 'indexed'" in out, out


def test_confirm_fix_judges_a_changed_kernel_on_the_case_alone(tmp_path):
    path = _recorded_failure(tmp_path, "indexed", history=[{"check": SCATTER, "kind": "Case", "case": CASE.to_dict()}],
                             calls_before=9, history_calls=3)
    code, out = _run(path, ("impl", "indexed"), ("confirm_fix", True))
    assert code == 0 and f"PASSES: {SCATTER} on indexed" in out and "earlier case" not in out, out


def test_an_incomplete_history_is_repeated_up_to_the_recorded_call_count_and_said(tmp_path):
    entry = {"check": SCATTER, "kind": "Case", "case": CASE.to_dict()}
    path = _recorded_failure(tmp_path, "indexed", history=[entry], calls_before=40, history_calls=4)
    code, out = _run(path)
    assert code == 3, out
    assert "repeating them for the 36 before" in out and "history is incomplete" in out, out


def test_a_failure_that_comes_back_alone_never_reruns_its_history(tmp_path):
    # Fails before the case ran alone first: replay repeated the history up to the recorded call count
    # (MAX_PADDING_CALLS calls of it here; a large-pool history ran past the JSON verdict's 300 s).
    entry = {"check": SCATTER, "kind": "Case", "case": CASE.to_dict()}
    path = _recorded_failure(tmp_path, "pagedkv.tools.mutants:scatter_drops_start_offset", history=[entry] * 16,
                             calls_before=10**9, history_calls=16)
    code, out = _run(path)
    assert code == 1 and f"FAILS: {SCATTER}" in out, out
    assert "the case alone first" in out and "earlier case" not in out and "repeating" not in out, out


def test_a_failure_that_passes_alone_is_rerun_after_its_history_in_a_fresh_process(tmp_path):
    entry = {"check": SCATTER, "kind": "Case", "case": CASE.to_dict()}
    path = _recorded_failure(tmp_path, "indexed", history=[entry], calls_before=3, history_calls=3)
    code, out = _run(path)
    assert code == 3 and "passes alone: rerunning it after the earlier calls" in out, out
    assert "rerunning the 1 earlier case(s)" in out and "did not reproduce" in out, out


def test_a_replay_process_that_ends_before_judging_is_not_taken_for_a_pass():
    """The fresh process of a replay after its history (and of an isolated replay) reads exit status 0 as
    "passes"; a backend calling ``os._exit(0)`` gives 0 too. Only a child that wrote its status judged."""
    import sys

    from pagedkv.cli.replay.child import run_judged

    ended, judged = run_judged([sys.executable, "-c", "import os; os._exit(0)"])
    assert ended.returncode == 0 and not judged
    done = "from pagedkv.cli.replay.child import report_done; import sys; sys.exit(report_done(0))"
    ended, judged = run_judged([sys.executable, "-c", done])
    assert ended.returncode == 0 and judged
    failed, judged = run_judged([sys.executable, "-c", "import os; os._exit(1)"])
    assert failed.returncode == 1 and judged  # a failure is a failure, reported or not


def test_the_top_level_help_names_specs_that_load():
    """``python -m pagedkv --help`` names what ``--impl`` and ``--pagedkv-impl`` can point at; every kernel and
    manager it names loads here (the engine peers where their engine is installed)."""
    import re

    from pagedkv.backends import load_backend
    from pagedkv.cli import build_parser
    from pagedkv.errors import BackendUnavailableError

    text = build_parser().format_help()
    kernels = re.search(r"kernels\s+(.*?) \(pagedkv's own\)", text).group(1).split(", ")
    assert kernels == ["loop", "indexed", "triton"], text
    specs = [s for line in text.splitlines() if line.strip().startswith(("managers", "engine peers"))
             for s in re.findall(r"pagedkv\.[\w.]+(?::\w+)?", line)]
    assert len(specs) == 4, text
    for spec in [*kernels, *specs]:
        try:
            assert load_backend(spec) is not None, spec
        except BackendUnavailableError:  # an engine peer without its engine, or triton without Triton
            assert spec == "triton" or spec.startswith("pagedkv.tools.peers:"), spec
