"""A pool just past a numeric limit, at a geometry the candidate declares (a plain-data case).

Past 2**24 slots float32 slot or block-offset arithmetic stops being exact (2**24 + 1 rounds to
2**24); past 2**31 elements int32 element offsets wrap. :meth:`LimitCase.for_space` takes the
candidate's own sizes: its smallest declared head_dim and kv-head count, a declared block size, a
16-bit dtype when it declares one (8 GiB of pools past 2**31 elements at head_dim 64 in float16).
The properties over it (:mod:`pagedkv.testing.properties.large_pools`) allocate the pools lazily,
so the case is cheap to replay anywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedkv.testing.cases.case import Geometry

#: name -> (slots, elements) the pool must exceed.
LIMITS = {"2_24_slots": (2**24 + 1, 0), "2_31_elements": (0, 2**31 + 1)}
#: The aliased pool past 2**32 slots (:mod:`pagedkv.testing.properties.aliased_pools`): its geometry.
ALIASED_LIMIT, ALIASED_GEOMETRY = "2_32_slots_aliased", Geometry(2**23 + 1, 512, 1, 1, 1, "float32")
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class LimitCase:
    """Pools of ``geometry`` (just past ``limit``): ``write_kv`` writes tokens at the first slots past
    it and in the last blocks; attention reads sequences held in the last blocks."""

    limit: str
    geometry: Geometry
    #: V read from K's storage (a backend declaring ``shared_kv_storage``, MLA's latent cache): ``v_cache`` is
    #: ``k_cache`` itself (V as wide as K), never a pool of its own
    latent: bool = False

    @classmethod
    def aliased(cls) -> "LimitCase":
        """The aliased pool's case: ``[2**23 + 1, 512, 1, 1]`` float32 with block stride 1 (32 MiB)."""
        return cls(ALIASED_LIMIT, ALIASED_GEOMETRY)

    @staticmethod
    def aliased_unsupported(caps) -> str | None:
        """Why the aliased pool lies outside ``caps`` (``None``: inside): a strided float32 view with block
        size 512, one kv head and head_dim 1."""
        reason = caps.rejects(ALIASED_GEOMETRY) or (None if caps.strided_pools else
                                                    "the backend declares contiguous pools only")
        return f"the aliased pool past 2**31 slots: {reason}" if reason else None

    @property
    def first_slot_past(self) -> int:
        """The first slot whose index (``2_24_slots``) or first element offset (``2_31_elements``) is past the limit."""
        slots, elements = LIMITS[self.limit]
        g = self.geometry
        return max(slots, -(-elements // (g.num_kv_heads * g.head_dim)))

    @property
    def pool_bytes(self) -> int:
        g = self.geometry
        return g.num_blocks * g.block_size * g.num_kv_heads * g.head_dim * _DTYPE_BYTES[g.dtype]

    def to_dict(self) -> dict:
        return {"limit": self.limit, "geometry": dataclasses.asdict(self.geometry),
                **({"latent": True} if self.latent else {})}

    @classmethod
    def from_dict(cls, data: dict) -> "LimitCase":
        return cls(data["limit"], Geometry(**data["geometry"]), bool(data.get("latent", False)))

    @classmethod
    def for_space(cls, limit: str, caps) -> tuple["LimitCase | None", str]:
        """``(case, "")`` inside ``caps``, or ``(None, why)``."""
        bs = caps.block_sizes.choose((16, 32, 64, 128, 256, 8, 4, 2, 1))[0]
        hd = caps.head_dims.choose((1, 2, 4, 8, 16, 32, 64, 128, 256))[0]
        kvh = caps.num_kv_heads.choose((1, 2, 4, 8))[0]
        group = caps.gqa_groups.choose((1, 2, 4, 8))[0]
        dtype = next((d for d in ("float16", "bfloat16", "float32") if d in caps.dtypes), None)
        if dtype is None:
            return None, "no float dtype declared"
        slots, elements = LIMITS[limit]
        nb = -(-max(slots, -(-elements // (kvh * hd))) // bs) + 2
        case = cls(limit, Geometry(nb, bs, kvh, hd, group, dtype), bool(getattr(caps, "shared_kv_storage", False)))
        if caps.max_pool_bytes is not None and case.pool_bytes > caps.max_pool_bytes:
            return None, f"a pool past {limit} needs {case.pool_bytes} bytes; declared max_pool_bytes " \
                         f"{caps.max_pool_bytes}"
        return case, ""
