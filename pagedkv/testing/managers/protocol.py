"""The cache-manager protocol: what the state machine asks of any engine's block manager.

A manager owns block ids, not K/V: it says which blocks a request's tokens live in and which slots its
next tokens go to; the machine writes the K/V there and reads it back. One request's life::

    block_ids, num_cached = m.admit(rid, prompt, namespace, extra_keys)   # prefix-cache lookup
    slots = m.reserve(rid, prompt[num_cached:num_cached + chunk])        # prefill chunk or decode token
    ... write K/V at ``slots`` in every layer ...
    m.commit(rid, num_tokens)                                            # those tokens' K/V is written
    m.free(rid)                                                          # finish, abort

Each engine's adapter maps these calls onto its own manager (vLLM's ``KVCacheManager``, SGLang's
``RadixCache`` + token-to-KV allocator, pagedkv's ``PagedKVCache``); :class:`ManagerCapabilities` says
what it has. A manager is handed to the machine by a factory ``make(config: ManagerConfig) -> CacheManager``.

**KV-cache groups** (a hybrid model: vLLM's ``HybridKVCacheCoordinator``, SGLang's SWA and Mamba radix
caches). ``ManagerConfig.groups`` asks for several groups (:class:`GroupSpec`: full attention, sliding
window, chunked local attention, a recurrent state such as Mamba), every group's blocks from one pool of
block ids, as in vLLM (a block id is one page of every layer slot: layer ``i`` of each group shares
memory, so a block owned by two groups at once is corruption). A manager whose
``capabilities.groups`` is not empty answers per group, in ``groups`` order::

    (block_ids_per_group, num_cached) = m.admit(...)     # one hit length every group agrees on
    slots_per_group = m.reserve(rid, tokens)             # a tuple: one slot list per group
    tables = m.block_table(rid)                          # a tuple: one block table per group

A group's slot is ``block_id * group.block_size + offset``. A one-group manager keeps the plain shapes
(lists); the machine wraps it (:func:`as_grouped`). The layouts a manager takes are its candidate's
``cache_manager_layouts``, beside ``cache_manager`` on the module or object ``--pagedkv-impl`` names (names in
:data:`HYBRID_LAYOUTS`; default ``(ONE_GROUP,)``).

**A KV connector** (``capabilities.connector``: vLLM's scheduler-side ``KVConnectorBase_V1``, LMCache,
NIXL): the machine plays the external store. ``admit(..., num_stored=S)`` says the store holds the
prompt's first ``S`` tokens (whole blocks, or any prefix where ``capabilities.token_loads``: a P/D prefiller's
prompt less its backoff); the manager takes the tokens past its local hit as external
(``num_external(rid)``); ``load(rid)`` allocates their blocks and returns the slots the load writes;
the request is not stepped until ``load_done(rid, ok)``; a failed load is recomputed from the local hit.
A freed request's blocks may be stored: none of them is handed to anyone before ``store_done(rid)``.

**Speculative decoding** (``capabilities.speculative``: vLLM's EAGLE / MTP, SGLang's spec v2):
``reserve(rid, tokens, num_draft=k)`` also takes the last ``k`` of ``tokens`` as unverified drafts;
``drop(rid, num_rejected)`` drops the rejected tail; no rejected token's K/V or state is ever served.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

#: An extra key at a token position: ``(position, key)``, e.g. a multimodal input's hash at its offset.
ExtraKey = tuple[int, Hashable]

#: Group kinds: what a query at position ``p`` reads of its own request (:meth:`GroupSpec.first_read`).
GROUP_KINDS = ("full", "sliding_window", "chunked_local", "mamba")


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group (vLLM's ``KVCacheGroupSpec`` with its ``KVCacheSpec``).

    Attributes:
        kind: one of :data:`GROUP_KINDS`:
            ``"full"``: a query reads every earlier token (vLLM ``FullAttentionSpec``);
            ``"sliding_window"``: tokens ``p - window .. p`` (``window`` is ``window_left``, flash-attn's
            convention; vLLM's ``SlidingWindowSpec.sliding_window`` is ``window + 1``);
            ``"chunked_local"``: tokens of its own chunk, ``p // chunk * chunk .. p`` (Llama 4's
            ``attention_chunk_size``; vLLM ``ChunkedLocalAttentionSpec``);
            ``"mamba"``: one recurrent state per request (vLLM ``MambaSpec``, SGLang's ``MambaRadixCache``):
            the slot of token ``p`` holds the state after token ``p`` where a step wrote one. A step
            writes the state after its last token only (with drafts: after its last verified token and
            after each draft token, so the accepted one can be kept), so a block caches a state only
            where a step ended at its last token: ``block_size`` is the state's alignment in tokens
            (vLLM's ``"align"`` mamba cache mode). A hit of ``h`` tokens must read the state after
            token ``h - 1`` at that token's slot.
        block_size: tokens per block of this group (a multiple of the hash block size, the smallest
            block size of the layout, where sizes differ).
        window: ``window_left`` tokens (``"sliding_window"`` only).
        chunk: chunk length in tokens, a multiple of ``block_size`` (``"chunked_local"`` only).
        num_layers: layers in the group (each reads and writes the group's blocks).
        host_resident: the group's pages live in a host pool, the device keeping reclaimable resident copies
            (``"full"`` only; vLLM's ``KVCacheGroupSpec.host_resident``, its HiSparse latent group). What a
            query reads is full attention's: a manager without a host tier serves it as a plain ``"full"``
            group, one with a tier names in its block table where each page is read (its device copy, or its
            host block where the copy was reclaimed).
        prefill_checkpoints: a prefill step may also write the state at the last prefix-match boundary below its
            end (vLLM: in every chunk it is valid for, under sparse retention only in the one reaching the prefill's
            end) (``"mamba"`` only; vLLM's Mamba2 layers, ``MambaSpec.
            num_prefill_checkpoint_blocks``: Nemotron-H, Granite 4, Falcon-H1, Zamba2, exporting the state from
            inside one forward pass rather than ending a chunk there), into a block its manager reserved for it:
            a reservation names by a slot of at least 0 each position whose state its step writes (the last
            always; an exported one in any block of the request's table), ``-1`` at the others. Where every Mamba
            group exports them under the state promise, the state at a prefilled prompt's replay boundary is
            promised a hit (``ManagerMachine.replay_hit``).

    Raises:
        ValueError: an unknown ``kind``, a ``window`` or ``chunk`` missing, negative or given to another
            kind, a ``block_size`` or ``num_layers`` below 1, a ``chunk`` not a multiple of ``block_size``,
            ``host_resident`` for a kind other than ``"full"``, ``prefill_checkpoints`` for a kind other than
            ``"mamba"``.
    """

    kind: str
    block_size: int
    window: int | None = None
    chunk: int | None = None
    num_layers: int = 1
    host_resident: bool = False
    prefill_checkpoints: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"kind {self.kind!r}: expected one of {GROUP_KINDS}")
        if self.block_size < 1 or self.num_layers < 1:
            raise ValueError(f"block_size {self.block_size} and num_layers {self.num_layers} must be >= 1")
        if (self.window is not None) != (self.kind == "sliding_window") or (self.window or 0) < 0:
            raise ValueError(f"window {self.window!r}: a window_left >= 0 for kind 'sliding_window' only")
        if (self.chunk is not None) != (self.kind == "chunked_local") or (
                self.chunk is not None and (self.chunk < 1 or self.chunk % self.block_size)):
            raise ValueError(f"chunk {self.chunk!r}: a positive multiple of block_size {self.block_size} for "
                             f"kind 'chunked_local' only")
        if self.host_resident and self.kind != "full":
            raise ValueError(f"host_resident: a host tier for kind 'full' only, not {self.kind!r}")
        if self.prefill_checkpoints and self.kind != "mamba":
            raise ValueError(f"prefill_checkpoints: exported states for kind 'mamba' only, not {self.kind!r}")

    def first_read(self, position: int) -> int:
        """The first token position (of the same request) whose slot a query at ``position`` reads: 0
        (full), ``position - window`` (sliding window, floored at 0), its chunk's start (chunked local),
        or ``position - 1`` (mamba: the state after the previous token, floored at 0)."""
        if self.kind == "sliding_window":
            return max(0, position - self.window)
        if self.kind == "chunked_local":
            return position // self.chunk * self.chunk
        if self.kind == "mamba":
            return max(0, position - 1)
        return 0


