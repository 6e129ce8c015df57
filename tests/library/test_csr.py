"""CSR page tables (FlashInfer's kv_indptr / kv_indices / kv_last_page_len): round trip and validation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.cache.config import blocks_needed
from pagedkv.csr import check_csr, csr_to_padded, padded_to_csr
from pagedkv.errors import ArgumentTypeError, BlockIndexError, DeviceMismatchError, DTypeMismatchError, ShapeError
from pagedkv.testing.cases.csr import CSR_FAULTS, call_paged_attention, csr_from_case, page_table_format
from strategies import cases, fragmented_cases

I32 = torch.int32


def t(values, dtype=I32):
    return torch.tensor(values, dtype=dtype)


@settings(max_examples=150, database=None, deadline=None)
@given(case=cases(max_seqs=5, max_len=40) | fragmented_cases(max_seqs=5, max_len=40))
def test_padded_to_csr_to_padded_keeps_every_read_entry_and_length(case):
    tables, lens, bs = case.block_tables(), case.seq_lens(), case.geometry.block_size
    csr = padded_to_csr(tables, lens, bs)
    # the metadata is valid FlashInfer CSR over the pool, and agrees with the padded lengths
    check_csr(csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len, bs, case.geometry.num_blocks, seq_lens=lens)
    assert csr.kv_indices.numel() == sum(len(case.used_table(i)) for i in range(len(case.seqs)))
    assert csr.kv_indices.dtype == csr.kv_indptr.dtype == csr.kv_last_page_len.dtype == I32
    back, back_lens = csr_to_padded(csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len, bs,
                                    width=tables.shape[1], pad_value=case.pad_value)
    torch.testing.assert_close(back_lens, lens, rtol=0, atol=0)
    for b in range(len(case.seqs)):
        need = blocks_needed(case.seqs[b].seq_len, bs)
        assert back[b, :need].tolist() == list(case.used_table(b))
        assert (back[b, need:] == case.pad_value).all()
    # and CSR -> padded -> CSR is the identity
    again = padded_to_csr(back, back_lens, bs)
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len"):
        assert torch.equal(getattr(again, name), getattr(csr, name)), name


@settings(max_examples=60, database=None, deadline=None)
@given(lens=st.lists(st.integers(0, 9), min_size=0, max_size=5))
def test_page_size_one_is_one_index_per_token(lens):
    """SGLang's token-granular layout: a page per token, every last page holding one token."""
    tables = torch.arange(len(lens) * 10, dtype=I32).view(len(lens), 10)
    csr = padded_to_csr(tables, t(lens), 1)
    assert csr.kv_indptr.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    assert csr.kv_last_page_len.tolist() == [min(n, 1) for n in lens]
    assert csr.seq_lens().tolist() == lens


def test_the_flashinfer_example():
    """FlashInfer's docs: pages [[0, 1], [2]] of page size 4 holding 7 and 2 tokens."""
    csr = padded_to_csr(t([[0, 1], [2, -1]]), t([7, 2]), 4)
    assert (csr.kv_indptr.tolist(), csr.kv_indices.tolist(), csr.kv_last_page_len.tolist()) == ([0, 2, 3], [0, 1, 2],
                                                                                               [3, 2])


VALID = dict(kv_indptr=[0, 2, 2, 3], kv_indices=[4, 1, 0], kv_last_page_len=[3, 0, 4])


def _check(num_pages=5, seq_lens=None, **over):
    args = {k: (v if isinstance(v, torch.Tensor) else t(v)) for k, v in {**VALID, **over}.items()}
    return check_csr(args["kv_indptr"], args["kv_indices"], args["kv_last_page_len"], 4, num_pages,
                     seq_lens=None if seq_lens is None else t(seq_lens))


def test_the_valid_example_passes():
    assert _check(seq_lens=[7, 0, 4]).seq_lens().tolist() == [7, 0, 4]


@pytest.mark.parametrize("over, error, match", [
    (dict(kv_indptr=[1, 2, 2, 3]), ShapeError, r"kv_indptr\[0\] must be 0"),
    (dict(kv_indptr=[0, 2, 1, 3]), ShapeError, "kv_indptr is not monotone"),
    (dict(kv_last_page_len=[0, 0, 4]), ShapeError, r"kv_last_page_len\[0\] = 0 must be in \[1, page_size = 4\]"),
    (dict(kv_last_page_len=[5, 0, 4]), ShapeError, r"kv_last_page_len\[0\] = 5 must be in"),
    (dict(kv_last_page_len=[3, 1, 4]), ShapeError, r"kv_last_page_len\[1\] = 1, but row 1 has no pages"),
    (dict(kv_indices=[4, 1, 5]), BlockIndexError, "kv_indices has page id 5 at entry 2"),
    (dict(kv_indices=[4, -1, 0]), BlockIndexError, "kv_indices has page id -1"),
    (dict(kv_indptr=[0, 2, 2, 4]), ShapeError, r"kv_indptr\[-1\] = 4 pages, kv_indices has 3"),
    (dict(kv_indptr=[0, 2, 3]), ShapeError, "kv_indptr must have batch \\+ 1 = 4 entries"),
    (dict(kv_indices=t([[4, 1, 0]])), ShapeError, "kv_indices must have 1 dims"),
    (dict(kv_indptr=t([0, 2, 2, 3], torch.float32)), DTypeMismatchError, "kv_indptr.dtype"),
    (dict(kv_last_page_len=t([3, 0, 4], torch.float64)), DTypeMismatchError, "kv_last_page_len.dtype"),
    (dict(kv_indices=[4, 1, 0], seq_lens=[9, 0, 4]), ShapeError, r"seq_lens\[0\] = 9 needs 3 pages .* a row longer "
                                                                 "than its pages"),
    (dict(seq_lens=[6, 0, 4]), ShapeError, r"seq_lens\[0\] = 6, but kv_indptr and kv_last_page_len give row 0 7"),
    (dict(seq_lens=[7, 0]), ShapeError, "seq_lens has 2 entries"),
])
def test_each_invalid_kind_is_refused_naming_the_argument(over, error, match):
    with pytest.raises(error, match=match):
        _check(**over)


