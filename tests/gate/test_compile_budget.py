"""The compile budget: a seeded palette of kernel specialisations per run (boundaries always in it), the
strategies drawing only from it, the count of what a run needed, and the plan's lease schedule."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.backends.capabilities import SPECIALIZATION_NAMES, Capabilities, Sizes, capabilities_of
from pagedkv.testing import specialisations
from pagedkv.tools.plan import _schedule
from pagedkv.testing.strategies.batches import cases
from pagedkv.testing.strategies.geometry import UNIVERSE, run_palette
from pagedkv.testing.strategies.palette import build_palette

TRITON_LIKE = Capabilities(features=frozenset({"window", "softcap", "alibi", "sinks", "fp8"}),
                           specialize_on=SPECIALIZATION_NAMES)


def test_the_ci_palette_is_fixed_holds_the_boundaries_and_stays_within_150_attention_specialisations():
    a = build_palette(SPECIALIZATION_NAMES, TRITON_LIKE, "ci", 0, UNIVERSE)
    assert a == build_palette(SPECIALIZATION_NAMES, TRITON_LIKE, "ci", 0, UNIVERSE)
    assert a.bound <= 150
    smallest, largest = a.shapes[0], a.shapes[1]
    assert (smallest["block_size"], smallest["head_dim"], smallest["gqa_group"]) == (1, 1, 1)
    assert (largest["block_size"], largest["head_dim"], largest["gqa_group"]) == (544, 576, 71)
    assert {s["dtype"] for s in a.shapes} == {"float32", "float16", "bfloat16"}
    features = sorted(TRITON_LIKE.features)
    assert frozenset() in a.feature_sets and frozenset(features) in a.feature_sets
    assert all(frozenset({f}) in a.feature_sets for f in features)


def test_the_nightly_palette_rotates_with_the_seed_and_keeps_the_boundaries():
    days = [build_palette(SPECIALIZATION_NAMES, TRITON_LIKE, "nightly", seed, UNIVERSE) for seed in (1, 2)]
    assert days[0].shapes != days[1].shapes
    assert all(p.shapes[0]["block_size"] == 1 and p.shapes[1]["block_size"] == 544 for p in days)


def test_the_palette_stays_inside_the_declared_space():
    caps = dataclasses.replace(TRITON_LIKE, block_sizes=Sizes(multiple_of=16), head_dims=Sizes(values={64, 128}),
                               dtypes=frozenset({"float16"}))
    p = build_palette(SPECIALIZATION_NAMES, caps, "ci", 0, UNIVERSE)
    assert all(s["block_size"] % 16 == 0 and s["head_dim"] in (64, 128) and s["dtype"] == "float16" for s in p.shapes)


def test_a_backend_declaring_no_specialisation_draws_freely():
    assert run_palette(Capabilities()) is None
    assert capabilities_of(__import__("pagedkv").get_backend("indexed")).specialize_on is None


def test_an_unknown_specialisation_name_is_rejected():
    with pytest.raises(ValueError, match="specialize_on: unknown \\['warp_count'\\]"):
        Capabilities(specialize_on={"block_size", "warp_count"})


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_drawn_cases_use_only_the_palettes_specialisations(data):
    palette = run_palette(TRITON_LIKE)
    case = data.draw(cases(caps=TRITON_LIKE))
    g = case.geometry
    shape = {"block_size": g.block_size, "head_dim": g.head_dim, "gqa_group": g.num_queries_per_kv, "dtype": g.dtype}
    assert shape in list(palette.shapes)
    assert case.features in palette.feature_sets


def test_the_run_counts_each_ops_distinct_specialisations(tmp_path, monkeypatch):
    monkeypatch.setattr(specialisations, "_SEEN", __import__("collections").defaultdict(set))
    palette = run_palette(TRITON_LIKE)
    drawn = [cases(caps=TRITON_LIKE).example() for _ in range(5)]
    for case in drawn + drawn:
        specialisations.record(("paged_attention", "gather"), case, TRITON_LIKE)
    specialisations.write(tmp_path, "gw0")
    tally = specialisations.read_all(tmp_path)
    keys = {specialisations.key_of("paged_attention", c, SPECIALIZATION_NAMES) for c in drawn}
    assert tally["paged_attention"] == keys and len(keys) <= palette.bound
    assert "paged_attention " in specialisations.summary_line(tally)


def test_the_lease_schedule_never_holds_more_than_the_budget():
    tests = [(f"t{i}", nbytes, 1.0) for i, nbytes in enumerate([8, 8, 8, 4, 4])]
    schedule, makespan = _schedule(tests, budget=16, workers=4)
    events = sorted({t for _, _, s, e, _ in schedule for t in (s, e)})
    for t in events:
        assert sum(b for _, b, s, e, _ in schedule if s <= t < e) <= 16
    assert makespan == 2.0
    assert _schedule([("huge", 32, 1.0)], budget=16, workers=2)[0][0][2] is None  # never: larger than the budget


MLA_LIKE = dataclasses.replace(TRITON_LIKE, head_dims_v=Sizes(), lse="head_major")


@settings(max_examples=40, deadline=None, database=None)
@given(st.data(), st.booleans())
def test_v_widths_and_the_lse_variant_are_drawn_from_the_palette(data, lse):
    from pagedkv.testing.strategies.palette import LSE
    from pagedkv.testing.strategies.partial import partial_cases

    palette = run_palette(MLA_LIKE)
    case = data.draw(partial_cases(caps=MLA_LIKE, parts=(2,)) if lse else cases(caps=MLA_LIKE))
    g = case.geometry
    shape = {"block_size": g.block_size, "head_dim": g.head_dim, "gqa_group": g.num_queries_per_kv, "dtype": g.dtype,
             "head_dim_v": g.v_dim}
    assert shape in list(palette.shapes)
    assert case.features | ({LSE} if lse else set()) in palette.feature_sets


def test_the_ci_palette_of_an_mla_space_has_v_widths_of_their_own_and_stays_within_110():
    palette = build_palette(SPECIALIZATION_NAMES, MLA_LIKE, "ci", 0, UNIVERSE)
    widths = {(s["head_dim"], s["head_dim_v"]) for s in palette.shapes}
    assert (576, 512) in widths and any(k != v for k, v in widths - {(576, 512)})
    assert palette.shapes[0]["head_dim_v"] == palette.shapes[0]["head_dim"]  # the smallest shape: one width
    assert palette.bound <= 110


def _attention_properties():
    from pagedkv.testing.registry import properties

    return [p for p in properties().values() if "paged_attention" in p.ops and p.kind in ("case", "scenario")]


@pytest.mark.parametrize("prop", _attention_properties(), ids=lambda p: p.name)
def test_every_generated_attention_case_is_one_of_the_palettes_specialisations(prop):
    """A strategy drawing its geometry past the palette compiles more kernels the more examples a run
    draws (a compile storm on a GPU): every generated attention case, the cache scenarios' too, must be
    a palette shape with a palette feature set."""
    from pagedkv.testing.specialisations import in_palette
    from pagedkv.tools.plan import _draw_keys

    if prop.requires(MLA_LIKE):
        pytest.skip(str(prop.requires(MLA_LIKE)))
    palette = run_palette(MLA_LIKE)
    keys = _draw_keys(prop, MLA_LIKE, 8, True, 0)["paged_attention"]
    assert keys and [k for k in keys if not in_palette(k, palette)] == []


def test_the_attention_budget_counts_the_explicit_examples_and_flags_a_draw_outside_the_palette():
    from pagedkv.tools.plan import attention_budget

    palette = run_palette(TRITON_LIKE)
    shape = palette.shapes[0]
    inside = (("block_size", shape["block_size"]), ("head_dim", shape["head_dim"]),
              ("gqa_group", shape["gqa_group"]), ("dtype", shape["dtype"]), ("features", "-"))
    own = (("block_size", 3), ("head_dim", 3), ("gqa_group", 3), ("dtype", "float32"), ("features", "-"))
    budget = attention_budget(palette, {"generated": {"paged_attention": {inside}},
                                        "explicit": {"paged_attention": {inside, own}}})
    assert (budget.palette_drawn, budget.explicit, budget.fixed, budget.outside) == (1, 1, 0, [])
    assert budget.within and budget.limit == palette.bound + 1
    leak = attention_budget(palette, {"generated": {"paged_attention": {inside, own}}})
    assert not leak.within and leak.outside == [own] and "OVER" in leak.describe()


@pytest.mark.slow(reason="25-60 s: draws every property's ci examples")
def test_the_ci_plan_of_the_triton_backend_stays_within_its_attention_budget(monkeypatch):
    """The committed GPU plan's promise: under ``ci`` the run compiles at most the palette's bound plus the
    explicit examples' and the limit properties' own geometries, and at most the compile-count check's 150."""
    import sys

    from hypothesis import settings

    import pagedkv.testing.settings as profiles

    monkeypatch.setattr(profiles, "_chosen", None)  # the profile the plan loads is its run's (this worker's back after)
    loaded = settings.get_current_profile_name()

    import pagedkv
    from pagedkv.tools.plan import plan_profile

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "bench"))
    from compile_count_check import CI_ATTENTION_BUDGET

    try:
        plan = plan_profile(pagedkv.get_backend("triton"), "ci", device="cuda", workers=16, cores=16, budget=2**40,
                            compile_s={}, example_costs={}, draw_limit=200)
    finally:
        settings.load_profile(loaded)
    assert plan.budget is not None and plan.budget.within, plan.budget.describe()
    assert plan.specialisations["paged_attention"] == plan.budget.total <= plan.budget.limit <= CI_ATTENTION_BUDGET