#: The layout of a one-group manager (today's ``block_size`` and ``window_left``, no groups).
ONE_GROUP = "one-group"

#: Hybrid layouts of real models, by name: ``layout(block_size, window) -> tuple[GroupSpec, ...]``;
#: ``block_size`` is the hash block size, ``window`` a ``window_left`` the machine draws (:func:`layout_window`).
HYBRID_LAYOUTS = {
    # Gemma 2/3/4: full-attention and sliding-window layers (5 sliding : 1 full in Gemma 3).
    "gemma3": lambda bs, w: (GroupSpec("full", bs), GroupSpec("sliding_window", bs, window=w, num_layers=2)),
    # Llama 4: full-attention (NoPE) and chunked local attention layers.
    "llama4": lambda bs, w: (GroupSpec("full", bs), GroupSpec("chunked_local", bs, chunk=2 * bs)),
    # Jamba, Qwen3-Next, Nemotron-H, Granite 4: Mamba (or linear attention) and full-attention layers.
    "jamba": lambda bs, w: (GroupSpec("full", bs), GroupSpec("mamba", bs)),
    "qwen3-next": lambda bs, w: (GroupSpec("full", bs), GroupSpec("mamba", bs, num_layers=2)),
    # GPT-OSS split as vLLM splits layers into equal groups: two full groups and one sliding-window group.
    "gpt-oss-2full-sw": lambda bs, w: (GroupSpec("full", bs), GroupSpec("full", bs),
                                       GroupSpec("sliding_window", bs, window=w)),
    # Groups of different block sizes, each a multiple of the hash block size.
    "mixed-block-sizes": lambda bs, w: (GroupSpec("full", 2 * bs), GroupSpec("sliding_window", bs, window=w)),
    # Three attention types: Hymba's full-attention and sliding-window layers beside Mamba layers.
    "hymba": lambda bs, w: (GroupSpec("full", bs), GroupSpec("sliding_window", bs, window=w),
                            GroupSpec("mamba", bs)),
    # DeepSeek-V4: one full (MLA) group and sliding-window groups of different windows (the second one odd:
    # not a multiple of an even block size).
    "deepseek-v4": lambda bs, w: (GroupSpec("full", bs), GroupSpec("sliding_window", bs, window=w),
                                  GroupSpec("sliding_window", bs, window=2 * w + bs + 1)),
    # Two sliding-window groups of one window and different block sizes: two specs of one kind.
    "two-window-block-sizes": lambda bs, w: (GroupSpec("full", 2 * bs), GroupSpec("sliding_window", bs, window=w),
                                             GroupSpec("sliding_window", 2 * bs, window=w)),
}


#: Layouts served with sparse prefix-cache retention (vLLM's ``prefix_cache_retention_interval``, in scheduler
#: blocks: the lcm of the groups' block sizes): a sliding-window group caches only the blocks a hit at a kept
#: boundary needs. ``0`` is vLLM 0.32's engine default (``--prefix-cache-retention-interval``: only the replay
#: boundary, the prompt less its last token, and a shared-prefix junction are kept); ``n > 0`` also keeps one
#: boundary every ``n`` scheduler blocks; a Mamba group keeps only those boundaries' states. Every other layout is
#: dense (every block cached, ``None``).
LAYOUT_RETENTION = {"gemma3-sparse": 0, "gemma3-interval": 3, "qwen3-next-sparse": 0, "deepseek-v4-interval": 3,
                    "nemotron-h-interval": 3, "nemotron-h-sparse": 0}
HYBRID_LAYOUTS["gemma3-sparse"] = HYBRID_LAYOUTS["gemma3-interval"] = HYBRID_LAYOUTS["gemma3"]
HYBRID_LAYOUTS["qwen3-next-sparse"] = HYBRID_LAYOUTS["qwen3-next"]
HYBRID_LAYOUTS["deepseek-v4-interval"] = HYBRID_LAYOUTS["deepseek-v4"]

#: Layouts served with a multi-module MTP drafter (``ManagerConfig.multi_module_mtp``): vLLM's speculative method
#: ``"mtp"`` over a model with several MTP modules (``num_nextn_predict_layers`` > 1: ``SpeculativeConfig.
#: use_multi_module_mtp``; Step-3.5's and MiMo's MTP heads), one MLA full-attention group as DeepSeek-V3's. Its
#: block size is the hash block size, at least the 3 draft tokens the machine asks for: vLLM refuses multi-module
#: MTP with prefix caching where ``scheduler_block_size < num_speculative_tokens`` (``KVCacheCoordinator.__init__``).
MULTI_MODULE_MTP_LAYOUTS = ("mtp-multi-module",)
HYBRID_LAYOUTS["mtp-multi-module"] = lambda bs, w: (GroupSpec("full", max(bs, 3)),)

