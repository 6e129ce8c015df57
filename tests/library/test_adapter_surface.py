"""The names a backend adapter imports live in :mod:`pagedkv.adapter` and do not move; names from before a
reorganisation keep working for a release, with a ``DeprecationWarning``."""

from __future__ import annotations

import warnings

import pytest

#: The pinned surface: changing it breaks adapters, so a change here needs a deprecation period.
ADAPTER_SURFACE = [
    "ArgumentTypeError", "ArgumentValueError", "BackendError", "BlockIndexError", "Capabilities", "CsrPageTable",
    "DTypeMismatchError", "DeviceMismatchError", "NonPromise", "PRECONDITIONS", "PagedKVError", "ShapeError", "Sizes",
    "check_csr", "check_gather", "check_paged_attention", "check_scatter", "check_write_kv",
]


def test_the_adapter_surface_is_pinned_and_each_name_is_the_librarys_own():
    import pagedkv.adapter as adapter
    from pagedkv.backends.capabilities import Capabilities
    from pagedkv.errors import ShapeError
    from pagedkv.validation.attention_arguments import check_paged_attention

    assert sorted(adapter.__all__) == sorted(ADAPTER_SURFACE)
    assert all(hasattr(adapter, name) for name in ADAPTER_SURFACE)
    assert adapter.Capabilities is Capabilities and adapter.ShapeError is ShapeError
    assert adapter.check_paged_attention is check_paged_attention


def test_every_adapter_error_is_a_builtin_type_the_contract_names():
    import pagedkv.adapter as adapter

    for name in ADAPTER_SURFACE:
        value = getattr(adapter, name)
        if isinstance(value, type) and issubclass(value, Exception) and name != "PagedKVError":  # the base
            assert issubclass(value, (ValueError, IndexError, TypeError)), name


@pytest.mark.parametrize("name", ["check_paged_attention", "check_write_kv", "check_gather", "check_scatter",
                                  "attention_args", "validation_level"])
def test_an_old_import_path_still_works_with_a_deprecation_warning(name):
    import importlib

    import pagedkv.validation

    with pytest.warns(DeprecationWarning, match=f"pagedkv.validation.{name} moved"):
        old = getattr(pagedkv.validation, name)
    assert old is getattr(importlib.import_module("pagedkv.validation.calls"), name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            pagedkv.validation.no_such_check  # noqa: B018


@pytest.mark.parametrize("text, expected", [("512M", 512 << 20), ("8GiB", 8 << 30), ("8g", 8 << 30),
                                            ("80GB", 80 * 10**9), ("1.5K", 1536), ("1048576", 1 << 20)])
def test_one_rule_for_byte_counts_wherever_a_size_is_read(text, expected):
    from pagedkv.testing.casefiles.schema import parse_bytes as max_bytes
    from pagedkv.testing.device_lease import parse_bytes as device_memory

    assert device_memory(text) == max_bytes(text) == expected


def test_every_fault_the_gate_injects_expects_a_builtin_type_and_names_an_argument():
    # a third-party kernel is judged on the builtin type and the argument, for padded tables and CSR metadata
    from pagedkv.testing.cases.csr import CSR_FAULTS
    from pagedkv.testing.cases.invalid_call import FAULTS, InvalidCall  # noqa: F401

    builtins = (ValueError, IndexError, TypeError)
    assert all(f.expected in {b.__name__ for b in builtins} and f.argument for f in FAULTS.values())
    assert all(f.error in builtins and f.argument.startswith("kv_") for f in CSR_FAULTS)


@pytest.mark.parametrize("old, name, new", [
    ("pagedkv.attention", "reference_attention", "pagedkv.attention.dense"),
    ("pagedkv.attention", "paged_attention_by_gather", "pagedkv.attention.dense"),
    ("pagedkv.arguments", "check_int_tensor", "pagedkv.validation.arguments"),
    ("pagedkv.arguments", "normalize_block_table", "pagedkv.validation.arguments"),
])
def test_modules_that_became_packages_keep_their_old_names_for_a_release(old, name, new):
    import importlib

    with pytest.warns(DeprecationWarning, match=f"{old}.{name} moved"):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(importlib.import_module(new), name)


def _hnd_call(num_blocks=6, block_size=16, num_kv_heads=2, head_dim=8):
    """A head-major (HND) pool pair and a paged_attention call over it: 4 query heads over 2 kv heads, one
    sequence of 20 tokens in blocks 0 and 1."""
    import torch

    k = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim)
    return (torch.zeros(5, 4, head_dim), k, torch.zeros_like(k), torch.tensor([[0, 1]]), torch.tensor([20]),
            torch.tensor([0, 5]))


