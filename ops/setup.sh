#!/usr/bin/env bash
# One-shot set-up on a fresh machine: virtual environment, torch (CPU build first, so pip does
# not pull a CUDA build), the project with its dev extras, and the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q torch==2.13.0
fi
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/kvserve fetch-model
# The C++ kernels for this CPU (under a minute on 2 cores) into ~/.cache/kvserve/kernels (or
# $KVSERVE_CACHE_DIR/kernels), once: later processes load them and never compile. Without a
# compiler kvserve runs on the torch fallbacks.
.venv/bin/python -m kvserve.kernels.cpp_build || true
