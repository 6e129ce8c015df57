"""End to end, the oracle and the report: the paged run judged against transformers' dense run.

The oracle (:func:`dense_oracle`) is transformers itself: a copy of the same model with
``attn_implementation="eager"`` runs each request's full token sequence (prompt + generated tokens)
densely, in float64. Per request it reports the max ``|logit|`` difference over every position the
paged run computed, and whether every paged greedy token is the dense argmax at its position (the
eager run builds transformers' own masks: sliding windows included; soft-capping and the scale are
the model's own). With an fp8 cache the dense run's K/V go through the paged run's quantize ->
dequantize (:mod:`pagedkv.cli.e2e.fp8`), so like is compared with like. The
dense run is teacher-forced on the paged tokens, so "every paged token is the dense argmax" is the
same statement as "dense greedy decoding from the prompt produces exactly the paged tokens".

Tolerance on the logits (``E2E_LOGIT_TOLERANCE``): absolute, multiplied by ``max(1, max|dense
logit|)`` of the request (the random model's logits reach about 6). Measured with the default
scenario over seeds 0-3 against the float64 oracle:

========  =========  ========  ===============================================================
dtype     tolerance  observed  why
========  =========  ========  ===============================================================
float32   5e-5       3e-6      float32 rounding through the layers (paged attention sums in a
                               different order than eager attention, the MLPs see a packed
                               batch); ~15x headroom
float16   2.5e-2     6.5e-3    the whole model runs in float16 (eps 9.8e-4): every matmul,
                               norm and residual add rounds; ~4x headroom
bfloat16  1.5e-1     4.4e-2    as float16 with bfloat16's 8x coarser eps (7.8e-3); ~3x headroom
========  =========  ========  ===============================================================

The half-precision budgets measure the model's own rounding against float64, not the cache: the
cache's data movement is bit-exact (the property suite proves it bitwise). A broken attention path
(causal offset ignored, GQA heads mapped with ``h % num_kv_heads``, a wrong block) moves the logits
by 7-10, far beyond every budget, and changes the greedy tokens of every request.

Greedy tokens: every paged token must be the dense argmax at its position. In float16 and bfloat16
a random model's top two logits are often closer than the dtype's rounding (bfloat16 logits are
quantized to ~0.03 at magnitude 4, so exact ties occur), so a few tokens flip against *any*
oracle. transformers' own dense bfloat16 run does the same: on the default scenario its eager
(sdpa) attention is off the float64 run by up to 0.28 (0.24) and flips 6 of 203 greedy tokens;
the paged bfloat16 run is off by 0.26 and flips 8. Such a difference is a *near tie* when the dense
top logit leads the paged token's dense logit by at most twice the logit error observed at that
position (and that error is within tolerance): rounding alone explains the swap. Near ties are
counted apart: by default any token difference fails (the exit status is 1), and
``--allow-near-ties`` accepts near ties while still failing any other difference. Because the oracle is
teacher-forced, positions after a near tie are still compared on identical inputs. The last line
``tokens identical: yes|no`` is always the strict statement.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from pagedkv.cli.e2e.fp8 import FP8_ORACLE_KWARG, Fp8OracleStep, register_fp8_oracle
from pagedkv.cli.e2e.scenario import RequestResult

#: absolute logit tolerance per run dtype, multiplied by ``max(1, max|dense logit|)`` (see module doc).
E2E_LOGIT_TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 5e-5,
    torch.float16: 2.5e-2,
    torch.bfloat16: 1.5e-1,
}


@dataclass(frozen=True)
class TokenMismatch:
    """A paged greedy token that is not the dense argmax: generated token ``index`` at ``position``."""

    index: int
    position: int
    paged: int
    dense: int
    margin: float  # dense logit of the dense argmax minus dense logit of the paged token (>= 0)
    row_diff: float  # max |paged - dense| logit at this position

    def describe(self) -> str:
        return (f"generated token {self.index} (position {self.position}): paged {self.paged}, "
                f"dense {self.dense}, dense margin {self.margin:.3g}, logit diff there {self.row_diff:.3g}")


@dataclass
class RequestCheck:
    """Paged vs dense for one request: max logit diff, the greedy-token verdict, and bookkeeping.

    Attributes:
        max_logit_diff: max ``|paged - dense|`` over every position the paged run computed (inf on NaN).
        max_abs_logit: max ``|dense logit|`` at those positions (scales the tolerance).
        mismatches: every paged greedy token that differs from the dense argmax at its position.
        fork_of: the request it forked (its ``cached_tokens`` are then shared by the fork, not prefix-cache hits).
    """

    seq_id: int
    prompt_len: int
    cached_tokens: int
    prefill_chunks: int
    generated: int
    steps: tuple[int, int]
    max_logit_diff: float
    max_abs_logit: float
    mismatches: list[TokenMismatch] = field(default_factory=list)
    fork_of: int | None = None

    @property
    def tokens_identical(self) -> bool:
        return not self.mismatches

    @property
    def computed(self) -> int:
        """Tokens this request ran through the model: its uncached prompt and every generated token but the last."""
        return self.prompt_len - self.cached_tokens + self.generated - 1


def dense_model(model: torch.nn.Module, dtype: torch.dtype = torch.float64,
                implementation: str = "eager") -> torch.nn.Module:
    """A copy of ``model`` with transformers' own eager attention, in ``dtype`` (the oracle)."""
    dense = copy.deepcopy(model).to(dtype=dtype)
    if hasattr(dense, "set_attn_implementation"):
        dense.set_attn_implementation(implementation)
    else:  # older transformers
        dense.config._attn_implementation = implementation
    return dense.eval()


