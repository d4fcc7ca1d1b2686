#!/usr/bin/env bash
# The Python package's test environment: a venv with torch 2.11.0 (the same
# build as the GPU runner's and as the libtorch the tch rows link), diffusers,
# transformers, pytest, tqdm, gguf (diffusers' GGUF layers import it) and peft (the adapters training tests add), all from PyPI. `cargo xtask ci` calls it; the
# result is cached (torch's CUDA wheels are large: its first run downloads
# about 3 GB).
# Usage: scripts/python-env.sh DEST   → DEST/bin/python
set -euo pipefail
DEST=${1:?usage: python-env.sh DEST}
REQS="torch==2.11.0 diffusers==0.42.1 transformers==5.17.0 pytest==9.2.0 tqdm==4.70.1 numpy<3"
# Added since the base set: installed into a cached base environment without
# downloading torch again.
EXTRA="gguf==0.19.0 peft==0.21.2"
STAMP="$DEST/.installed"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$REQS $EXTRA" ]; then echo "python env: cached in $DEST"; exit 0; fi
if [ -f "$STAMP" ] && case "$(cat "$STAMP")" in "$REQS"|"$REQS "*) true ;; *) false ;; esac; then
  # shellcheck disable=SC2086
  "$DEST/bin/pip" install -q --disable-pip-version-check $EXTRA
  "$DEST/bin/python" -c "import gguf, peft" && echo "$REQS $EXTRA" > "$STAMP" && echo "python env: $EXTRA added to $DEST" && exit 0
fi
rm -rf "$DEST"
python3 -m venv "$DEST"
# shellcheck disable=SC2086
"$DEST/bin/pip" install -q --disable-pip-version-check $REQS $EXTRA
"$DEST/bin/python" -c "import torch, diffusers, transformers, pytest, tqdm, gguf, peft; print('python env: torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)"
echo "$REQS $EXTRA" > "$STAMP"