#: Layouts served with a prefix-match unit finer than every group's block (vLLM's ``--prefix-match-unit``,
#: ``CacheConfig.prefix_match_unit``, the hash block size): ``qwen3-next-fine`` is Qwen3-Next (Gated DeltaNet) as
#: vLLM serves it with fine-grained partial hash hits, full attention and a Mamba "align" group of one block
#: size (vLLM aligns the attention block to the Mamba state's page), four prefix-match units a block, the unit the
#: drawn hash block size. A hit then lands on any unit boundary, inside a block (vLLM's
#: ``HybridKVCacheCoordinator.enable_partial_hash_hits``). ``nemotron-h-fine`` is the same for a model of Mamba2
#: layers (Nemotron-H, Granite 4), whose prompt's last chunk exports the state at its replay boundary
#: (``GroupSpec.prefill_checkpoints``) where vLLM would otherwise end a chunk there.
LAYOUT_PREFIX_MATCH_UNIT = {"qwen3-next-fine", "nemotron-h-fine"}
HYBRID_LAYOUTS["qwen3-next-fine"] = lambda bs, w: (GroupSpec("full", 4 * bs), GroupSpec("mamba", 4 * bs, num_layers=2))
HYBRID_LAYOUTS["nemotron-h-fine"] = lambda bs, w: (GroupSpec("full", 4 * bs),
                                                   GroupSpec("mamba", 4 * bs, num_layers=2, prefill_checkpoints=True))

#: DeepSeek-V3.2 / GLM-5 sparse MLA served with a host tier (vLLM's HiSparse, ``vllm/v1/hisparse/``): the latent
#: group's pages live in a host pool with device copies reclaimed under pressure (``GroupSpec.host_resident``), the
#: indexer's keys a ``full`` group on the device.
HYBRID_LAYOUTS["hisparse"] = lambda bs, w: (GroupSpec("full", bs, host_resident=True), GroupSpec("full", bs))

#: Nemotron-H, Granite 4, Falcon-H1, Zamba2: Mamba2 layers (``MambaMixer2``) beside full attention, whose every
#: prefill chunk of two blocks or more exports the state one block before its end into a block the manager reserved
#: for it (``GroupSpec.prefill_checkpoints``, vLLM's ``MambaSpec.num_prefill_checkpoint_blocks``): a checkpoint on a
#: block boundary, kept where retention keeps that boundary. ``nemotron-h-interval`` serves it with a retention
#: interval (:data:`LAYOUT_RETENTION`), so the checkpoint a chunk exports is kept only on a segment's boundary;
#: ``nemotron-h-sparse`` under vLLM's default sparse retention, where only the chunk reaching the prefill's end exports.
HYBRID_LAYOUTS["nemotron-h"] = HYBRID_LAYOUTS["nemotron-h-interval"] = HYBRID_LAYOUTS["nemotron-h-sparse"] = (
    lambda bs, w: (GroupSpec("full", bs), GroupSpec("mamba", bs, num_layers=2, prefill_checkpoints=True)))


#: The widest window draw of a hybrid layout: ``window_left`` of this many blocks and one token, a window over several
#: blocks as real models' are (Gemma 3's 1,024 tokens are 64 blocks of 16); the draws below it are windows of that
#: many tokens inside a block or two (0: vLLM's ``sliding_window`` 1, which caches nothing).
WIDE_WINDOW_BLOCKS = 3


def layout_window(draw: int, block_size: int) -> int:
    """The ``window_left`` in tokens of a hybrid layout's window draw (0-3) at hash block size ``block_size``:
    ``draw`` tokens, or for 3, :data:`WIDE_WINDOW_BLOCKS` blocks and one token."""
    return WIDE_WINDOW_BLOCKS * block_size + 1 if draw >= 3 else draw


def layout_prefix_match_unit(name: str, block_size: int) -> int | None:
    """Layout ``name``'s prefix-match unit in tokens at hash block size ``block_size`` (``None``: the gcd of its
    groups' block sizes, vLLM's default)."""
    return block_size if name in LAYOUT_PREFIX_MATCH_UNIT else None


def layout_retention(name: str, block_size: int, window: int) -> int | None:
    """Layout ``name``'s retention interval in tokens (``None``: dense; 0: replay boundaries and junctions
    only), at hash block size ``block_size`` and window ``window`` as :func:`layout_groups` takes them."""
    if name not in LAYOUT_RETENTION:
        return None
    sizes = [g.block_size for g in layout_groups(name, block_size, window)]
    return LAYOUT_RETENTION[name] * math.lcm(*sizes)


def layout_groups(name: str, block_size: int, window: int) -> tuple[GroupSpec, ...]:
    """The groups of layout ``name`` (``()`` for :data:`ONE_GROUP`) at hash block size ``block_size``
    and sliding window ``window`` (``window_left``).

    Raises:
        ValueError: an unknown layout name.
    """
    if name == ONE_GROUP:
        return ()
    if name not in HYBRID_LAYOUTS:
        raise ValueError(f"layout {name!r}: expected {ONE_GROUP!r} or one of {sorted(HYBRID_LAYOUTS)}")
    return HYBRID_LAYOUTS[name](block_size, window)


