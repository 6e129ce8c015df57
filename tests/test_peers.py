"""Other projects' paged KV code under the same properties (pagedkv.testing.peers), when installed here.

Absent projects (or a missing CUDA device) skip with the reason. What each peer passes in full is
``pagedkv.testing.peers.report()``; these tests pin the parts that hold.
"""

import pytest

from pagedkv.testing import peers
from pagedkv.errors import BackendUnavailableError
from pagedkv.testing.registry import properties
from pagedkv.testing.runner import run_property


def _peer(name):
    try:
        return peers.PEERS[name]()
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("name,prop", [("torch_paged_attention", "write_kv_lands_at_slot_mapping_and_skips_negative_slots"),
                                       ("vllm_cache_ops", "write_kv_lands_at_slot_mapping_and_skips_negative_slots"),
                                       ("flash_attn_kvcache", "paged_attention_matches_fp64_dense_reference")])
def test_peer_passes_the_property(name, prop, device):
    failed, _, case, error = run_property(_peer(name), properties()[prop], "dev", device)
    assert not failed, f"{name} fails {prop}: {error} on {case}"


def test_torch_paged_attention_cannot_map_one_block_twice_in_a_sequence(device):
    """A documented limit of PagedAttention's physical_to_logical map, reported as ValueError."""
    import torch

    from pagedkv.testing.cases import Case, Geometry, SeqSpec

    args = Case(Geometry(2, 2), (SeqSpec((1, 1), 4, 1),)).block_tables(device)
    peer = _peer("torch_paged_attention")
    k = torch.zeros((2, 2, 1, 4), device=device)
    with pytest.raises(ValueError, match="names a physical block twice"):
        peer.paged_attention(torch.zeros((1, 1, 4), device=device), k, k.clone(), args,
                             torch.tensor([4], dtype=torch.int32, device=device),
                             torch.tensor([0, 1], dtype=torch.int32, device=device))


def test_peers_load_by_spec_or_fail_with_the_reason():
    from pagedkv import BackendError, load_backend

    for name, reason in peers.available().items():
        if reason:
            with pytest.raises(BackendError, match="need|not installed|has no"):
                load_backend(f"pagedkv.testing.peers:{name}")
        else:
            assert load_backend(f"pagedkv.testing.peers:{name}").name == name
