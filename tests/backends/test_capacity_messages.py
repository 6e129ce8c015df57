"""C9 on pagedkv's own backends: a table too short for its tokens (or holding ``-1`` where a token is read) is
refused before any write, with pagedkv's message. The gate judges a candidate on the error type and the
argument named only (``test_every_fault_is_rejected_on_a_fixed_case``); these are pagedkv's own words."""

from __future__ import annotations

import pytest
import torch

from pagedkv.backends import get_backend
from pagedkv.testing.compare import bits


@pytest.mark.parametrize("name", ["loop", "indexed", "triton"])
def test_capacity_is_checked_before_any_write(name):
    if name == "triton":
        pytest.importorskip("triton")
    backend = get_backend(name)
    cache = torch.full((4, 4, 1, 4), float("nan"))
    cache[2], cache[0] = 1.0, 2.0
    table = torch.tensor([2, 0, -1], dtype=torch.int32)
    before = bits(cache).clone()
    with pytest.raises(ValueError, match=r"block_table has 2 entries.*seq_len 9"):
        backend.gather(cache, table[:2], 9)
    with pytest.raises(IndexError, match=r"block_table has block id -1 at entry 2"):
        backend.gather(cache, table, 9)
    with pytest.raises(ValueError, match=r"start \+ n = 6 \+ 3 = 9"):
        backend.scatter(cache, table[:2], torch.ones((3, 1, 4)), 6)
    assert torch.equal(bits(cache), before)
