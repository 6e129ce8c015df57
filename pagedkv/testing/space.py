"""The space under test: which backends, on which device, inside which declared input space.

Every entry point (the pytest plugin, ``python -m pagedkv mutate`` / ``fuzz`` / ``peers`` / ``replay``,
the mutation command) asks this module, so they agree on what a backend is judged on:

- :func:`load_candidates`: the candidate a spec names, else every built-in backend usable here;
- :func:`capabilities_under_test`: the backend's declared
  :class:`~pagedkv.backends.capabilities.Capabilities`, trimmed where this machine cannot judge a
  part of it (Triton's interpreter and bfloat16 ``tl.dot``), and the drawing space of a backend
  whose kernels are interpreted here;
- :func:`interpreted` and :func:`example_cap`: Triton kernels run by the interpreter (100-1000x
  slower) draw a tenth of the profile's examples;
- :func:`pick_device`: the device the suite's tensors live on; :func:`select_device` also makes it current.

Nothing here imports Hypothesis or pytest.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
from typing import Any

#: The fewest and the most examples a property draws for a backend whose kernels Triton interprets on the
#: CPU (100-1000x slower than the other backends): a tenth of the profile's count, within these bounds
#: (``ci`` 10, ``gpu`` 20, ``nightly`` 25). The interpreter stands in for a GPU here; the search proper
#: runs compiled, at the profile's full count, on a GPU runner (docs/gpu.md).
INTERPRETED_MIN_EXAMPLES = 5
INTERPRETED_MAX_EXAMPLES = 25
#: The largest GQA group an interpreted split-K decode peer draws on the CPU: one past the 16-head tile of
#: vLLM's and SGLang's grouped kernels (``BLOCK_H``), so a tile past the last query head is still drawn.
#: Their second stage runs one interpreted program per (query row, query head): a group of 64 or 71 costs
#: 7 s a call of two rows at head_dim 3 (measured, vLLM's and SGLang's decode alike), a group of 8 about 1 s.
INTERPRETED_MAX_SPLIT_K_GROUP = 17
_OWN_TRITON = "pagedkv.backends.triton.backend"


def load_candidates(spec: str | None) -> list:
    """The backend ``spec`` names (see :func:`pagedkv.load_backend`), else every built-in backend usable here.

    Raises:
        pagedkv.BackendError: the spec cannot be loaded (the message says why).
    """
    import pagedkv

    if spec:
        return [pagedkv.load_backend(spec)]
    return [pagedkv.get_backend(name) for name in pagedkv.available_backends()]


def _module_of(backend: Any):
    return backend if inspect.ismodule(backend) else inspect.getmodule(backend)


def runs_triton_in_interpreter(backend: Any) -> bool:
    """Whether ``backend`` (not pagedkv's own Triton backend) launches Triton kernels and Triton runs
    them in its interpreter here."""
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" not in sys.modules:
        return False
    module = _module_of(backend)
    if module is None or module.__name__ == _OWN_TRITON:
        return False
    return launches_triton(backend)


def interpreted(backend: Any) -> bool:
    """Whether Triton interprets ``backend``'s kernels here (pagedkv's own Triton backend included)."""
    module = _module_of(backend)
    if module is not None and module.__name__ == _OWN_TRITON:
        return os.environ.get("TRITON_INTERPRET") == "1"
    return runs_triton_in_interpreter(backend)


def capabilities_under_test(backend: Any, *, for_drawing: bool = False):
    """The backend's declared :class:`~pagedkv.backends.capabilities.Capabilities`, less ``bfloat16``
    for a Triton candidate run by the interpreter (there ``tl.dot`` on bfloat16 multiplies bit
    patterns as integers, a Triton bug; pagedkv's own kernel upcasts first). With ``for_drawing``,
    pagedkv's own Triton backend under the interpreter draws from the small geometries (block_size
    <= 16, head_dim <= 8, GQA group <= 7): its production sizes run compiled on a GPU, and here in
    ``tests/backends/test_triton.py``'s shapes, the fixed limits and the regression files; an interpreted
    split-K peer (vLLM's and SGLang's MLA decode) draws GQA groups up to
    :data:`INTERPRETED_MAX_SPLIT_K_GROUP` (its other sizes as declared: MLA's 576 / 512 included).

    Raises:
        TypeError: the backend's ``capabilities`` attribute is not a Capabilities.
    """
    from pagedkv.backends.capabilities import Sizes, capabilities_of

    caps = capabilities_of(backend)
    if "bfloat16" in caps.dtypes and len(caps.dtypes) > 1 and runs_triton_in_interpreter(backend):
        caps = dataclasses.replace(caps, dtypes=caps.dtypes - {"bfloat16"})
    if for_drawing and interpreted(backend) and not runs_triton_in_interpreter(backend):
        caps = dataclasses.replace(caps, block_sizes=Sizes(max=16), head_dims=Sizes(max=8), gqa_groups=Sizes(max=7))
    elif for_drawing and caps.split_k and runs_triton_in_interpreter(backend):
        caps = dataclasses.replace(caps, gqa_groups=_at_most(caps.gqa_groups, INTERPRETED_MAX_SPLIT_K_GROUP))
    if caps.specialize_on is None and launches_triton(backend):  # a Triton kernel specialises on all of them
        from pagedkv.backends.capabilities import SPECIALIZATION_NAMES

        caps = dataclasses.replace(caps, specialize_on=SPECIALIZATION_NAMES)
    return caps


def _at_most(sizes, top: int):
    """``sizes`` (a :class:`~pagedkv.backends.capabilities.Sizes`) less its values above ``top`` (as it is
    when none would be left)."""
    if sizes.values is not None:
        kept = frozenset(v for v in sizes.values if v <= top)
        return dataclasses.replace(sizes, values=kept) if kept else sizes
    if sizes.min > top:
        return sizes
    return dataclasses.replace(sizes, max=top if sizes.max is None else min(sizes.max, top))


def launches_triton(backend: Any) -> bool:
    """Whether ``backend`` launches Triton kernels (each compiles one variant per specialisation): it says so
    (``LAUNCHES_TRITON = True``, an adapter whose kernels live in another package's modules: vLLM's and
    SGLang's peers), or its module holds Triton objects."""
    declared = getattr(backend, "LAUNCHES_TRITON", None)
    if declared is not None:
        return bool(declared)
    module = _module_of(backend)
    return module is not None and any(getattr(v, "__module__", "").startswith("triton")
                                      or getattr(v, "__name__", "") == "triton" for v in vars(module).values())


def example_cap(backends, max_examples: int) -> int | None:
    """At most this many examples a property, or ``None`` (no cap): when any of ``backends`` is interpreted
    here, a tenth of ``max_examples`` within :data:`INTERPRETED_MIN_EXAMPLES` and
    :data:`INTERPRETED_MAX_EXAMPLES`. ``max_examples`` is the run's count: the profile's in the suite, the
    kill table and the kill rates; a batch's in ``python -m pagedkv fuzz``."""
    if not any(interpreted(b) for b in backends):
        return None
    return min(INTERPRETED_MAX_EXAMPLES, max(INTERPRETED_MIN_EXAMPLES, max_examples // 10))


def pick_device(chosen: str | None = None) -> str:
    """``chosen``, else ``$PAGEDKV_DEVICE``, else ``cuda:N`` (xdist worker ``gwK`` takes
    ``K % device_count``), else ``cpu``."""
    chosen = chosen or os.environ.get("PAGEDKV_DEVICE")
    if chosen:
        return chosen
    import torch

    if torch.cuda.is_available():
        worker = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", "gw0"))
        return f"cuda:{int(worker.group(1)) % torch.cuda.device_count() if worker else 0}"
    return "cpu"


def select_device(chosen: str | None = None) -> str:
    """:func:`pick_device`, made the current CUDA device when it is one (:func:`torch.cuda.set_device`): each
    xdist worker's kernels then launch, allocate and synchronise on its own device, not on ``cuda:0``."""
    device = pick_device(chosen)
    if device.startswith("cuda"):
        import torch

        if torch.device(device).index is not None:  # plain "cuda": the current device already
            torch.cuda.set_device(torch.device(device))
    return device


#: The leading positional parameters of each op up to its last pool (the contract's signatures).
_CONTRACT_PARAMS = {"gather": ("cache",), "scatter": ("cache",), "write_kv": ("k_cache", "v_cache"),
                    "paged_attention": ("query", "k_cache", "v_cache"),
                    "paged_attention_csr": ("query", "k_cache", "v_cache")}
#: The pool arguments of each op, by name (the contract's signatures).
_POOL_ARGS = {"gather": ("cache",), "scatter": ("cache",), "write_kv": ("k_cache", "v_cache"),
              "paged_attention": ("k_cache", "v_cache"), "paged_attention_csr": ("k_cache", "v_cache")}


class DeclaredLayout:
    """A backend declaring a pool layout other than NHD (``Capabilities.layout``: ``"HND"``, a
    :class:`~pagedkv.layouts.PoolLayout` or a ``(key, value)`` pair) seen through the contract's ops,
    which take logical ``[num_blocks, block_size, num_kv_heads, head_dim]`` pools. Each 4-D pool argument
    reaches the backend as its storage in the declared layout (``k_cache`` in the key layout, ``v_cache``
    in the value layout, ``gather``'s / ``scatter``'s ``cache`` in the key layout):

    - a pool the kit built in that layout (:func:`~pagedkv.testing.cases.memory.new_pools`, a view of
      its storage): the storage itself, found from the pool's strides; no copy, and what the backend
      writes lands in the pool the suite compares;
    - any other pool (a copy-pair layout, a pool a property made with ``torch.where``, a library
      cache's): ``to_storage`` of it, and after the call (raised or not) ``to_logical`` of that storage
      copied back into the pool, so writes, and stray writes, are seen in logical positions (block by
      block under :data:`~pagedkv.testing.cases.memory.BLOCKWISE_COPY`: the large-pool checks).

    Anything that is not a 4-D tensor (a bad argument of a rejection property) is passed as it is, and a
    ``v_cache`` that is the ``k_cache`` tensor reaches the backend as the same storage object (the
    rejection property's one-tensor-for-both fault stays that fault)."""

    def __init__(self, backend: Any, layouts: tuple):
        self._backend = backend
        self._layouts = layouts

    def __getattr__(self, name: str) -> Any:  # called once per name: the op is kept on the instance
        target = getattr(self._backend, name)
        if name not in _POOL_ARGS or not callable(target):
            return target
        import torch

        signature = inspect.signature(target)
        if any(arg not in signature.parameters for arg in _POOL_ARGS[name]):
            # ``(*args, **kwargs)`` (a proxy, a decorator): the pools are found at the contract's positions
            signature = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                           for p in _CONTRACT_PARAMS[name]] +
                                          [inspect.Parameter("rest", inspect.Parameter.VAR_POSITIONAL),
                                           inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD)])
        key_layout, value_layout = self._layouts
        from pagedkv.testing.cases.memory import BLOCKWISE_COPY, blockwise_to_logical, blockwise_to_storage

        def op(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            given = dict(bound.arguments)
            copied = []
            blockwise = BLOCKWISE_COPY.get()
            for arg in _POOL_ARGS[name]:
                pool = bound.arguments.get(arg)
                if not isinstance(pool, torch.Tensor) or pool.dim() != 4:
                    continue
                if arg == "v_cache" and pool is given.get("k_cache"):
                    bound.arguments[arg] = bound.arguments["k_cache"]  # one tensor for both stays one tensor
                    continue
                layout = value_layout if arg == "v_cache" else key_layout
                storage = _storage_or_none(layout, pool)
                if storage is None:
                    storage = (blockwise_to_storage(layout, pool) if blockwise and not layout.is_view else
                               layout.copy_to_storage(pool))
                    copied.append((pool, layout, storage))
                bound.arguments[arg] = storage
            try:
                return target(*bound.args, **bound.kwargs)
            finally:
                for pool, layout, storage in copied:
                    if blockwise and not layout.is_view:
                        blockwise_to_logical(layout, storage, pool)
                    else:
                        pool.copy_(layout.copy_to_logical(storage))

        op.__name__ = getattr(target, "__name__", name)
        setattr(self, name, op)
        return op


def _storage_or_none(layout: Any, pool: Any) -> Any:
    try:
        return layout.storage_of(pool)
    except Exception:  # noqa: BLE001 - a user's allocate may not take the meta device: convert instead
        return None


class CsrPageTables:
    """A backend declaring ``page_table="csr"`` seen through the contract's padded ``paged_attention``:
    the drawn case's ``block_tables`` / ``seq_lens`` reach it as FlashInfer's ``kv_indptr`` /
    ``kv_indices`` / ``kv_last_page_len`` (:func:`pagedkv.testing.cases.csr.call_paged_attention`)."""

    def __init__(self, backend: Any):
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None,
                        **features):
        from pagedkv.testing.cases.csr import call_paged_attention

        return call_paged_attention(self._backend, query, k_cache, v_cache, block_tables, seq_lens,
                                    query_start_loc, scale, **features)

    def paged_attention_csr(self, query, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len,
                            query_start_loc, scale=None, **features):
        """The backend's own CSR call, for the properties about CSR metadata itself."""
        return self._backend.paged_attention(query, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len,
                                             query_start_loc, scale, **features)


def as_declared_layout(backend: Any, caps: Any = None) -> Any:
    """``backend`` seen through the contract's ops: a :class:`DeclaredLayout` view when it declares a
    layout other than NHD, a :class:`CsrPageTables` view when it declares ``page_table="csr"``, else itself
    (``caps``: its declarations, when the caller has read them already)."""
    from pagedkv.backends.capabilities import capabilities_of
    from pagedkv.layouts import NHD

    if isinstance(backend, (DeclaredLayout, CsrPageTables)):
        return backend  # already seen through the contract's ops
    caps = caps if caps is not None else capabilities_of(backend)
    layouts = caps.pool_layouts
    if layouts != (NHD, NHD):
        backend = DeclaredLayout(backend, layouts)
    if caps.page_table == "csr":  # outermost: CSR metadata is built from the logical pools' block_size
        backend = CsrPageTables(backend)
    return backend
