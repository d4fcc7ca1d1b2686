#!/usr/bin/env bash
# Runs on the GPU runner from the bundle (`cargo xtask gpu-bundle`): the CUDA
# conformance suite with OFFLOAD_REQUIRE_DEVICE=1, a compute-sanitizer pass, the
# cuda benchmark and the diffusers anchor. Writes everything under $OUT.
# SMOKE=1: a small model and one resolution, to check the bundle works.
# CANDLE=1: the demo on candle-cuda, the candle rows (CPU and CUDA) and the candle Flux bench (gpu-bundle --candle).
# TCH=1: also the tch rows (CPU and CUDA) and the tch::nn Flux-shaped bench.
# CUDA=0: skip the cuda bench.
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/offload-out}; mkdir -p "$OUT"
export OFFLOAD_REQUIRE_DEVICE=1 BENCH_DATE=${BENCH_DATE:-$(date -u +%F)}
COMMIT=${COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.txt"
echo "== conformance"; "$B/conformance" --backend sim,cuda --json "$OUT/conformance-cuda.json" 2>&1 | tee "$OUT/conformance-cuda.txt"
if [ "${RACECHECK:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  echo "== racecheck (our kernels; cuBLAS's nvjet kernels excluded)"
  { timeout 120 compute-sanitizer --tool racecheck "$B/conformance" --backend cuda 2>&1 | tail -4
    timeout 120 compute-sanitizer --tool racecheck "$B/cuda_bench" --no-gemm --double 1 --single 2 --resolutions 256 --depths 1 --steps 1 --out /tmp/san.json 2>&1 | tail -4
    timeout 120 compute-sanitizer --tool memcheck "$B/cuda_bench" --no-gemm --double 1 --single 2 --resolutions 256 --depths 1 --steps 1 --out /tmp/san.json 2>&1 | tail -4
  } | tee "$OUT/racecheck.txt"
fi
if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer"
  { compute-sanitizer --tool memcheck --leak-check full "$B/conformance" --backend cuda 2>&1 | tail -25
    compute-sanitizer --tool memcheck "$B/cuda_bench" --double 1 --single 2 --resolutions 256 --depths 1 --steps 1 --out /tmp/san.json 2>&1 | tail -8
    compute-sanitizer --tool racecheck "$B/cuda_bench" --double 1 --single 2 --resolutions 256 --depths 1 --steps 1 --out /tmp/san.json 2>&1 | tail -8
    compute-sanitizer --tool synccheck "$B/cuda_bench" --double 1 --single 2 --resolutions 256 --depths 1 --steps 1 --out /tmp/san.json 2>&1 | tail -8
  } | tee "$OUT/compute-sanitizer.txt"
fi
if [ "${CUDA:-1}" = 0 ]; then
  echo "== cuda bench skipped (CUDA=0)"
elif [ "${SMOKE:-0}" = 1 ]; then
  "$B/cuda_bench" --double 2 --single 4 --resolutions 1024 --steps 2 --commit "$COMMIT" --out "$OUT/cuda-smoke.json" 2>&1 | tail -20
else
  echo "== cuda bench"; "$B/cuda_bench" --steps "${STEPS:-5}" ${BENCH_ARGS:-} --commit "$COMMIT" --out "$OUT/${BENCH_OUT:-cuda-flux.json}" 2>&1 | tee "$OUT/cuda-bench.txt"
fi
if [ "${TCH:-0}" = 1 ] && [ -x "$B/conformance-tch" ]; then
  echo "== tch conformance"; "$B/conformance-tch" --backend tch,tch-cuda --json "$OUT/conformance-tch.json" 2>&1 | tee "$OUT/conformance-tch.txt"
  echo "== tch bench"; "$B/tch_bench" --steps "${STEPS:-5}" ${TCH_ARGS:-} --commit "$COMMIT" --out "$OUT/tch-flux.json" 2>&1 | tee "$OUT/tch-bench.txt"
fi
if [ "${CANDLE:-0}" = 1 ] && [ -f "$B/conformance-candle.gz" ]; then
  C=/tmp/offload-candle; mkdir -p $C
  for f in conformance-candle candle_flux_bench flux_demo; do [ -f "$B/$f.gz" ] && gunzip -c "$B/$f.gz" > "$C/$f" && chmod +x "$C/$f"; done
  echo "== demo (candle-cuda)"; "$C/flux_demo" ${DEMO_ARGS:---hidden 3072 --double 2 --single 4 --res 1024 --steps 3} 2>&1 | tee "$OUT/demo.txt"
  echo "== candle conformance"; "$C/conformance-candle" --backend candle,candle-cuda --json "$OUT/conformance-candle.json" 2>&1 | tee "$OUT/conformance-candle.txt"
  echo "== candle bench"; "$C/candle_flux_bench" --steps "${STEPS:-5}" ${CANDLE_ARGS:-} --commit "$COMMIT" --out "$OUT/candle-flux.json" 2>&1 | tee "$OUT/candle-bench.txt"
fi
if [ "${ANCHORS:-1}" = 1 ]; then
  echo "== diffusers anchor"
  if [ -d "$B/../.whl" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$B"/../.whl/*.whl && export PYTHONPATH=/tmp/site; fi
  L=""; [ "${SMOKE:-0}" = 1 ] && L="--layers 2 --single-layers 4 --resolutions 1024 --steps 2"
  timeout ${ANCHOR_TIMEOUT:-270} python3 "$B/diffusers_group_offload.py" --modes resident,block_stream $L --out "$OUT/diffusers-block.json" 2>&1 | tail -12
  [ "${SMOKE:-0}" = 1 ] || timeout ${ANCHOR_TIMEOUT:-200} python3 "$B/diffusers_group_offload.py" --modes leaf_stream --out "$OUT/diffusers-leaf.json" 2>&1 | tail -6
fi
echo "== done"
