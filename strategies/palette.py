"""The compile budget of a run: a small palette of kernel specialisations the suite draws from.

Every distinct ``(block_size, head_dim, GQA group, dtype, feature set)`` is a new specialisation of a
Triton kernel (``tl.constexpr`` parameters: ours, vLLM's and most users'), compiled on first use; for a
JIT library such as FlashInfer, a new nvcc module of about a minute. Drawn freely, a GPU run compiles
hundreds. A candidate declares what specialises its kernels (``Capabilities(specialize_on={...})``,
all of :data:`SPECIALIZATION_NAMES` by default for Triton backends); per run the suite then draws those
parameters from a palette of :class:`Palette` ``shapes`` (whole ``(block_size, head_dim, gqa_group,
dtype)`` tuples, with V's width ``head_dim_v`` where the space declares V widths of their own) and
``feature_sets`` (with the LSE variant where an LSE is declared), while tables, lengths, sharing, poisons
and values vary freely.

The palette is seeded by the run (:func:`palette_seed`): fixed under ``ci`` (and ``smoke``, ``dev``,
``repro``), rotating by the UTC day under ``gpu`` and ``nightly``, ``$PAGEDKV_PALETTE_SEED`` to pin one;
``$PAGEDKV_PALETTE=off`` draws freely. Each size always includes its boundary values: the first shape
holds every parameter's smallest allowed value, the second every largest (each declared dtype is
drawn as often), the deployed sizes (:data:`DEPLOYED`) come next, and each feature is in a set alone and in
the set of all of them. A V width of its own (:func:`v_width_options`) is part of a shape, never a
kernel of its own: MLA's 512 for a 576-wide K, and for about half the other shapes a narrower or wider V
(a candidate that declares V widths draws the MLA shape one case in three, :func:`is_mla_shape`); the LSE
(``return_lse``, a kernel variant) is drawn in two sets of its own, alone and with every non-fp8 feature. At most
``len(shapes) * len(feature_sets)`` attention specialisations (fp8 sets twice: e4m3 and e5m2),
:data:`PALETTE_SIZES` per profile.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
from functools import lru_cache
from typing import Any

from pagedkv.backends.capabilities import SPECIALIZATION_NAMES  # noqa: F401  (re-exported)

#: The geometry parameters of a shape, in its order (``head_dim_v`` only where V widths are declared).
SHAPE_NAMES = ("block_size", "head_dim", "gqa_group", "dtype")
#: MLA's latent cache: K 576 wide (512 latent + 64 rope), V its first 512 columns.
MLA_WIDTHS = {576: 512}
#: The pseudo-feature of a palette feature set that the LSE properties draw (``return_lse=True``).
LSE = "lse"
#: ``(shapes, feature sets)`` per profile: ``ci`` stays at most 10 x 14 = 140 attention specialisations.
PALETTE_SIZES = {"smoke": (4, 4), "dev": (10, 8), "ci": (10, 8), "repro": (10, 8), "gpu": (16, 10),
                 "nightly": (24, 12)}
#: The sizes most models deploy (Llama, Mistral, Qwen: head_dim 128, GQA group 4 or 8; vLLM's block size 16), in
#: every palette that declares them: a fixed ``ci`` palette never leaves out the kernel most traffic runs.
DEPLOYED = {"head_dim": (128, 64), "block_size": (16,), "gqa_group": (4, 8)}
#: Profiles whose palette rotates with the UTC day (the others are fixed: a gate must not flip on a rerun).
ROTATING = frozenset({"gpu", "nightly"})
_CAPS_FIELD = {"block_size": "block_sizes", "head_dim": "head_dims", "gqa_group": "gqa_groups"}


@dataclasses.dataclass(frozen=True)
class Palette:
    """The specialisations one run draws from.

    Attributes:
        names: the declared specialising parameters (a subset of :data:`SPECIALIZATION_NAMES`).
        shapes: dicts of the declared :data:`SHAPE_NAMES` (block_size, head_dim, gqa_group: ints; dtype: a name).
        feature_sets: frozensets of feature names (the first is the empty set); ``()`` when features are not
            declared as specialising.
        seed, profile: what chose it.
    """

    names: frozenset
    shapes: tuple
    feature_sets: tuple
    seed: int
    profile: str

    @property
    def bound(self) -> int:
        """The most attention specialisations a run can need: shapes x feature sets (fp8 sets count twice)."""
        sets = sum(2 if "fp8" in s else 1 for s in self.feature_sets) or 1
        return max(1, len(self.shapes)) * sets

    def describe(self) -> str:
        """One line: the shapes' values per parameter, the feature sets, the seed."""
        parts = [f"{n} {sorted({s[n] for s in self.shapes}, key=str)}" for n in SHAPE_NAMES if n in self.names]
        widths = sorted(f"{s['head_dim']}/{s['head_dim_v']}" for s in self.shapes
                        if s.get("head_dim_v", s.get("head_dim")) != s.get("head_dim"))
        if widths:
            parts.append(f"V widths of their own {widths}")
        if self.feature_sets:
            parts.append(f"{len(self.feature_sets)} feature sets")
        return (f"palette ({self.profile}, seed {self.seed}): {len(self.shapes)} shapes over " + "; ".join(parts)
                + f"; at most {self.bound} attention specialisations")


