#!/usr/bin/env bash
# The denoising loop with FirstBlockCache on the GPU runner (bench/anchors/cache_loop.py): for
# each repeat in CACHE_REPEATS (default "1 2 3"), one process per entry of
# CACHE_RUNS ("model:case"), each file kept in $D; then every
# file so far packed into $OUT/cache.tgz. A run whose file exists is kept; one
# that would start past CACHE_DEADLINE seconds (default 560) is left for the
# next command. CACHE_ARGS go to every cache_loop.py. Needs the wheels in .whl (`cargo xtask wheel`) and the registry
# (.bundle/registry.json, `cargo xtask gpu-bundle --python`).
set -uo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/offload-out}; mkdir -p "$OUT"
D=${CACHE_DIR:-/tmp/cache-out}; mkdir -p "$D"
if [ ! -d /tmp/site/offload ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$R"/.whl/*.whl "$R"/.whl/offload/*.whl
fi
export PYTHONPATH=/tmp/site
export OFFLOAD_COMMIT=${OFFLOAD_COMMIT:-$(cat "$R/.whl/COMMIT" 2>/dev/null)}
[ -n "$OFFLOAD_COMMIT" ] || { echo "no .whl/COMMIT: build the wheels with cargo xtask wheel"; exit 1; }
runs=${CACHE_RUNS:-"flux-dev:1024 wan2.1-t2v-14b:480x832x21"}
for r in ${CACHE_REPEATS:-1 2 3}; do
  for run in $runs; do
    IFS=: read -r model case <<< "$run"
    f="$D/cache-$model-$case-r$r.json"
    [ -s "$f" ] && { echo "== $run r$r: kept"; continue; }
    est=${CACHE_EST:-150}
    if [ $((SECONDS + est)) -gt "${CACHE_DEADLINE:-560}" ]; then echo "== $run r$r: left for the next command (${SECONDS} s gone)"; continue; fi
    echo "== $run r$r (at ${SECONDS} s)"
    # Wan 14B's loop takes minutes: its warm-up loop is three steps (set-up and the automatic plan, chosen at the second).
    extra=(); case $model in wan*) extra=(--warmup-steps 3);; esac
    timeout $(( ${CACHE_DEADLINE:-560} - SECONDS )) python3 "$R/bench/anchors/cache_loop.py" --registry "$R/.bundle/registry.json" \
      --model "$model" --case "$case" "${extra[@]}" ${CACHE_ARGS:-} --out "$f" > "${f%.json}.log" 2>&1
    echo "   rc $? in $((SECONDS)) s"; grep -E "^(resident|offload|block_stream) " "${f%.json}.log" | cut -c1-300
  done
done
tar czf "$OUT/cache.tgz" -C "$D" .