@dataclasses.dataclass(frozen=True)
class ManagerCapabilities:
    """What a manager has and promises.

    Attributes:
        block_size: tokens per block (1 for a token-granular manager such as SGLang's page size 1).
        fork: ``fork(parent, child)`` shares the parent's blocks (copy-on-write on the partial block).
        window: ``window_left`` tokens a query attends back (sliding-window release of leading blocks);
            ``None``: full attention.
        namespaces: a namespace (cache salt, LoRA adapter) separates prefix-cache entries.
        extra_keys: extra keys at token positions (multimodal hashes) are part of a token's identity.
        prompt_embeds: prompt embeddings are part of a token's identity: an extra key ``("embed", identifier,
            index)`` says the input at its position is row ``index`` of embedding payload ``identifier``, not
            its token id (a placeholder; vLLM's ``prompt_embeds`` with ``prompt_is_token_ids``). Without it
            the machine draws no embeddings for the manager.
        preempt: ``preempt(rid)`` frees a request that is later re-admitted (recompute).
        resume: ``resume(rid)`` preempts a request and looks it up again as the same request, its output
            kept (vLLM's ``Scheduler._preempt_request``: the blocks freed, ``num_computed_tokens`` 0, the
            waiting request's ``get_computed_blocks`` over every token so far, prompt and output).
        evict: ``evict(num_blocks)`` drops unreferenced cached blocks on request.
        reset: ``reset()`` empties the prefix cache (no live request may read a dropped entry).
        eviction_order: the eviction order the manager promises, or ``None`` (not promised). ``"lru"`` is
            judged as vLLM's ``FreeKVCacheBlockQueue`` orders its blocks: a block handed out afresh is the front
            of a queue that starts as the never-used blocks (any order among them), where each call's released
            blocks with no cached content go to the very front, ahead of the never-used ones (any order among
            themselves), and its cached ones to the back, in release order (a request's blocks tail first;
            with several groups each group's tail first, the groups in any order). "Cached" is what the hit
            promise counts (a window group's blocks no whole-block hit reads are uncached). Other values are
            printed, not judged.
        hit_promise: what was committed and not evicted hits: a cached full block stays cached until its
            block is handed out again (or ``evict`` names it, or ``reset`` drops everything), so an admit
            must hit at least every such leading block, up to ``len(prompt) - min_computed_on_full_hit``.
            Beside a Mamba group with ``coordinated_lookup`` (no connector, EAGLE or ``hit_alignment``), what is
            promised is the state promise: a state a completed step wrote on a block boundary that retention keeps
            (``retention_interval``) hits while no eviction can have taken it.
        async_steps: the next step may be reserved before the previous one's writes complete (vLLM's
            async scheduling): ``commit(rid, n)`` says the step writing tokens below ``n`` completed, and
            blocks those in-flight steps read or write (the attention window behind each in-flight
            token) must not be handed to anyone meanwhile, not even after ``free(rid)``: a free with steps
            in flight is deferred until their ``commit`` (which the machine still calls after ``free``).
        min_computed_on_full_hit: tokens a hit on the whole prompt still leaves to compute (1 in vLLM and
            SGLang: the last token's logits are needed).
        defers_commit: a reservation may stay unwritten (the request aborted between reserve and write)
            and only ``commit`` makes tokens hittable. ``False``: the manager caches at reserve time and
            relies on the engine writing every reserved slot in the same step (vLLM v1), so the machine
            writes each reservation at once.
        owns_pools: the manager holds the K/V pools itself (``kv_pools(layer)``), because it copies K/V
            (copy-on-write); otherwise the machine allocates pools of ``total`` blocks. It may answer
            ``in_flight_pages() -> set[int]``: pages (``block * page + offset``) a copy fills from a block an
            in-flight step still writes (the engine copies after that step), left unread until it completes.
        groups: the KV-cache groups it serves (:class:`GroupSpec`, in the order of its per-group
            returns); ``()``: one group of ``block_size`` and ``window`` with plain (non-tuple) returns.
            A grouped manager that owns pools answers ``kv_pools(layer)`` for layer slot ``layer``
            (``[num_blocks, max block_size, num_kv_heads, head_dim]``; group ``g``'s block ``b``, offset
            ``o`` at ``[b, o]``), shared by layer ``layer`` of every group.
        connector: a KV connector (``num_stored`` on admit, ``num_external``, ``load``, ``load_done``,
            ``store_done``); see :class:`CacheManager`.
        speculative: draft tokens (``reserve(..., num_draft=k)``, ``drop``).
        misuse: the manager declares how it refuses misuse: ``misuses(request_id, freed_id)`` maps a
            name to ``(call, exception types)`` (a double free, a bad argument, ...), and ``snapshot()``
            returns its whole state (comparable with ``==``); each call must raise one of its types and
            change nothing, and so must a refused reservation (:mod:`.api_rules`).
        lookahead: with speculative decoding on, each reservation also holds blocks for this many positions
            past its tokens, where the proposer (EAGLE / MTP drafter) writes its next drafts' K/V in the same
            step, before any later reservation (vLLM's ``num_lookahead_tokens``); the machine writes there.
        admission: the admission promise, ``None`` (not promised): a ``reserve`` or ``load`` is refused only
            when the pool is short (and ``admit`` or ``resume``, which take no block, never). Its need is, per
            group, the blocks its tokens (and the lookahead) lie in that its table does not hold, plus, on a
            request's first reservation or load, the hit blocks no live request holds (touching one takes it
            from the free queue), less a window's or chunk's hit blocks wholly before the first token computed
            after it (never touched; all counted with drafts on, as vLLM's EAGLE window keeps one block more); a
            refusal while ``counts()`` shows that many free fails. ``"chunk"``: the need of the call's own
            tokens (vLLM's ``allocate_slots``);
            ``"sequence"``: a first reservation or load also needs the blocks of the whole prompt
            (``ManagerConfig.full_sequence_must_fit``: vLLM's ``scheduler_reserve_full_isl``);
            ``"whole-hit"``: as ``"chunk"``, but a load touches every block of its hit (kept for a recompute
            from the hit should the load fail).
        window_release: a sliding-window or chunked-local group releases the blocks a request's next query
            never reads: right after a ``reserve``, every block wholly before the group's first read of the
            request's first uncommitted token is ``-1`` in its table (vLLM's ``remove_skipped_blocks`` at
            the start of ``allocate_slots``, on the processed-token basis).
        retention_interval: sparse prefix-cache retention the hit promise follows (``ManagerConfig``'s,
            vLLM's ``prefix_cache_retention_interval``): ``None`` (dense) every block of a sliding-window
            group a whole-block hit needs is cached; otherwise only the blocks a hit needs at a kept boundary
            (each multiple of a positive interval, the prompt's replay boundary ``num_prompt - 1`` and a
            shared-prefix junction, each rounded down to whole scheduler blocks). Beside a Mamba group under the
            state promise it is a ceiling too (the retention promise): a hit reads a Mamba state only at such a
            kept boundary of a request sharing it, never at one retention drops.
        eagle_drop: with speculative decoding on, a hit leaves its last block to recompute (vLLM's EAGLE / MTP:
            the draft model's K/V of a hit's last token is written with the token after it, so each group
            matches one block past the hit and drops it). The hit promise is then the longest whole-block
            prefix whose every group also holds that next block cached, within the prompt's whole hash
            blocks; with several groups of full attention and sliding windows, the hit vLLM's coordinator
            agrees on (:mod:`pagedkv.testing.managers.lookup`: a popped hit re-aligned to the groups' common
            multiple, each group's drop redone where another shrinks the candidate) where the manager declares
            ``coordinated_lookup``. Declared without ``speculative`` (the engine runs EAGLE, the machine draws no
            drafts: vLLM beside a Mamba group), it moves the replay promise of ``hit_alignment`` to EAGLE's replay
            boundary (one prefix-match unit below the prompt's last whole unit).
        coordinated_lookup: the agreed hit of groups of full attention and sliding windows is the one vLLM's
            ``HybridKVCacheCoordinator.find_longest_cache_hit`` finds (each group's finder to a fixed point, a
            window needing its window's blocks contiguous and aligned), and what is cached is what vLLM's
            ``get_num_cacheable_tokens`` and ``reachable_block_mask`` cache: the machine promises exactly that
            hit (:mod:`pagedkv.testing.managers.lookup`), a lower bound and, where it knows every cached block,
            an upper one.
        eagle_margin: under ``eagle_drop``, the lookup reaches past the hit's cap (``len(prompt) -
            min_computed_on_full_hit``) to the prompt's whole hash blocks for the block it drops (vLLM's hybrid
            coordinator: ``eagle_proof_margin``); ``False``: it stops at the cap (vLLM's one-group
            ``UnitaryKVCacheCoordinator.find_longest_cache_hit``), so the next block must lie within it too.
        reprefill: with speculative decoding on, the last this many tokens a reservation computes are not cached
            by it (a later reservation caches them): vLLM's ``num_prefill_lookahead - 1`` re-prefillable tokens
            (``KVCacheCoordinator.get_num_cacheable_tokens``), ``num_speculative_tokens - 1`` under a multi-module
            MTP drafter (``VllmConfig.num_prefill_lookahead_tokens``: each module reads one prefill token further
            ahead), 0 under EAGLE. The hit promise follows it.
        kv_events: the manager publishes what it caches (vLLM's KV cache events, read by KV-aware routers):
            ``take_events()`` returns the events since the last call (:mod:`.kv_events`: ``BlockStored``,
            ``BlockRemoved``, ``AllBlocksCleared``), judged by an index rebuilt from them alone.
        hit_alignment: hits land on multiples of this many tokens, finer than the groups' blocks (vLLM's
            fine-grained partial hash hits: ``cache_hit_alignment_tokens``, the prefix-match unit, where a Mamba
            "align" group's block exceeds it); a hit may then end inside a block of every group, each group's
            admitted blocks being ``ceil(num_cached / block_size)``, the last one partly hit (copied on write
            before the request writes past the hit). ``None``: whole blocks of every group.
        cached_prompt: the manager reports, once a request's prefill produced its first output (the step computing
            its prompt's last token completed), how many of its prompt's leading tokens the prefix cache holds under
            the request's own block tables (:meth:`CachedPromptCalls.cached_prompt_tokens`; vLLM's
            ``KVCacheManager.estimate_cached_tokens``, which ``PrefillStats.finalize`` turns into the
            ``num_cache_creation_tokens`` of a ``RequestOutput``: ``min(reported, prompt) - num_cached_tokens``, the
            prompt tokens an API bills as written to the cache). Judged where every group is full attention or a
            sliding window and the machine knows what is cached (:meth:`~.machine.ManagerMachine.judge_cached_prompt`).
        zeroes_new_blocks: the engine's worker zeroes blocks the manager hands out afresh before their first use
            (vLLM's ``new_block_ids_to_zero``, run by ``GPUModelRunner._zero_block_ids`` wherever
            ``KVCacheConfig.needs_kv_cache_zeroing``: Mamba layers or mixed-precision KV caches), and the manager
            names them (:meth:`ZeroingCalls.take_zeroed`). The machine zeroes them in its pools: a step's before the
            step writes, a connector load's after the load's data arrives (the worker's zeroing and an asynchronous
            load race; vLLM's scheduler passes ``skip_zeroing_group_ids`` so that a load's blocks are not named).
            The machine zeroes after the call returns: a manager holding its pools (``owns_pools``) whose calls run
            copies into new blocks zeroes them itself, before its copies, as vLLM's worker does (vLLM's peer in
            ``qwen3-next-fine``), and does not declare this.
        token_loads: the manager serves :attr:`ManagerConfig.token_loads`: a connector over a store holding any
            prefix of the prompt, so that a load may end inside a block: a P/D prefiller's prompt less its backoff
            (vLLM's ``NixlConnector`` loads the prompt less ``_prefill_backoff()`` tokens past the local hit, the
            backoff 0 for attention, 1 beside a Mamba group), an LMCache chunk saved unfull. Without it the
            machine's store holds whole blocks (an offloading store's).
        loads_keep_held: a connector load may leave a group's token unwritten where the request's table already
            holds its block from a longer hit of that group than the agreed one (vLLM's HiSparse: the host tier keeps
            the latent pages past an indexer block evicted from the device, and ``OffloadingConnector`` loads only
            the indexer group there, bounded by the host tier's hit): ``load`` gives such a token's slot as ``-1``;
            the machine writes nothing there (nor a failed load's garbage) and judges the block as every read
            finds it. Without it a load writes every token of every group that holds a block for it.
        chunk_checkpoints: the checkpoint promise: every Mamba group declaring ``prefill_checkpoints`` exports the
            state wherever vLLM's rule says a prefill chunk does (:func:`~.lookup.prefill_checkpoint`), naming that
            position's slot in the reservation. Without it an export is the manager's choice, judged only where it
            writes one (the state promise) or where the replay promise asks for the prompt's replay boundary.
        stored_groups: with a connector, the groups whose blocks a freed request's store reads (vLLM's
            ``OffloadingConnector`` under HiSparse: the indexer group alone, ``get_offloading_group_ids``): until
            ``store_done`` the machine keeps the request's blocks of these groups from anyone else, and takes the
            others as released at the free (a HiSparse latent page copied to the host tier, its device copy
            unpinned, may be handed out). ``None``: every group's.
    """

    block_size: int
    fork: bool = False
    window: int | None = None
    namespaces: bool = True
    extra_keys: bool = False
    preempt: bool = True
    resume: bool = False
    evict: bool = False
    reset: bool = False
    eviction_order: str | None = None
    hit_promise: bool = False
    async_steps: bool = False
    min_computed_on_full_hit: int = 1
    defers_commit: bool = False
    owns_pools: bool = False
    groups: tuple[GroupSpec, ...] = ()
    connector: bool = False
    speculative: bool = False
    misuse: bool = False
    lookahead: int = 0
    admission: str | None = None
    window_release: bool = False
    retention_interval: int | None = None
    eagle_drop: bool = False
    coordinated_lookup: bool = False
    prompt_embeds: bool = False
    kv_events: bool = False
    reprefill: int = 0
    eagle_margin: bool = True
    hit_alignment: int | None = None
    cached_prompt: bool = False
    zeroes_new_blocks: bool = False
    token_loads: bool = False
    loads_keep_held: bool = False
    stored_groups: tuple[int, ...] | None = None
    chunk_checkpoints: bool = False

    def summary(self) -> str:
        """One line: the capabilities the machine judges."""
        have = [n for n in ("fork", "namespaces", "extra_keys", "preempt", "resume", "evict", "reset", "defers_commit",
                            "hit_promise", "async_steps", "connector", "speculative", "prompt_embeds", "kv_events",
                            "cached_prompt", "zeroes_new_blocks", "token_loads", "chunk_checkpoints")
                if getattr(self, n)]
        layout = (f"groups {', '.join(_group_name(g) for g in self.groups)}" if self.groups else
                  f"block_size {self.block_size}, window {self.window}")
        return (f"{layout}, {' '.join(have) or 'no options'}, "
                f"eviction order {self.eviction_order or 'not promised'}, a full hit computes "
                f">= {self.min_computed_on_full_hit} token(s)")