def current_profile() -> str:
    """The run's Hypothesis profile's pagedkv name (``pagedkv-ci`` -> ``ci``; another name as it is): the one
    the suite chose and reports (:func:`pagedkv.testing.settings.chosen_profile`), else the loaded one."""
    from hypothesis import settings

    from pagedkv.testing.settings import chosen_profile

    name = chosen_profile() or settings.get_current_profile_name() or "default"
    return name.removeprefix("pagedkv-")


def palette_seed(profile: str | None = None) -> int:
    """``$PAGEDKV_PALETTE_SEED`` when set; else the UTC day's ordinal under a rotating profile
    (:data:`ROTATING`), else 0.

    Raises:
        ValueError: ``$PAGEDKV_PALETTE_SEED`` is not an integer.
    """
    pinned = os.environ.get("PAGEDKV_PALETTE_SEED")
    if pinned:
        try:
            return int(pinned)
        except ValueError:
            raise ValueError(f"PAGEDKV_PALETTE_SEED={pinned!r} is not an integer") from None
    profile = profile or current_profile()
    return datetime.datetime.now(datetime.timezone.utc).date().toordinal() if profile in ROTATING else 0


def _allowed(name: str, caps: Any, universe: dict) -> list:
    if name == "dtype":
        return [d for d in universe["dtype"] if caps is None or d in caps.dtypes]
    sizes = getattr(caps, _CAPS_FIELD[name], None) if caps is not None else None
    values = [v for v in universe[name] if sizes is None or sizes.allows(v)]
    return sorted(set(values or (sizes.choose(()) if sizes is not None else universe[name])))


def _column(values: list, count: int, rng: random.Random, deployed: tuple = ()) -> list:
    """``count`` values: the smallest, the largest, the ``deployed`` ones among ``values``, then the others in a
    seeded order (repeating when there are fewer values than rows)."""
    inner = values[1:-1] if len(values) > 2 else list(values)
    rng.shuffle(inner)
    first = [v for v in deployed if v in inner]
    inner = first + [v for v in inner if v not in first]
    rest = [inner[i % len(inner)] for i in range(max(0, count - 2))] if inner else []
    return ([values[0], values[-1]] + rest)[:count]


def build_palette(names: frozenset, caps: Any, profile: str, seed: int, universe: dict) -> Palette:
    """The palette of a declared space (see the module docstring); ``universe`` maps each of
    :data:`SHAPE_NAMES` to the values the strategies draw (:data:`pagedkv.testing.strategies.geometry.UNIVERSE`)."""
    count, num_sets = PALETTE_SIZES.get(profile, PALETTE_SIZES["ci"])
    rng = random.Random(f"{seed}/{profile}")
    shape_names = [n for n in SHAPE_NAMES if n in names]
    columns = {n: _column(_allowed(n, caps, universe), count, rng, DEPLOYED.get(n, ())) for n in shape_names
               if n != "dtype"}
    if "dtype" in shape_names:  # every declared dtype, evenly
        dtypes = _allowed("dtype", caps, universe)
        rng.shuffle(dtypes)
        columns["dtype"] = [dtypes[i % len(dtypes)] for i in range(count)]
    shapes, seen = [], set()
    for i in range(count):
        shape = {n: columns[n][i] for n in shape_names}
        key = tuple(shape.values())
        if shape and key not in seen:
            seen.add(key)
            shapes.append(shape)
    if "head_dim" in shape_names and declares_v_widths(caps):
        rng_v = random.Random(f"{seed}/{profile}/head_dim_v")
        for i, shape in enumerate(shapes):  # the first shape (every smallest value) keeps one width
            options = v_width_options(shape["head_dim"], caps)
            mla = MLA_WIDTHS.get(shape["head_dim"])
            own = [w for w in options if w != shape["head_dim"]]
            shape["head_dim_v"] = (mla if mla in options else rng_v.choice(own) if i and own and rng_v.random() < 0.5
                                   else shape["head_dim"])
    sets: list = []
    if "features" in names:
        declared = sorted(caps.features) if caps is not None else sorted(_all_features())
        sets = [frozenset()] + [frozenset({f}) for f in declared]
        if len(declared) > 1:
            sets.append(frozenset(declared))
        if caps is not None and getattr(caps, "lse", None) is not None:  # the LSE kernels: two sets, no random one
            sets += [frozenset({LSE}), frozenset({LSE, *declared}) - {"fp8"}]
            sets = list(dict.fromkeys(sets))
        while len(sets) < num_sets and len(declared) > 2 and LSE not in set().union(*sets):
            pick = frozenset(rng.sample(declared, rng.randint(2, len(declared) - 1)))
            if pick not in sets:
                sets.append(pick)
    return Palette(frozenset(names), tuple(shapes), tuple(sets), seed, profile)


