#!/usr/bin/env bash
# The exponent decoder's builds side by side (`codec_speed --variants`, each
# bit-exact on the same bytes) at 256 MiB and 1 GiB, REPEATS times each (default 3, one
# process each), then, where ncu reads the counters, one launch of the ring's build
# profiled (stall reasons, and per-instruction samples). From the repository root on the
# runner: bash bench/decoder-builds.sh (the bundle in .bundle); results under $OUT/dec.
set -uo pipefail
B=${B:-.bundle}; D=$OUT/dec; mkdir -p $D
for r in $(seq 1 ${REPEATS:-3}); do
  for mib in 256 1024; do
    timeout 120 $B/codec_speed $mib --variants --json $D/codec-$mib-run$r.json > $D/codec-$mib-run$r.txt 2>&1
    echo "rc=$?" >> $D/codec-$mib-run$r.txt; echo "== $mib MiB run $r"; cat $D/codec-$mib-run$r.txt
  done
done
if [ "${NCU:-1}" = 1 ] && command -v ncu >/dev/null; then
  timeout 240 ncu --clock-control none -k exp_decode -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    $B/codec_speed 256 > $D/ncu-sections.txt 2>&1; echo "ncu rc=$?" >> $D/ncu-sections.txt
  tail -120 $D/ncu-sections.txt
  timeout 240 ncu --clock-control none -k exp_decode -c 1 --section SourceCounters --page source --print-source sass --csv \
    $B/codec_speed 256 > $D/ncu-source.csv 2>&1; echo "ncu rc=$?" >> $D/ncu-source.csv
  tail -3 $D/ncu-source.csv
fi
tar czf $OUT/dec.tgz -C $OUT dec
