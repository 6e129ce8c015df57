"""Argument checks, run before any kernel launch and any write (a device-side assert poisons a CUDA process).

- ``arguments``: checks of single arguments: tensors, pools, block tables, lengths, features;
- ``attention_arguments``: the checks of a whole ``paged_attention`` call;
- ``calls``: the checks of whole ``gather`` / ``scatter`` / ``write_kv`` calls, and the public names;
- ``levels``: the validation levels an op's ``validate`` argument picks;
- ``overlap``: whether two tensors may address a common byte.

The rules, with the exception each raises: docs/validation.md. An adapter imports the checks from
:mod:`pagedkv.adapter`; the names this package exported before it became a package
(``from pagedkv.validation import check_paged_attention``) still resolve, with a ``DeprecationWarning``,
for one release.
"""

from __future__ import annotations

from pagedkv._moved import moved

#: Names importable from ``pagedkv.validation`` itself until the next release: old name -> its module now.
_MOVED = {name: "pagedkv.validation.calls" for name in (
    "ALL_FEATURES", "FP8_DTYPES", "LEVELS", "AttentionArgs", "TableLike", "WriteArgs", "attention_args",
    "check_cache", "check_cache_pair", "check_features", "check_gather", "check_kv_scale", "check_paged_attention",
    "check_scatter", "check_write_kv", "check_write_overlap", "gather_args", "normalize_block_table",
    "scatter_args", "shares_memory", "validation_level", "write_kv_args")}
__getattr__ = moved("pagedkv.validation", _MOVED)
