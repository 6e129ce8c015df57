"""The paths around the gate honour a candidate's declared layout and page table: the drift comparison,
``replay --other``, ``bench --impls``, and the ``page_table`` declaration itself."""

from __future__ import annotations

import io
import os
import sys

import pytest

from pagedkv.backends import indexed
from pagedkv.backends.capabilities import Capabilities, Sizes, capabilities_of
from pagedkv.tools.baseline.drift import measure
from pagedkv.testing.cases.case import Case, Geometry, SeqSpec

sys.path.insert(0, os.path.dirname(__file__))
from declarable import PACKED_PAIR, honest  # noqa: E402

HALF_HND_CSR = Capabilities(layout="HND", page_table="csr", dtypes={"float16", "bfloat16"},
                            block_sizes=Sizes(values={1, 16}), head_dims=Sizes(values={64, 128}))
CASE = Case(Geometry(6, 16, 2, 64, 2, "float16"), (SeqSpec((0, 1), 17, 1), SeqSpec((2, 3, 4), 40, 7)), seed=5)


@pytest.mark.parametrize("caps", [HALF_HND_CSR, Capabilities(layout=PACKED_PAIR, page_table="csr")],
                         ids=["hnd-csr", "copy-pair-keys-csr"])
def test_drift_builds_each_sides_pools_in_its_own_layout(caps):
    """A head-major CSR candidate against the NHD padded reference it wraps: no divergence, no ulp."""
    candidate = honest("declared", caps, ("write_kv", "paged_attention"))
    drift = measure(candidate, indexed, CASE)
    assert drift.compared == ["write_kv", "paged_attention"] and not drift.diverged and drift.ulp == 0, drift
    assert not measure(indexed, candidate, CASE).diverged


def test_replay_other_outside_the_baselines_space_is_not_compared(tmp_path, monkeypatch):
    from pagedkv.cli.replay.drift import drift_against

    module = tmp_path / "half_hnd.py"
    module.write_text("from declarable import honest\n"
                      "from pagedkv.backends.capabilities import Capabilities\n"
                      "backend = honest('half_hnd', Capabilities(layout='HND', dtypes={'float16'}), "
                      "('write_kv', 'paged_attention'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    record = {"case": CASE.replace(geometry=Geometry(6, 16, 2, 64, 2, "float32")),
              "check": "paged_attention_matches_fp64_dense_reference"}
    out = io.StringIO()
    assert drift_against(indexed, "indexed", record, "half_hnd:backend", "cpu", out) == 0
    assert "not compared" in out.getvalue() and "dtype float32" in out.getvalue(), out.getvalue()


def test_a_page_table_attribute_beside_capabilities_that_disagrees_is_refused():
    class Both:
        capabilities = Capabilities(layout="HND")
        page_table = "csr"

    with pytest.raises(ValueError, match=r'Capabilities\(page_table="csr"\)'):
        capabilities_of(Both())

    class Attribute:  # no capabilities: the attribute is the declaration
        page_table = "csr"

    assert capabilities_of(Attribute()).page_table == "csr"


@pytest.mark.parametrize("layout", ["HND", "PACKED_PAIR"])
def test_bench_times_a_candidate_in_its_declared_layout_and_page_table(layout, tmp_path, monkeypatch):
    """The honest candidates refuse storage and tables they did not declare: no failed row, every op timed."""
    from pagedkv import cli
    from pagedkv.cli.bench.report import load_rows

    (tmp_path / "declared_bench.py").write_text(
        "from declarable import PACKED_PAIR, honest\n"
        "from pagedkv.backends.capabilities import Capabilities, Sizes\n"
        f"backend = honest('declared', Capabilities(layout={layout if layout == 'PACKED_PAIR' else repr(layout)}, "
        "page_table='csr', block_sizes=Sizes(values={16}), dtypes={'float16'}), "
        "('gather', 'scatter', 'write_kv', 'paged_attention'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    assert cli.main(["bench", "--device", "cpu", "--seq-lens", "40", "--block-sizes", "16", "--presets", "2x64",
                     "--dtypes", "float16", "--min-time", "0.001", "--rounds", "1", "--malloc", "system", "--no-plot",
                     "--impls", "declared_bench:backend", "--out-dir", str(tmp_path), "--name", "d"]) == 0
    rows = [r for r in load_rows(tmp_path / "d.json") if r.impl == "declared_bench:backend"]
    assert sorted(r.op for r in rows if r.time_s and not r.note) == ["attention", "gather", "scatter", "write_kv"], \
        [r.note for r in rows]


@pytest.mark.parametrize("layout", ["HND", "slots_last"])
def test_a_head_strided_sub_view_reaches_a_view_layout_as_its_storage(layout):
    """K and V as sub-views of one wider pool (head stride ``2 * head_dim + 1``) in a permuting view layout
    reach the backend as strided views of the kit's storage, not as copies: a ``value`` that is a view into
    ``v_cache`` still overlaps what the backend is handed, and the honest candidate rejects it."""
    from declarable import SLOTS_LAST

    from pagedkv.testing import execute
    from pagedkv.testing.cases.invalid_call import InvalidCall
    from pagedkv.testing.registry import properties

    caps = Capabilities(layout="HND" if layout == "HND" else SLOTS_LAST)
    candidate = honest("strided", caps, ("write_kv", "paged_attention"))
    case = CASE.replace(geometry=Geometry(6, 16, 2, 64, 2, "float32"), layout="head_strided")
    prop = properties()["write_kv_rejects_bad_arguments_and_writes_nothing"]
    outcome = execute.run_case(prop, (candidate,), InvalidCall("write_kv", "value_overlaps_pool", case, 0))
    assert outcome.status == "passed", outcome.first_line
    attention = properties()["paged_attention_matches_fp64_dense_reference"]
    assert execute.run_case(attention, (candidate,), case).status == "passed"
