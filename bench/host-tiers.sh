#!/usr/bin/env bash
# The host tiers (mapped, disk under HOST_RAM_GIB, default 8, copy), three processes,
# merged; then SHARED_PAIRS (default 3) pairs of processes serving the mapped file at once
# (the second started 3 s after the first), merged by merge-host-tiers-shared; under
# DEADLINE seconds (default 560). From the bundle: bash .bundle/host-tiers.sh
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd); H=$OUT/tiers; mkdir -p $H /tmp/ckpt
export BENCH_DATE=${BENCH_DATE:-$(date -u +%F)}
df -h /tmp | tee $H/df.txt; mount | grep -E " / | /tmp " | tee -a $H/df.txt
for r in 1 2 3; do
  left=$(( ${DEADLINE:-560} - SECONDS ))
  [ $left -lt 60 ] && { echo "deadline: run $r not started"; break; }
  echo "== run $r (${SECONDS}s)"
  timeout $left $B/zoo host-tiers --model flux-dev --file /tmp/ckpt/flux-dev.safetensors --case 1024 --depth 1 --steps 5 \
    --host-ram-gib ${HOST_RAM_GIB:-8} --disk-steps 2 --commit ${COMMIT:-unknown} --out $H/host-tiers-run$r.json > $H/run$r.txt 2>&1
  echo "rc=$?" >> $H/run$r.txt; tail -12 $H/run$r.txt
done
$B/zoo merge-host-tiers --out $H/host-tiers.json $H/host-tiers-run*.json 2>&1 | tee $H/merge.txt
for p in $(seq 1 ${SHARED_PAIRS:-3}); do
  left=$(( ${DEADLINE:-560} - SECONDS ))
  [ $left -lt 70 ] && { echo "deadline: pair $p not started"; break; }
  echo "== pair $p (${SECONDS}s)"
  for side in a b; do
    timeout $(( left - 5 )) $B/zoo host-tiers --model flux-dev --file /tmp/ckpt/flux-dev.safetensors --case 1024 --depth 1 --steps 30 \
      --only mapped --group pair$p --commit ${COMMIT:-unknown} --out $H/shared-pair$p-$side.json > $H/shared-pair$p-$side.txt 2>&1 &
    [ $side = a ] && sleep 3
  done
  wait
  tail -3 $H/shared-pair$p-a.txt $H/shared-pair$p-b.txt
done
$B/zoo merge-host-tiers-shared --out $H/host-tiers-shared.json $H/shared-pair*.json 2>&1 | tee $H/merge-shared.txt
tar czf $OUT/tiers.tgz -C $OUT tiers
