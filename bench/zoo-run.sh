#!/usr/bin/env bash
# The bench room on the GPU runner, from the bundle (`cargo xtask gpu-bundle`).
#   zoo-run.sh registry   the registry checked against the reference classes
#   zoo-run.sh repeat R   per model: process run R of offload's tch backend, cuda's (its
#                         reference model; flux-dev by default) and candle's (where the
#                         bundle has zoo-candle.gz), then
#                         process R of each of diffusers' offloaded modes (the anchors)
#   zoo-run.sh merge      `zoo merge`: medians, spreads, bounds and the comparison,
#                         computed from every run's file
#   zoo-run.sh pipeline   the pipeline case: three `zoo pipeline` processes, merged
#   zoo-run.sh compressed the coded case: the decoder's speed (codec_speed 256, 1024), then three
#                         `zoo run --backend cuda --coded` processes (flux-dev, COMPRESSED_ARGS,
#                         default `--cases 1024,2048 --depths 1,2`; ≈ 190 s each, so with
#                         ZOO_DEADLINE=560 two commands, .zoo-out carried), merged by `zoo merge-compressed`
#   zoo-run.sh            all of it, three repeats (merged once no run is left)
# `zoo merge` takes one commit per model: to re-measure one model, put the other
# models' kept runs and anchors (bench/raw/<date>-zoo-<commit>/) into $ZOO_DIR.
# A run whose file is in $ZOO_DIR already is kept, so with ZOO_DEADLINE=560 the
# same command, repeated with .zoo-out carried back, goes on where the last stopped.
# Files collect in $ZOO_DIR (default .zoo-out beside the bundle, kept between
# commands on a warm runner); each command also leaves $OUT/zoo.tgz, all so far.
#   ANCHOR_TOGETHER=1: one anchor process per repeat runs every mode (order alternating by repeat)
#   A user's case, ours and diffusers' on it in one command:
#     ZOO_MODELS=flux-dev ZOO_ARGS="--size 1344x768 --batch 2" ZOO_CUDA_MODELS= bench/zoo-run.sh
#   (cuda's reference model runs batch 1 only; video: ZOO_MODELS=wan2.1-t2v-14b ZOO_ARGS="--size 832x480 --frames 33 --steps 5")
#   ZOO_MODELS="flux-dev qwen-image"  ZOO_ARGS="--cases 1024" (files then named by case)  ANCHOR_MODES="block_stream leaf_stream" (empty: none)
#   CUDA_COMMIT (cuda runs from another build)  ZOO_TCH=0 (no tch runs)  ZOO_CANDLE_MODELS="flux-dev" (empty: none)  ZOO_CANDLE_ARGS="--cases 1024"  ZOO_CUDA_MODELS="flux-dev" (empty: none)  ZOO_CUDA_ARGS
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/offload-out}; mkdir -p "$OUT"
Z=${ZOO_DIR:-$B/../.zoo-out}; mkdir -p "$Z"
# In the bundle the driver and the anchors' scripts sit beside this script; in the
# repository, zoo is built by `cargo xtask bench --backend tch` (ZOO_BIN).
ZOO=${ZOO_BIN:-$B/zoo}
AD=$B; [ -f "$B/anchors/zoo_anchor.py" ] && AD=$B/anchors
export BENCH_DATE=${BENCH_DATE:-$(date -u +%F)}
COMMIT=${COMMIT:-unknown}
if [ -d "$B/../.whl" ] && [ ! -d /tmp/site/diffusers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$B"/../.whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site

registry() {
  [ -s "$Z/registry-check.json" ] && return 0
  echo "== registry vs the reference classes"
  "$ZOO" registry --json "$Z/registry.json" && python3 "$AD/registry_check.py" "$Z/registry.json" "$Z/registry-check.json" 2>&1 | tee "$Z/registry-check.txt"
}

# candle's driver travels gzipped (its kernels make it large): `zoo-candle.gz`.
ZOO_CANDLE=${ZOO_CANDLE_BIN:-}
if [ -z "$ZOO_CANDLE" ] && [ -f "$B/zoo-candle.gz" ]; then
  ZOO_CANDLE=/tmp/zoo-candle; gunzip -c "$B/zoo-candle.gz" > "$ZOO_CANDLE" && chmod +x "$ZOO_CANDLE"
fi

# One process run, unless its file is already there (a command can continue where
# an earlier one stopped: carry .zoo-out back) or ZOO_DEADLINE (seconds since this
# command began) would pass before it ends (its estimate, the third argument).
LEFT=0
once() {
  local name=$1 out=$2 est=$3; shift 3
  if [ -s "$out" ]; then echo "== $name: kept from an earlier command"; return 0; fi
  if [ -n "${ZOO_DEADLINE:-}" ] && [ $((SECONDS + est)) -gt "$ZOO_DEADLINE" ]; then
    echo "== $name: left for the next command (${SECONDS} s gone, about $est s needed)"; LEFT=1; return 0
  fi
  echo "== $name (at ${SECONDS} s)"
  local t0=$SECONDS
  rm -f "$out"
  "$@"
  echo "== $name: $((SECONDS - t0)) s"
}

run_tch() { "$ZOO" run --backend tch --model "$1" --commit "$COMMIT" --out "$2" ${ZOO_ARGS:-} 2>&1 | tee "${2%.json}.txt"; }
run_cuda() { "$ZOO" run --backend cuda --model "$1" --commit "${CUDA_COMMIT:-$COMMIT}" --out "$2" ${ZOO_CUDA_ARGS:-${ZOO_ARGS:-}} 2>&1 | tee "${2%.json}.txt"; }
run_candle() { "$ZOO_CANDLE" run --backend candle --model "$1" --commit "$COMMIT" --out "$2" ${ZOO_CANDLE_ARGS:-${ZOO_ARGS:-}} 2>&1 | tee "${2%.json}.txt"; }
run_anchor() {
  # The anchors take ZOO_ARGS' cases, user case (size, batch, frames), steps and warmup,
  # so both sides time the same case and steps.
  local A=""; [ -n "${ZOO_ARGS:-}" ] && A=$(echo " ${ZOO_ARGS}" | grep -o -- '--\(cases\|size\|batch\|frames\|steps\|warmup\) [^ ]*' | tr '\n' ' ')
  timeout "${ANCHOR_TIMEOUT:-300}" python3 "$AD/zoo_anchor.py" --registry "$REG" --model "$1" --mode "$2" $A \
    --out "$3" 2>&1 | grep -v Warning | tee "${3%.json}.txt"
}

# With --cases in ZOO_ARGS the run files name the cases (tch-flux-dev-c1024-run1.json),
# so one command per (model, case) — ours and the anchors together, within a device
# command's ten minutes — keeps every case's files apart; `zoo merge` groups by case.
SFX=""
CASES=$(echo " ${ZOO_ARGS:-}" | grep -o -- '--cases [^ ]*' | cut -d' ' -f2)
[ -n "$CASES" ] && SFX="-c${CASES//,/_}"
# A user's case (ZOO_ARGS="--size 1344x768 --batch 2 --frames 1"): files named by it
# (tch-flux-dev-s1344x768-b2-run1.json), and a registry file holding it for the anchors.
USER_CASE=$(echo " ${ZOO_ARGS:-}" | grep -o -- '--\(size\|batch\|frames\) [^ ]*' | tr '\n' ' ')
REG=$Z/registry.json
if [ -n "$USER_CASE" ]; then
  UC=$(echo "$USER_CASE" | sed 's/--\(.\)[a-z]* /\1/g; s/ *$//; s/ /-/g')
  SFX="$SFX-$UC"; REG=$Z/registry-$UC.json
fi

repeat() {
  local r=$1
  [ -f "$Z/registry.json" ] || "$ZOO" registry --json "$Z/registry.json"
  [ -f "$REG" ] || "$ZOO" registry --json "$REG" $USER_CASE
  for model in ${ZOO_MODELS:-flux-dev qwen-image}; do
    # Estimates (s) for ZOO_DEADLINE, from this machine's logs (bench/raw/*/device-command*.log):
    # one of our processes, one anchor process with one mode and with both.
    local est a1 a2
    case "$model" in
      flux-dev) est=45 a1=75 a2=100 ;;
      qwen-image) est=50 a1=90 a2=95 ;;
      wan2.1-t2v-14b) est=80 a1=100 a2=130
        # 21 latent frames: a step of ≈ 3 s (32 760 tokens); run with `--steps 3`.
        [[ "$CASES" == *x21* ]] && est=90 a1=110 a2=130 ;;
      *) est=20 a1=35 a2=45 ;;
    esac
    if [ "${ZOO_TCH:-1}" = 1 ]; then
      once "$model: offload tch, run $r" "$Z/tch-$model$SFX-run$r.json" "$est" run_tch "$model" "$Z/tch-$model$SFX-run$r.json"
    fi
    if [[ " ${ZOO_CUDA_MODELS-flux-dev} " == *" $model "* ]]; then
      once "$model: offload cuda, run $r" "$Z/cuda-$model$SFX-run$r.json" "$est" run_cuda "$model" "$Z/cuda-$model$SFX-run$r.json"
    fi
    if [ -n "$ZOO_CANDLE" ] && [[ " ${ZOO_CANDLE_MODELS-flux-dev} " == *" $model "* ]]; then
      once "$model: offload candle, run $r" "$Z/candle-$model$SFX-run$r.json" "$est" run_candle "$model" "$Z/candle-$model$SFX-run$r.json"
    fi
    if [ "${ANCHOR_TOGETHER:-0}" = 1 ] && [ -n "${ANCHOR_MODES-x}" ]; then
      # Every mode in one anchor process per repeat (the model built and pinned
      # once), the order turned round in every other repeat.
      local modes=$(echo ${ANCHOR_MODES-block_stream leaf_stream} | tr ' ' ',')
      [ $((r % 2)) = 0 ] && modes=$(echo ${ANCHOR_MODES-block_stream leaf_stream} | tr ' ' '\n' | tac | paste -sd,)
      once "$model: diffusers $modes, run $r" "$Z/diffusers-$model$SFX-modes-run$r.json" "$a2" run_anchor "$model" "$modes" "$Z/diffusers-$model$SFX-modes-run$r.json"
    else
      for mode in ${ANCHOR_MODES-block_stream leaf_stream}; do
        once "$model: diffusers $mode, run $r" "$Z/diffusers-$model$SFX-$mode-run$r.json" "$a1" run_anchor "$model" "$mode" "$Z/diffusers-$model$SFX-$mode-run$r.json"
      done
    fi
  done
}

