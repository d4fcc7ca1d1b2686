#!/usr/bin/env bash
# The coded file on the H200: offload-cuda's GPU tests and the cuda rows' conformance
# suite (no sabotage; ROWS, empty for none; TESTS filters the tests), then a coded start from the coded file against coding at build
# (zoo host-tiers --only coded-file,coded on the Flux-dev-shaped checkpoint, three
# processes), merged by merge-coded-start; runs not started past DEADLINE seconds
# (default 400). Everything under $OUT/coded, archived after each step into
# $OUT/coded.tgz. From the bundle: bash .bundle/coded-start.sh
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd); R=$OUT/coded; mkdir -p $R /tmp/ckpt
export BENCH_DATE=${BENCH_DATE:-$(date -u +%F)} OFFLOAD_REQUIRE_DEVICE=1
pack() { tar czf $OUT/coded.tgz -C $OUT coded; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt 2>&1; nproc >> $R/gpu.txt
echo "== offload-cuda GPU tests${TESTS:+ matching $TESTS} (${SECONDS}s)"
timeout 100 $B/cuda-tests --test-threads 1 ${TESTS:-} > $R/cuda-tests.txt 2>&1; echo "rc=$?" >> $R/cuda-tests.txt; tail -4 $R/cuda-tests.txt; pack
if [ -n "${ROWS:-cuda,cuda-coded}" ]; then
  echo "== conformance, rows ${ROWS:-cuda,cuda-coded} (${SECONDS}s)"
  timeout 90 $B/conformance --backend ${ROWS:-cuda,cuda-coded} --json $R/conformance.json > $R/conformance.txt 2>&1
  echo "rc=$?" >> $R/conformance.txt; tail -6 $R/conformance.txt; grep -i "coded_file" $R/conformance.txt; pack
fi
for r in 1 2 3; do
  left=$(( ${DEADLINE:-400} - SECONDS ))
  [ $left -lt 60 ] && { echo "deadline: run $r not started"; break; }
  echo "== run $r (${SECONDS}s)"
  timeout $left $B/zoo host-tiers --model flux-dev --file /tmp/ckpt/flux-dev.safetensors --case 1024 --depth 1 --steps 3 \
    --only coded-file,coded --commit ${COMMIT:-unknown} --out $R/coded-start-run$r.json > $R/run$r.txt 2>&1
  echo "rc=$?" >> $R/run$r.txt; tail -7 $R/run$r.txt; pack
done
$B/zoo merge-coded-start --out $R/coded-start.json $R/coded-start-run*.json 2>&1 | tee $R/merge.txt
df -h /tmp > $R/df.txt; pack