def _group_name(group: GroupSpec) -> str:
    extent = {"sliding_window": f" window {group.window}", "chunked_local": f" chunk {group.chunk}"}
    return f"{group.kind}{extent.get(group.kind, '')} (block_size {group.block_size}, {group.num_layers} layer(s))"


@dataclasses.dataclass(frozen=True)
class ManagerConfig:
    """What the machine asks a factory for: ``num_blocks`` blocks of ``block_size`` tokens (a hint: a
    token-granular manager may use block size 1), ``window_left`` (or ``None``), prefix caching on, and
    the pools' geometry when the manager owns them (``num_layers`` x ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` float32).

    ``groups`` (non-empty: a hybrid layout, :data:`HYBRID_LAYOUTS`) replaces ``block_size`` and
    ``window_left`` by one :class:`GroupSpec` per group (``block_size`` is then the hash block size,
    ``num_layers`` the layer slots: the largest group's ``num_layers``), all groups on one pool of
    ``num_blocks`` blocks. ``connector``: a KV connector is attached (the machine is its store).
    ``num_speculative_tokens``: the most draft tokens one step reserves (0: no speculative decoding).
    ``full_sequence_must_fit``: admit a request (its first reservation or load) only where the blocks of
    its whole prompt fit (vLLM's ``scheduler_reserve_full_isl``, on by default there); a manager that
    honours it declares ``capabilities.admission == "sequence"``.
    ``retention_interval``: sparse prefix-cache retention in tokens (:data:`LAYOUT_RETENTION`; ``None``: dense).
    ``multi_module_mtp``: the drafter is a chain of MTP modules (:data:`MULTI_MODULE_MTP_LAYOUTS`), each reading
    one prefill token further ahead (``capabilities.reprefill``).
    ``prefix_match_unit``: the hash block size in tokens where finer than the gcd of the groups' block sizes
    (:data:`LAYOUT_PREFIX_MATCH_UNIT`; ``None``: that gcd, ``block_size``).
    ``token_loads`` (with ``connector``): the connector's store is a P/D prefiller's, holding any prefix of a prompt
    (``admit``'s ``num_stored`` may end inside a block, and the connector offers it as it is: NIXL's remote prefill);
    off, an offloading store's whole blocks (the connector rounds what it offers down to whole blocks).
    A manager that cannot serve a connector or drafts leaves the capability off (the machine then asks for
    neither), or raises ``ValueError`` naming it: the machine asks again without drafts, then without the
    connector, and judges what it serves. It never asks for a layout the manager does not list."""

    num_blocks: int
    block_size: int
    window_left: int | None = None
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 2
    groups: tuple[GroupSpec, ...] = ()
    connector: bool = False
    num_speculative_tokens: int = 0
    full_sequence_must_fit: bool = False
    retention_interval: int | None = None
    multi_module_mtp: bool = False
    prefix_match_unit: int | None = None
    token_loads: bool = False


