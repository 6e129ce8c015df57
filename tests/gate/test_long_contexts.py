"""Long contexts in every profile: a share of the attention cases draws contexts of hundreds to several
thousand tokens (decode and chunked prefill, at most two sequences, small heads), inside the declared
space, so errors that grow with the context are found under ``ci``."""

from hypothesis import HealthCheck, given, settings

from pagedkv.backends.capabilities import Capabilities, Sizes
from pagedkv.testing import execute
from pagedkv.testing.registry import properties
from pagedkv.testing.strategies.batches import LONG_CONTEXTS, LONG_Q_TILE_EDGES
from pagedkv.testing.settings import register_profiles, suite_settings

LONG_PROPERTIES = ("paged_attention_matches_fp64_dense_reference", "a_request_alone_equals_the_same_request_in_a_batch",
                   "decoding_token_by_token_equals_one_prefill_and_chunked_prefill")


def _draw(prop: str, caps, n: int = 100) -> list:
    seen = []

    # from Hypothesis's own defaults, not whatever profile an earlier test in this process loaded
    @settings(settings.get_profile("default"), max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(properties()[prop].strategy_in(caps))
    def collect(case):
        seen.append(case)

    collect()
    return seen


def test_a_share_of_the_attention_cases_is_long_decode_and_chunked_prefill():
    for prop in LONG_PROPERTIES:
        cases = _draw(prop, None, 200)  # twice the ci profile's examples: a share, not one search's luck
        # long and cheap: a context of hundreds of tokens or more on few sequences, one kv head, a small
        # head_dim (a short case at a production block size such as 544 can reach 255 tokens too, but
        # not with this shape)
        long = [c for c in cases if max(s.seq_len - s.q_len for s in c.seqs) >= min(LONG_CONTEXTS)
                and len(c.seqs) <= 2 and c.geometry.num_kv_heads == 1 and c.geometry.head_dim <= 8]
        assert len(long) >= 20, (prop, len(long))  # one in ten at least (one in four attention cases is long)
        contexts = {max(s.seq_len - s.q_len for s in c.seqs) for c in long}
        assert max(contexts) >= 1536 and min(contexts) < 1024, (prop, sorted(contexts))
        q_lens = {max(s.q_len for s in c.seqs) for c in long}
        assert 1 in q_lens and 1 < max(q_lens) <= LONG_Q_TILE_EDGES[-1], (prop, q_lens)  # decode and chunked


def test_long_cases_stay_inside_the_declared_space():
    caps = Capabilities(block_sizes=Sizes(values={16, 64}), head_dims=Sizes(values={64, 128}),
                        num_kv_heads=Sizes(min=2), dtypes={"bfloat16"})
    long = [c for c in _draw("paged_attention_matches_fp64_dense_reference", caps)
            if max(s.seq_len for s in c.seqs) >= min(LONG_CONTEXTS)]
    assert long
    for c in long:
        assert caps.rejects(c.geometry) is None, c.geometry


def test_a_float16_softmax_denominator_is_found_under_the_ci_profile():
    """The kernel of ``tests/kernels/narrow_denominator.py`` (0.3% error at 64 keys, 45% past 2048)
    fails the reference property in the ``ci`` profile's derandomized run, on a long context.
    ``bench/long_context_kill_rate.py`` measures the rate over independent seeds."""
    from hypothesis import Phase

    from tests.kernels import narrow_denominator

    register_profiles()
    chosen = settings(settings.get_profile("pagedkv-ci"), phases=[Phase.explicit, Phase.generate])
    outcome = execute.run(properties()["paged_attention_matches_fp64_dense_reference"], (narrow_denominator,),
                          "cpu", suite_settings(chosen))
    assert outcome.failed, outcome
    assert outcome.failures[0].case is not None
    assert max(s.seq_len for s in outcome.failures[0].case.seqs) >= min(LONG_CONTEXTS), outcome.failures[0].case
