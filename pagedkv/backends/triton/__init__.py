"""The fused backend: Triton kernels that read K/V through the block table (vLLM's design).

- :mod:`.backend`: the ``triton`` backend (``get_backend("triton")``): validation, then the launchers;
- :mod:`.kernels`: the launchers' one import (attention, copies, the interpreter switch);
- :mod:`.attention`: the paged-attention kernel, split-K decode and its merge;
- :mod:`.copy`: gather, scatter and ``write_kv`` (vLLM's ``reshape_and_cache``);
- :mod:`.common`: the interpreter switch, fp8 helpers; :mod:`.launch_grid`: grids within CUDA's limits.

Importing this package imports nothing: the kernels compile ahead of time (the compile report) in
processes where the backend itself cannot run.
"""