@runtime_checkable
class CacheManager(Protocol):
    """The calls every manager answers; optional ones are listed in :class:`ManagerCapabilities`.

    Request ids are ints, token ids ints, namespaces ``None``, a str (a cache salt) or tagged parts
    (:func:`namespace_parts`); an extra key ``(position, ("mm", identifier, index))`` is token ``index`` of
    a multimodal input (its placeholder run starts where ``index`` is 0), ``(position, ("embed", identifier,
    index))`` row ``index`` of a prompt-embedding payload given at that position instead of a token
    (``capabilities.prompt_embeds``; :func:`prompt_embedding_rows`). Slots are
    ``block_id * block_size + offset``. Refusal (out of blocks) is ``None`` and changes nothing.

    A grouped manager (``capabilities.groups``) returns a tuple with one entry per group where the
    one-group shape is a list (block ids of ``admit``, slots of ``reserve`` and ``load``, ``block_table``);
    a hit length is one number every group agrees on (each group's hit truncated to it: right after
    ``admit``, group ``g``'s block table is exactly its hit, ``num_cached // block_size`` entries, ``-1``
    where the group needs no block). A slot may be ``-1`` only where the group keeps nothing of that
    token: a Mamba group for a token whose state the step does not write, a load's token outside the
    window or chunk of the first token computed after it. Optional calls (``fork``, ``evict``, ``reset``,
    ``kv_pools``, ``reference_counts() -> {block: count}`` of every referenced block, judged against the
    tables holding each block, :class:`SpeculativeCalls`, :class:`ConnectorCalls`) exist where the
    capabilities say so (``reference_counts`` wherever the manager exposes them).
    """

    capabilities: ManagerCapabilities

    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = (), *, num_stored: int = 0) -> tuple[list[int], int] | None:
        """Start a request with its prompt: ``(block_ids, num_cached_tokens)`` of the cached prefix it
        reuses (``num_cached_tokens`` leading tokens need no compute), or ``None`` when refused.
        Grouped: ``(tuple of per-group block id lists, num_cached_tokens)``. The hit's blocks are taken
        (referenced, out of the free queue) by the request's first ``reserve`` or ``load``, not here: a
        refused first reservation leaves them where they were. A hit block that the window of the first
        computed token no longer reads may be left untouched then (``-1`` in the table, still free).

        ``num_stored`` (connector only; passed only when non-zero): the external store holds the
        prompt's first ``num_stored`` tokens (whole blocks of every group's size; any prefix, the prompt less a
        backoff of 0-2 tokens, where the manager declares ``token_loads``). The manager takes
        ``num_external(request_id)`` of them past its local hit (vLLM's
        ``get_num_new_matched_tokens``), at most up to ``len(token_ids) - min_computed_on_full_hit``."""

    def reserve(self, request_id: int, token_ids: Sequence[int], num_draft: int = 0) -> list[int] | None:
        """Slots (``int`` list, one per token) for the request's next ``len(token_ids)`` tokens; tokens
        past those admitted extend the request (decode). ``None``: out of blocks, nothing changed.
        Grouped: a tuple of per-group slot lists (each one per token; a group's slot is
        ``block_id * group.block_size + offset``).

        ``num_draft`` (speculative only; passed only when non-zero): the last ``num_draft`` of
        ``token_ids`` are unverified draft tokens (vLLM's ``num_lookahead_tokens`` / spec tokens): they
        get slots and the machine writes their K/V and state, but they are not the request's tokens
        (nothing caches them) until :meth:`drop` says how many were accepted."""

    def commit(self, request_id: int, num_tokens: int) -> None:
        """The K/V of the request's first ``num_tokens`` tokens is written in every layer."""

    def free(self, request_id: int) -> None:
        """Release the request (finish or abort): it holds nothing afterwards (a connector manager may
        keep its blocks for a store until :meth:`ConnectorCalls.store_done`; a request with a load in
        flight keeps them until :meth:`ConnectorCalls.load_done`)."""

    def block_table(self, request_id: int) -> list[int]:
        """The request's block ids in order; ``-1`` where the window released a block (or a chunked-local
        or Mamba group holds none). Grouped: a tuple of per-group lists."""

    def holds(self, request_id: int) -> bool:
        """Whether the manager still keeps any state of the request (after ``free``: only while a
        connector's store or load of it is pending)."""

    def counts(self) -> tuple[int, int, int] | None:
        """``(free, used, total)`` blocks, or ``None`` when not exposed. Cached blocks nobody references
        count as free (they are evictable). ``total`` never changes and is at least ``ManagerConfig.num_blocks``:
        blocks the manager never hands out (vLLM's null block, SGLang's padding page) come on top, named by an
        optional ``reserved_blocks`` attribute (the machine's pools hold ``total + reserved_blocks``)."""

    def self_check(self) -> None:
        """Check the manager's own exposed state (reference counts, free queue, hash index) against what
        it reports; raise ``AssertionError`` naming the inconsistency. A no-op where nothing is exposed."""


