"""An attention mismatch names its kind when the output equals a recognisable wrong attention."""

import pytest
import torch

from pagedkv.testing.cases import known as kc
from pagedkv.testing.compare import Mismatch
from pagedkv.testing.properties.definitions import attention_matches_reference


class PlantedAttention:
    """Plain-torch causal attention over NHD pools with one planted fault (or none)."""

    def __init__(self, mask_offset=0, scale=None, round_robin=False, noise=0.0):
        self.mask_offset, self.scale, self.round_robin, self.noise = mask_offset, scale, round_robin, noise
        self.name = "planted"

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        _, bs, kv_heads, _ = k_cache.shape
        scale = self.scale or (query.shape[-1] ** -0.5 if scale is None else scale)
        heads = torch.arange(query.shape[1])
        kv_of = heads % kv_heads if self.round_robin else heads // (query.shape[1] // kv_heads)
        out = torch.zeros_like(query)
        qsl = query_start_loc.tolist()
        for b, n in enumerate(seq_lens.tolist()):
            q = query[qsl[b]:qsl[b + 1]].double()
            if q.shape[0] == 0:
                continue
            pos = torch.arange(n)
            slots = block_tables[b][pos // bs].long() * bs + pos % bs
            k = k_cache.reshape(-1, kv_heads, k_cache.shape[-1])[slots].double()[:, kv_of]
            v = v_cache.reshape(-1, kv_heads, k_cache.shape[-1])[slots].double()[:, kv_of]
            logits = torch.einsum("qhd,khd->hqk", q, k) * scale
            rows = torch.arange(q.shape[0]).unsqueeze(1) + (n - q.shape[0]) + self.mask_offset
            logits = logits.masked_fill(pos.unsqueeze(0) > rows, float("-inf"))
            o = torch.einsum("hqk,khd->qhd", logits.softmax(-1).nan_to_num(0.0), v)
            out[qsl[b]:qsl[b + 1]] = (o + self.noise).to(query.dtype)
        return out


@pytest.mark.parametrize("planted, kind", [
    (dict(mask_offset=-1), "with the causal mask shifted one token early"),
    (dict(mask_offset=1), "with the causal mask shifted one token late"),
    (dict(mask_offset=10**6), "without the causal mask"),
    (dict(scale=1.0), "without the scale"),
    (dict(round_robin=True), "with query heads mapped to kv heads round-robin"),
])
def test_a_recognisable_mismatch_names_its_kind(planted, kind):
    with pytest.raises(Mismatch, match="paged_attention vs fp64 reference at ") as info:
        attention_matches_reference(PlantedAttention(**planted), kc.C8)
    message = str(info.value)
    assert "; the output equals attention " in message and kind in message.split("; the output equals attention ")[1]
    assert kind in info.value.where["kind"]


def test_a_mismatch_of_no_known_shape_names_none():
    attention_matches_reference(PlantedAttention(), kc.C8)  # the unplanted kernel passes
    with pytest.raises(Mismatch) as info:
        attention_matches_reference(PlantedAttention(noise=0.01), kc.C8)
    assert "equals attention" not in str(info.value) and "kind" not in info.value.where