def test_a_head_major_pool_is_checked_through_the_layout_it_is_declared_in():
    """``layout="HND"`` reads block size and head count where HND keeps them: the call an honest HND kernel
    makes passes, where reading its pools as NHD (block size 2, 16 kv heads) refuses it."""
    import torch

    from pagedkv.adapter import ShapeError, check_gather, check_paged_attention, check_scatter, check_write_kv

    query, k, v, tables, seq_lens, starts = _hnd_call()
    with pytest.raises(ShapeError, match="num_kv_heads 16"):
        check_paged_attention(query, k, v, tables, seq_lens, starts)
    assert check_paged_attention(query, k, v, tables, seq_lens, starts, layout="HND").num_queries_per_kv == 2
    assert check_gather(k, [0, 1], 20, layout="HND")[1] == 20
    assert check_scatter(k, [0, 1], torch.zeros(3, 2, 8), 17, layout="HND")[1:] == (17, 3)
    slots = check_write_kv(k, v, torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), torch.tensor([3, 95]), layout="HND")
    assert slots.tolist() == [3, 95]


def test_a_head_major_pool_still_refuses_what_its_logical_pool_refuses():
    """The view changes where the checks read sizes, not what they refuse: a slot past the 6 blocks of 16
    tokens, a block id past the pool, a table too short for the sequence."""
    import torch

    from pagedkv.adapter import BlockIndexError, ShapeError, check_gather, check_paged_attention, check_write_kv

    query, k, v, tables, seq_lens, starts = _hnd_call()
    with pytest.raises(BlockIndexError, match="slot_mapping"):
        check_write_kv(k, v, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.tensor([96]), layout="HND")
    with pytest.raises(BlockIndexError, match="block_tables"):
        check_paged_attention(query, k, v, torch.tensor([[0, 6]]), seq_lens, starts, layout="HND")
    with pytest.raises(ShapeError, match="needs 3 blocks"):
        check_gather(k, [0, 1], 33, layout="HND")


@pytest.mark.parametrize("layout, message", [("XYZ", "unknown layout"), (5, "layout must be"),
                                             ("copy", "copy pair, not a view")])
def test_a_layout_the_checks_cannot_view_is_refused_naming_it(layout, message):
    from pagedkv.adapter import ArgumentValueError, check_gather
    from pagedkv.layouts import PoolLayout

    if layout == "copy":
        layout = PoolLayout("packed", to_storage=lambda t: t.clone(), to_logical=lambda t: t.clone())
    _, k, *_ = _hnd_call()
    with pytest.raises(ArgumentValueError, match=message):
        check_gather(k, [0], 1, layout=layout)


def test_a_head_major_pool_checked_without_its_layout_is_told_to_pass_it():
    """A check refusing HND pools read as NHD says to pass ``layout="HND"`` where the call is valid read
    head-major, and only there. Fails before: "num_kv_heads 16" alone, no word of ``layout``."""
    import torch

    from pagedkv.adapter import ShapeError, check_gather, check_paged_attention, check_write_kv

    query, k, v, tables, seq_lens, starts = _hnd_call()
    for refused in (lambda: check_paged_attention(query, k, v, tables, seq_lens, starts),
                    lambda: check_gather(k, [0, 1], 20),
                    lambda: check_write_kv(k, v, torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), torch.tensor([0, 1, 40]))):
        with pytest.raises(ShapeError, match='pass layout="HND"'):
            refused()
    with pytest.raises(ShapeError) as refused_either_way:
        check_gather(k, [0, 9], 20)  # 20 tokens in two blocks of 2 or of 16 with block 9 of 6: refused both ways
    assert "layout" not in str(refused_either_way.value)
