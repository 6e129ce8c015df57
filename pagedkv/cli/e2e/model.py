"""End to end, the model hookup: a transformers causal LM whose attention is served from a
:class:`PagedKVCache`.

The model is a ``transformers`` causal LM: a small Llama, Mistral (sliding window) or Gemma 2
(alternating sliding-window and full layers, logit soft-capping) with seeded random weights
(:func:`build_model`), or any local checkpoint directory of a decoder-only model whose attention goes
through transformers' ``AttentionInterface``.
Its attention is replaced, not wrapped: :func:`register_attention` registers ``"pagedkv"`` with
``transformers.AttentionInterface`` and the model is built with ``attn_implementation="pagedkv"``.
Transformers then builds no mask and keeps no cache of its own (every call is ``use_cache=False``);
for every layer the registered function

1. writes the step's new K and V (after RoPE) into the layer's pools with the backend's
   ``write_kv(k_cache, v_cache, key, value, slot_mapping)``, and
2. computes causal varlen attention with the backend's ``paged_attention(query, k_cache, v_cache,
   block_tables, seq_lens, query_start_loc, scale)`` straight from the blocks, with the layer's own
   ``scale``, ``window_left`` and ``softcap`` (and ``k_scale`` / ``v_scale`` for an fp8 cache),

using a :class:`StepContext` passed to the model as the keyword argument ``pagedkv_step`` (transformers
forwards unknown keyword arguments down to the attention function, as its own continuous batching
does with ``cu_seq_lens_q`` and the block table).

Every step is one packed varlen batch, as in vLLM and transformers' continuous batching: the new
tokens of all running requests are concatenated into ``input_ids [1, total_q]`` with their absolute
``position_ids [1, total_q]`` (RoPE needs them); ``query_start_loc`` splits the rows per request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.cli.e2e.fp8 import calculate_kv_scales

#: attention implementation name registered with ``transformers.AttentionInterface``.
ATTN_IMPLEMENTATION = "pagedkv"

#: keyword argument that carries the :class:`StepContext` through the model's forward.
STEP_KWARG = "pagedkv_step"



def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("pagedkv.cli.e2e needs transformers: pip install 'pagedkv[hf]'") from exc
    return transformers


# -- the attention hook -------------------------------------------------------------------------------
@dataclass
class StepContext:
    """What the attention function of every layer needs for one packed step.

    Attributes:
        cache: the :class:`pagedkv.cache.paged_cache.PagedKVCache`; layer ``l`` uses
            ``cache.k_cache(l)`` / ``v_cache(l)``.
        backend: any object with the contract's ``write_kv`` and ``paged_attention``.
        slot_mapping: ``int64 [total_q]``, where each new token's K/V goes.
        block_tables: ``int32 [batch, max_blocks]``, ``-1``-padded, *after* this step's ``append``.
        seq_lens: ``int32 [batch]``, context lengths including this step's tokens.
        query_start_loc: ``int32 [batch + 1]``, row offsets of each request in the packed batch.
        kv_scales: for fp8 pools, ``{layer: (k_scale, v_scale)}``, shared by every step of the run:
            a layer missing from it gets its scales from this step's K/V (vLLM's
            ``calculate_kv_scales`` on the first prefill, see :mod:`pagedkv.cli.e2e.fp8`).
    """

    cache: Any
    backend: Any
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    kv_scales: dict[int, tuple[float, float]] | None = None


def pagedkv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, scaling: float | None = None,
                              dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function backed by pagedkv (registered as ``"pagedkv"``).

    Args:
        module: the attention module; its ``layer_idx`` selects the layer's pools.
        query: ``[1, num_q_heads, total_q, head_dim]`` (after RoPE), the packed step.
        key, value: ``[1, num_kv_heads, total_q, head_dim]``, the step's new K/V only.
        attention_mask: ignored (transformers builds none for this implementation; causality and
            request boundaries come from ``seq_lens`` / ``query_start_loc``).
        scaling: logits multiplier (the model's own: ``head_dim ** -0.5``, Gemma 2's
            ``query_pre_attn_scalar ** -0.5``), passed on as ``scale``.
        dropout: must be 0 (inference only).
        kwargs: must hold ``pagedkv_step``, a :class:`StepContext`. The layer's ``sliding_window``
            (``W``: a query sees the last ``W`` keys, itself included, as transformers' sliding-window
            mask) becomes ``window_left=W - 1`` and ``softcap`` (Gemma 2's ``attn_logit_softcapping``)
            ``softcap``; each is passed only when set, so a backend without the feature still serves
            plain models.

    Returns:
        ``([1, total_q, num_q_heads, head_dim], None)`` in ``query.dtype``, as transformers expects.

    Raises:
        ValueError: no ``pagedkv_step`` keyword, a batch dimension other than 1, non-zero dropout, or
            a module without ``layer_idx``. The backend's own errors propagate unchanged.
    """
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, StepContext):
        raise ValueError(f"attention implementation {ATTN_IMPLEMENTATION!r} needs the keyword argument "
                         f"{STEP_KWARG}=StepContext(...) in the model call, got {type(step).__name__}")
    if query.shape[0] != 1:
        raise ValueError(f"pagedkv attention expects a packed batch of 1, got query batch {query.shape[0]}")
    if dropout:
        raise ValueError(f"pagedkv attention is inference only, got dropout={dropout}")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx; cannot pick the layer's K/V pools")
    cache = step.cache
    k_cache, v_cache = cache.k_cache(layer), cache.v_cache(layer)
    q = query[0].transpose(0, 1).contiguous()  # [total_q, Hq, D]
    k = key[0].transpose(0, 1).contiguous()  # [total_q, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()
    features: dict[str, Any] = {}
    window = kwargs.get("sliding_window")
    if window is not None:
        features["window_left"] = int(window) - 1
    softcap = kwargs.get("softcap")
    if softcap:
        features["softcap"] = float(softcap)
    scales: dict[str, Any] = {}
    if step.kv_scales is not None:
        if layer not in step.kv_scales:
            step.kv_scales[layer] = calculate_kv_scales(k, v)
        scales = dict(zip(("k_scale", "v_scale"), step.kv_scales[layer]))
    step.backend.write_kv(k_cache, v_cache, k, v, step.slot_mapping, **scales)
    out = step.backend.paged_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens,
                                       step.query_start_loc, scaling, **features, **scales)
    return out.unsqueeze(0), None


