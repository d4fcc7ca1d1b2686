#!/usr/bin/env bash
# The Python package on the GPU runner, from the bundle (`cargo xtask gpu-bundle --python`).
#   py-run.sh test     pytest's CUDA rows (OFFLOAD_REQUIRE_DEVICE=1): the tiny real classes
#                      streamed bitwise equal on CUDA, a user's stream, no host sync, LoRA gradients
#   py-run.sh bench    per model in PY_MODELS (default flux-dev), PY_REPEATS processes (default 3) of
#                      zoo_anchor.py --mode offload,block_stream,leaf_stream: resident, the package and
#                      diffusers' group offloading on the same model object in one process; then
#                      py_merge.py over every process kept
#   py-run.sh start    host RAM at 1 x (py_start.py): the checkpoint of PY_START_MODEL (flux-dev)
#                      written once to PY_CKPT (/tmp/PY_START_MODEL.safetensors) and synced, then PY_REPEATS processes, each
#                      a model on the meta device enabled with checkpoint= and timed to its first streamed step;
#                      merged into $PY_DIR/DATE-python-start.json
#   py-run.sh pipeline the whole pipeline (py_pipeline.py): PY_REPEATS processes of FluxPipeline (Flux-dev's
#                      transformer and VAE, random weights, prompt embeddings passed) at 1024², 4 steps, resident,
#                      the package under PY_BUDGET_GIB (8) and diffusers' offloading; merged into DATE-python-pipeline.json
#   py-run.sh cuda     offload-cuda's unit tests with their GPU rows required (cuda-lib-tests: the reference model's
#                      fp8 weights among them)
#   py-run.sh          test and bench
# PY_ORDER=alternate runs the modes in reverse in every second process (diffusers' first, the package last).
# PY_DEADLINE (s) starts no process past it, by PY_EST or the last process's time. PY_ARGS go to each zoo_anchor.py (e.g. "--cases 1024 --depth 1").
# PY_ARGS="--compile default --warmup 2": every mode with its repeated blocks compiled (resident and the package fullgraph=True,
# diffusers' modes fullgraph=False; MODEL-compiled; "--compile max-autotune-no-cudagraphs": MODEL-compiled-max-autotune). PY_STORAGE=fp8 runs every
# mode with diffusers' layerwise casting (fp8 storage, bf16 compute); the files say MODEL-fp8 (fp8-linears: every Linear of the
# blocks fp8, MODEL-fp8-linears). PY_CODED=1: the package holds the weights coded (MODEL-…-coded). PY_BUDGET_GIB=B: the
# package planned under B GiB from a traced step's calibration (zoo_anchor.py --budget-gib; MODEL-…-budgetB). Files collect in $PY_DIR
# (default .py-out beside the bundle); $OUT/py.tgz holds them all.
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/offload-out}; mkdir -p "$OUT"
Z=${PY_DIR:-$B/../.py-out}; mkdir -p "$Z"
export BENCH_DATE=${BENCH_DATE:-$(date -u +%F)}
if [ ! -d /tmp/site/offload ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$B"/../.whl/*.whl "$B"/../.whl/offload/*.whl
fi
export PYTHONPATH=/tmp/site
what=${1:-all}
rc=0
if [ "$what" = test ] || [ "$what" = all ]; then
  echo "== pytest (CUDA rows required)"
  # The two-GPU row runs only where asked (PY_TWO_GPUS=1, on a machine with two), and must then run.
  two=(-k "not second_gpu"); [ "${PY_TWO_GPUS:-0}" = 1 ] && { two=(); export OFFLOAD_REQUIRE_TWO_GPUS=1; }
  (cd "$B/py-tests" && OFFLOAD_REQUIRE_DEVICE=1 timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -q -rs -p no:cacheprovider "${two[@]}" . 2>&1 | tail -40 | tee "$Z/pytest.txt")
  # Every row runs here: a skipped CUDA row is a failure on the GPU runner.
  grep -q " passed" "$Z/pytest.txt" && ! grep -q -E "[0-9]+ (failed|error|skipped)" "$Z/pytest.txt" || rc=1
  tar czf "$OUT/py.tgz" -C "$Z" .
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for m in ${PY_MODELS:-flux-dev}; do
    for r in $(seq 1 "${PY_REPEATS:-3}"); do
      # A quantized registry model (flux-dev-gguf-q8_0, ...) names its own storage.
      st=${PY_STORAGE:-bf16}; tag=$m; [ "$st" != bf16 ] && [ "${m%-"$st"}" = "$m" ] && tag=$m-$st
      storage=; [ -n "${PY_STORAGE:-}" ] && storage="--storage $PY_STORAGE"
      coded=; [ -n "${PY_CODED:-}" ] && { coded=--coded; tag=$tag-coded; }
      budget=; [ -n "${PY_BUDGET_GIB:-}" ] && { budget="--budget-gib $PY_BUDGET_GIB"; tag=$tag-budget$PY_BUDGET_GIB; }
      f="$Z/py-$tag-r$r.json"
      [ -s "$f" ] && { echo "== $tag r$r: kept"; continue; }
      # The estimate is PY_EST or the last process's own time, whichever is longer.
      est=${PY_EST:-150}; [ "${last:-0}" -gt "$est" ] && est=$last
      if [ -n "${PY_DEADLINE:-}" ] && [ $((SECONDS + est)) -gt "$PY_DEADLINE" ]; then
        echo "== $tag r$r: left for the next command (${SECONDS} s gone)"; continue
      fi
      echo "== $tag r$r (at ${SECONDS} s)"; t0=$SECONDS
      # shellcheck disable=SC2086
      # diffusers' block level raises on T5EncoderModel (its shared embedding reached
      # twice; bench/NOTES.md, 2026-12-02): leaf level is its anchor there.
      modes=offload,block_stream,leaf_stream; [ "$m" = t5-xxl ] && modes=offload,leaf_stream
      # PY_ORDER=alternate: every second process runs diffusers' modes first and the
      # package last, so a GPU that slows as it warms favours neither side.
      if [ "${PY_ORDER:-}" = alternate ] && [ $((r % 2)) = 0 ]; then
        modes=leaf_stream,block_stream,offload; [ "$m" = t5-xxl ] && modes=leaf_stream,offload
      fi
      timeout "${PY_TIMEOUT:-420}" python3 "$B/zoo_anchor.py" --registry "$B/registry.json" --model "$m" \
        --mode $modes $storage $coded $budget ${PY_ARGS:-} --out "$f" 2>&1 | grep -v Warning | tee "${f%.json}.txt" || rc=1
      last=$((SECONDS - t0))
      tar czf "$OUT/py.tgz" -C "$Z" .
    done
  done
  ls "$Z"/py-*.json >/dev/null 2>&1 && python3 "$B/py_merge.py" --date "$BENCH_DATE" --out "$Z/$BENCH_DATE-python-package.json" --at "${COMMIT:-unknown}" "$Z"/py-*.json 2>&1 | tee "$Z/merge.txt"
fi
if [ "$what" = cuda ]; then
  echo "== the reference model's fp8 weights (GPU rows required)"
  OFFLOAD_REQUIRE_DEVICE=1 timeout 120 "$B/cuda-lib-tests" gpu_tests::reference -- --nocapture 2>&1 | tail -30 | tee "$Z/cuda-fp8-tests.txt"
  grep -q "test result: ok" "$Z/cuda-fp8-tests.txt" || rc=1
  echo "== offload-cuda's unit tests (GPU rows required)"
  OFFLOAD_REQUIRE_DEVICE=1 timeout "${PYTEST_TIMEOUT:-300}" "$B/cuda-lib-tests" 2>&1 | tail -30 | tee "$Z/cuda-lib-tests.txt"
  grep -q "test result: ok" "$Z/cuda-lib-tests.txt" || rc=1
fi
if [ "$what" = pipeline ]; then
  for r in $(seq 1 "${PY_REPEATS:-3}"); do
    f="$Z/pipeline-r$r.json"
    [ -s "$f" ] && continue
    echo "== pipeline r$r (at ${SECONDS} s)"
    timeout "${PY_TIMEOUT:-420}" python3 "$B/py_pipeline.py" run --registry "$B/registry.json" --budget-gib "${PY_BUDGET_GIB:-8}" \
      --commit "${COMMIT:-unknown}" --out "$f" 2>&1 | grep -v Warning | tee "${f%.json}.txt" || rc=1
    tar czf "$OUT/py.tgz" -C "$Z" .
  done
  python3 "$B/py_pipeline.py" merge --date "$BENCH_DATE" --out "$Z/$BENCH_DATE-python-pipeline.json" "$Z"/pipeline-r*.json 2>&1 | tee "$Z/pipeline-merge.txt"
fi
if [ "$what" = start ]; then
  m=${PY_START_MODEL:-flux-dev}; ck=${PY_CKPT:-/tmp/$m.safetensors}
  [ -s "$ck" ] || python3 "$B/py_start.py" write --registry "$B/registry.json" --model "$m" --checkpoint "$ck" 2>&1 | tee "$Z/start-write.txt" || rc=1
  # On disk before the first process, as a user's checkpoint is: its dirty pages'
  # write-back otherwise lands in the first start (bench/NOTES.md, 2026-12-05).
  # PY_START_SYNC=0 leaves it as written (the runs before this rule).
  [ "${PY_START_SYNC:-1}" = 1 ] && sync "$ck"
  for r in $(seq 1 "${PY_REPEATS:-3}"); do
    f="$Z/start-$m-r$r.json"
    [ -s "$f" ] && continue
    echo "== start $m r$r (at ${SECONDS} s)"
    timeout "${PY_TIMEOUT:-420}" python3 "$B/py_start.py" run --registry "$B/registry.json" --model "$m" --checkpoint "$ck" \
      --commit "${COMMIT:-unknown}" --out "$f" 2>&1 | grep -v Warning | tee "${f%.json}.txt" || rc=1
    tar czf "$OUT/py.tgz" -C "$Z" .
  done
  python3 "$B/py_start.py" merge --date "$BENCH_DATE" --out "$Z/$BENCH_DATE-python-start.json" "$Z"/start-"$m"-r*.json 2>&1 | tee "$Z/start-merge.txt"
fi
tar czf "$OUT/py.tgz" -C "$Z" .
exit $rc
