#!/usr/bin/env bash
# The Python package's test environment: a venv with torch 2.11.0 (the same
# build as the GPU runner's and as the libtorch the tch rows link), diffusers,
# transformers, pytest and tqdm, all from PyPI. `cargo xtask ci` calls it; the
# result is cached (torch's CUDA wheels are large: its first run downloads
# about 3 GB).
# Usage: scripts/python-env.sh DEST   → DEST/bin/python
set -euo pipefail
DEST=${1:?usage: python-env.sh DEST}
REQS="torch==2.11.0 diffusers==0.42.1 transformers==5.17.0 pytest==9.2.0 tqdm==4.70.1 numpy<3"
STAMP="$DEST/.installed"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$REQS" ]; then echo "python env: cached in $DEST"; exit 0; fi
rm -rf "$DEST"
python3 -m venv "$DEST"
# shellcheck disable=SC2086
"$DEST/bin/pip" install -q --disable-pip-version-check $REQS
"$DEST/bin/python" -c "import torch, diffusers, transformers, pytest, tqdm; print('python env: torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)"
echo "$REQS" > "$STAMP"