@runtime_checkable
class SpeculativeCalls(Protocol):
    """What a manager with ``capabilities.speculative`` answers besides :class:`CacheManager`."""

    def drop(self, request_id: int, num_rejected: int) -> None:
        """Verification of the request's last draft reservation: its last ``num_rejected`` draft tokens
        are rejected (dropped: the request is that many tokens shorter; blocks may stay allocated), the
        others accepted (the request's tokens from now on). No rejected token's K/V or state may ever be
        served by a hit (vLLM's Mamba hit over EAGLE drafts served state written over rejected tokens).

        Raises:
            ValueError: ``num_rejected`` negative or above the last reservation's ``num_draft``."""


@runtime_checkable
class CachedPromptCalls(Protocol):
    """What a manager with ``capabilities.cached_prompt`` answers besides :class:`CacheManager`."""

    def cached_prompt_tokens(self, request_id: int) -> int:
        """Tokens (a count, >= 0) of the request's leading tokens that the prefix cache holds under the blocks its
        tables hold now, the least over its KV-cache groups: per group the furthest token position any of its
        blocks is cached up to (a full block's end, or a partial entry's last whole hash block where a group's
        block is wider than the hash block). Asked right after the step that computed the prompt's last token
        completes (vLLM's ``KVCacheManager.estimate_cached_tokens``, read by ``Scheduler.update_from_output`` for
        ``PrefillStats.finalize``)."""


@runtime_checkable
class EventCalls(Protocol):
    """What a manager with ``capabilities.kv_events`` answers besides :class:`CacheManager`."""

    def take_events(self) -> list:
        """The KV-cache events since the last call, oldest first (:mod:`.kv_events`), and forget them."""


@runtime_checkable
class ResumeCalls(Protocol):
    """What a manager with ``capabilities.resume`` answers besides :class:`CacheManager`."""

    def resume(self, request_id: int) -> tuple[list[int], int] | None:
        """Preempt the request (nothing in flight, no pending hit) and look it up again under the same id
        with every token so far (prompt and output) as its prompt: ``(block_ids, num_cached_tokens)`` as
        :meth:`CacheManager.admit` returns them (grouped: per group), the hit adopted by the next
        ``reserve``; ``None``: refused (the manager then keeps nothing of the request)."""


@runtime_checkable
class ConnectorCalls(Protocol):
    """What a manager with ``capabilities.connector`` answers besides :class:`CacheManager`: the
    scheduler side of a KV connector, the machine playing the external store."""

    def num_external(self, request_id: int) -> int:
        """Tokens past the local hit the connector will load for a just-admitted request (0 when the
        store offers nothing beyond the hit); ``num_cached + num_external`` is whole blocks."""

    def load(self, request_id: int) -> list[int] | None:
        """Allocate blocks for the external tokens (vLLM's ``allocate_slots`` with
        ``num_external_computed_tokens`` and ``delay_cache_blocks``): the slots the load writes, one per
        external token (grouped: a tuple of per-group lists), or ``None`` when refused (nothing changed,
        the request is then freed). Until :meth:`load_done`, the request is not stepped."""

    def load_done(self, request_id: int, ok: bool) -> int | None:
        """The load finished: ``ok`` (its K/V is written, the tokens are computed and cacheable) or
        failed (the external tokens are recomputed: the request's computed length is its local hit and
        its next ``reserve`` starts there; nothing the failed load wrote is ever served). Also called
        for a request freed while its load was in flight (its blocks stay unusable until then).

        A manager that lets a request whose load failed go and looks its prefix up again (vLLM's
        ``recompute_kv_load_failures``) returns the new hit (at most the local hit; its blocks held from
        the next ``reserve``, as after ``admit``, or at once where ``holds`` says so); ``None``: the local
        hit, as it was."""

    def store_done(self, request_id: int) -> None:
        """A freed request's blocks are stored externally: a free deferred for the store (vLLM's
        ``finished_sending``) releases now. Called once after every free of a connector manager; until
        then no block the request held may be handed to anyone."""


