#!/usr/bin/env bash
# Every conformance row (cuda, cuda-coded, tch-cuda, candle-cuda, vulkan) with its breaks,
# one process a row, under DEADLINE seconds (default 540). From the bundle: bash .bundle/conformance-rows.sh
# (ROWS_RELAY=1: the cuda-relay row too, on a machine with two GPUs). Carry .gl for the vulkan row.
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd); C=$OUT/conf; mkdir -p $C
export OFFLOAD_REQUIRE_DEVICE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
SAB="--commit ${COMMIT:-unknown} --gpu"
left() { echo $(( ${DEADLINE:-540} - SECONDS )); }
echo "== cuda rows"; timeout $(left) $B/conformance --backend sim,cuda,cuda-coded --json $C/conformance-cuda.json --sabotage $C/sabotage-cuda.json $SAB "$GPU" > $C/conformance-cuda.txt 2>&1; echo "rc=$? at ${SECONDS}s" | tee -a $C/conformance-cuda.txt
tail -25 $C/conformance-cuda.txt
if [ "${ROWS_RELAY:-0}" = 1 ]; then
  echo "== cuda-relay"; timeout $(left) $B/conformance --backend cuda-relay --json $C/conformance-relay.json --sabotage $C/sabotage-relay.json $SAB "$GPU" > $C/conformance-relay.txt 2>&1; echo "rc=$? at ${SECONDS}s" | tee -a $C/conformance-relay.txt
  tail -25 $C/conformance-relay.txt
fi
if [ -x $B/conformance-tch ]; then
  echo "== tch-cuda"; timeout $(left) $B/conformance-tch --backend tch-cuda --json $C/conformance-tch.json --sabotage $C/sabotage-tch.json $SAB "$GPU" > $C/conformance-tch.txt 2>&1; echo "rc=$? at ${SECONDS}s" | tee -a $C/conformance-tch.txt
  tail -20 $C/conformance-tch.txt
fi
if [ -f $B/conformance-candle.gz ]; then
  gunzip -c $B/conformance-candle.gz > /tmp/conformance-candle && chmod +x /tmp/conformance-candle
  echo "== candle-cuda"; timeout $(left) /tmp/conformance-candle --backend candle-cuda --json $C/conformance-candle.json --sabotage $C/sabotage-candle.json $SAB "$GPU" > $C/conformance-candle.txt 2>&1; echo "rc=$? at ${SECONDS}s" | tee -a $C/conformance-candle.txt
  tail -20 $C/conformance-candle.txt
fi
if [ -x $B/conformance-vulkan ] && [ -d "$B/../.gl" ]; then
  for f in "$B"/../.gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  if ! ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  fi
  echo "== vulkan (default: split copies)"; timeout $(left) $B/conformance-vulkan --backend vulkan --json $C/conformance-vulkan.json --sabotage $C/sabotage-vulkan.json $SAB "$GPU" > $C/conformance-vulkan.txt 2>&1; echo "rc=$? at ${SECONDS}s" | tee -a $C/conformance-vulkan.txt
  tail -20 $C/conformance-vulkan.txt
fi
tar czf $OUT/conf.tgz -C $OUT conf
