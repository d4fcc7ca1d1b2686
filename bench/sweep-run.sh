#!/usr/bin/env bash
# The sweep of classes beyond the registry on the GPU runner:
# for each repeat in SWEEP_REPEATS (default "1 2 3"), one process per group of
# models (bench/anchors/sweep.py: resident, the package with defaults, diffusers'
# group offloading on the same object), each file kept in $D; then every file
# so far packed into $OUT/sweep.tgz. A group whose file exists is kept; one that
# would start past SWEEP_DEADLINE seconds (default 560) is left for the next
# command. SWEEP_STEPS: timed steps per mode (default 3). SWEEP_ARGS: more of
# sweep.py's options (a probe: `--depth 3`, `--tables-on-device`; give it its
# own SWEEP_DIR, as its files are not the defaults'). Needs the wheels in .whl (`cargo xtask wheel`).
set -uo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/offload-out}; mkdir -p "$OUT"
D=${SWEEP_DIR:-/tmp/sweep-out}; mkdir -p "$D"
if [ ! -d /tmp/site/offload ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$R"/.whl/*.whl "$R"/.whl/offload/*.whl
fi
export PYTHONPATH=/tmp/site
# The commit the wheels were built from (`cargo xtask wheel`): the runner's copy
# of the tree has no history of its own.
export OFFLOAD_COMMIT=${OFFLOAD_COMMIT:-$(cat "$R/.whl/COMMIT" 2>/dev/null)}
[ -n "$OFFLOAD_COMMIT" ] || { echo "no .whl/COMMIT: build the wheels with cargo xtask wheel"; exit 1; }
groups=${SWEEP_GROUPS:-"cogview4,ltx-video,sana-1600m,lumina2,cogvideox-2b,skyreels-v2-1.3b pixart-sigma,allegro,llama-3.2-3b,qwen3-4b"}
for r in ${SWEEP_REPEATS:-1 2 3}; do
  g=0
  for models in $groups; do
    g=$((g + 1)); f="$D/sweep-g$g-r$r.json"
    [ -s "$f" ] && { echo "== g$g r$r: kept"; continue; }
    est=${SWEEP_EST:-150}
    if [ $((SECONDS + est)) -gt "${SWEEP_DEADLINE:-560}" ]; then echo "== g$g r$r: left for the next command (${SECONDS} s gone)"; continue; fi
    echo "== g$g r$r $models (at ${SECONDS} s)"
    timeout $(( ${SWEEP_DEADLINE:-560} - SECONDS )) python3 "$R/bench/anchors/sweep.py" "$f" --models "$models" --steps "${SWEEP_STEPS:-3}" ${SWEEP_ARGS:-} > "$D/sweep-g$g-r$r.log" 2>&1
    echo "   rc $? in $((SECONDS)) s"; grep -E " offload | FAILED|block_stream|leaf_stream" "$D/sweep-g$g-r$r.log" | cut -c1-260
  done
done
tar czf "$OUT/sweep.tgz" -C "$D" .
