#!/usr/bin/env bash
# The compressed results file: offload-cuda's GPU tests of the decoder and the coded ring
# (LIB_TESTS=1, default), the decoder's builds (`codec_speed --variants`, 256 MiB and
# 1 GiB; the ring's build is the file's decode speed), then RUNS (default 3) `zoo run
# --backend cuda --coded` processes of flux-dev (CASES, default 1024,2048; depths 1 and
# 2), each started only with MIN_LEFT seconds (default 200) left of DEADLINE (default
# 560; the first also traces a raw and a coded step), merged by `zoo merge-compressed`
# once all are there (CODED_ARGS: more `zoo run` options, e.g. --high-priority-compute). Files collect in $ZDIR
# (default .comp-out, kept on a warm runner): what is there already is not run again, so
# the same command repeated goes on where the last stopped. From the repository root on
# the runner, the bundle in .bundle: COMMIT=… bash bench/compressed-run.sh; each command
# leaves $OUT/comp.tgz, all so far.
set -uo pipefail
B=${B:-.bundle}; Z=${ZDIR:-.comp-out}; mkdir -p $Z
export BENCH_DATE=${BENCH_DATE:-$(date -u +%F)}
if [ "${LIB_TESTS:-1}" = 1 ]; then
  for f in codec coded; do
    [ -s $Z/cuda-lib-tests-$f.txt ] && continue
    OFFLOAD_REQUIRE_DEVICE=1 timeout 120 $B/cuda-lib-tests $f > $Z/cuda-lib-tests-$f.txt 2>&1; echo "rc=$?" >> $Z/cuda-lib-tests-$f.txt
    grep -E "test result|FAILED|panicked|rc=" $Z/cuda-lib-tests-$f.txt
  done
fi
for m in 256 1024; do
  [ -s $Z/codec-speed-$m.json ] && continue
  timeout 120 $B/codec_speed $m --variants --json $Z/codec-speed-$m.json > $Z/codec-speed-$m.txt 2>&1; cat $Z/codec-speed-$m.txt
done
for r in $(seq 1 ${RUNS:-3}); do
  [ -s $Z/coded-run$r.json ] && continue
  left=$(( ${DEADLINE:-560} - SECONDS ))
  [ $left -lt ${MIN_LEFT:-200} ] && { echo "deadline: run $r not started (${left}s left)"; break; }
  echo "== coded run $r (${SECONDS}s)"
  trace=""; [ $r = 1 ] && trace="--trace $Z/trace.json"
  timeout $left $B/zoo run --backend cuda --model flux-dev --coded --cases ${CASES:-1024,2048} --depths 1,2 --steps 5 $trace \
    ${CODED_ARGS:-} --commit ${COMMIT:-unknown} --out $Z/coded-run$r.json > $Z/coded-run$r.txt 2>&1
  echo "rc=$? at ${SECONDS}s" >> $Z/coded-run$r.txt; grep -E "coded|streamed|rc=" $Z/coded-run$r.txt | tail -10
done
if [ "$(ls $Z/coded-run*.json 2>/dev/null | wc -l)" -ge ${RUNS:-3} ]; then
  $B/zoo merge-compressed --out $Z/compressed.json $Z/coded-run*.json --codec $Z/codec-speed-*.json 2>&1 | tail -8 | tee $Z/merge.txt
fi
tar czf $OUT/comp.tgz $Z
