#!/usr/bin/env bash
# Runs on the GPU runner from the bundle (`cargo xtask gpu-bundle`): the CUDA
# conformance suite with OFFLOAD_REQUIRE_DEVICE=1, a compute-sanitizer pass, one
# process run of the bench room's cuda file and the bench room. Writes everything under $OUT.
# SMOKE=1: a small model and one resolution, to check the bundle works.
# CANDLE=1: the demo on candle-cuda and the candle rows (CPU and CUDA) (gpu-bundle --candle); candle's bench is the room's (zoo-candle.gz).
# TCH=1: also the tch rows (CPU and CUDA).
# ZOO=1 (default): the bench room (bench/zoo-run.sh: registry check, tch on the registry's models, diffusers' anchors).
# VULKAN=1: the vulkan row (loader from .gl/) and the Vulkan bench, 3 runs merged by code.
# BENCH=0: conformance and sabotage tables only, no benches.
# CODEC=1: the exponent decoder's GPU round trip and its speed (codec_speed 256, 1024).
# CUDA=0: skip the cuda run (`zoo run --backend cuda --model flux-dev`; STEPS, BENCH_ARGS (default
#   `--depths 1,2`; e.g. `--budgets 8,12,16 --trace $OUT/trace.json`), BENCH_OUT).
# SANITIZE=1 (default): compute-sanitizer over the conformance suite, then (memcheck, racecheck,
#   synccheck) over the bench room's cuda file, shrunk; ZOO_SANITIZE=1 SANITIZE=0: the second part alone.
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/offload-out}; mkdir -p "$OUT"
export OFFLOAD_REQUIRE_DEVICE=1 BENCH_DATE=${BENCH_DATE:-$(date -u +%F)}
COMMIT=${COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.txt"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
# Every conformance binary also runs every deliberate ring break on its rows
# (--sabotage); the tables are merged by the code at the end of this script.
SAB="--commit $COMMIT --gpu"
echo "== conformance"; "$B/conformance" --backend sim,cuda,cuda-coded --json "$OUT/conformance-cuda.json" --sabotage "$OUT/sabotage-cuda.json" $SAB "$GPU" 2>&1 | tee "$OUT/conformance-cuda.txt"
if [ "${RACECHECK:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  echo "== racecheck (our kernels; cuBLAS's nvjet kernels excluded)"
  { timeout 120 compute-sanitizer --tool racecheck "$B/conformance" --backend cuda 2>&1 | tail -4
    for tool in racecheck memcheck; do
      timeout 120 compute-sanitizer --tool $tool "$B/zoo" run --backend cuda --model flux-dev --no-gemm --blocks 1 --res 256 --cases 256 \
        --warmup 0 --out /tmp/san.json 2>&1 | tail -4
    done
  } | tee "$OUT/racecheck.txt"
fi
if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer"
  compute-sanitizer --tool memcheck --leak-check full "$B/conformance" --backend cuda 2>&1 | tail -25 | tee "$OUT/compute-sanitizer.txt"
fi
if { [ "${SANITIZE:-1}" = 1 ] || [ "${ZOO_SANITIZE:-0}" = 1 ]; } && command -v compute-sanitizer >/dev/null; then
  # The bench room's cuda file (offload-cuda's reference model) under the sanitizer:
  # flux-dev's first block of each stack, 256², five steps (cuBLAS included).
  echo "== compute-sanitizer (the bench room's cuda file)"
  for tool in memcheck racecheck synccheck; do
    timeout 300 compute-sanitizer --tool $tool "$B/zoo" run --backend cuda --model flux-dev --blocks 1 --res 256 --cases 256 --warmup 0 \
      --out /tmp/zoo-san.json 2>&1 | tail -6
  done | tee "$OUT/compute-sanitizer-zoo.txt"
fi
if [ "${CUDA:-1}" = 0 ]; then
  echo "== cuda run skipped (CUDA=0)"
elif [ "${SMOKE:-0}" = 1 ]; then
  "$B/zoo" run --backend cuda --model flux-dev --blocks 2 --cases 1024 --commit "$COMMIT" --out "$OUT/cuda-smoke.json" 2>&1 | tail -20
else
  echo "== cuda run (the bench room's cuda file, one process)"
  "$B/zoo" run --backend cuda --model flux-dev --steps "${STEPS:-5}" ${BENCH_ARGS:---depths 1,2} --commit "$COMMIT" \
    --out "$OUT/${BENCH_OUT:-cuda-flux.json}" 2>&1 | tee "$OUT/cuda-bench.txt"
fi
if [ "${TCH:-0}" = 1 ] && [ -x "$B/conformance-tch" ]; then
  echo "== tch conformance"; "$B/conformance-tch" --backend tch,tch-cuda --json "$OUT/conformance-tch.json" --sabotage "$OUT/sabotage-tch.json" $SAB "$GPU" 2>&1 | tee "$OUT/conformance-tch.txt"
fi
if [ "${CANDLE:-0}" = 1 ] && [ -f "$B/conformance-candle.gz" ]; then
  C=/tmp/offload-candle; mkdir -p $C
  for f in conformance-candle flux_demo; do [ -f "$B/$f.gz" ] && gunzip -c "$B/$f.gz" > "$C/$f" && chmod +x "$C/$f"; done
  echo "== demo (candle-cuda)"; "$C/flux_demo" ${DEMO_ARGS:---hidden 3072 --double 2 --single 4 --res 1024 --steps 3} 2>&1 | tee "$OUT/demo.txt"
  echo "== candle conformance"; "$C/conformance-candle" --backend candle,candle-cuda --json "$OUT/conformance-candle.json" --sabotage "$OUT/sabotage-candle.json" $SAB "$GPU" 2>&1 | tee "$OUT/conformance-candle.txt"
fi
if [ "${CODEC:-0}" = 1 ] && [ -x "$B/cuda-lib-tests" ]; then
  # The exponent decoder on the GPU: its round trip (bit-exact, damage an error),
  # then its speed at two sizes (kernel only, bit-exact checked).
  echo "== codec"
  { OFFLOAD_REQUIRE_NVRTC=1 "$B/cuda-lib-tests" codec --nocapture
    "$B/codec_speed" 256 --json "$OUT/codec-speed-256.json"
    "$B/codec_speed" 1024 --json "$OUT/codec-speed-1024.json"; } 2>&1 | tee "$OUT/codec.txt"
fi
if [ "${ZOO:-1}" = 1 ]; then
  # The bench room: registry check, tch runs and diffusers' anchors, merged (bench/zoo-run.sh).
  ZOO_DIR="$OUT/zoo" bash "$B/zoo-run.sh" 2>&1 | tail -30
fi
if [ "${VULKAN:-0}" = 1 ] && [ -x "$B/conformance-vulkan" ]; then
  # The runner has NVIDIA's Vulkan driver but no loader: the loader and the
  # validation layer travel as Debian packages in .gl/ (cargo xtask gpu-bundle).
  for f in "$B"/../.gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  if ! ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1; then
    export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
  fi
  # One process per row: on the H200 (driver 580.159) a process that had run the vulkan
  # row's cases could not create an instance for the vulkan-import row's eighth case
  # on (VK_ERROR_INCOMPATIBLE_DRIVER); each row alone passes (bench/NOTES.md, 2026-12-01).
  for row in vulkan vulkan-import vulkan-split; do
    echo "== $row conformance"; "$B/conformance-vulkan" --backend $row --json "$OUT/conformance-$row.json" --sabotage "$OUT/sabotage-$row.json" $SAB "$GPU" 2>&1 | tee "$OUT/conformance-$row.txt"
  done
  if [ "${VULKAN_BENCH:-${BENCH:-1}}" = 1 ]; then
    if [ "${VK_DIAG:-0}" = 1 ]; then
      echo "== vulkan bandwidth variants (one run each, kept as diagnostics)"
      for v in ${VK_DIAG_VARIANTS:-"host-cached:--host-cached" "compute-queue:--copy-queue compute" "chunk16:--copy-chunk-mib 16"}; do
        "$B/vulkan-bench" --commit "$COMMIT" --steps 2 --out "$OUT/vulkan-diag-${v%%:*}.json" ${v#*:} 2>&1 | grep -E "bandwidth|d=1" | tee -a "$OUT/vulkan-diag.txt"
      done
    fi
    echo "== vulkan bench (3 runs, separate processes)"
    for r in 1 2 3; do "$B/vulkan-bench" --commit "$COMMIT" --out "$OUT/vulkan-run$r.json" ${VK_ARGS:-} 2>&1 | tee "$OUT/vulkan-run$r.txt"; done
    # The same three runs with other options, when asked (VK_ARGS2="--host-memory imported":
    # the store's pages imported with VK_EXT_external_memory_host).
    if [ -n "${VK_ARGS2:-}" ]; then
      for r in 1 2 3; do "$B/vulkan-bench" --commit "$COMMIT" --out "$OUT/vulkan2-run$r.json" $VK_ARGS2 2>&1 | tee "$OUT/vulkan2-run$r.txt"; done
    fi
    for PREFIX in vulkan vulkan2; do ls "$OUT"/$PREFIX-run*.json >/dev/null 2>&1 || continue
    python3 "$B/vulkan_merge.py" "$OUT" "$PREFIX"
    done
  fi
fi
if ls "$OUT"/sabotage-*.json >/dev/null 2>&1; then
  echo "== sabotage table"; python3 "$B/sabotage_table.py" "$OUT" "$BENCH_DATE"
fi
echo "== done"
