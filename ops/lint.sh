#!/usr/bin/env bash
# ruff and mypy over the project. mypy sees the sources through a kvserve/ folder of symlinks,
# since the import names (kvserve.shared, ...) map to top-level folders.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
mkdir -p .mypy_src/kvserve
for pkg in shared kernels services; do ln -sfn "../../$pkg" ".mypy_src/kvserve/$pkg"; done
MYPYPATH=.mypy_src .venv/bin/mypy -p kvserve.shared -p kvserve.kernels -p kvserve.services