def declares_v_widths(caps: Any) -> bool:
    """Whether a declared space draws V of its own width or K's latent view (``head_dims_v``, ``shared_kv_storage``)."""
    return caps is not None and (getattr(caps, "head_dims_v", None) is not None
                                 or bool(getattr(caps, "shared_kv_storage", False)))


def v_width_options(head_dim: int, caps: Any) -> list[int]:
    """V widths a case of K width ``head_dim`` may draw in ``caps`` (``None``: any), ``head_dim`` first:
    MLA's 512 beside a 576-wide K, half of K and a wider V (K + 3) at the small head dims, one less
    than K elsewhere; at most ``head_dim`` where V is K's storage (``shared_kv_storage``)."""
    candidates = [head_dim, *([MLA_WIDTHS[head_dim]] if head_dim in MLA_WIDTHS else []), max(1, head_dim // 2),
                  head_dim + 3 if head_dim <= 8 else head_dim - 1]
    allowed = getattr(caps, "head_dims_v", None) if caps is not None else None
    shared = bool(getattr(caps, "shared_kv_storage", False)) if caps is not None else False
    if caps is not None and allowed is None and not shared:
        return [head_dim]
    out = [w for w in dict.fromkeys(candidates)
           if w >= 1 and (w == head_dim or allowed is None or allowed.allows(w)) and (not shared or w <= head_dim)]
    return out


def _all_features() -> frozenset:
    from pagedkv.backends.capabilities import FEATURE_NAMES

    return FEATURE_NAMES


@lru_cache(maxsize=64)
def _cached(names: frozenset, caps: Any, profile: str, seed: int, universe: tuple) -> Palette:
    return build_palette(names, caps, profile, seed, dict(universe))


def palette_for(caps: Any, universe: dict) -> Palette | None:
    """The run's palette for a declared space, or ``None`` (no ``specialize_on`` declared, or
    ``$PAGEDKV_PALETTE=off``): what :func:`~pagedkv.testing.strategies.geometry.geometries` and the
    feature draws consult."""
    names = getattr(caps, "specialize_on", None)
    if not names or os.environ.get("PAGEDKV_PALETTE", "").lower() in ("off", "0", "no"):
        return None
    profile = current_profile()
    try:
        return _cached(frozenset(names), caps, profile, palette_seed(profile), tuple(sorted(universe.items())))
    except TypeError:  # a declared space that cannot be hashed (a custom layout object)
        return build_palette(frozenset(names), caps, profile, palette_seed(profile), universe)


def is_mla_shape(shape: dict) -> bool:
    """Whether ``shape`` is MLA's latent cache (:data:`MLA_WIDTHS`: K 576 wide, V its first 512 columns), the
    width DeepSeek V3/R1, Kimi K2 and GLM ship and the one where vLLM's and SGLang's MLA decode kernels take
    their rope tile (``BLOCK_DPE``): a candidate that declares V widths of its own draws it one case in three."""
    return MLA_WIDTHS.get(shape.get("head_dim")) == shape.get("head_dim_v") is not None


def shape_fits(shape: dict, **lists) -> bool:
    """Whether ``shape`` lies in the lists a strategy was called with (``block_size=(...)``, ...)."""
    return all(shape[n] in allowed for n, allowed in lists.items() if n in shape and allowed is not None)


def shape_key(shape: dict) -> tuple:
    """A shape's values in :data:`SHAPE_NAMES` order (V's width last when it has one)."""
    return tuple(shape[n] for n in (*SHAPE_NAMES, "head_dim_v") if n in shape)