# The pipeline case: three processes of `zoo pipeline` (T5-XXL → Flux-dev × steps → VAE
# under one budget; PIPELINE_ARGS, e.g. "--steps 4 --budget 8"), then their merge.
run_pipeline_proc() { "$ZOO" pipeline --commit "$COMMIT" --out "$1" ${PIPELINE_ARGS:-} 2>&1 | tee "${1%.json}.txt"; }
pipeline() {
  for r in $(seq 1 "${ZOO_REPEATS:-3}"); do
    once "pipeline, run $r" "$Z/pipeline-run$r.json" 90 run_pipeline_proc "$Z/pipeline-run$r.json"
  done
  [ "$LEFT" = 0 ] && "$ZOO" merge-pipeline --out "$Z/pipeline.json" "$Z"/pipeline-run*.json 2>&1 | tee -a "$Z/merge.txt"
}

run_coded() { "$ZOO" run --backend cuda --model flux-dev --coded --commit "$COMMIT" --out "$1" ${COMPRESSED_ARGS:---cases 1024,2048 --depths 1,2} 2>&1 | tee "${1%.json}.txt"; }
compressed() {
  for m in 256 1024; do
    once "codec_speed $m MiB" "$Z/codec-speed-$m.json" 20 "$B/codec_speed" "$m" --json "$Z/codec-speed-$m.json"
  done
  for r in $(seq 1 "${ZOO_REPEATS:-3}"); do
    once "compressed (cuda --coded), run $r" "$Z/coded-run$r.json" 190 run_coded "$Z/coded-run$r.json"
  done
  [ "$LEFT" = 0 ] && "$ZOO" merge-compressed --out "$Z/compressed.json" "$Z"/coded-run*.json --codec "$Z"/codec-speed-*.json 2>&1 | tee -a "$Z/merge.txt"
}

merge() {
  echo "== merge"
  for be in tch cuda candle; do
    rm -f "$Z/zoo-$be.json"
    ls "$Z"/$be-*-run*.json >/dev/null 2>&1 || continue
    "$ZOO" merge --min-repeats "${ZOO_REPEATS:-3}" --out "$Z/zoo-$be.json" "$Z"/$be-*-run*.json --anchors "$Z"/diffusers-*-run*.json 2>&1 | tee -a "$Z/merge.txt"
  done
}

case "${1:-all}" in
  registry) registry ;;
  repeat) repeat "${2:?repeat needs a number}" ;;
  merge) merge ;;
  pipeline) pipeline ;;
  compressed) compressed ;;
  all) registry; for r in $(seq 1 "${ZOO_REPEATS:-3}"); do repeat "$r"; done; [ "$LEFT" = 0 ] && merge ;;
  *) echo "usage: zoo-run.sh [registry | repeat R | merge | pipeline | compressed]"; exit 2 ;;
esac
tar czf "$OUT/zoo.tgz" -C "$Z" .
echo "== zoo done"