def register_attention() -> str:
    """Register :func:`pagedkv_attention_forward` as ``"pagedkv"`` with transformers (idempotent).

    Returns:
        The implementation name, for ``attn_implementation=``.

    Raises:
        ImportError: transformers is not installed.
    """
    _require_transformers()
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, pagedkv_attention_forward)
    return ATTN_IMPLEMENTATION


# -- models -------------------------------------------------------------------------------------------
#: ``--arch`` choices: transformers architectures built with seeded random weights.
ARCHS = ("llama", "mistral", "gemma2", "deepseek_v3")

#: DeepSeek-V3 (MLA) config of the random model: a latent of 32 plus 8 rope columns (V3's 512 + 64 at a
#: tenth), per-head nope / V widths of 16, dense MLPs on every layer (no MoE routing to set up).
MLA_KV_LORA_RANK, MLA_ROPE_DIM, MLA_NOPE_DIM, MLA_V_DIM = 32, 8, 16, 16

#: sliding window of the ``mistral`` and ``gemma2`` configs (tokens a query sees, itself included):
#: small, so the scenario's contexts exceed it, and not a multiple of the usual block sizes.
DEFAULT_SLIDING_WINDOW = 10

#: Gemma 2 config: ``attn_logit_softcapping`` small enough that the random model's attention logits
#: (up to ~6) are visibly bent by the tanh; ``final_logit_softcapping`` (applied by the model itself);
#: ``query_pre_attn_scalar`` unlike ``head_dim``, so a backend ignoring ``scale`` is caught.
GEMMA2_ATTN_SOFTCAP = 4.0
GEMMA2_FINAL_SOFTCAP = 8.0
GEMMA2_QUERY_PRE_ATTN_SCALAR = 24


