"""Attention math shared by the backends and the checks.

- ``dense``: dense attention over gathered K/V and the fp64 reference (flash-attn's varlen conventions);
- ``blockwise``: the fused kernel's block-by-block algorithm (online softmax), in plain PyTorch;
- ``fp8``: fp8 KV arithmetic (vLLM's ``kv_cache_dtype="fp8"``): quantize on write, dequantize on read.
"""

from pagedkv._moved import moved

# ``pagedkv.attention`` was one module before it became this package: its names, for one release.
__getattr__ = moved("pagedkv.attention", {name: "pagedkv.attention.dense" for name in (
    "attend", "causal_mask", "feature_logits", "paged_attention_by_gather", "paged_attention_sync_free",
    "reference_attention", "softmax_with_sinks")})