@torch.no_grad()
def dense_oracle(model: torch.nn.Module, results: dict[int, RequestResult],
                 dtype: torch.dtype = torch.float64, fp8: Fp8OracleStep | None = None) -> list[RequestCheck]:
    """Run each request's prompt + generated tokens densely and compare with the paged run.

    The dense run is teacher-forced on the paged tokens, so "no mismatches" is exactly "dense greedy
    decoding from the prompt reproduces the paged tokens", and after a mismatch the later positions
    are still compared on the same inputs.

    Args:
        model: the paged model (copied, not modified).
        results: :meth:`PagedEngine.run`'s output.
        dtype: the dense run's dtype (float64: the truth the paged run is judged against).
        fp8: for an fp8 cache: the dtype and the paged run's scales; the dense run's K/V then go
            through the quantize -> dequantize round trip (:func:`pagedkv.cli.e2e.fp8.fp8_oracle_attention`),
            and ``fp8.count`` counts the rounding-boundary elements.

    Returns:
        One :class:`RequestCheck` per request, in seq id order.
    """
    extra = {}
    if fp8 is None:
        dense = dense_model(model, dtype)
    else:
        dense = dense_model(model, dtype, register_fp8_oracle())
        extra[FP8_ORACLE_KWARG] = fp8
    device = next(dense.parameters()).device
    checks = []
    for sid in sorted(results):
        res = results[sid]
        prompt = list(res.prompt)
        ids = prompt + res.generated
        if fp8 is not None:
            fp8.codes = res.kv_codes
        logits = dense(input_ids=torch.tensor([ids], device=device), use_cache=False,
                       **extra).logits[0].double().cpu()
        positions = sorted(res.logits)
        paged = torch.stack([res.logits[p] for p in positions]).double()
        ref = logits[positions]
        row_diff = (paged - ref).abs().amax(dim=1).nan_to_num(nan=float("inf"))
        diff = float(row_diff.max())
        row_of = {p: i for i, p in enumerate(positions)}
        mismatches = []
        for j, token in enumerate(res.generated):
            p = len(prompt) - 1 + j
            want = int(torch.argmax(logits[p]))
            if want != token:
                mismatches.append(TokenMismatch(j, p, token, want, float(logits[p, want] - logits[p, token]),
                                                float(row_diff[row_of[p]])))
        checks.append(RequestCheck(sid, len(prompt), res.cached_tokens, res.prefill_chunks, len(res.generated),
                                   (res.first_step, res.finish_step), diff, float(ref.abs().max()), mismatches,
                                   res.request.fork_of))
    return checks