def _config(arch: str, sliding_window: int, **common: Any):
    """The transformers config of ``arch`` (see :func:`build_model`)."""
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "mistral":  # every layer slides
        return transformers.MistralConfig(**common, sliding_window=sliding_window)
    if arch == "gemma2":  # layers alternate sliding / full (transformers' default layer_types)
        return transformers.Gemma2Config(**common, head_dim=common["hidden_size"] // common["num_attention_heads"],
                                         sliding_window=sliding_window, attn_logit_softcapping=GEMMA2_ATTN_SOFTCAP,
                                         final_logit_softcapping=GEMMA2_FINAL_SOFTCAP,
                                         query_pre_attn_scalar=GEMMA2_QUERY_PRE_ATTN_SCALAR)
    if arch == "deepseek_v3":  # MLA: one latent "kv head"; q_lora for the query as in V3
        common = {**common, "num_key_value_heads": common["num_attention_heads"]}
        return transformers.DeepseekV3Config(
            **common, q_lora_rank=32, kv_lora_rank=MLA_KV_LORA_RANK, qk_rope_head_dim=MLA_ROPE_DIM,
            qk_nope_head_dim=MLA_NOPE_DIM, v_head_dim=MLA_V_DIM, first_k_dense_replace=common["num_hidden_layers"],
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
            rope_interleave=True)
    raise ValueError(f"arch must be one of {list(ARCHS)}, got {arch!r}")


def build_model(*, arch: str = "llama", seed: int = 0, vocab_size: int = 256, hidden_size: int = 64,
                num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                initializer_range: float = 0.2, sliding_window: int = DEFAULT_SLIDING_WINDOW,
                dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """A small causal LM of architecture ``arch`` with seeded random weights, attention served by pagedkv.

    - ``llama``: ``LlamaForCausalLM`` (RoPE, GQA, RMSNorm, SwiGLU), full causal attention;
    - ``mistral``: ``MistralForCausalLM`` with ``sliding_window`` on every layer;
    - ``gemma2``: ``Gemma2ForCausalLM``: sliding-window and full layers alternating, attention logit
      soft-capping, ``query_pre_attn_scalar``, final logit soft-capping (embeddings untied, as in
      every config here: tied ones make a random model echo its input token, whatever attention does).

    ``initializer_range`` is larger than a trained model's init (0.02) so that attention is sharp
    (far from uniform): a wrong key or a missing causal offset then changes the output visibly.

    Returns:
        The model in eval mode, in ``dtype`` on ``device``, ``config._attn_implementation == "pagedkv"``.

    Raises:
        ImportError: transformers is not installed. ValueError: heads that do not divide, an unknown
            ``arch``, ``sliding_window < 1``.
    """
    _require_transformers()
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size {hidden_size}, num_heads {num_heads}, num_kv_heads {num_kv_heads} must divide")
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    from transformers import AutoModelForCausalLM

    register_attention()
    config = _config(arch, sliding_window, vocab_size=vocab_size, hidden_size=hidden_size,
                     intermediate_size=intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                     num_key_value_heads=num_kv_heads, max_position_embeddings=4096,
                     initializer_range=initializer_range, tie_word_embeddings=False)
    config._attn_implementation = ATTN_IMPLEMENTATION
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION)
    if is_mla(model):
        install_latent_attention(model)
    return model.to(device=device, dtype=dtype).eval()


# -- MLA: attention over the paged latent cache --------------------------------------------------------
def is_mla(model: torch.nn.Module) -> bool:
    """Whether ``model`` uses multi-head latent attention (DeepSeek V2 / V3: ``kv_lora_rank`` in its config)."""
    return getattr(model.config, "kv_lora_rank", None) is not None


def install_latent_attention(model: torch.nn.Module) -> None:
    """Serve every MLA layer of ``model`` from the paged latent cache (:func:`latent_attention_forward`);
    without a :class:`StepContext` (the dense oracle's copy) a layer runs transformers' own forward."""
    import types

    for module in model.modules():
        if hasattr(module, "kv_b_proj") and hasattr(module, "kv_a_proj_with_mqa"):
            module.forward = types.MethodType(latent_attention_forward, module)