@runtime_checkable
class ZeroingCalls(Protocol):
    """What a manager with ``capabilities.zeroes_new_blocks`` answers besides :class:`CacheManager`."""

    def take_zeroed(self) -> list[int]:
        """The block ids the worker zeroes, named since the last call (vLLM's ``KVCacheManager.take_new_block_ids``,
        sent as ``SchedulerOutput.new_block_ids_to_zero``): every layer's page of each, in every group (one block id
        is one page of the shared pool). The machine calls it after every call; a block another request held
        before that call is corruption."""


def namespace_parts(namespace: Hashable) -> tuple[str | None, tuple[str, str] | None]:
    """``(cache_salt, lora)`` of a namespace, ``lora`` as ``(name, path)``: ``None``; a str (a cache salt);
    ``("lora", n)`` (adapter ``lora{n}`` at ``/lora``); or a tuple of tagged parts ``(("salt", s),)``,
    ``(("lora", name, path),)`` or both. Two namespaces are one only when equal: a salt spelled like a
    LoRA name, or one LoRA name at two paths, are different namespaces.

    Raises:
        ValueError: a namespace of another shape.
    """
    if namespace is None:
        return None, None
    if isinstance(namespace, str):
        return namespace, None
    if (isinstance(namespace, tuple) and len(namespace) == 2 and namespace[0] == "lora"
            and isinstance(namespace[1], int)):
        return None, (f"lora{namespace[1]}", "/lora")
    salt = lora = None
    for part in namespace if isinstance(namespace, tuple) else ():
        if isinstance(part, tuple) and len(part) == 2 and part[0] == "salt":
            salt = str(part[1])
        elif isinstance(part, tuple) and len(part) == 3 and part[0] == "lora":
            lora = (str(part[1]), str(part[2]))
        else:
            raise ValueError(f"namespace {namespace!r}: parts must be ('salt', s) or ('lora', name, path)")
    if salt is None and lora is None:
        raise ValueError(f"namespace {namespace!r}: no salt and no LoRA adapter")
    return salt, lora


def is_embedding(key: Hashable) -> bool:
    """Whether an extra key is a prompt-embedding row ``("embed", identifier, index)``."""
    return isinstance(key, tuple) and len(key) == 3 and key[0] == "embed"


def prompt_embedding_rows(extra_keys: Sequence[ExtraKey], num_tokens: int) -> dict[int, tuple[str, int]]:
    """``position -> (identifier, index)`` of each prompt-embedding row in ``extra_keys`` below ``num_tokens``
    (the prompt: a key past it, left by a truncated request, is not an input); ``{}``: a prompt of tokens only."""
    return {pos: (str(key[1]), int(key[2])) for pos, key in extra_keys if is_embedding(key) and 0 <= pos < num_tokens}


def multimodal_spans(extra_keys: Sequence[ExtraKey]) -> list[tuple[str, int, int]]:
    """``(identifier, offset, length)`` of each multimodal input in ``extra_keys`` (``(position, ("mm",
    identifier, index))`` entries, index 0 at its offset); prompt-embedding rows (:func:`is_embedding`) are
    none; other keys are one-token inputs at their position (``str(key)`` their identifier)."""
    spans: list[list] = []
    for pos, key in sorted((e for e in extra_keys if not is_embedding(e[1])), key=lambda e: e[0]):
        if isinstance(key, tuple) and len(key) == 3 and key[0] == "mm":
            if key[2] > 0 and spans and spans[-1][0] == str(key[1]) and spans[-1][1] + spans[-1][2] == pos:
                spans[-1][2] += 1
                continue
            spans.append([str(key[1]), pos, 1])
        else:
            spans.append([str(key), pos, 1])
    return [tuple(s) for s in spans]


def manager_layouts(candidate) -> tuple[str, ...]:
    """The layouts a candidate's manager takes: its ``cache_manager_layouts`` (names in
    :data:`HYBRID_LAYOUTS` or :data:`ONE_GROUP`), default ``(ONE_GROUP,)``.

    Raises:
        ValueError: an unknown layout name.
    """
    layouts = tuple(getattr(candidate, "cache_manager_layouts", (ONE_GROUP,)))
    for name in layouts:
        if name != ONE_GROUP and name not in HYBRID_LAYOUTS:
            raise ValueError(f"cache_manager_layouts: unknown layout {name!r}")
    return layouts


class GroupedView:
    """A one-group manager seen as a grouped one: plain returns wrapped in one-entry tuples, every other
    attribute passed through. ``capabilities.groups`` is its one group (full or sliding window)."""

    def __init__(self, manager) -> None:
        self.inner = manager
        caps = manager.capabilities
        group = (GroupSpec("full", caps.block_size) if caps.window is None else
                 GroupSpec("sliding_window", caps.block_size, window=caps.window))
        self.capabilities = dataclasses.replace(caps, groups=(group,))

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @staticmethod
    def _grouped_hit(got):
        """An ``admit``-shaped answer ``(block_ids, num_cached_tokens)`` with its block ids as one group's."""
        return None if got is None else ((list(got[0]),), got[1])

    def admit(self, *args, **kwargs):
        return self._grouped_hit(self.inner.admit(*args, **kwargs))

    def resume(self, request_id: int):
        return self._grouped_hit(self.inner.resume(request_id))

    def reserve(self, *args, **kwargs):
        got = self.inner.reserve(*args, **kwargs)
        return None if got is None else (list(got),)

    def load(self, request_id: int):
        got = self.inner.load(request_id)
        return None if got is None else (list(got),)

    def block_table(self, request_id: int):
        return (list(self.inner.block_table(request_id)),)


def as_grouped(manager):
    """``manager`` with grouped returns: itself when ``capabilities.groups`` is set, else a :class:`GroupedView`."""
    return manager if manager.capabilities.groups else GroupedView(manager)


def manager_factory(candidate) -> object | None:
    """The manager factory a candidate provides (its ``cache_manager`` attribute), or ``None``."""
    factory = getattr(candidate, "cache_manager", None)
    return factory if callable(factory) else None
