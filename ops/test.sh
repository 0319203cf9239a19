#!/usr/bin/env bash
# The default test run (slow and GPU tests are deselected in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q "$@"
