"""Faults planted by hand in vLLM's v1 core, each run under the manager gate and under vLLM's own tests.

    python bench/planted_manager_faults.py --tests ../shared/vllm-0.32.0-tests-v1-core \
        --json bench/results/planted-vllm-manager-faults.json --md bench/results/planted-vllm-manager-faults.md

Each fault is one edit (a reverted fix or a plausible slip) in the classes the one-group gate used to miss:
identities that collide only in their encoding, the declared eviction order, prefix hits that silently stop,
blocks freed while an in-flight step reads them. A fault's file is loaded in a child process with pagedkv's
mutant finder (the installed package is never edited). The gate: the cache-manager machine on
``pagedkv.tools.peers:vllm_cache_manager`` as the suite runs its one-group layout under the ``ci`` profile
(``programs.one_group_programs``: 400 derandomized programs of 30 steps, or drawn from Hypothesis seed N with
``--seed N``; no shrinking, which does not change a verdict). vLLM's tests: the cache subset of
``tests/v1/core`` its README lists (637 tests), ``-x``. Killed: the child fails.
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

CORE = "vllm/v1/core"

#: (id, class, file under vllm/v1/core, old text, new text, what it breaks)
FAULTS = [
    ("lora-path-dropped", "encoding", "kv_cache_utils.py",
     'return [("lora", lora_request.lora_name, lora_request.lora_path)]',
     'return [("lora", lora_request.lora_name)]',
     "the LoRA key without its path: one adapter name at two paths shares cache entries"),
    ("untagged-salt-and-lora", "encoding", "kv_cache_utils.py",
     ('[("cache_salt", request.cache_salt)]\n        if (start_token_idx == 0',
      'return [("lora", lora_request.lora_name, lora_request.lora_path)]'),
     ('[request.cache_salt]\n        if (start_token_idx == 0', 'return [lora_request.lora_name]'),
     "salt and LoRA keys untagged (the pre-tag format): a salt spelled like a LoRA name collides with it"),
    ("mm-offset-dropped", "encoding", "kv_cache_utils.py",
     'extra_keys.append(("mm", mm_feature.identifier, offset - start_token_idx))',
     'extra_keys.append(("mm", mm_feature.identifier))',
     "a multimodal key without its offset in the block: one image at two offsets collides"),
    ("free-not-reversed", "eviction order", "single_type_kv_cache_manager.py",
     "self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))",
     "self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))",
     "a request's blocks released head first: its prefix is evicted before its tail"),
    ("cached-reused-first", "eviction order", "block_pool.py",
     "self.free_block_queue.append_n(blocks_to_evict_last)",
     "self.free_block_queue.prepend_n(blocks_to_evict_last)",
     "released cached blocks go to the front of the free queue: most recently used evicted first"),
    ("uncached-reused-last", "eviction order", "block_pool.py",
     "self.free_block_queue.prepend_n(blocks_to_evict_first)",
     "self.free_block_queue.append_n(blocks_to_evict_first)",
     "released uncached blocks go to the back: cached blocks are evicted while empty ones wait"),
    ("cache-one-step-late", "hit promise", "kv_cache_manager.py",
     "total_computed_tokens + num_new_tokens,\n            request.num_tokens,",
     "total_computed_tokens,\n            request.num_tokens,",
     "full blocks cached one step late: a request's last chunk is never cached"),
    ("hit-one-block-short", "hit promise", "single_type_kv_cache_manager.py",
     "itertools.islice(full_block_hashes, max_length // block_size)",
     "itertools.islice(full_block_hashes, (max_length - 1) // block_size)",
     "a full-attention hit stops one block early when the prompt is whole blocks plus one token"),
    ("index-keeps-newest-only", "hit promise", "block_pool.py",
     "self._cache[key] = {blocks.block_id: blocks, block.block_id: block}",
     "self._cache[key] = block",
     "a second block with a cached hash replaces the first in the index: the first, still cached, no "
     "longer hits once the second is evicted"),
    ("window-frees-in-flight", "in-flight", "kv_cache_manager.py",
     "max(0, total_computed_tokens - request.num_in_flight_tokens),",
     "total_computed_tokens,",
     "the window frees on the optimistic basis: blocks an in-flight step still reads are handed out"),
    ("window-one-token-short", "in-flight", "single_type_kv_cache_manager.py",
     "num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens,",
     "num_computed_tokens - self.sliding_window + 2 - self.extra_retained_tokens,",
     "the window releases its oldest token's block one token early"),
    # From vLLM's code and its public record (a reverted fix names its pull request).
    ("mm-hash-resumes-at-last-item", "encoding", "kv_cache_utils.py",
     "curr_mm_idx, _ = get_mm_features_in_window(\n                    mm_features,\n"
     "                    start_token_idx,\n                    start_token_idx + hash_block_size,\n                )",
     "curr_mm_idx = -1",
     "a block completed by appended tokens is hashed from the last multimodal item only (the incremental "
     "path before vllm#51694, issue #49377): an earlier item in that block is left out of its key"),
    ("prompt-embeds-not-in-key", "encoding", "kv_cache_utils.py",
     "lora_extra_keys + mm_extra_keys + cache_salt_keys + prompt_embeds_keys",
     "lora_extra_keys + mm_extra_keys + cache_salt_keys",
     "prompt embeddings left out of the block key (the key vllm#27219 added): two embedding payloads over "
     "the same placeholder ids share cache entries"),
    ("hit-evictable-not-reserved", "accounting", "single_type_kv_cache_manager.py",
     "return num_new_blocks + num_evictable_blocks",
     "return num_new_blocks",
     "the admission check forgets that touching a hit block still in the free queue takes it from the free "
     "count (vllm#11565, issue #11562 reverted): an admitted allocation runs the pool dry halfway"),
    ("free-queue-remove-keeps-count", "accounting", "kv_cache_utils.py",
     "        block.prev_free_block = block.next_free_block = None\n        self.num_free_blocks -= 1",
     "        block.prev_free_block = block.next_free_block = None",
     "a hit block taken out of the free queue stays in its counter: the pool reports blocks it does not have"),
    ("resumed-hit-capped-at-prompt", "hit promise", "kv_cache_manager.py",
     "max_cache_hit_length = request.num_tokens - 1",
     "max_cache_hit_length = request.num_prompt_tokens - 1",
     "the hit limit taken from the prompt, not all tokens: a preempted request no longer hits the blocks its "
     "own output filled"),
    ("window-released-head-first", "eviction order", "single_type_kv_cache_manager.py",
     "                break\n            freed.append(blocks[i])\n            blocks[i] = self._null_block\n"
     "        if freed:\n            self.block_pool.free_blocks(freed)",
     "                break\n            freed.append(blocks[i])\n            blocks[i] = self._null_block\n"
     "        if freed:\n            self.block_pool.free_blocks(reversed(freed))",
     "blocks leaving the sliding window released head first: the oldest block of the run is evicted before "
     "the newer ones"),
    ("index-drops-last-duplicate", "hit promise", "block_pool.py",
     "            block = blocks.pop(block_id, None)\n            if len(blocks) > 0:",
     "            block = blocks.pop(block_id, None)\n            if len(blocks) > 1:",
     "evicting one of two blocks of one hash drops the other from the index too: a cached block that was "
     "never evicted no longer hits"),
]

#: The gate's child; ``SEED`` (prepended by ``--seed``) draws its programs from that Hypothesis seed instead of
#: derandomized.
_GATE = r'''
import contextlib, json, sys, time
if sys.argv[1] != "-":
    install_mutant(sys.argv[1], sys.argv[2], sys.argv[3])
from hypothesis import Phase, settings
from pagedkv.testing.hypothesis_internals import forced_seed
from pagedkv.testing.managers import programs
from pagedkv.testing.managers.machine import machine_for
from pagedkv.testing.settings import manager_settings, suite_settings
from pagedkv.tools.peers import vllm_hybrid_manager as vm
machine = machine_for(vm.cache_manager, windows=vm.cache_manager_windows, name="vllm_cache_manager_manager")
seed = globals().get("SEED")
base = manager_settings(100, 30, base=suite_settings())
s = settings(base, max_examples=programs.one_group_programs(base.max_examples),
             phases=(Phase.explicit, Phase.generate), derandomize=seed is None)
t0 = time.perf_counter()
with contextlib.nullcontext() if seed is None else forced_seed(seed):
    steps = programs.run_recorded(machine, s)
print("RESULT " + json.dumps({"killed": steps is not None, "error": steps.error if steps else "",
      "first_failing_example": steps.first_failing_example if steps else None, "examples": machine.examples_run,
      "steps": machine.checks_run, "seconds": round(time.perf_counter() - t0, 1)}))
'''

_THEIRS = r'''
import sys, pytest
if sys.argv[1] != "-":
    install_mutant(sys.argv[1], sys.argv[2], sys.argv[3])
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-x", *sys.argv[4:]]))
'''

CACHE_SUBSET = ["tests/v1/core/test_prefix_caching.py", "tests/v1/core/test_kv_cache_utils.py",
                "tests/v1/core/test_single_type_kv_cache_manager.py", "tests/v1/core/test_swa_inflight_window_free.py",
                "tests/v1/core/test_prefix_replay.py", "tests/v1/core/test_kv_sharing.py",
                "tests/v1/core/test_kv_cache_metrics.py", "tests/v1/core/test_deferred_block_free.py",
                "tests/v1/core/prefix_cache"]


def _mutate(vllm_dir: Path, fault, work: Path) -> tuple[str, Path, Path]:
    fid, _, name, old, new, _ = fault
    original = vllm_dir / "v1" / "core" / name
    text = original.read_text()
    for o, n in zip(*((old, new) if isinstance(old, tuple) else ((old,), (new,)))):
        if text.count(o) != 1:
            raise SystemExit(f"{fid}: the text to replace occurs {text.count(o)} times in {original}")
        text = text.replace(o, n)
    path = work / fid / name
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return f"vllm.v1.core.{name[:-3].replace('/', '.')}", path, original


def _child(code: str, args: list[str], cwd: Path, env: dict, timeout: int) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", BOOTSTRAP + code, *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        rc, out = -9, "timed out"
    return rc, out, time.monotonic() - t0


def main(argv=None, *, faults=None, their_args=None, gate=None, doc=None, options=None) -> int:
    """Run ``faults`` (default :data:`FAULTS`) under ``gate`` (the child's code, default the one-group gate; a
    callable: built from the parsed arguments) and under vLLM's tests (``their_args(tests)``: pytest
    arguments, default the cache subset). ``options(parser)`` adds a caller's own arguments."""
    parser = argparse.ArgumentParser(description=(doc or __doc__).splitlines()[0])
    parser.add_argument("--tests", required=True, type=Path, help="the CPU-runnable copy of vLLM's tests/v1/core")
    parser.add_argument("--only", nargs="*", help="fault ids (default: all)")
    parser.add_argument("--skip-theirs", action="store_true", help="run the gate only")
    parser.add_argument("--theirs-from", help="a JSON this script wrote: take vLLM's tests' verdicts from it")
    parser.add_argument("--skip-gate", action="store_true", help="run vLLM's tests only")
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    if options:
        options(parser)
    args = parser.parse_args(argv)
    if callable(gate):
        gate = gate(args)
    import vllm

    vllm_dir = Path(vllm.__file__).parent
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "PAGEDKV_PROFILE": "ci",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    faults = [f for f in faults or FAULTS if not args.only or f[0] in args.only]
    theirs = their_args(args.tests.resolve()) if their_args else CACHE_SUBSET
    rows = []
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        for fault in [("none", "baseline", "", "", "", "the release as installed")] + faults:
            if fault[0] == "none":
                mod_args = ["-", "-", "-"]
            else:
                module, path, original = _mutate(vllm_dir, fault, Path(tmp))
                mod_args = [module, str(path), str(original)]
            row = {"id": fault[0], "class": fault[1], "file": fault[2], "what": fault[5], "gate": {"killed": False}}
            if not args.skip_gate:
                rc, out, secs = _child(gate or _GATE, mod_args, repo, env, 900)
                line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
                row["gate"] = json.loads(line[7:]) if line else {"killed": True, "error": f"crashed: {out[-200:]}"}
                row["gate_wall_s"] = round(secs, 1)
            if args.theirs_from:
                row["theirs"] = next(r["theirs"] for r in json.loads(Path(args.theirs_from).read_text())["rows"]
                                     if r["id"] == fault[0])
            elif not args.skip_theirs:
                rc, out, secs = _child(_THEIRS, mod_args + theirs, args.tests.resolve(), env, 900)
                first = next((ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))), "")
                row["theirs"] = {"killed": rc != 0, "returncode": rc, "seconds": round(secs, 1),
                                 "first_failure": first[:200], "summary": out.strip().splitlines()[-1][:200]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.json).write_text(json.dumps({"tests": str(args.tests), "rows": rows}, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (the baseline row first) and its totals."""
    faults = [r for r in rows if r["id"] != "none"]
    gate = sum(r["gate"]["killed"] for r in faults)
    theirs = sum(r.get("theirs", {}).get("killed", False) for r in faults)
    lines = [f"**Totals:** {len(faults)} planted faults; the gate under `ci` kills {gate}, vLLM's tests kill "
             f"{theirs}.", "",
             "| fault | class | file | what | gate | example | steps | gate s | vLLM tests | their s | first failure |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g, t = r["gate"], r.get("theirs", {})
        lines.append(f"| {r['id']} | {r['class']} | {r['file']} | {r['what']} | "
                     f"{'killed' if g['killed'] else 'survived'} | {g.get('first_failing_example') or '-'} | "
                     f"{g.get('steps', '-')} | {g.get('seconds', '-')} | "
                     f"{'killed' if t.get('killed') else 'survived' if t else '-'} | {t.get('seconds', '-')} | "
                     f"{(g.get('error') or t.get('first_failure', ''))[:140]} |")
    return "\n".join(lines) + "\n"


def _options(parser) -> None:
    parser.add_argument("--seed", type=int, help="the gate's programs from this Hypothesis seed instead of "
                        "derandomized (a derandomized verdict is the same under any PYTHONHASHSEED)")


if __name__ == "__main__":
    sys.exit(main(options=_options, gate=lambda args: f"SEED = {args.seed!r}\n" + _GATE))
