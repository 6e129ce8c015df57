"""Test cases as plain data: small frozen dataclasses whose ``repr`` is valid Python, a JSON round
trip, and the tensors they describe, built from a seed on the CPU so every device sees the same values.

A :class:`Case` is a batch of sequences over one pool: each :class:`SeqSpec` has a block table,
a length, the number of new query tokens (attention) and a write start (scatter). Slots that no
sequence owns (including the unused tail of each last block) hold *poison* (NaN, inf or a sentinel),
so a read path that touches them shows it.

This module needs only torch: cases run, replay and report without Hypothesis installed
(``strategies/`` draws them).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

from pagedkv.cache.config import CacheConfig, blocks_needed, dtype_from_name
from pagedkv.attention.fp8 import quantize
from pagedkv.testing.cases.memory import POOL_LAYOUT, new_pools

VALUE_PATTERNS = ("normal", "identity", "large", "diffuse")
POISONS = ("nan", "inf", "sentinel", "zero")
FINITE_POISONS = ("sentinel", "zero")  # for backends that assume finite unused slots
LAYOUTS = ("contiguous", "kv_interleaved", "head_strided")
#: Layouts of the partial-attention cases too: ``"latent"``, V a view of K's first columns (MLA).
ALL_LAYOUTS = (*LAYOUTS, "latent")
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_EXACT_INTEGERS = {"float32": 2**24, "float16": 2**11, "bfloat16": 2**8}  # ids a dtype holds exactly
_LARGE = 30.0  # |q|, |k| ~ 30: logits in the hundreds, exp() overflows without max subtraction


@dataclass(frozen=True)
class Geometry:
    """Pool geometry: ``num_blocks`` blocks of ``[block_size, num_kv_heads, head_dim]``, and
    ``num_kv_heads * num_queries_per_kv`` query heads (GQA group size ``num_queries_per_kv``). ``head_dim_v``:
    V's width when it differs from K's (``None``: ``head_dim``); see :attr:`v_dim`."""

    num_blocks: int
    block_size: int
    num_kv_heads: int = 1
    head_dim: int = 4
    num_queries_per_kv: int = 1
    dtype: str = "float32"
    head_dim_v: int | None = None

    @property
    def v_dim(self) -> int:
        """V's (and the attention output's) width."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.num_queries_per_kv

    def cache_config(self, device: str = "cpu", num_layers: int = 1) -> CacheConfig:
        """The library's :class:`~pagedkv.cache.config.CacheConfig` of this geometry (the one place the kit
        builds a cache's configuration from a geometry), in the pool layout of :func:`pool_layout`."""
        return CacheConfig(self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim, self.torch_dtype,
                           device, num_layers=num_layers, kv_layout=POOL_LAYOUT.get())

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


@dataclass(frozen=True)
class SeqSpec:
    """One sequence: ``block_table`` (physical ids, at least ``ceil(seq_len / block_size)``), its
    length, ``q_len`` new query tokens (its last ``q_len`` positions) and a scatter ``start``."""

    block_table: tuple[int, ...]
    seq_len: int
    q_len: int = 1
    start: int = 0


