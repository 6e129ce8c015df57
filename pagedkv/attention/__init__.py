"""Attention math shared by the backends and the checks.

- ``dense``: dense attention over gathered K/V and the fp64 reference (flash-attn's varlen conventions);
- ``blockwise``: the fused kernel's block-by-block algorithm (online softmax), in plain PyTorch;
- ``fp8``: fp8 KV arithmetic (vLLM's ``kv_cache_dtype="fp8"``): quantize on write, dequantize on read.
"""