def test_argument_kinds():
    with pytest.raises(ArgumentTypeError, match="kv_indptr must be a torch.Tensor"):
        check_csr([0, 1], t([0]), t([1]), 4)
    with pytest.raises(ArgumentTypeError, match="page_size must be an int"):
        check_csr(t([0, 1]), t([0]), t([1]), 4.0)
    with pytest.raises(ShapeError, match="page_size must be >= 1"):
        check_csr(t([0, 1]), t([0]), t([1]), 0)
    with pytest.raises(DeviceMismatchError, match="kv_indices is on meta"):
        check_csr(t([0, 1]), t([0]).to("meta"), t([1]), 4)


def test_padded_to_csr_refuses_a_row_too_short_for_its_length():
    with pytest.raises(ShapeError, match=r"seq_lens\[1\] = 9 needs 3 pages of page_size 4, block_tables has 2"):
        padded_to_csr(t([[0, 1], [2, 3]]), t([5, 9]), 4)
    with pytest.raises(ShapeError, match=r"seq_lens\[0\] = -1 is negative"):
        padded_to_csr(t([[0, 1]]), t([-1]), 4)
    with pytest.raises(ShapeError, match="width 1 is smaller than the longest row's 2 pages"):
        csr_to_padded(t([0, 2]), t([0, 1]), t([1]), 4, width=1)


def test_csr_to_padded_given_the_pool_size_names_kv_indices_for_a_page_past_it():
    """A kernel converting its CSR arguments reports a page past the pool under the name its caller used."""
    with pytest.raises(BlockIndexError, match="kv_indices"):
        csr_to_padded(t([0, 2]), t([0, 4]), t([1]), 4, 4)
    tables, lens = csr_to_padded(t([0, 2]), t([0, 3]), t([1]), 4, 4)
    assert tables.tolist() == [[0, 3]] and lens.tolist() == [5]


@settings(max_examples=60, database=None, deadline=None)
@given(case=cases(max_seqs=4, max_len=30), data=st.data())
def test_every_csr_fault_is_refused_with_its_error(case, data):
    """The faults the suite injects into a CSR candidate's metadata are caught by pagedkv's validator."""
    csr = csr_from_case(case)
    faults = [f for f in CSR_FAULTS if f.applies(csr)]
    fault = data.draw(st.sampled_from(faults))
    bad = fault.breaks(csr, case.geometry.num_blocks)
    assert fault.error in (ValueError, IndexError, TypeError)  # a candidate is judged on the builtin type
    with pytest.raises(fault.error, match=fault.argument):
        check_csr(bad.kv_indptr, bad.kv_indices, bad.kv_last_page_len, bad.page_size, case.geometry.num_blocks)


class _CsrReference:
    """A CSR candidate for the call path: converts back and runs pagedkv's loop backend."""

    name = "csr_reference"
    page_table = "csr"

    def paged_attention(self, query, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, query_start_loc,
                        scale=None):
        from pagedkv.backends import loop

        tables, lens = csr_to_padded(kv_indptr, kv_indices, kv_last_page_len, k_cache.shape[1])
        check_csr(kv_indptr, kv_indices, kv_last_page_len, k_cache.shape[1], k_cache.shape[0])
        return loop.paged_attention(query, k_cache, v_cache, tables, lens, query_start_loc, scale)


@settings(max_examples=25, database=None, deadline=None)
@given(case=cases(max_seqs=3, max_len=20, features=False))
def test_a_csr_candidate_sees_the_same_attention_as_a_padded_one(case):
    from pagedkv.backends import loop

    assert page_table_format(_CsrReference()) == "csr" and page_table_format(loop) == "padded"
    k, v = case.caches()
    args = (case.query(), k, v, case.block_tables(), case.seq_lens(), case.query_start_loc(), case.scale)
    want = loop.paged_attention(*args)
    got = call_paged_attention(_CsrReference(), *args)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
