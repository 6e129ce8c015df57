"""Faults planted by hand in vLLM's Triton MLA decode and merge kernels, each run under the gate and under
vLLM's own kernel tests.

    python bench/vllm_attention_tests_on_cpu.py --mla-shapes vllm-0.32.0.tar.gz /tmp/vtests-mla
    python bench/vllm_attention_tests_on_cpu.py vllm-0.32.0.tar.gz /tmp/vtests
    python bench/planted_attention_faults.py --decode-tests /tmp/vtests-mla --merge-tests /tmp/vtests \
        --json bench/results/planted-vllm-attention-faults.json --md bench/results/planted-vllm-attention-faults.md

Each fault is one edit (a reverted fix or a plausible slip, several of the classes the issue trackers of
vLLM, SGLang and FlashInfer record: an LSE in base 2 merged as natural log, an empty split merged as valid,
the rope part read at the wrong offset, a wrong split boundary, a mask one slot long, NaN from two empty
parts) in ``vllm/v1/attention/ops/triton_decode_attention.py`` or ``triton_merge_attn_states.py``. A
fault's file is loaded in a child process with pagedkv's mutant finder (the installed package is never
edited). The gate: the decode faults under ``paged_attention_returns_the_log_sum_exp_of_the_reference``
and ``paged_attention_matches_fp64_dense_reference`` on ``pagedkv.tools.peers:vllm_triton_decode``, the
merge faults under the two ``merge_attn_states`` properties on ``vllm_merge_attn_states``, each under the
``ci`` profile (derandomized, no shrinking: a verdict, not a minimal case) within ``--budget`` seconds a
fault (a run the budget cuts is a survivor, marked so). vLLM's tests: the CPU-runnable copies of
``tests/kernels/attention/test_triton_decode_attention.py`` (MLA widths) and ``test_merge_attn_states.py``
(``bench/vllm_attention_tests_on_cpu.py``), the merge test's cases that fail on the release left out.
Killed: the child fails (a crash too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedkv.tools.mutants.generate import BOOTSTRAP

DECODE, MERGE = "triton_decode_attention.py", "triton_merge_attn_states.py"

#: (id, class, file under vllm/v1/attention/ops, old text, new text, what it breaks)
FAULTS = [
    ("decode-lse-base-2", "LSE base", DECODE,
     "lse_val = e_max + tl.log(e_sum)", "lse_val = (e_max + tl.log(e_sum)) * 1.4426950408889634",
     "stage 2 writes the row's LSE in base 2 (an exp2 kernel's) where natural log is declared (vllm#47079)"),
    ("decode-split-lse-base-2", "LSE base", DECODE,
     "            e_max + tl.log(e_sum),\n            mask=mask_h,",
     "            (e_max + tl.log(e_sum)) * 1.4426950408889634,\n            mask=mask_h,",
     "the grouped stage 1 writes each split's LSE in base 2, stage 2 merges them as natural log (sglang#33065)"),
    ("decode-empty-split-merged", "empty part", DECODE,
     "        if split_kv_end > split_kv_start:\n            tv = tl.load(",
     "        if split_kv_end >= split_kv_start:\n            tv = tl.load(",
     "stage 2 merges an empty split (no keys: its scratch never written) as valid (vllm#47188)"),
    ("decode-rope-offset", "MLA rope", DECODE,
     "base_offs_kpe = cur_kv_head * stride_buf_kh + offs_dpe[:, None]",
     "base_offs_kpe = cur_kv_head * stride_buf_kh + (offs_dpe - BLOCK_DPE)[:, None]",
     "K's rope columns read BLOCK_DPE columns early, inside the latent part"),
    ("decode-split-floor", "split boundary", DECODE,
     "    kv_len_per_split = tl.cdiv(cur_batch_seq_len, NUM_KV_SPLITS)\n    split_kv_start = kv_len_per_split * "
     "split_kv_id\n    split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)\n\n"
     "    e_max = tl.zeros([BLOCK_H]",
     "    kv_len_per_split = cur_batch_seq_len // NUM_KV_SPLITS\n    split_kv_start = kv_len_per_split * "
     "split_kv_id\n    split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)\n\n"
     "    e_max = tl.zeros([BLOCK_H]",
     "the grouped stage 1 cuts splits by floor division: the last seq_len % splits keys are never read"),
    ("decode-key-load-one-long", "mask", DECODE,
     "mask=(offs_n[None, :] < split_kv_end) & (mask_d[:, None]),",
     "mask=(offs_n[None, :] <= split_kv_end) & (mask_d[:, None]),",
     "the key tile loads the slot after its split (logit masked); in MLA V is that tile, so 0 * NaN poison "
     "reaches the output (flashinfer#941)"),
    ("decode-kv-head-modulo", "GQA", DECODE,
     "cur_kv_head = cur_head_id // tl.cdiv(kv_group_num, BLOCK_H)",
     "cur_kv_head = cur_head_id % tl.cdiv(kv_group_num, BLOCK_H)",
     "the grouped kernel's kv head by modulo: every query head reads kv head 0"),
    ("decode-lse-without-max", "LSE", DECODE,
     "lse_val = e_max + tl.log(e_sum)", "lse_val = tl.log(e_sum)",
     "stage 2's LSE without the running maximum (the output is right)"),
    ("merge-nan-two-empty", "empty part", MERGE,
     'out = tl.where(max_lse == float("-inf"), 0.0, out)', "out = out",
     "the both-empty guard reverted: two parts of no keys merge to 0/0 = NaN (vllm#27491)"),
    ("merge-lse-nan-two-empty", "empty part", MERGE,
     'out_lse = tl.where(max_lse == float("-inf"), float("-inf"), out_lse)', "out_lse = out_lse",
     "the both-empty LSE guard reverted: (-inf) - (-inf) makes the merged LSE NaN"),
    ("merge-exp2", "LSE base", MERGE,
     "    p_se = tl.exp(p_lse)\n    s_se = tl.exp(s_lse)", "    p_se = tl.exp2(p_lse)\n    s_se = tl.exp2(s_lse)",
     "the weights taken in base 2 from natural-log LSEs (sglang#40903)"),
    ("merge-lse-without-max", "LSE", MERGE,
     "out_lse = tl.log(out_se) + max_lse", "out_lse = tl.log(out_se)",
     "the merged LSE without the maximum subtracted before the exps"),
    ("merge-scales-swapped", "weights", MERGE,
     "out = p_out * p_scale + s_out * s_scale", "out = p_out * s_scale + s_out * p_scale",
     "each part weighted by the other's share"),
    ("merge-no-max-subtraction", "overflow", MERGE,
     "    p_lse = p_lse - max_lse\n    s_lse = s_lse - max_lse", "    p_lse = p_lse - 0.0\n    s_lse = s_lse - 0.0",
     "exp of the raw LSEs: above 88 float32 overflows to inf and the weights to NaN"),
]

GATE_PROPERTIES = {
    DECODE: ("pagedkv.tools.peers:vllm_triton_decode", ("paged_attention_returns_the_log_sum_exp_of_the_reference",
                                                       "paged_attention_matches_fp64_dense_reference")),
    MERGE: ("pagedkv.tools.peers:vllm_merge_attn_states",
            ("merge_attn_states_of_any_cut_equals_attention_over_the_whole",
             "merge_attn_states_with_no_keys_is_exact_and_never_nan")),
}
THEIR_TESTS = {DECODE: "test_triton_decode_attention.py", MERGE: "test_merge_attn_states.py"}

_GATE = r'''
import json, os, sys, time
if sys.argv[1] != "-":
    install_mutant(sys.argv[1], sys.argv[2], sys.argv[3])
from hypothesis import settings
from pagedkv.backends import load_backend
from pagedkv.testing.execute import run
from pagedkv.testing.registry import properties
from pagedkv.testing.settings import mutant_settings
from pagedkv.tools.mutants.kill_table import case_summary, run_property
backend = load_backend(sys.argv[4])
props = properties()
seed = os.environ.get("PLANTED_SEED")
for name in sys.argv[5:]:
    t0 = time.perf_counter()
    if seed is None:
        outcome = run_property(backend, props[name], "ci", shrink=False)
    else:  # the ci example count, drawn at random from this seed
        outcome = run(props[name], (backend,), "cpu", settings(mutant_settings("ci", shrink=False), derandomize=False),
                      seed=int(seed))
    row = {"property": name, "killed": bool(outcome.failed), "status": outcome.status, "examples": outcome.examples,
           "seconds": round(time.perf_counter() - t0, 1),
           "case": case_summary(outcome)[:300],
           "error": str(outcome.failures[0].error)[:300] if outcome.failed else ""}
    print("RESULT " + json.dumps(row), flush=True)
    if outcome.failed:
        break
'''

_THEIRS = r'''
import sys, pytest
if sys.argv[1] != "-":
    install_mutant(sys.argv[1], sys.argv[2], sys.argv[3])
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-x", *sys.argv[4:]]))
'''


def _mutate(ops_dir: Path, fault, work: Path) -> tuple[str, Path, Path]:
    fid, _, name, old, new, _ = fault
    original = ops_dir / name
    text = original.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{fid}: the text to replace occurs {text.count(old)} times in {original}")
    path = work / fid / name
    path.parent.mkdir(parents=True)
    path.write_text(text.replace(old, new))
    return f"vllm.v1.attention.ops.{name[:-3]}", path, original


def _child(code: str, args: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", BOOTSTRAP + code, *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = -9, (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out += "\ntimed out"
    return rc, out, time.monotonic() - t0


def _their_cases(tests: Path, name: str, env: dict) -> list[str]:
    """The node ids of ``name`` in ``tests`` that pass on the release (a failing one cannot kill)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", name], cwd=tests,
                          env=env, capture_output=True, text=True, timeout=1200)
    return [ln.split(" ")[1] for ln in done.stdout.splitlines() if ln.startswith("PASSED ")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-tests", type=Path, help="the CPU-runnable copy of vLLM's decode test (MLA widths)")
    parser.add_argument("--merge-tests", type=Path, help="the CPU-runnable copy of vLLM's merge test")
    parser.add_argument("--only", nargs="*", help="fault ids (default: all)")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds of the gate a fault (default 300)")
    parser.add_argument("--skip-theirs", action="store_true", help="run the gate only")
    parser.add_argument("--skip-gate", action="store_true", help="run vLLM's tests only")
    parser.add_argument("--theirs-from", type=Path, help="a JSON this script wrote with --skip-gate: its verdicts")
    parser.add_argument("--seed", type=int, help="draw the gate's examples at random from this seed (default: ci's "
                                                 "derandomized draw)")
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args(argv)
    import vllm

    ops_dir = Path(vllm.__file__).parent / "v1" / "attention" / "ops"
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "PAGEDKV_PROFILE": "ci",
           "TRITON_INTERPRET": "1", **({"PLANTED_SEED": str(args.seed)} if args.seed is not None else {}),
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    tests = {DECODE: args.decode_tests, MERGE: args.merge_tests}
    earlier = {r["id"]: r["theirs"] for r in json.loads(args.theirs_from.read_text())["rows"]} \
        if args.theirs_from else {}
    theirs = {} if args.skip_theirs or earlier else \
        {f: _their_cases(tests[f].resolve(), THEIR_TESTS[f], env) for f in tests}
    faults = [f for f in FAULTS if not args.only or f[0] in args.only]
    rows = []
    with tempfile.TemporaryDirectory(prefix="planted-attention-") as tmp:
        for fault in faults:
            module, path, original = _mutate(ops_dir, fault, Path(tmp))
            mod_args = [module, str(path), str(original)]
            row = {"id": fault[0], "class": fault[1], "file": fault[2], "what": fault[5], "gate": {"killed": False}}
            if not args.skip_gate:
                spec, props = GATE_PROPERTIES[fault[2]]
                rc, out, secs = _child(_GATE, mod_args + [spec, *props], repo, env, args.budget)
                runs = [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
                killed = any(r["killed"] for r in runs)
                crashed = rc not in (0, -9) and not killed
                row["gate"] = {"killed": killed or crashed, "runs": runs, "budget_cut": rc == -9,
                               "error": f"crashed (rc {rc}): {out.strip()[-200:]}" if crashed else
                               next((r["error"] for r in runs if r["killed"]), ""),
                               "case": next((r["case"] for r in runs if r["killed"]), ""), "seconds": round(secs, 1)}
            if fault[0] in earlier:
                row["theirs"] = earlier[fault[0]]
            elif not args.skip_theirs:
                ids = theirs[fault[2]]
                rc, out, secs = _child(_THEIRS, mod_args + ids, tests[fault[2]].resolve(), env, 1200)
                first = next((ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))), "")
                row["theirs"] = {"killed": rc != 0, "returncode": rc, "tests": len(ids), "seconds": round(secs, 1),
                                 "first_failure": first[:200]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` and its totals."""
    gate = sum(r["gate"]["killed"] for r in rows)
    theirs = sum(r.get("theirs", {}).get("killed", False) for r in rows)
    both = sum(r["gate"]["killed"] and r.get("theirs", {}).get("killed", False) for r in rows)
    lines = [f"**Totals:** {len(rows)} planted faults; the gate under `ci` kills {gate}, vLLM's tests kill {theirs} "
             f"(both {both}, the gate only {gate - both}, vLLM's tests only {theirs - both}, neither "
             f"{len(rows) - gate - theirs + both}).", "",
             "| fault | class | file | what | gate | gate s | failing case / error | vLLM tests | their s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g, t = r["gate"], r.get("theirs", {})
        verdict = "killed" if g["killed"] else "survived (budget cut)" if g.get("budget_cut") else "survived"
        detail = (g.get("case") or g.get("error") or "").replace("|", "/").replace("\n", " ")[:160]
        theirs = "killed" if t.get("killed") else "survived" if t else "-"
        lines.append(f"| {r['id']} | {r['class']} | {r['file']} | {r['what']} | {verdict} | {g.get('seconds', '-')} | "
                     f"{detail} | {theirs} | {t.get('seconds', '-')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
