#!/usr/bin/env bash
# Validate compose.yaml (schema, interpolation, anchors) without Docker running, once per
# topology (`docker-compose --profile aggregated|disagg config -q`), and check that the default,
# COMPOSE_PROFILES in .env, starts the aggregated topology (worker, not prefill/decode).
# Needs the docker-compose command (Debian: apt-get install docker-compose).
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "validate-compose: error: $*" >&2; exit 1; }
if ! command -v docker-compose >/dev/null 2>&1; then
  fail "docker-compose not found on PATH;" \
    "install it (Debian/Ubuntu: apt-get install -y docker-compose)"
fi
[ -f ops/otel-collector.yaml ] || fail "ops/otel-collector.yaml missing"
[ -f .env ] || fail ".env missing (it sets COMPOSE_PROFILES, the default topology)"
for profile in aggregated disagg; do
  docker-compose -f compose.yaml --profile "$profile" config -q ||
    fail "compose.yaml is invalid under profile $profile" \
      "(docker-compose -f compose.yaml --profile $profile config)"
done

# The profiles a plain `docker-compose up` enables: .env's COMPOSE_PROFILES (a shell variable
# would override it, so it is unset here). Compose v1 does not filter `config --services` by
# profile, so ask its own code which profiles it enables; v2 filters, so ask for the services.
version=$(docker-compose version --short 2>/dev/null || echo unknown)
if [[ $version == 1.* ]]; then
  python=$(head -n 1 "$(command -v docker-compose)" | sed 's/^#! *//')
  default=$(env -u COMPOSE_PROFILES $python -c '
from compose.cli.command import get_profiles_from_options
from compose.config.environment import Environment
print(",".join(get_profiles_from_options({}, Environment.from_env_file("."))))')
  [ "$default" = aggregated ] ||
    fail "the default profiles are '$default', not 'aggregated' (.env)"
else
  services=" $(env -u COMPOSE_PROFILES docker-compose -f compose.yaml config --services |
    sort | tr '\n' ' ')"
  [[ $services == *" worker "* && $services != *" prefill "* && $services != *" decode "* ]] ||
    fail "the default (.env) starts${services}, not the aggregated topology"
fi
echo "validate-compose: compose.yaml OK under profiles aggregated (the default) and disagg" \
  "($version)"