class _ForeignKernels:
    """An adapter whose Triton kernels live in another package's modules (as vLLM's and SGLang's peers)."""

    name = "foreign"
    capabilities = Capabilities(split_k=True)

    def paged_attention(self, *args, **kwargs):
        raise NotImplementedError


def test_an_adapter_declaring_triton_launches_gets_a_palette_and_the_interpreters_example_count(monkeypatch):
    import triton  # noqa: F401  (the interpreter's decision needs Triton imported)

    from pagedkv.testing import space

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    plain = _ForeignKernels()
    assert not space.launches_triton(plain) and space.example_cap([plain], 100) is None
    monkeypatch.setattr(_ForeignKernels, "LAUNCHES_TRITON", True, raising=False)
    caps = space.capabilities_under_test(plain, for_drawing=True)
    assert space.example_cap([plain], 100) == 10 and caps.specialize_on == SPECIALIZATION_NAMES
    assert caps.gqa_groups.allows(17) and not caps.gqa_groups.allows(18)  # an interpreted split-K peer's groups


def test_an_mla_space_draws_the_mla_shape_one_case_in_three():
    """A candidate declaring V widths of its own draws MLA's shape (K 576, V its first 512: the width its
    deployments run, and where vLLM's and SGLang's decode kernels take their rope tile) one case in three, as
    the latent cache, not as one palette shape of ten (a fault in the rope tile survived 10 examples in two runs
    of three); a space with equal widths keeps the palette's even draw."""
    from hypothesis import HealthCheck

    from pagedkv.testing.cases.case import Case, SeqSpec
    from pagedkv.testing.strategies.batches import latent_view
    from pagedkv.testing.strategies.geometry import geometries

    def share(caps):
        drawn = []

        @settings(max_examples=150, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(geometries(caps=caps), st.data())
        def draw(g, data):  # the rest of a case drawn too, so the geometries' small space is never exhausted
            drawn.append(g.head_dim == 576)
            if g.head_dim == 576 and caps is MLA_LIKE:  # MLA's cache
                assert data.draw(latent_view(Case(g, (SeqSpec((), 0, 0),)), caps)) == {"layout": "latent"}
            data.draw(st.integers(0, 2**20))
        draw()
        return sum(drawn) / len(drawn)

    assert 0.18 < share(MLA_LIKE) < 0.5
    assert share(TRITON_LIKE) < 0.12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_palette_holds_the_deployed_sizes_and_the_verdict_names_it(seed):
    """A fixed ``ci`` palette never leaves out the shape most traffic runs (head_dim 128 beside 64, GQA 4 and 8,
    block size 16), and the header and the JSON say which sizes the compile budget drew."""
    from pagedkv.testing.report import drawn_space
    from pagedkv.testing.strategies.palette import DEPLOYED

    palette = build_palette(SPECIALIZATION_NAMES, TRITON_LIKE, "ci", seed, UNIVERSE)
    for name, sizes in DEPLOYED.items():
        assert set(sizes) <= {s[name] for s in palette.shapes}, (name, palette.describe())

    class HeadDimTemplated:
        capabilities = Capabilities(specialize_on={"head_dim"})

        def paged_attention(self, *args):
            raise AssertionError("not called")

    (note,) = drawn_space(HeadDimTemplated())
    assert note.startswith("the compile budget (specialize_on ['head_dim']): palette (") and "128" in note
