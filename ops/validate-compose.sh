#!/usr/bin/env bash
# Validate compose.yaml (schema, interpolation, anchors) without Docker running:
# `docker-compose config -q`. Needs the docker-compose command (Debian: apt-get install docker-compose).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v docker-compose >/dev/null 2>&1; then
  echo "validate-compose: error: docker-compose not found on PATH;" \
    "install it (Debian/Ubuntu: apt-get install -y docker-compose)" >&2
  exit 1
fi
[ -f ops/otel-collector.yaml ] || { echo "validate-compose: error: ops/otel-collector.yaml missing" >&2; exit 1; }
if ! docker-compose -f compose.yaml config -q; then
  echo "validate-compose: error: compose.yaml is invalid (docker-compose -f compose.yaml config)" >&2
  exit 1
fi
echo "validate-compose: compose.yaml OK ($(docker-compose version --short 2>/dev/null || echo docker-compose))"
