#!/usr/bin/env bash
# The relay on a machine with two GPUs: the cuda-relay conformance row with its breaks,
# then `zoo relay` three times (one link against relay, one process each) and
# `zoo merge-relay`, under DEADLINE seconds (default 540). From the bundle:
# bash .bundle/relay-run.sh
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd); R=$OUT/relay; mkdir -p $R
export OFFLOAD_REQUIRE_DEVICE=1 BENCH_DATE=${BENCH_DATE:-$(date -u +%F)}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
nvidia-smi topo -m > $R/topo.txt 2>&1
left() { echo $(( ${DEADLINE:-540} - SECONDS )); }
timeout $(left) $B/conformance --backend cuda-relay --json $R/conformance-relay.json --sabotage $R/sabotage-relay.json \
  --commit ${COMMIT:-unknown} --gpu "$GPU" > $R/conformance-relay.txt 2>&1; echo "rc=$?" >> $R/conformance-relay.txt
tail -25 $R/conformance-relay.txt
for r in 1 2 3; do
  [ $(left) -lt 60 ] && { echo "deadline: run $r not started"; break; }
  timeout $(left) $B/zoo relay --model ${MODEL:-flux-dev} --case ${CASE:-1024} --depth 1 --steps 5 --helpers 1 \
    --commit ${COMMIT:-unknown} --out $R/relay-run$r.json > $R/run$r.txt 2>&1; echo "rc=$?" >> $R/run$r.txt; tail -3 $R/run$r.txt
done
$B/zoo merge-relay --out $R/relay-x2.json $R/relay-run*.json 2>&1 | tee $R/merge.txt
tar czf $OUT/relay.tgz -C $OUT relay
