#!/usr/bin/env bash
# The coded ring's d = 1 gap (bench/NOTES.md): the decoder's speed once, then
# PROBE_RUNS (default 3) rounds of coded flux-dev processes at 1024², one per variant of
# PROBE_VARIANTS (default "normal high": the decoder at normal and at high priority,
# `--high-priority-decode`), each with PROBE_ARGS (default "--depths 1"; e.g.
# "--depths 1,2 --staging-buffers 3,4,6,8"); the first round traced (raw and coded steps);
# each variant merged by `zoo merge-compressed`. LIB_TESTS=1 first runs offload-cuda's GPU
# unit tests of the coded ring. Under DEADLINE seconds (default 560); a process starts only
# with MIN_LEFT seconds (default 100) left. From the bundle: COMMIT=… bash .bundle/coded-probe.sh
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd); P=$OUT/probe; mkdir -p $P
export BENCH_DATE=${BENCH_DATE:-$(date -u +%F)}
if [ "${LIB_TESTS:-0}" = 1 ]; then
  OFFLOAD_REQUIRE_DEVICE=1 timeout 120 $B/cuda-lib-tests coded > $P/cuda-lib-tests.txt 2>&1; echo "lib tests rc=$?" | tee -a $P/cuda-lib-tests.txt
  grep -E "test result|FAILED|panicked" $P/cuda-lib-tests.txt
fi
timeout 60 $B/codec_speed 256 --json $P/codec-speed-256.json > $P/codec-speed.txt 2>&1; tail -1 $P/codec-speed.txt
for r in $(seq 1 ${PROBE_RUNS:-3}); do
  for v in ${PROBE_VARIANTS:-normal high}; do
    left=$(( ${DEADLINE:-560} - SECONDS ))
    [ $left -lt ${MIN_LEFT:-100} ] && { echo "deadline: $v run $r not started"; break 2; }
    extra="${PROBE_ARGS:---depths 1}"; [ $v = high ] && extra="$extra --high-priority-decode"
    [ $r = 1 ] && extra="$extra --trace $P/trace-$v.json"
    echo "== $v run $r (${SECONDS}s)"
    timeout $left $B/zoo run --backend cuda --model flux-dev --coded --cases 1024 --steps 5 $extra \
      --commit ${COMMIT:-unknown} --out $P/coded-$v-run$r.json > $P/coded-$v-run$r.txt 2>&1
    echo "rc=$?" >> $P/coded-$v-run$r.txt; grep -E "streamed|timeline|rc=" $P/coded-$v-run$r.txt | tail -12
  done
done
for v in ${PROBE_VARIANTS:-normal high}; do
  ls $P/coded-$v-run*.json > /dev/null 2>&1 || continue
  $B/zoo merge-compressed --out $P/compressed-$v.json --probe --min-repeats 1 $P/coded-$v-run*.json --codec $P/codec-speed-256.json 2>&1 | tail -4 | tee $P/merge-$v.txt
done
tar czf $OUT/probe.tgz -C $OUT probe