@dataclass(frozen=True)
class Case:
    """A batch of sequences over one pool, with value pattern, poison, padding and seed.

    Attributes:
        values: ``"normal"`` (standard normal), ``"identity"`` (each token's K is its own id, V its
            negation: a wrong read names the token it returned), ``"large"`` (q and k ~ 30x normal) or
            ``"diffuse"`` (k ~ normal / 16, so attention spreads over every key, and v ~ normal + 1, so the
            output stays near 1: a weight lost or mis-summed anywhere in a long context moves it).
        poison: what every unowned slot holds: ``"nan"``, ``"inf"``, ``"sentinel"`` (the dtype's
            max) or ``"zero"``.
        pad_value: fills block-table entries past each sequence's table.
        pad_columns: extra padded columns in the batch's block tables.
        table_dtype: ``"int32"`` or ``"int64"`` block tables.
        layout: ``"contiguous"``, ``"kv_interleaved"`` (``kv[:, 0]`` / ``kv[:, 1]`` of one ``[num_blocks, 2,
            block_size, H, D]`` tensor) or ``"head_strided"`` (``kv[..., :D]`` / ``kv[..., D + 1:]`` of one
            ``[num_blocks, block_size, H, 2 * D + 1]`` tensor: head stride ``2 * D + 1``, V at an offset) or
            ``"latent"`` (MLA: ``v_cache = k_cache[..., :head_dim_v]``, V the first columns of K's storage,
            so each token's V is its K's first ``head_dim_v`` values).
        scale: attention scale (``None``: ``1 / sqrt(head_dim)``).
        window_left: sliding window of ``paged_attention`` (``-1``: off; see ``docs/contract.md``).
        softcap: logit soft-cap (``0.0``: off).
        alibi: pass ALiBi slopes (:meth:`alibi_slopes`: the geometric slopes times a factor drawn from the seed).
        sinks: pass attention sinks (:meth:`sink_values`: drawn from the seed, some heads ``-inf``).
        kv_cache_dtype: ``"auto"`` (pools in the geometry's dtype) or ``"fp8_e4m3"`` / ``"fp8_e5m2"``
            (pools store ``sat(x / scale)``; the queries and outputs keep the geometry's dtype).
        k_scale, v_scale: fp8 scales: a number (per tensor) or one number per kv head.
        num_splits: split-K parts passed as ``paged_attention``'s ``num_splits`` (``None``: not passed;
            drawn only for a backend that declares ``split_k``).
        cuts: per sequence, sorted key positions cutting its context into parts (the partial-attention
            properties: part ``j`` of a row is its visible keys in ``[cuts[j - 1], cuts[j])``); ``()``: none.
    """

    geometry: Geometry
    seqs: tuple[SeqSpec, ...]
    values: str = "normal"
    poison: str = "nan"
    pad_value: int = -1
    pad_columns: int = 0
    table_dtype: str = "int32"
    layout: str = "contiguous"
    scale: float | None = None
    seed: int = 0
    window_left: int = -1
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    kv_cache_dtype: str = "auto"
    k_scale: float | tuple[float, ...] = 1.0
    v_scale: float | tuple[float, ...] = 1.0
    num_splits: int | None = None
    cuts: tuple[tuple[int, ...], ...] = ()

    # -- plain data ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if out["num_splits"] is None:  # unset: files read the same as those written before the field
            del out["num_splits"]
        if not out["cuts"]:
            del out["cuts"]
        if out["geometry"]["head_dim_v"] is None:
            del out["geometry"]["head_dim_v"]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Case":
        data = dict(data)
        data["geometry"] = Geometry(**data["geometry"])
        data["seqs"] = tuple(SeqSpec(**{**s, "block_table": tuple(s["block_table"])}) for s in data["seqs"])
        for key in ("k_scale", "v_scale"):
            if isinstance(data.get(key), list):
                data[key] = tuple(data[key])
        if "cuts" in data:
            data["cuts"] = tuple(tuple(c) for c in data["cuts"])
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "Case":
        return cls.from_dict(json.loads(text))

    def replace(self, **changes) -> "Case":
        return dataclasses.replace(self, **changes)

    # -- derived metadata ------------------------------------------------------------------------
    @property
    def seq_lens_list(self) -> list[int]:
        return [s.seq_len for s in self.seqs]

    @property
    def query_start_loc_list(self) -> list[int]:
        out = [0]
        for s in self.seqs:
            out.append(out[-1] + s.q_len)
        return out

    def row_position(self, row: int) -> tuple[int, int]:
        """``(sequence, position)`` of query row ``row`` (an index into the packed ``[total_q, ...]``
        query): the sequence whose rows hold it, and its position there (``seq_len - q_len + i``)."""
        qsl = self.query_start_loc_list
        seq = max(b for b in range(len(self.seqs)) if qsl[b] <= row)
        s = self.seqs[seq]
        return seq, s.seq_len - s.q_len + (row - qsl[seq])

    def used_table(self, i: int) -> tuple[int, ...]:
        """The entries of sequence ``i``'s table that are read (``ceil(seq_len / block_size)``)."""
        s = self.seqs[i]
        return s.block_table[: blocks_needed(s.seq_len, self.geometry.block_size)]

    def block_tables(self, device="cpu") -> torch.Tensor:
        """``[batch, width]`` tables in ``table_dtype``, ``pad_value`` past each sequence's entries."""
        width = max((len(s.block_table) for s in self.seqs), default=0) + self.pad_columns
        out = torch.full((len(self.seqs), width), self.pad_value, dtype=torch.int64)
        for row, s in enumerate(self.seqs):
            out[row, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int64)
        return out.to(device=device, dtype=getattr(torch, self.table_dtype))

    def seq_lens(self, device="cpu") -> torch.Tensor:
        return torch.tensor(self.seq_lens_list, dtype=torch.int32, device=device)

    def query_start_loc(self, device="cpu") -> torch.Tensor:
        return torch.tensor(self.query_start_loc_list, dtype=torch.int32, device=device)

    def owned_slots(self) -> set[int]:
        """Slots some sequence owns (position < seq_len)."""
        bs = self.geometry.block_size
        return {b * bs + p % bs for i, s in enumerate(self.seqs) for p in range(s.seq_len)
                for b in [self.used_table(i)[p // bs]]}

    # -- optional attention features ------------------------------------------------------------------
    @property
    def features(self) -> frozenset[str]:
        """The optional features the case uses (names as in a backend's ``FEATURES``)."""
        return frozenset(name for name, on in (
            ("window", self.window_left >= 0), ("softcap", self.softcap > 0), ("alibi", self.alibi),
            ("sinks", self.sinks), ("fp8", self.kv_cache_dtype != "auto")) if on)

    @property
    def pool_dtype(self) -> torch.dtype:
        """The pools' dtype: the geometry's, or the fp8 format of ``kv_cache_dtype``."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.geometry.torch_dtype

    def alibi_slopes(self, device="cpu") -> torch.Tensor:
        """``float32 [num_q_heads]``: the standard geometric slopes ``2 ** (-8 (h + 1) / n)`` times a factor
        in ``[0.25, 2)`` drawn from the seed."""
        n = self.geometry.num_q_heads
        factor = 0.25 + 1.75 * float(torch.rand((), generator=self._generator(5)))
        return (torch.tensor([2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]) * factor).to(device)

    def sink_values(self, device="cpu") -> torch.Tensor:
        """``float32 [num_q_heads]`` sink logits drawn from the seed (``2 * normal``), about a quarter ``-inf``."""
        gen = self._generator(6)
        n = self.geometry.num_q_heads
        values, off = torch.randn(n, generator=gen) * 2, torch.rand(n, generator=gen) < 0.25
        return values.masked_fill(off, float("-inf")).to(device)

    def scale_vectors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)`` as ``float32 [num_kv_heads]`` on the CPU (a per-tensor scale repeated)."""
        h = self.geometry.num_kv_heads
        return tuple(torch.tensor(list(s) if isinstance(s, tuple) else [float(s)] * h, dtype=torch.float32)
                     for s in (self.k_scale, self.v_scale))

    def kv_scales(self, device="cpu") -> dict:
        """``{"k_scale", "v_scale"}`` as a backend takes them (a float, or ``float32 [num_kv_heads]``), or
        ``{}`` for pools that are not fp8."""
        if self.kv_cache_dtype == "auto":
            return {}
        return {name: s if not isinstance(s, tuple) else vec.to(device)
                for name, s, vec in zip(("k_scale", "v_scale"), (self.k_scale, self.v_scale), self.scale_vectors())}

    def attention_features(self, device="cpu") -> dict:
        """The keyword arguments of ``paged_attention`` for the features in use (only those: a backend
        without feature arguments takes a feature-free case unchanged)."""
        out: dict = {}
        if self.window_left >= 0:
            out["window_left"] = self.window_left
        if self.softcap > 0:
            out["softcap"] = self.softcap
        if self.alibi:
            out["alibi_slopes"] = self.alibi_slopes(device)
        if self.sinks:
            out["sinks"] = self.sink_values(device)
        if self.num_splits is not None:  # a launch option, not a feature: passed through, never in the reference
            out["num_splits"] = self.num_splits
        return {**out, **self.kv_scales(device)}

    def stored(self, x: torch.Tensor, which: str = "k") -> torch.Tensor:
        """Values as the pool stores them: ``x`` itself, or its fp8 quantization
        (``pagedkv.attention.fp8.quantize``)."""
        if self.kv_cache_dtype == "auto":
            return x
        return quantize(x, self.scale_vectors()[which == "v"].to(x.device), self.pool_dtype)

    def stored_kv(self, stream: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`logical_kv` as the pools hold it (quantized for fp8 pools)."""
        return [(self.stored(k, "k"), self.stored(v, "v")) for k, v in self.logical_kv(stream)]

    # -- tensors (CPU generator, then cast and moved: identical on every device) ----------------------
    def _generator(self, stream: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + stream)

    def _poison_value(self) -> float:
        dtype = self.pool_dtype
        return {"nan": float("nan"), "inf": float("inf"), "sentinel": torch.finfo(dtype).max, "zero": 0.0}[self.poison]

    def logical_kv(self, stream: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence, ``(K, V)`` of shape ``[seq_len, num_kv_heads, head_dim]`` in the case dtype (CPU).

        ``stream`` selects an independent draw (0: the cache's initial content, 1: values to write).
        """
        g, gen = self.geometry, self._generator(stream)
        out, uid = [], 0
        exact = _EXACT_INTEGERS[g.dtype]
        for s in self.seqs:
            shape = (s.seq_len, g.num_kv_heads, g.head_dim)
            if self.values == "identity":
                ids = (torch.arange(uid, uid + s.seq_len) % (exact - 1) + 1).to(torch.float32)
                k = ids.view(-1, 1, 1).expand(shape) * (1 if stream == 0 else -1)
                v = -k
            else:
                k = torch.randn(shape, generator=gen)
                v = torch.randn((*shape[:2], g.v_dim), generator=gen)
                if self.values == "large":
                    k = k * _LARGE
                elif self.values == "diffuse":
                    k, v = k / 16, v + 1
            if g.v_dim != g.head_dim and self.values == "identity":
                v = -k[..., :1].expand(*shape[:2], g.v_dim)
            if self.layout == "latent":  # V is the first v_dim columns of K's storage
                v = k[..., : g.v_dim]
            uid += s.seq_len
            out.append((k.to(g.torch_dtype).contiguous(), v.to(g.torch_dtype).contiguous()))
        return out

    def query(self, device="cpu") -> torch.Tensor:
        """``[total_q, num_q_heads, head_dim]`` queries in the case dtype."""
        g, gen = self.geometry, self._generator(2)
        q = torch.randn((self.query_start_loc_list[-1], g.num_q_heads, g.head_dim), generator=gen)
        if self.values == "large":
            q = q * _LARGE
        return q.to(g.torch_dtype).to(device)

    def empty_caches(self, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Poison-filled logical ``(k_cache, v_cache)`` in the case's layout, their storage in the pool
        layout of :func:`~pagedkv.testing.cases.memory.pool_layout` (poisoned in that storage)."""
        g = self.geometry
        shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        if self.layout == "latent":
            k_cache = new_pools(shape, self.pool_dtype, device, self._poison_value())[0]
            return k_cache, k_cache[..., : g.v_dim]
        if g.v_dim != g.head_dim:  # pools of two widths, each in its own storage
            v_shape = (*shape[:3], g.v_dim)
            return (new_pools(shape, self.pool_dtype, device, self._poison_value())[0],
                    new_pools(v_shape, self.pool_dtype, device, self._poison_value())[1])
        return new_pools(shape, self.pool_dtype, device, self._poison_value(),
                         interleaved=self.layout == "kv_interleaved", head_strided=self.layout == "head_strided")

    def caches(self, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)``: poison everywhere, each sequence's K/V (:meth:`stored_kv`) at its owned slots.

        Written by :func:`reference_write` in sequence order; where read-only tables share a block,
        later sequences overwrite earlier ones (what a reader then sees is what the pool holds).
        """
        k_cache, v_cache = self.empty_caches(device)
        for i, (k, v) in enumerate(self.stored_kv(0)):
            reference_write(k_cache, self.used_table(i), k.to(device), 0)
            reference_write(v_cache, self.used_table(i), v.to(device), 0)
        return k_cache, v_cache


def reference_write(cache: torch.Tensor, block_table, values: torch.Tensor, start: int = 0) -> None:
    """The definition of a write, position by position: ``cache[table[p // bs], p % bs] = values[p - start]``."""
    bs = cache.shape[1]
    for j in range(values.shape[0]):
        p = start + j
        cache[int(block_table[p // bs]), p % bs] = values[j]


def reference_gather(cache: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """The definition of a read, position by position: row ``p`` is ``cache[table[p // bs], p % bs]``."""
    bs = cache.shape[1]
    rows = [cache[int(block_table[p // bs]), p % bs] for p in range(seq_len)]
    return torch.stack(rows) if rows else cache.new_empty((0, *cache.shape[2:]))


@dataclass(frozen=True)
class CacheScenario:
    """A history of cache operations (plain data) for sharing, copy-on-write and prefix-cache properties.

    ``ops`` is a tuple of tuples:

    - ``("add", seq_id, token_ids)`` or ``("add", seq_id, token_ids, cache_key)``: add_sequence with a
      prompt (under a cache namespace), then append, write and commit its uncached tokens;
    - ``("append", seq_id, token_ids)``: append, write and commit decode/prefill tokens;
    - ``("reserve", seq_id, token_ids)`` (optionally ``cache_key`` last): append *without* writing or
      committing (a new ``seq_id`` is added first, as ``add`` does); the sequence may then be freed
      before the write (preemption, abort) or written later;
    - ``("write", seq_id, n)``: write and commit the next ``n`` reserved tokens (fewer: a partial
      write of a chunk), all of them when ``n`` is ``None``;
    - ``("fork", parent_id, child_id)``;
    - ``("free", seq_id)``: of a live sequence (finish, preemption or abort); freeing one that is not
      live must be refused and change nothing.

    Each token's K/V is a function of the token, its position, every token before it, the layer and
    the sequence's namespace (:func:`token_kv`), so a sequence's expected content follows from its
    tokens alone. ``num_layers`` layers are written and checked. ``constant_hash`` injects a hash
    function that collides always.
    """

    geometry: Geometry
    ops: tuple = ()
    enable_prefix_caching: bool = True
    constant_hash: bool = False
    seed: int = 0
    num_layers: int = 1

    def to_dict(self) -> dict:
        out = {**dataclasses.asdict(self), "ops": [list(op) for op in self.ops]}
        if out["geometry"]["head_dim_v"] is None:
            del out["geometry"]["head_dim_v"]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "CacheScenario":
        data = dict(data)
        data["geometry"] = Geometry(**data["geometry"])
        data["ops"] = tuple(tuple(tuple(x) if isinstance(x, list) else x for x in op) for op in data["ops"])
        return cls(**data)

    def replace(self, **changes) -> "CacheScenario":
        return dataclasses.replace(self, **changes)


def token_kv(geometry: Geometry, token_ids, start: int, seed: int, *, prefix=None, layer: int = 0,
             salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V rows for ``token_ids`` at positions ``start ..``, as a model's K/V: each row depends on its
    token, its position, *every token before it* (``prefix``, a rolling hash), the ``layer``, a
    ``salt`` (a cache namespace, an adapter) and the ``seed``. So a prefix-cache hit through a wrong
    parent chain, a block copied from the wrong layer or a hit across namespaces reads other values.

    Args:
        geometry: the pool geometry (heads, head_dim, dtype).
        token_ids: the tokens at positions ``start .. start + len(token_ids) - 1``.
        start: the first position.
        seed: value seed.
        prefix: the ``start`` tokens before them (required when ``start > 0``).
        layer: the layer (``>= 0``).
        salt: an int mixed into the prefix hash.

    Returns:
        ``(k, v)``, each ``[n, num_kv_heads, head_dim]`` in the geometry's dtype, on the CPU.

    Raises:
        ValueError: ``prefix`` missing or not ``start`` tokens long.
    """
    token_ids = [int(t) for t in token_ids]
    prefix = [] if prefix is None and start == 0 else prefix
    if prefix is None or len(prefix) != start:
        raise ValueError(f"prefix must hold the {start} tokens before position {start}, got "
                         f"{None if prefix is None else len(prefix)}")
    h = (salt * 2_654_435_761 + 97) % 1_000_003
    for t in prefix:
        h = (h * 31 + int(t) + 7) % 1_000_003
    hashes = []
    for t in token_ids:  # position p's value sees tokens 0 .. p
        h = (h * 31 + t + 7) % 1_000_003
        hashes.append(h % 4099)
    n = len(token_ids)
    ids = torch.tensor(token_ids, dtype=torch.float32).view(n, 1, 1)
    ph = torch.tensor(hashes, dtype=torch.float32).view(n, 1, 1)
    pos = torch.arange(start, start + n, dtype=torch.float32).view(n, 1, 1)
    h_ = torch.arange(geometry.num_kv_heads, dtype=torch.float32).view(1, -1, 1)
    d = torch.arange(geometry.head_dim, dtype=torch.float32).view(1, 1, -1)
    base = ids * 0.37 + pos * 0.011 + h_ * 0.13 + d * 0.07 + seed * 0.003 + ph * 0.0173 + layer * 0.61
    k, v = torch.sin(base), torch.cos(base * 1.3)
    return k.to(geometry.torch_dtype), v.to(geometry.torch_dtype)


def writable(case: Case) -> list[int]:
    """Sequences whose written range ``[start, seq_len)`` uses distinct blocks, disjoint from earlier ones."""
    bs, taken, out = case.geometry.block_size, set(), []
    for i, s in enumerate(case.seqs):
        blocks = case.used_table(i)[s.start // bs:] if s.seq_len > s.start else ()
        if len(set(blocks)) == len(blocks) and not taken & set(blocks):
            taken |= set(blocks)
            out.append(i)
    return out


def write_slot_mapping(case: Case) -> tuple[list[int], list[tuple[int, int]]]:
    """The ``slot_mapping`` a ``write_kv`` of the case writes: positions ``start .. seq_len - 1`` of each
    writable sequence, with a ``-1`` padding token after every third real one. Also returns, per
    token, ``(seq, position)`` (``(-1, -1)`` for padding)."""
    bs, slots, owners = case.geometry.block_size, [], []
    for i in writable(case):
        s = case.seqs[i]
        for p in range(s.start, s.seq_len):
            slots.append(case.used_table(i)[p // bs] * bs + p % bs)
            owners.append((i, p))
            if len(slots) % 4 == 3:
                slots.append(-1)
                owners.append((-1, -1))
    return slots, owners
