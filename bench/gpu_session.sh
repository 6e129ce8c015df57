#!/usr/bin/env bash
# One prepared run on a machine with a CUDA GPU (torch, triton, hypothesis, pytest-xdist,
# transformers and matplotlib already installed; nothing is fetched): the property suite under the
# `gpu` profile, the end-to-end model check on CUDA for every backend, and the full benchmark.
# Everything lands in ${OUT:-gpu-results}/ (summary.txt, suite.txt, e2e.txt, bench.txt and
# cuda-full.json/csv/png: seven files); each step has its own time limit so one slow step cannot eat
# the others' time.
#
#   bash bench/gpu_session.sh                 # SUITE_S=240 E2E_S=120 BENCH_S=240 to change the limits
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
summary="$out/summary.txt"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$summary" 2>&1

start=$(date +%s)
PAGEDKV_PROFILE=gpu timeout "${SUITE_S:-240}" python3 -m pytest -n "${WORKERS:-8}" -p no:cacheprovider -q \
  --durations=15 > "$out/suite.txt" 2>&1
echo "suite (gpu profile): exit $? in $(( $(date +%s) - start )) s: $(grep -E '[0-9]+ (passed|failed)' "$out/suite.txt" | tail -1)" >> "$summary"
[ -d .pagedkv-failures ] && cp -r .pagedkv-failures "$out/failures"

for backend in triton indexed; do
  for dtype in float32 bfloat16; do
    echo "== e2e --backend $backend --dtype $dtype" >> "$out/e2e.txt"
    timeout "${E2E_S:-120}" python3 -m pagedkv e2e --backend "$backend" --device cuda --dtype "$dtype" \
      >> "$out/e2e.txt" 2>&1
    echo "e2e $backend $dtype: exit $? $(tail -1 "$out/e2e.txt")" >> "$summary"
  done
done

timeout "${BENCH_S:-240}" python3 -m pagedkv bench --device cuda --out-dir "$out" --name cuda-full --no-progress \
  > "$out/bench.txt" 2>&1
echo "bench: exit $? (table and limits: bench.txt; data: cuda-full.json/csv/png)" >> "$summary"
cat "$summary"