@dataclass
class E2EReport:
    """Outcome of :func:`run_e2e`.

    ``ok`` means: every request's logit diff is within tolerance, and every greedy token equals the
    dense argmax, except (unless ``strict_tokens``) at a *near tie*: the dense top logit leads the
    paged token's dense logit by at most twice the logit error observed at that very position (and
    that error is within tolerance), so rounding alone explains the swap.
    """

    backend: str
    dtype: torch.dtype
    device: str
    checks: list[RequestCheck]
    tolerance: float
    steps: int
    tokens_computed: int
    cache_stats: dict[str, float]
    seconds: float
    strict_tokens: bool = True
    error: str = ""  # the paged run raised (backend or cache manager fault): no checks, not ok
    notes: list[str] = field(default_factory=list)  # information lines printed before the last line

    @property
    def max_logit_diff(self) -> float:
        if self.error:
            return float("inf")
        return max((c.max_logit_diff for c in self.checks), default=0.0)

    @property
    def tokens_identical(self) -> bool:
        return not self.error and all(c.tokens_identical for c in self.checks)

    def allowed(self, check: RequestCheck) -> float:
        """The absolute logit tolerance for one request (scaled by its largest dense logit)."""
        return self.tolerance * max(1.0, check.max_abs_logit)

    def is_near_tie(self, check: RequestCheck, mismatch: TokenMismatch) -> bool:
        """Whether rounding explains ``mismatch``: margin <= 2 x the (tolerated) logit error there."""
        return mismatch.row_diff <= self.allowed(check) and mismatch.margin <= 2 * mismatch.row_diff

    @property
    def within_tolerance(self) -> bool:
        return not self.error and all(math.isfinite(c.max_logit_diff) and c.max_logit_diff <= self.allowed(c)
                                      for c in self.checks)

    @property
    def tokens_ok(self) -> bool:
        if self.error:
            return False
        if self.strict_tokens:
            return self.tokens_identical
        return all(self.is_near_tie(c, m) for c in self.checks for m in c.mismatches)

    @property
    def ok(self) -> bool:
        return self.tokens_ok and self.within_tolerance

    def _verdict(self, check: RequestCheck) -> str:
        if check.tokens_identical:
            return "yes"
        ties = sum(self.is_near_tie(check, m) for m in check.mismatches)
        bad = [m for m in check.mismatches if not self.is_near_tie(check, m)]
        first = bad[0] if bad else check.mismatches[0]
        kind = f"{len(bad)} differ, {ties} near ties" if bad else f"{ties} near ties"
        return f"no ({kind}; first: {first.describe()})"

    def lines(self) -> list[str]:
        """The human-readable report; the last line is ``e2e: max |logit diff| X, tokens identical: yes|no``."""
        s = self.cache_stats
        if self.error:
            return [f"backend {self.backend}, dtype {str(self.dtype).removeprefix('torch.')}, device {self.device}: "
                    f"the paged run failed: {self.error}",
                    "e2e: max |logit diff| inf, tokens identical: no"]
        # every count in the header is a sum of the table's columns (one source)
        hits = sum(c.cached_tokens for c in self.checks if c.fork_of is None)
        shared = sum(c.cached_tokens for c in self.checks if c.fork_of is not None)
        out = [f"backend {self.backend}, dtype {str(self.dtype).removeprefix('torch.')}, device {self.device}: "
               f"{len(self.checks)} requests, {self.steps} steps, {sum(c.computed for c in self.checks)} tokens "
               f"computed, {hits + shared} prompt tokens not computed ({hits} from the prefix cache + {shared} "
               f"shared by a fork), {int(s['cow_copies'])} copy-on-write copies, {int(s['evictions'])} evictions "
               f"({self.seconds:.1f} s)",
               "columns: prompt = prompt tokens; cached = of those, not computed (prefix-cache hit, or shared by the "
               "fork marked f); computed = tokens run through the model; new = tokens generated",
               f"{'req':>4} {'prompt':>6} {'cached':>7} {'computed':>8} {'chunks':>6} {'new':>4} {'steps':>9} "
               f"{'max|logit diff|':>16} {'allowed':>9}  tokens identical"]
        for c in self.checks:
            cached = f"{c.cached_tokens}{'f' if c.fork_of is not None else ' '}"
            out.append(f"{c.seq_id:>4} {c.prompt_len:>6} {cached:>7} {c.computed:>8} {c.prefill_chunks:>6} "
                       f"{c.generated:>4} {c.steps[0]:>4}-{c.steps[1]:<4} {c.max_logit_diff:>16.3e} "
                       f"{self.allowed(c):>9.2e}  {self._verdict(c)}")
        if not self.tokens_identical and self.tokens_ok:
            out.append("greedy tokens differ only at near ties (dense margin <= 2 x the logit error there): "
                       "accepted only with --allow-near-ties")
        if not self.within_tolerance:
            out.append(f"logit diff exceeds the {str(self.dtype).removeprefix('torch.')} tolerance "
                       f"{self.tolerance:g} x max(1, max|dense logit|)")
        out.extend(self.notes)
        out.append(f"e2e: max |logit diff| {self.max_logit_diff:.3e}, "
                   f"tokens identical: {'yes' if self.tokens_identical else 'no'}")
        return out
