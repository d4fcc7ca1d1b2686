#!/usr/bin/env bash
# The LoRA training step on the GPU runner (bench/anchors/train_step.py): for
# each repeat in TRAIN_REPEATS (default "1 2 3"), one process per entry of
# TRAIN_RUNS ("model:case:ckpt[:attention]", ckpt 0 or 1), each file kept in $D; then every
# file so far packed into $OUT/train.tgz. A run whose file exists is kept; one
# that would start past TRAIN_DEADLINE seconds (default 560) is left for the
# next command. attention (else TRAIN_ATTENTION, default math): SDPA's backend for every mode
# (train_step.py --attention): bitwise equality needs a backward that sums in a
# fixed order, and torch 2.11's default one gave a resident Flux backward an
# illegal address on the H100 (bench/anchors/sdpa_probe.py names which backend).
# Math attention keeps each layer's scores for the backward: Wan 14B's 32760
# tokens would need ~85 GB for one layer's, and Flux-dev without checkpointing
# ~58 GB over its 57 layers; those rows run under flash or memory-efficient
# attention, their gradients judged against the resident run's own spread
# where its backward does not repeat itself.
# TRAIN_DEPTH (default 2): the ring's depth, or auto (the package's choice, from
# a traced training step; four warm-up iterations then, and "-dauto" in each
# file's name, as any depth but 2 is named).
# TRAIN_WARMUP: untimed steps per mode after the check step (default 2; 4 under
# auto). 1 is enough where the depth is given (the check step, the first after
# `enable`, learns the block order): Wan 14B's 18-s steps make each one count.
# The file records it.
# TRAIN_BUDGET=B: each process also measures the package planned under B GiB of
# device weights from the ring's traced training step (train_step.py
# --budget-gib: mode offload_planned; "-bB" in each file's name).
# Needs the wheels in .whl (`cargo xtask wheel`) and the registry
# (.bundle/registry.json, `cargo xtask gpu-bundle --python`).
set -uo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/offload-out}; mkdir -p "$OUT"
D=${TRAIN_DIR:-/tmp/train-out}; mkdir -p "$D"
if [ ! -d /tmp/site/offload ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$R"/.whl/*.whl "$R"/.whl/offload/*.whl
fi
export PYTHONPATH=/tmp/site
export OFFLOAD_COMMIT=${OFFLOAD_COMMIT:-$(cat "$R/.whl/COMMIT" 2>/dev/null)}
[ -n "$OFFLOAD_COMMIT" ] || { echo "no .whl/COMMIT: build the wheels with cargo xtask wheel"; exit 1; }
runs=${TRAIN_RUNS:-"flux-dev:1024:1 flux-dev:1024:0:efficient qwen-image:1024:1 wan2.1-t2v-14b:480x832x21:1:flash"}
for r in ${TRAIN_REPEATS:-1 2 3}; do
  for run in $runs; do
    IFS=: read -r model case ckpt attention <<< "$run"
    attention=${attention:-${TRAIN_ATTENTION:-math}}
    depth=${TRAIN_DEPTH:-2}; tag=""; warm=${TRAIN_WARMUP:-2}
    [ "$depth" = 2 ] || tag="-d$depth"
    [ "$depth" = auto ] && warm=${TRAIN_WARMUP:-4}
    budget=(); [ -n "${TRAIN_BUDGET:-}" ] && { budget=(--budget-gib "$TRAIN_BUDGET"); tag="$tag-b$TRAIN_BUDGET"; }
    f="$D/train-$model-$case-c$ckpt-$attention$tag-r$r.json"
    [ -s "$f" ] && { echo "== $run r$r: kept"; continue; }
    est=${TRAIN_EST:-150}
    if [ $((SECONDS + est)) -gt "${TRAIN_DEADLINE:-560}" ]; then echo "== $run r$r: left for the next command (${SECONDS} s gone)"; continue; fi
    echo "== $run r$r (at ${SECONDS} s)"
    flag=(); [ "$ckpt" = 1 ] && flag=(--checkpointing)
    timeout $(( ${TRAIN_DEADLINE:-560} - SECONDS )) python3 "$R/bench/anchors/train_step.py" --registry "$R/.bundle/registry.json" \
      --model "$model" --case "$case" "${flag[@]}" --attention "$attention" --depth "$depth" --warmup "$warm" "${budget[@]}" --out "$f" > "${f%.json}.log" 2>&1
    echo "   rc $? in $((SECONDS)) s"; grep -E "^(resident|offload|offload_planned|block_stream) " "${f%.json}.log" | cut -c1-300
  done
done
tar czf "$OUT/train.tgz" -C "$D" .
