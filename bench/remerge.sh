#!/usr/bin/env bash
# Every merge of `zoo` re-run on the committed raw files (bench/raw/), and on the
# argument errors a merge or `zoo run` gives, into OUT: per job its JSON (if any)
# and a log of its stdout, stderr and exit status. A refactor of the bench room
# must leave OUT byte-identical: run this before and after, then `diff -r`.
#   bench/remerge.sh ZOO OUT        (ZOO: a `zoo` binary; no feature needed)
# With COMPARE=1, also compares each job that rebuilds a committed results file
# (bench/results/) with it, and says which differ.
set -uo pipefail
ZOO=$(realpath "${1:?usage: remerge.sh ZOO OUT}")
OUT=${2:?usage: remerge.sh ZOO OUT}
B=$(cd "$(dirname "$0")" && pwd)
R=$B/raw
bash "$B/raw.sh"  # the raw runs, unpacked from bench/raw.tar.gz
mkdir -p "$OUT"
# The host-tier and relay merges stamp BENCH_DATE; the others take their runs' dates.
export BENCH_DATE=2026-12-01

# job NAME SUBCOMMAND ARGS…: `zoo SUBCOMMAND --out OUT/NAME.json ARGS…`.
job() {
  local name=$1 sub=$2; shift 2
  (cd "$R" && "$ZOO" "$sub" --out "$OUT/$name.json" "$@") >"$OUT/$name.log" 2>&1
  echo "rc $?" >>"$OUT/$name.log"
}
# plain NAME ARGS…: `zoo ARGS…` (no --out added).
plain() {
  local name=$1; shift
  mkdir -p "$OUT/cwd" && (cd "$OUT/cwd" && "$ZOO" "$@") >"$OUT/$name.log" 2>&1
  echo "rc $?" >>"$OUT/$name.log"
}

