#!/usr/bin/env bash
# A CUDA 13.0 build environment for offload-candle's `cuda` feature (candle's kernels
# are compiled with nvcc at build time) on a machine with no GPU and no system CUDA:
# nvcc and the libraries from PyPI, a link stub for libcuda. `cargo xtask
# gpu-bundle --candle` calls it (cached in ~/.cache/offload/cuda-build-env).
# Usage: bash scripts/cuda-build-env.sh DEST ; then `source DEST/env.sh`
set -euo pipefail
DEST=${1:?usage: cuda-build-env.sh DEST}
if [ -f "$DEST/env.sh" ]; then echo "cuda build env: cached in $DEST"; exit 0; fi
mkdir -p "$DEST"
python3 -m venv "$DEST/venv"
"$DEST/venv/bin/pip" install -q \
  "nvidia-cuda-nvcc==13.0.88" "nvidia-cuda-crt==13.0.88" "nvidia-nvvm==13.0.88" \
  "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" \
  "nvidia-cublas==13.0.2.14" "nvidia-cuda-nvrtc==13.0.88" "nvidia-curand==10.4.0.35"
CU=$(echo "$DEST"/venv/lib/python3*/site-packages/nvidia/cu13)
# unversioned .so names for the linker (-lcublas etc.)
mkdir -p "$DEST/link/lib/stubs" "$DEST/link/runstub"
for l in cudart cublas cublasLt nvrtc; do ln -sf "$CU/lib/lib$l.so.13" "$DEST/link/lib/lib$l.so"; done
ln -sf "$CU/lib/libcurand.so.10" "$DEST/link/lib/libcurand.so"
# libcuda.so link stub (the driver is not on PyPI): every cu* symbol cudarc declares, SONAME libcuda.so.1
SYS=$(ls -d ~/.cargo/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs | head -1)
grep -oE "^\s+(pub )?fn cu[A-Za-z0-9_]+\(" "$SYS" | sed -E 's/.*fn (cu[A-Za-z0-9_]+)\(/\1/' | sort -u \
  | awk '{print "int " $1 "(void){return 34;}"}' > "$DEST/link/libcuda_stub.c"   # 34 = CUDA_ERROR_STUB_LIBRARY
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$DEST/link/lib/stubs/libcuda.so" "$DEST/link/libcuda_stub.c"
ln -sf ../lib/stubs/libcuda.so "$DEST/link/runstub/libcuda.so.1"   # only for smoke-running here
cat > "$DEST/env.sh" <<EOT
export PATH=$CU/bin:\$PATH           # nvcc (cudaforge + cudarc's cuda-version-from-build-system)
export CUDA_ROOT=$DEST/link          # cudarc dynamic-linking: adds -L \$CUDA_ROOT/lib and lib/stubs
export LIBRARY_PATH=$DEST/link/lib   # for -lcudart from candle-kernels when cudarc is NOT dynamic-linking
export CUDA_COMPUTE_CAP=90           # cudaforge: no nvidia-smi needed (H200 = sm_90 -> sm_90a)
EOT
echo "ok: source $DEST/env.sh"
