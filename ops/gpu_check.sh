#!/usr/bin/env bash
# Does the GPU path work, and how fast is it: every step and its figures in one JSON line
# (ops/gpu_check.py says what runs). On a CUDA machine with the project installed:
#   bash ops/gpu_check.sh [--model PATH] [--out DIR]    # <= 8 minutes on one H200
#   bash ops/gpu_check.sh --smoke                       # the same steps on the CPU, tiny sizes
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
exec "$PY" ops/gpu_check.py "$@"
