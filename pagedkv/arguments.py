"""Moved to :mod:`pagedkv.validation.arguments` (the adapter's checks: :mod:`pagedkv.adapter`); this path
resolves its old names, with a ``DeprecationWarning``, for one release."""

from pagedkv._moved import moved

__getattr__ = moved("pagedkv.arguments", {name: "pagedkv.validation.arguments" for name in (
    "ALL_FEATURES", "HEAD_VECTOR_DTYPES", "MAX_NUM_SPLITS", "as_head_vector", "as_scale", "check_cache",
    "check_cache_pair", "check_features", "check_head_vector", "check_ids_in_range", "check_int_tensor",
    "check_kv_scale", "check_length", "check_like_cache", "check_no_overlap", "check_num_splits",
    "check_pool_scales", "check_real", "check_scale", "check_softcap", "check_tensor", "check_window",
    "normalize_block_table")})
