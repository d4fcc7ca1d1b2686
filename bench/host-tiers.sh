#!/usr/bin/env bash
# Issue 17: the host tiers (mapped, disk under HOST_RAM_GIB, default 8, copy), three processes,
# merged; under DEADLINE seconds (default 560). From the bundle: bash .bundle/host-tiers.sh
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
tar czf $OUT/tiers.tgz -C $OUT tiers
