#!/usr/bin/env bash
# The one-shot GPU run: everything pagedkv can only check on a CUDA device, in under 10 minutes on one
# GPU, written to ONE summary file. Nothing is fetched; torch, triton, hypothesis, pytest-xdist and
# transformers must already be installed (matplotlib optional). Run from anywhere:
#
#   bash bench/gpu_session.sh            # results in $OUT if set (the device runner's folder), else gpu-results/
#
# Steps, each under its own time limit (seconds; override by environment) so that one slow step cannot
# eat the others' time; a step that hits its limit is reported as such and the next one runs:
#   1. SUITE_S=210   the conformance suite and tests/ under the `gpu` Hypothesis profile, -n auto
#                    (SIGINT at the limit: pytest still prints its summary line)
#   2. COMPILE_S=90  the compile report for the real device's architecture (registers, spills, shared
#                    memory, occupancy; `python -m bench.compile_report --arch <cc>`), plus
#                    registers / spills of the kernels the suite actually loaded, read back from the driver
#   3. E2E_S=40      e2e on CUDA: a transformers Llama served from the cache, triton float32 / bfloat16 and
#                    indexed bfloat16 (3 runs)
#   4. BENCH_S=170   the benchmark with the GPU limit table: gather, write_kv, fused decode with split-K
#                    (`triton`) and without (`triton-nosplit`) against gather-then-SDPA and a device copy in
#                    the same run; batch 1 / 4 / 16 at 4k-128k contexts
# Total of the limits: 580 s plus start-up. summary.txt collects each step's verdict line and the
# important tables; the full logs sit next to it (suite.txt, compile.txt, e2e.txt, bench.txt,
# cuda-session.json/csv).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
summary="$out/summary.txt"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
step() { echo "== $* (t=$(elapsed) s)" >> "$summary"; }
{
  echo "pagedkv GPU session $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1 | head -4
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'device', torch.cuda.get_device_name(0), 'SMs', torch.cuda.get_device_properties(0).multi_processor_count)" 2>&1
} > "$summary"
cc=$(python3 -c "import torch; a, b = torch.cuda.get_device_capability(0); print(a * 10 + b)" 2>/dev/null || echo 90)

# 1. the suite under the gpu profile
step "suite: PAGEDKV_PROFILE=gpu pytest --pyargs pagedkv.testing.suite tests/ -n auto"
PAGEDKV_PROFILE=gpu PAGEDKV_FAILURE_DIR="$out/failures" timeout -s INT -k 20 "${SUITE_S:-210}" \
  python3 -m pytest --pyargs pagedkv.testing.suite tests -n auto -p no:cacheprovider -q -m "not slow" \
  --durations=10 > "$out/suite.txt" 2>&1
rc=$?
{ echo "suite exit $rc$([ $rc -eq 124 ] || [ $rc -eq 2 ] && echo ' (time limit or interrupted)')";
  grep -E "^(FAILED|ERROR)" "$out/suite.txt" | head -30
  grep -E "[0-9]+ (passed|failed|error)" "$out/suite.txt" | tail -1; } >> "$summary"

# 2. compile report for this device (ahead of time, the same matrix as CI's nightly default level)
step "compile report: python -m bench.compile_report --arch $cc"
timeout -k 10 "${COMPILE_S:-90}" python3 -m bench.compile_report --arch "$cc" \
  --json "$out/compile-report-sm$cc.json" > "$out/compile.txt" 2>&1
rc=$?
{ echo "compile report exit $rc"; grep -E "SPILLS|FAILED|SMEM>LIMIT" "$out/compile.txt" | head -20
  tail -1 "$out/compile.txt"; } >> "$summary"
# what the driver says about the kernels really built on this device
timeout 60 python3 - >> "$summary" 2>&1 <<'EOF'
import torch
from pagedkv import get_backend
from pagedkv.backends import triton_attention as ta
b = get_backend("triton")
dev = "cuda"
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    for ql, splits in ((1, 1), (1, 4), (64, 1)):
        q = torch.randn(2 * ql, 32, 128, device=dev, dtype=dtype)
        k = torch.randn(64, 16, 8, 128, device=dev, dtype=dtype)
        tables = torch.arange(64, device=dev, dtype=torch.int32).reshape(2, 32)
        seq = torch.tensor([ql + 300, ql + 100], device=dev, dtype=torch.int32)
        qsl = torch.tensor([0, ql, 2 * ql], device=dev, dtype=torch.int32)
        ta.paged_attention(q, k, k, tables, seq, qsl, 0.1, ql, num_splits=splits)
torch.cuda.synchronize()
for name in ("_paged_attention_kernel", "_merge_splits_kernel"):
    fn = getattr(ta, name)
    for cache in fn.device_caches.values():
        for kernel in cache[0].values():
            kernel._init_handles()
            c = kernel.metadata
            print(f"driver: {name} warps {c.num_warps} regs {kernel.n_regs} spills {kernel.n_spills} shared {c.shared}")
EOF

# 3. e2e on CUDA
step "e2e on CUDA"
for spec in "triton float32" "triton bfloat16" "indexed bfloat16"; do
  set -- $spec
  echo "== e2e --backend $1 --dtype $2" >> "$out/e2e.txt"
  timeout -k 5 "${E2E_S:-40}" python3 -m pagedkv e2e --backend "$1" --device cuda --dtype "$2" >> "$out/e2e.txt" 2>&1
  echo "e2e $1 $2: exit $? $(tail -1 "$out/e2e.txt")" >> "$summary"
done

# 4. the benchmark with the GPU limit table (split-K vs unsplit decode vs gather-then-SDPA vs a device copy)
step "bench: gather, write_kv, decode attention on cuda"
timeout -k 10 "${BENCH_S:-170}" python3 -m pagedkv bench --device cuda --ops gather,write_kv,attention \
  --impls indexed,indexed+sdpa,triton,triton-nosplit --dtypes bfloat16 --presets 8x128 --block-sizes 1,16 \
  --seq-lens 4096,16384,65536,131072 --attn-batches 1,4,16 --min-time 0.05 --rounds 2 --no-progress --no-plot \
  --out-dir "$out" --name cuda-session > "$out/bench.txt" 2>&1
rc=$?
{ echo "bench exit $rc"
  awk '/^limits/{p=1} p' "$out/bench.txt" | head -30
  echo "decode attention rows (impl, batch, context, us, % copy bandwidth):"
  python3 - "$out/cuda-session.json" <<'EOF' 2>&1 | head -40
import json, sys
d = json.load(open(sys.argv[1])); cols = d["columns"]
for r in d["rows"]:
    r = dict(zip(cols, r))
    if r["op"] == "attention" and r["block_size"] == 16:
        print(f"  {r['impl']:15} B={r['batch']:<3} L={r['seq_len']:<7} {1e6 * (r['time_s'] or 0):9.1f} us "
              f"{r['pct_copy_bw'] or 0:6.1f} %")
EOF
} >> "$summary"
echo "total $(elapsed) s" >> "$summary"
cat "$summary"