# `zoo merge`: each directory's runs per backend with its anchors.
for d in "$R"/*-zoo-* "$R"/2026-11-30-issue15-first-gpu; do
  for be in tch cuda candle; do
    ls "$d"/$be-*.json >/dev/null 2>&1 || continue
    n=$(basename "$d")
    job "merge-$n-$be" merge --min-repeats 3 "$d"/$be-*.json --anchors "$d"/diffusers-*.json
    job "merge-$n-$be-min1" merge --probe --min-repeats 1 "$d"/$be-*.json --anchors "$d"/diffusers-*.json
    job "merge-$n-$be-noanchors" merge --probe --min-repeats 1 "$d"/$be-*.json
  done
done
# The published files, from the directories each model's runs were kept in
# (candle's flux-dev anchors are the ones run in its own command, at 07aeb66).
Z=$R/2026-11-30-zoo
job results-zoo-tch merge --min-repeats 3 \
  $Z-9c9881b/tch-flux-dev-run*.json $Z-6bf93c4/tch-wan*-run*.json \
  $Z-54bafd4/tch-qwen-image-run*.json $Z-54bafd4/tch-qwen2.5*-run*.json $Z-54bafd4/tch-sd3.5*-run*.json \
  $R/2026-12-02-zoo-56ceb12/tch-*-run*.json \
  --anchors $Z-9c9881b/diffusers-*-run*.json $Z-6bf93c4/diffusers-*-run*.json \
  $Z-54bafd4/diffusers-qwen-image-*-run*.json $Z-54bafd4/diffusers-qwen2.5*-run*.json $Z-54bafd4/diffusers-sd3.5*-run*.json \
  $R/2026-12-02-zoo-56ceb12/diffusers-*-run*.json
job results-zoo-candle merge --min-repeats 3 \
  $Z-07aeb66/candle-*-run*.json $Z-6bf93c4/candle-qwen2.5*-run*.json $Z-6bf93c4/candle-sd3.5*-run*.json $Z-6bf93c4/candle-t5*-run*.json $R/2026-12-02-zoo-56ceb12/candle-*-run*.json \
  --anchors $Z-07aeb66/diffusers-*-run*.json
# Coded runs are run files too.
for d in "$R"/*-compressed-* "$R"/*-coded-*; do
  n=$(basename "$d")
  for f in "$d"/coded-run*.json "$d"/zoo/coded-run*.json "$d"/coded-*-run*.json; do
    [ -f "$f" ] && job "merge-$n-$(basename "$f" .json)" merge --probe --min-repeats 1 "$f"
  done
done

# `zoo merge-compressed`.
for d in "$R"/*-compressed-* "$R"/*-coded-*; do
  n=$(basename "$d")
  for runs in coded-run coded-normal-run coded-high-run zoo/coded-run; do
    ls "$d"/$runs*.json >/dev/null 2>&1 || continue
    tag=${runs//\//-}
    job "compressed-$n-$tag" merge-compressed --probe --min-repeats 1 "$d"/$runs*.json --codec $(ls "$d"/codec-speed-*.json "$d"/zoo/codec-speed-*.json 2>/dev/null)
    job "compressed-$n-$tag-nocodec" merge-compressed --probe --min-repeats 1 "$d"/$runs*.json
    job "compressed-$n-$tag-min3" merge-compressed "$d"/$runs*.json --codec $(ls "$d"/codec-speed-*.json "$d"/zoo/codec-speed-*.json 2>/dev/null)
  done
done
job results-compressed merge-compressed $R/2026-12-01-compressed-3980ca5/coded-run*.json \
  --codec $R/2026-12-01-compressed-3980ca5/codec-speed-*.json
job compressed-mixed-priority merge-compressed --probe --min-repeats 1 \
  $R/2026-12-01-coded-probe-741599f/coded-normal-run1.json $R/2026-12-01-coded-probe-741599f/coded-high-run1.json
job compressed-anchors merge-compressed --probe --min-repeats 1 $R/2026-12-01-compressed-3980ca5/coded-run1.json --anchors x.json

# `zoo merge-pipeline`.
P=$Z-6bf93c4
job results-pipeline merge-pipeline $P/pipeline-run*.json
job pipeline-min4 merge-pipeline --min-repeats 4 $P/pipeline-run*.json
job pipeline-min1 merge-pipeline --probe --min-repeats 1 $P/pipeline-run1.json

# The host-tier merges.
for d in "$R"/*-host-tiers-*; do
  n=$(basename "$d")
  job "tiers-$n" merge-host-tiers "$d"/host-tiers-run*.json
  job "tiers-$n-min4" merge-host-tiers --min-repeats 4 "$d"/host-tiers-run*.json
  job "tiers-$n-coded-start" merge-coded-start --probe --min-repeats 1 "$d"/host-tiers-run*.json
  job "tiers-$n-shared" merge-host-tiers-shared --probe --min-repeats 1 "$d"/host-tiers-run*.json
done
H=$R/2026-12-01-host-tiers-741599f
# Refused since runs of different plans are (the file it made was superseded by
# 2026-12-03's and is no longer published).
job results-tiers-1201 merge-host-tiers $H/host-tiers-run*.json
BENCH_DATE=2026-12-03 job results-tiers-1203 merge-host-tiers $R/2026-12-03-host-tiers-975d863/host-tiers-run*.json
job tiers-mixed merge-host-tiers $H/host-tiers-run1.json $R/2026-12-01-host-tiers-8de303b/host-tiers-run2.json $H/host-tiers-run3.json
job results-tiers-shared merge-host-tiers-shared $H/shared-pair*.json
job tiers-shared-min4 merge-host-tiers-shared --min-repeats 4 $H/shared-pair*.json
job tiers-shared-as-tiers merge-host-tiers --probe --min-repeats 1 $H/shared-pair*.json
job tiers-shared-twice merge-host-tiers-shared $H/shared-pair1-a.json $H/shared-pair1-a.json $H/shared-pair2-*.json $H/shared-pair3-*.json
job tiers-shared-odd merge-host-tiers-shared --probe --min-repeats 1 $H/shared-pair1-*.json $H/shared-pair2-a.json
C=$R/2026-12-02-coded-start-06ca6e2
job coded-start merge-coded-start $C/coded-start-run1.json
job coded-start-min1 merge-coded-start --probe --min-repeats 1 $C/coded-start-run1.json
job coded-start-anchors merge-coded-start --probe --min-repeats 1 $C/coded-start-run1.json --anchors x.json

# `zoo merge-relay`: no relay run was ever made (no two-GPU machine); three made up here.
for k in 1 2 3; do
  python3 - "$OUT/relay-run$k.in" "$k" <<'EOF'
import json, sys
k = int(sys.argv[2])
json.dump({"commit": "abc", "gpu": "H200", "gpus": 2, "model": "flux-dev", "case": "1024", "resolution": 1024, "depth": 1,
  "helpers": [1], "helper_share": 0.5, "single_bps": 55e9 + k, "aggregate_bps": 105e9 - k, "steps_resident_s": [0.17, 0.171, 0.169],
  "steps_single_s": [0.431 + k * 1e-3] * 3, "steps_relay_s": [0.229 + k * 1e-3, 0.23, 0.231], "step_bytes": 23700000000,
  "relayed_bytes": 11850000000 * (k != 2), "bitwise_equal": True, "output_finite_nonconstant": True}, open(sys.argv[1], "w"))
EOF
done
job relay merge-relay "$OUT"/relay-run*.in
job relay-min4 merge-relay --min-repeats 4 "$OUT"/relay-run*.in
job relay-two merge-relay --min-repeats 2 "$OUT"/relay-run1.in "$OUT"/relay-run3.in

# Argument errors and the commands that need no device.
plain usage
plain usage-bad nonsense
plain merge-no-out merge $Z-9c9881b/tch-flux-dev-run1.json
plain merge-bad-min merge --out /dev/null --min-repeats x $Z-9c9881b/tch-flux-dev-run1.json
plain merge-missing merge --out /dev/null /nonexistent.json
plain registry registry
plain registry-json registry --json "$OUT/registry.json"
plain registry-user registry --json "$OUT/registry-user.json" --size 1344x768 --batch 2
plain registry-user-bad registry --size 1344x7 --batch 2
for args in \
  "--model flux-dev --budget 8 --out x" "--model flux-dev --model qwen-image --out x" \
  "--backend cuda --model flux-dev --trace --no-gemm --out x" "--backend tch --model flux-dev --budgets 8 --out x" \
  "--model flux-dev --out" "--backend tch --model flux-dev --high-priority-compute --out x" \
  "--backend tch --model flux-dev --depths 1,auto --out x" "--backend candle --model flux-dev --depths 0 --out x" \
  "--backend candle --model flux-dev --depths , --out x" "--backend cuda --model flux-dev --high-priority-compute --out x" \
  "--backend cuda --model flux-dev --high-priority-decode --out x" "--backend cuda --model flux-dev --staging-buffers 2 --out x" \
  "--backend cuda --model flux-dev --coded --staging-buffers 0 --out x" "--backend cuda --model flux-dev --coded --staging-buffers 2 --out x" \
  "--backend tch --model flux-dev --trace t --out x" "--backend tch --model flux-dev --no-gemm --out x" \
  "--backend tch --model flux-dev --coded --out x" "--backend tch --model nomodel --out x" "--backend tch --out x" \
  "--backend tch --model flux-dev" "--backend tch --model flux-dev --blocks x --out x" \
  "--backend tch --model flux-dev --size 1024x1024 --res 1024 --out x" "--backend tch --model flux-dev --res 1000 --out x" \
  "--backend tch --model flux-dev --res x --out x" "--backend tch --model flux-dev --steps 4 --out x" \
  "--backend tch --model flux-dev --steps x --out x" "--backend cuda --model flux-dev --budgets , --out x" \
  "--backend cuda --model flux-dev --budgets -1 --out x" "--backend vulkan --model flux-dev --out x" \
  "--backend tch --model flux-dev --out x" "--backend candle --model flux-dev --out x" "--backend cuda --model flux-dev --out x" \
  "--backend tch --model flux-dev --cases 1024 --size 512x512 --out x" "--backend tch --model flux-dev --depths 0,1 --out x"; do
  plain "run ${args//[^a-z0-9,]/_}" run $args
done
for args in "" "--out x --foo 1" "--out x --steps" "--out x --steps 0" "--out x --budget 0" "--out x --budget x" \
  "--out x --res 1024 --res 1024" "--out x --passes 0" "--out x --steps 2 --passes 2 --warmup 0 --budget 8 --res 1024 --commit c"; do
  plain "pipeline ${args//[^a-z0-9,]/_}" pipeline $args
done
for args in "" "--model flux-dev" "--model nomodel --out x" "--model flux-dev --out x --threads x"; do
  plain "entropy ${args//[^a-z0-9,]/_}" entropy $args
done
for sub in host-tiers relay; do
  for args in "" "--model flux-dev" "--model flux-dev --out x" "--model flux-dev --out x --file f" \
    "--model flux-dev --out x --file f --depth 0" "--model flux-dev --out x --file f --host-ram-gib x" \
    "--model flux-dev --out x --helpers a" "--model nomodel --out x --file f"; do
    plain "$sub ${args//[^a-z0-9,]/_}" $sub $args
  done
done

if [ "${COMPARE:-0}" = 1 ]; then
  for pair in results-zoo-tch:2026-12-02-zoo-tch results-zoo-candle:2026-12-02-zoo-candle \
    merge-2026-11-30-zoo-07aeb66-cuda:2026-11-30-zoo-cuda \
    results-compressed:2026-12-01-compressed-h200 results-pipeline:2026-11-30-pipeline-tch \
    results-tiers-1203:2026-12-03-host-tiers-h200 \
    results-tiers-shared:2026-12-01-host-tiers-shared-h200; do
    if cmp -s "$OUT/${pair%%:*}.json" "$B/results/${pair#*:}.json"; then echo "same: ${pair#*:}"; else echo "differs: ${pair#*:}"; fi
  done
fi
