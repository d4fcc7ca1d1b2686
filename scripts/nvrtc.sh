#!/usr/bin/env bash
# libnvrtc from PyPI, for compiling offload-cuda's NVRTC kernels in CI (no GPU, no
# system CUDA needed): `cargo xtask ci` runs those compile tests against it.
# Usage: bash scripts/nvrtc.sh DEST ; prints the directory holding libnvrtc.so.13.
set -euo pipefail
DEST=${1:?usage: nvrtc.sh DEST}
if ! ls "$DEST"/venv/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 >/dev/null 2>&1; then
  mkdir -p "$DEST"
  python3 -m venv "$DEST/venv" >&2
  "$DEST/venv/bin/pip" install -q "nvidia-cuda-nvrtc==13.0.88" >&2
fi
dirname "$(ls "$DEST"/venv/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 | head -1)"
