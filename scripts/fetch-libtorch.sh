#!/usr/bin/env bash
# libtorch 2.11.0 (what tch 0.24 expects, the same build as the GPU runner's torch)
# from the PyPI wheels: no other download site needed. `cargo xtask` calls this
# when LIBTORCH is not set; the result is cached.
# Usage: scripts/fetch-libtorch.sh DEST   → DEST/torch is LIBTORCH (C++11 ABI).
set -euo pipefail
DEST=${1:?usage: fetch-libtorch.sh DEST}
if [ -f "$DEST/torch/lib/libtorch_cpu.so" ]; then echo "libtorch: cached in $DEST/torch"; exit 0; fi
mkdir -p "$DEST/wheels"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$DEST/wheels" \
  torch==2.11.0 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
for w in "$DEST"/wheels/*.whl; do python3 -m zipfile -e "$w" "$DEST"; done
rm -rf "$DEST/wheels"
test -f "$DEST/torch/lib/libtorch_cpu.so"
echo "libtorch: installed in $DEST/torch"
