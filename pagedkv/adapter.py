"""The names a backend adapter imports, in one place that does not move.

An engine team's adapter (the module ``--pagedkv-impl`` names) declares its input space and checks its
arguments with these, and raises the builtin types the contract names (``ValueError``, ``IndexError``,
``TypeError``; pagedkv's own errors below are subclasses of them, so either may be raised or caught)::

    from pagedkv.adapter import Capabilities, Sizes, check_paged_attention

    capabilities = Capabilities(block_sizes=Sizes(multiple_of=16), layout="HND")

    def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                              layout=capabilities.layout)
        ...

Each check takes the pools in the layout the declaration names (``layout=``, default ``"NHD"``): a head-major
pool is read through its logical view, so block size and head count come from where that layout keeps them.

The modules these come from (:mod:`pagedkv.backends.capabilities`, :mod:`pagedkv.validation`,
:mod:`pagedkv.csr`, :mod:`pagedkv.errors`) may be reorganised; this module's ``__all__`` is pinned by a test
and changes only with a deprecation period (an old name keeps working for a release with a
``DeprecationWarning``), as ``from pagedkv.validation import check_paged_attention`` does today.
"""

from __future__ import annotations

from pagedkv.backends.capabilities import PRECONDITIONS, Capabilities, NonPromise, Sizes
from pagedkv.csr import CsrPageTable, check_csr
from pagedkv.errors import (ArgumentTypeError, ArgumentValueError, BackendError, BlockIndexError, DeviceMismatchError,
                            DTypeMismatchError, PagedKVError, ShapeError)
from pagedkv.validation.attention_arguments import check_paged_attention
from pagedkv.validation.calls import check_gather, check_scatter, check_write_kv

__all__ = [
    # the declaration
    "Capabilities", "NonPromise", "PRECONDITIONS", "Sizes",
    # the argument checks (each raises the errors below before any kernel launch)
    "check_csr", "check_gather", "check_paged_attention", "check_scatter", "check_write_kv", "CsrPageTable",
    # the errors (each a subclass of the builtin type the contract names)
    "ArgumentTypeError", "ArgumentValueError", "BackendError", "BlockIndexError", "DeviceMismatchError",
    "DTypeMismatchError", "PagedKVError", "ShapeError",
]
