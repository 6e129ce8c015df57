"""Triton kernels of the ``triton`` backend, and their launchers: the one import the backend needs.

- :mod:`pagedkv.backends.triton.attention`: the fused paged-attention kernel (decode and prefill over a
  cached prefix, GQA, window / soft-cap / ALiBi / sinks / fp8 behind constexpr flags), split-K decode
  and its merge kernel, the tile configuration and the launcher :func:`paged_attention`.
- :mod:`pagedkv.backends.triton.merge`: :func:`merge_attn_states`, the merge of two partial attention states.
- :mod:`pagedkv.backends.triton.copy`: :func:`gather`, :func:`scatter`, :func:`write_kv` (vLLM
  ``reshape_and_cache``), token-tiled copies.
- :mod:`pagedkv.backends.triton.common`: the interpreter switch, :func:`check_runnable`, fp8 helpers.
- :mod:`pagedkv.backends.triton.launch_grid`: launch grids within CUDA's limits and the split-K count (pure).
- :mod:`bench.compile_report`: every kernel compiled ahead of time for sm_80 / sm_90 with
  registers, spills, shared memory and occupancy (``python -m bench.compile_report``).

The launchers do no argument checking (``pagedkv.backends.triton.backend`` validates first) and launch
nothing for empty work. Without a CUDA device the kernels run on the CPU in Triton's interpreter
(``TRITON_INTERPRET=1``, chosen in :mod:`pagedkv.backends.interpreter` before Triton is imported).
"""

from __future__ import annotations

from pagedkv.backends.triton.launch_grid import splits
from pagedkv.backends.triton.attention import attention_config, num_splits_for, paged_attention
from pagedkv.backends.triton.common import LOG2E, check_runnable, interpreting
from pagedkv.backends.triton.copy import copy_config, gather, scatter, write_kv
from pagedkv.backends.triton.merge import merge_attn_states

__all__ = ["LOG2E", "attention_config", "check_runnable", "copy_config", "gather", "interpreting",
           "merge_attn_states", "num_splits_for", "paged_attention", "scatter", "splits", "write_kv"]