def latent_attention_forward(self: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple,
                             attention_mask: torch.Tensor | None, cache: Any = None, **kwargs: Any):
    """DeepSeek-V3 attention over the paged latent cache, vLLM's MLA decode (weights absorbed).

    The layer's latent ``c = [kv_a_layernorm(kv_c) (kv_lora_rank), RoPE(k_pe) (rope)]`` is its one "kv
    head": written with ``write_kv`` into the layer's pool ``k_cache [num_blocks, block_size, 1,
    kv_lora_rank + rope]``, and read by ``paged_attention(query, k_cache, k_cache[..., :kv_lora_rank], ...)``:
    V is the latent part of the same storage. The query is ``[q_nope @ W_UK, RoPE(q_pe)]`` (``W_UK``
    absorbed from ``kv_b_proj``), so ``q . c = q_nope . k_nope + q_pe . k_pe`` as in the expanded model,
    and the output ``o @ W_UV`` is the expanded model's attention output. transformers' own forward
    (expanded K and V) runs when no :class:`StepContext` is passed.

    Returns:
        ``(attn_output [1, total_q, hidden_size], None)``.
    """
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, StepContext):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    batch, t = hidden_states.shape[:2]
    if batch != 1:
        raise ValueError(f"pagedkv attention expects a packed batch of 1, got {batch}")
    nope, rope, rank, heads = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank, self.num_heads
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q_pass, q_rot = torch.split(q.view(1, t, heads, self.qk_head_dim).transpose(1, 2), [nope, rope], dim=-1)
    kv_c, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    kv_c = self.kv_a_layernorm(kv_c)
    k_rot = k_rot.view(1, 1, t, rope)
    cos, sin = position_embeddings
    rotary = ds.apply_rotary_pos_emb_interleave if self.config.rope_interleave else ds.apply_rotary_pos_emb
    q_rot, k_rot = rotary(q_rot, k_rot, cos, sin)
    w = self.kv_b_proj.weight.view(heads, nope + self.v_head_dim, rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    query = torch.cat([torch.einsum("hti,hic->thc", q_pass[0], w_uk), q_rot[0].transpose(0, 1)], dim=-1)
    latent = torch.cat([kv_c[0], k_rot[0, 0]], dim=-1).unsqueeze(1)  # [total_q, 1, rank + rope]
    k_cache = step.cache.k_cache(self.layer_idx)
    # write_kv takes two pools: the cache's V pool gets the latent too and is never read (the cache
    # manager has no single-pool mode); attention reads V from K's storage
    step.backend.write_kv(k_cache, step.cache.v_cache(self.layer_idx), latent, latent, step.slot_mapping)
    out = step.backend.paged_attention(query.contiguous(), k_cache, k_cache[..., :rank], step.block_tables,
                                       step.seq_lens, step.query_start_loc, self.scaling)
    out = torch.einsum("thc,hvc->thv", out, w_uv).reshape(1, t, heads * self.v_head_dim)
    return self.o_proj(out), None


def load_model(path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """Load a local causal-LM checkpoint directory with pagedkv attention (no network access).

    Only ``*.safetensors`` weights are read (``use_safetensors=True``: pickle ``.bin`` / ``.pt``
    checkpoints can run code when loaded) and never code shipped with the checkpoint
    (``trust_remote_code=False``: the architecture must be one transformers has).

    Raises:
        ImportError: transformers is not installed. OSError: ``path`` is not a directory, holds no
            ``.safetensors`` weights, or is not a loadable checkpoint.
        ValueError: its config asks for remote code.
    """
    _require_transformers()
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise OSError(f"model directory {path!r} does not exist (only local checkpoints are loaded)")
    if not any(name.endswith(".safetensors") for name in os.listdir(path)):
        raise OSError(f"model directory {path!r} holds no .safetensors weights; only safetensors are loaded "
                      f"(pickle .bin/.pt checkpoints can run code): convert it with save_pretrained(..., "
                      f"safe_serialization=True) on a machine you trust")
    register_attention()
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                 trust_remote_code=False, attn_implementation=ATTN_IMPLEMENTATION)
    return model.to(device=device, dtype=dtype).eval()


def every_layer_window_left(model: torch.nn.Module) -> int | None:
    """The ``window_left`` every attention layer of ``model`` uses, or ``None`` when one attends fully.

    ``sliding_window`` (``W``, the query included) on every layer, as Mistral's config sets it, gives
    ``W - 1``: the cache can then release the blocks no later query reads (``CacheConfig.window_left``).
    ``None`` without a window, with ``use_sliding_window=False`` (Qwen 2), or when ``layer_types``
    holds a full-attention layer (Gemma 2 alternates): such a layer reads the whole context, so the
    shared block table must keep every block (the windowed layers just skip the early ones).
    """
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    if window is None or not getattr(cfg, "use_sliding_window", True):
        return None
    kinds = getattr(cfg, "layer_types", None)
    if kinds is not None and any(kind != "sliding_attention" for kind in kinds):
        return None
    return int(window) - 1


def model_geometry(model: torch.nn.Module) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers decoder-only model (MLA: one latent
    "head" of ``kv_lora_rank + qk_rope_head_dim``)."""
    cfg = model.config
    if is_mla(model):
        return cfg.num_hidden_layers, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim
